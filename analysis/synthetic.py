"""Synthetic run directories with known times, written through the real recorder.

For tests, docs and trying the report without training anything: every number in the
resulting scaling table follows from the arguments by the formulas in ``stats``.
"""

from __future__ import annotations

from pathlib import Path

from hpcpar.run.records import LocalGrid, RunRecorder

#: Default split of each rank's step time over the recorded phases (fractions of t_step):
#: compute = fwd + bwd + opt - halo = 0.65, halo 0.1, exposed allreduce 0.1, io 0.1, other 0.05.
PHASE_SHARES = {"t_data": 0.1, "t_fwd": 0.3, "t_bwd": 0.4, "t_halo": 0.1,
                "t_allreduce_exposed": 0.1, "t_allreduce_total": 0.2, "t_opt": 0.05}


def synthetic_run(run_dir, grid=(1, 1, 1, 1), steps: int = 10, t_step=1.0,
                  global_batch: int = 8, shares: dict | None = None, status: str = "ok",
                  stop: dict | None = None, meta: dict | None = None) -> Path:
    """Write a run of ``grid`` = (data, x, y, z) ranks with ``steps`` steps.

    ``t_step``: seconds, or ``f(rank, step) -> seconds``. Each phase is ``shares[phase] *
    t_step``. ``samples`` = global_batch / data per rank. ``status``: "ok"/"preempted"/"failed"
    finish normally; "running" leaves the run as a crash does (no merge, no end time).
    ``stop``: {rank: last step written} for ranks that died early.
    """
    grid = tuple(grid)
    size = grid[0] * grid[1] * grid[2] * grid[3]
    shares = {**PHASE_SHARES, **(shares or {})}
    timing = t_step if callable(t_step) else (lambda r, s: float(t_step))
    info = {"job_name": "synthetic", "global_batch": global_batch, **(meta or {})}
    recorders = [RunRecorder(run_dir, LocalGrid(grid, rank=r), info) for r in range(size)]
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
    return Path(run_dir)
