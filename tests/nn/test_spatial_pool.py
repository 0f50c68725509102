"""SpatialMaxPool3d / SpatialAvgPool3d against torch on the full volume (ceil_mode, padding,
count_include_pad, divisor_override, dilation), sampled cases in one MPI launch."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import SPATIAL_GRIDS, compare_with_twin, cover, on_subgrid


def pool_cases(world: int):
    rng = random.Random(9)
    usable = [(d, g) for g in SPATIAL_GRIDS for d in (1, 2) if d * g[0] * g[1] * g[2] <= world]
    n = max(12, len(usable))
    cases = cover(rng, n, kind=["max", "avg"], kernel=[1, 2, 3], stride=[1, 2, 3],
                  padding=[0, 1], ceil_mode=[False, True], size=[17, 31, 12],
                  dtype=[torch.float32, torch.float64], count_include_pad=[True, False],
                  dilation=[1, 2], divisor=[None, None, 5])
    for i, c in enumerate(cases):
        c["data"], c["dims"] = usable[i % len(usable)]
        if c["kernel"] == 1:
            c["padding"] = 0
        sizes = [rng.choice([11, 12, 13]) for _ in range(3)]
        sizes[i % 3] = c["size"]
        c["shape"] = tuple(sizes)
    return cases


def _layers(c, grid):
    from hpcpar.nn import SpatialAvgPool3d, SpatialMaxPool3d

    k, s, p = c["kernel"], c["stride"], c["padding"]
    if c["kind"] == "max":
        args = dict(kernel_size=k, stride=s, padding=p, dilation=c["dilation"],
                    ceil_mode=c["ceil_mode"])
        return nn.MaxPool3d(**args), SpatialMaxPool3d(**args, grid=grid)
    args = dict(kernel_size=k, stride=s, padding=p, ceil_mode=c["ceil_mode"],
                count_include_pad=c["count_include_pad"], divisor_override=c["divisor"])
    return nn.AvgPool3d(**args), SpatialAvgPool3d(**args, grid=grid)


def test_pool_cases_cover_ceil_mode_and_both_kinds():
    cases = pool_cases(4)
    assert {(c["kind"], c["ceil_mode"]) for c in cases} >= {("max", True), ("avg", True)} or \
        {c["ceil_mode"] for c in cases} == {False, True}
    assert {c["kernel"] for c in cases} == {1, 2, 3}


def test_bad_pool_arguments():
    from hpcpar.errors import LayerError
    from hpcpar.nn import SpatialMaxPool3d

    class FakeGrid:
        spatial_comm = None

    with pytest.raises(LayerError, match="return_indices"):
        SpatialMaxPool3d(2, return_indices=True, grid=FakeGrid())
    with pytest.raises(LayerError, match="at most half"):
        SpatialMaxPool3d(2, padding=2, grid=FakeGrid())
    with pytest.raises(LayerError, match="grid="):
        SpatialMaxPool3d(2, grid=None)


@mpi_case(nprocs=(4,), timeout=240)
def test_pools_match_torch(comm):
    for c in pool_cases(comm.Get_size()):
        def check(grid, c=c):
            twin, spatial = _layers(c, grid)
            compare_with_twin(grid, twin, spatial, c["shape"], 3, c["dtype"], what=f"{c}")
        on_subgrid(comm, c["data"], c["dims"], check)


if __name__ == "__main__":  # pragma: no cover - mpiexec -n 4 python tests/nn/test_spatial_pool.py
    from mpi4py import MPI

    test_pools_match_torch(MPI.COMM_WORLD)
    print("ok")
