"""Fitting the planner to runs measured on the machine ("calibrate on the demo job").

The microbenchmarks of ``hpcpar plan --calibrate`` give every layer's relative cost; one real
job run on the machine gives its absolute level: the host's speed that day and the framework
time per step no microbenchmark carries. ``hpcpar plan JOB -n N --fit-on RUN ...`` scales
every prediction at N ranks by the median measured / predicted step of the finished runs at
N ranks (the nearest rank count when none ran at N). Measured on the 2-core VM: UNet3D, GCN
and the TP job at 1, 2 and 4 ranks, fitted on the demo CosmoFlow job's runs, 8 and 6 of 9
within ±25% of the measured step in two runs; unfitted 3 and 2 of 9
(``docs/guides/tensor-parallel.md``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

from hpcpar.plan.machine import Machine
from hpcpar.plan.planner import Prediction, Workload, predict

__all__ = ["ratios", "scale", "apply"]


def ratios(points: Iterable[tuple[Workload, tuple, float]], machine: Machine) -> dict:
    """``{ranks: [measured / predicted step, ...]}`` of the finished runs' ``(workload, grid,
    measured seconds per step)``."""
    out: dict[int, list[float]] = {}
    for work, grid, measured in points:
        pred = predict(work, tuple(grid), machine)
        if pred.feasible and pred.t_step > 0:
            out.setdefault(math.prod(grid), []).append(measured / pred.t_step)
    return out


def scale(table: dict, ranks: int) -> float:
    """The factor for ``ranks``: the median ratio of the runs at that count, else of the
    nearest count that ran (the smaller on a tie); 1 without runs."""
    if not table:
        return 1.0
    nearest = min(table, key=lambda n: (abs(n - ranks), n))
    return statistics.median(table[nearest])


def apply(preds: list[Prediction], factor: float) -> list[Prediction]:
    """Scale each feasible prediction's step by ``factor`` (recorded in ``extra["fit"]``);
    the order, fastest first, is unchanged."""
    for p in preds:
        if p.feasible:
            p.t_step *= factor
            p.extra["fit"] = factor
    return preds
