"""The Slurm allocation this shell is in: its hosts and where ``srun`` puts each rank.

Read from the allocation's environment only (``SLURM_JOB_NODELIST``, ``SLURM_TASKS_PER_NODE``), so
``hpcpar info`` can show the rank -> host table before anything is launched. ``srun``'s default
distribution is *block*: the first node's tasks are ranks 0..n0-1, the next node's follow, and so
on."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from hpcpar.errors import LaunchError

__all__ = ["expand_hostlist", "tasks_per_node", "rank_hosts"]


def _split_top(text: str) -> list[str]:
    """Split at commas that are not inside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur] if cur else parts


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list -> host names, in order: ``"node[1-3,7],gpu[01-02]x"``
    -> ``["node1", "node2", "node3", "node7", "gpu01x", "gpu02x"]`` (zero padding is kept);
    :class:`LaunchError` for what is not in Slurm's host list syntax."""
    hosts = []
    for part in _split_top(text.strip()):
        m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\](.*)", part)
        if not m:
            if "[" in part or "]" in part or not part:
                raise LaunchError(f"SLURM_JOB_NODELIST {text!r}: cannot read {part!r}")
            hosts.append(part)
            continue
        prefix, ranges, rest = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise LaunchError(f"SLURM_JOB_NODELIST {text!r}: bad range {r!r}")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                hosts += [prefix + str(i).zfill(width) + tail for tail in expand_hostlist(rest)] \
                    if "[" in rest else [prefix + str(i).zfill(width) + rest]
    return hosts


def tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` as one count per node: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``;
    :class:`LaunchError` for a part that is not ``N`` or ``N(xM)``."""
    counts = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise LaunchError(f"SLURM_TASKS_PER_NODE {text!r}: cannot read {part!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def rank_hosts(env: Mapping[str, str] | None = None) -> list[str] | None:
    """The host of every rank ``srun`` starts in this allocation (block distribution), in rank
    order; None outside an allocation. ``env`` defaults to ``os.environ``. A node list and task
    counts that disagree on the number of nodes, or cannot be read, raise :class:`LaunchError`."""
    env = os.environ if env is None else env
    nodelist, tasks = env.get("SLURM_JOB_NODELIST"), env.get("SLURM_TASKS_PER_NODE")
    if not env.get("SLURM_JOB_ID") or not nodelist or not tasks:
        return None
    hosts, counts = expand_hostlist(nodelist), tasks_per_node(tasks)
    if len(hosts) != len(counts):
        raise LaunchError(f"SLURM_JOB_NODELIST {nodelist!r} names {len(hosts)} hosts but "
                          f"SLURM_TASKS_PER_NODE {tasks!r} gives {len(counts)}")
    return [h for h, n in zip(hosts, counts) for _ in range(n)]
