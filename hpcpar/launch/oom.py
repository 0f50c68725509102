"""Telling a rank killed by a memory limit from any other crash.

The kernel's out-of-memory killer sends SIGKILL: the launcher only sees "signal 9", as after a
``kill -9``. The memory cgroup (Slurm's memory limit, a ``systemd-run -p MemoryMax=`` scope, a
container) counts the processes it killed: :class:`OomWatch` reads those counters of this process's
memory cgroup and its ancestors before the ranks start and after they end, so ``hpcpar run`` can say
"out of memory" and exit with :data:`hpcpar.errors.EXIT_OUT_OF_MEMORY`.

The kernel counts a kill in the killed process's own group (v1 ``memory.oom_control``:
``oom_kill``); v2's ``memory.events`` of a group also counts its descendants' kills, so v2 ranks in
their own groups below ``hpcpar run``'s are seen too. Ranks in other groups (a sibling Slurm step,
v1 per-rank groups) are not: their launcher (``srun``) or wrapper reports those."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["memory_limit", "OomWatch"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60


def _cgroup_lines(proc: Path) -> list[tuple[str, str]]:
    try:
        text = proc.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            out.append((parts[1], parts[2]))
    return out


def memory_groups(proc: Path = Path("/proc/self/cgroup"),
                  root: Path = CGROUP_ROOT) -> list[tuple[Path, int]]:
    """This process's memory cgroup directory and its ancestors, innermost first, each with
    the cgroup version (1 or 2); empty when there is none to read."""
    lines = _cgroup_lines(proc)
    v1 = [rel for controllers, rel in lines if "memory" in controllers.split(",")]
    v2 = [rel for controllers, rel in lines if controllers == ""]
    if v1:
        base, version, rel = root / "memory", 1, v1[0]
    elif v2 and (root / "cgroup.controllers").is_file():
        base, version, rel = root, 2, v2[0]
    else:
        return []
    path = base / rel.lstrip("/")
    out = []
    while True:
        if path.is_dir():
            out.append((path, version))
        if path == base:
            return out
        path = path.parent


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _oom_kills(group: Path, version: int, own: bool) -> int:
    if version == 1:
        text = _read(group / "memory.oom_control")
    else:   # own group: kills below it too; ancestors: their own only
        text = _read(group / ("memory.events" if own else "memory.events.local"))
    m = re.search(r"^oom_kill (\d+)", text, re.M)
    return int(m.group(1)) if m else 0


def _limit(group: Path, version: int) -> int:
    text = _read(group / ("memory.limit_in_bytes" if version == 1 else "memory.max")).strip()
    return int(text) if text.isdigit() else UNLIMITED


def memory_limit(groups: list[tuple[Path, int]] | None = None) -> int | None:
    """The tightest memory limit on this process's cgroups, bytes; None when unlimited."""
    groups = memory_groups() if groups is None else groups
    limit = min((_limit(g, v) for g, v in groups), default=UNLIMITED)
    return limit if limit < UNLIMITED else None


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3g} GiB"


class OomWatch:
    """Counts the out-of-memory kills of this process's memory cgroups from now on; ``proc``
    (``/proc/<pid>/cgroup``) and ``root`` (the cgroup mount) let tests point elsewhere."""

    def __init__(self, proc: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT):
        self.groups = memory_groups(proc, root)
        self.before = self._counts()

    def _counts(self) -> list[int]:
        return [_oom_kills(g, v, i == 0) for i, (g, v) in enumerate(self.groups)]

    def kills(self) -> list[tuple[Path, int]]:
        """Groups that killed processes since the watch began, with how many."""
        return [(g, now - then) for (g, _), now, then in
                zip(self.groups, self._counts(), self.before) if now > then]

    def message(self, ranks: int, grid: str) -> str | None:
        """The one-line ``"out of memory: ..."`` error for a run of ``ranks`` on ``grid``
        (``"DxXxYxZ"``) that ended with kills, naming the group, its limit and what to change; else
        None."""
        kills = self.kills()
        if not kills:
            return None
        group, n = kills[0]
        version = next(v for g, v in self.groups if g == group)
        limit = _limit(group, version)
        size = _gib(limit).replace(" ", "") if limit < UNLIMITED else "SIZE"
        where = f"cgroup {group.name}" + (f": {_gib(limit)}" if limit < UNLIMITED else "")
        who = "rank 0 was" if ranks == 1 else f"{n} of the {ranks} ranks' processes were"
        return (f"out of memory: {who} killed by the kernel's memory limit ({where}) on grid "
                f"{grid}; split the sample over more ranks (--grid with more x/y/z ranks) or use a "
                f"smaller batch; `hpcpar plan JOB -n N --memory-budget {size}` shows what fits")
