"""Synthetic run directories with known times, written through the real recorder.

For tests, docs and trying the report without training anything: every number in the
resulting scaling table follows from the arguments by the formulas in ``stats``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from hpcpar.formats.records import LocalGrid, RunRecorder, machine_facts

__all__ = ["PHASE_SHARES", "synthetic_run"]

#: Default split of each rank's step time over the recorded phases (fractions of t_step):
#: compute = fwd + bwd + opt - halo = 0.65, halo 0.1 (of which 0.04 waiting for messages when
#: the spatial group has more than one rank, else 0), exposed allreduce 0.1, io 0.1, other 0.05.
PHASE_SHARES = {"t_data": 0.1, "t_fwd": 0.3, "t_bwd": 0.4, "t_halo": 0.1,
                "t_allreduce_exposed": 0.1, "t_allreduce_total": 0.2, "t_opt": 0.05,
                "t_halo_wait": 0.04}


def synthetic_run(run_dir: str | os.PathLike, grid: Sequence[int] = (1, 1, 1, 1),
                  steps: int = 10, t_step: float | Callable[[int, int], float] = 1.0,
                  global_batch: int = 8, shares: dict | None = None, status: str = "ok",
                  stop: dict | None = None, meta: dict | None = None,
                  cores_per_node: int | None = None, threads: int = 1,
                  nodes: int = 1, metrics: dict | None = None) -> Path:
    """Write a run with known times through the real recorder (tests, trying the report).

    Args:
        run_dir: The run directory to write.
        grid: ``(data, x, y, z)`` ranks.
        steps: Steps per rank.
        t_step: Seconds per step, or ``f(rank, step) -> seconds``.
        global_batch: Samples per step; each rank records ``global_batch / data``.
        shares: Phase -> share of ``t_step`` (each phase is ``shares[phase] * t_step``).
        status: ``"ok"``, ``"preempted"`` or ``"failed"`` finish normally; ``"running"``
            leaves the run as a crash does (no merge, no end time).
        stop: ``{rank: last step written}`` for ranks that died early.
        cores_per_node: Cores of each node; the run's machine facts (``meta.json``
            ``machine``) are those of ``nodes`` nodes holding the ranks in even blocks, each
            rank with ``threads`` threads. None: unknown (the machine writing the files did
            not run them).
        threads: Threads per rank.
        nodes: Nodes.
        meta: Extra meta.json facts (``machine``, ``job`` ... replace the defaults: the
            machine this runs on, and a job spec ``{"job": {"name"}, "train": {"steps",
            "global_batch"}, "grid": ...}``). ``host_load`` is kept as given, ``after``
            included (default: not recorded): the load of the machine writing the files
            says nothing of the synthetic run.
        metrics: The run's ``metrics.json`` (final losses, loss histories), written when
            given.

    Returns:
        The run directory.
    """
    grid = tuple(grid)
    size = grid[0] * grid[1] * grid[2] * grid[3]
    shares = {**PHASE_SHARES, **(shares or {})}
    if grid[1] * grid[2] * grid[3] == 1 and "t_halo_wait" in shares:
        shares["t_halo_wait"] = 0.0  # no spatial neighbour: no message to wait for
    timing = t_step if callable(t_step) else (lambda r, s: float(t_step))
    job = {"job": {"name": "synthetic"}, "train": {"steps": steps, "global_batch": global_batch},
           "grid": dict(zip(("data", "x", "y", "z"), grid))}
    machine = None
    if cores_per_node:
        per_rank = [{"host": f"node{r * nodes // size}", "cpus": list(range(cores_per_node)),
                     "threads": threads} for r in range(size)]
        machine = machine_facts(per_rank)
    info = {"job_name": "synthetic", "global_batch": global_batch, "job": job,
            "machine": machine, **(meta or {})}
    recorders = [RunRecorder(run_dir, LocalGrid(grid, rank=r, nodes=nodes), info)
                 for r in range(size)]
    stop = stop or {}
    for s in range(steps):
        for r, rec in enumerate(recorders):
            if s > stop.get(r, steps):
                continue
            t = timing(r, s)
            rec.step(step=s, loss=1.0 / (1 + s), t_step=t, samples=global_batch // grid[0],
                     bytes_halo=1000 * r, bytes_allreduce=4000, bytes_read=100,
                     peak_mem=1e6 * (1 + r), **{k: v * t for k, v in shares.items()})
    for rec in reversed(recorders):  # rank 0 last: it merges what the others closed
        if status == "running":
            rec.close()
        else:
            rec.finish(status)
    load = (meta or {}).get("host_load", {"before": None, "after": None})
    recorders[0].update_meta(lambda m: m.update(host_load=load))
    if metrics is not None:
        (Path(run_dir) / "metrics.json").write_text(json.dumps(metrics))
    return Path(run_dir)
