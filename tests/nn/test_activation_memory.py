"""Activation memory with no overhead (issue 29 item 1): hpcpar on one rank allocates at most
1.05x what plain torch allocates for the same layer or model and input, in both memory
formats, and on 2 ranks at most 1.1x torch / 2 plus the ghost faces.

Counted by torch's profiler (every CPU tensor allocation and free, in order): the peak of
the bytes live during forward + backward above those live before it. Deterministic, unlike
the RSS (benchmarks/memory.py measures that). Exactness of the same layers is tested by
test_spatial_pool.py, test_spatial_conv.py and test_model_zoo.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import alloc_peak, one_rank_grid, randn

FORMATS = [torch.contiguous_format, torch.channels_last_3d]


def _pair(make, grid, fmt):
    torch.manual_seed(0)
    plain = make().to(memory_format=fmt)
    from hpcpar.nn import spatialize

    return plain, spatialize(plain, grid)


def _input(shape, fmt, grid=None):
    x = randn(shape, 1)
    if grid is not None:
        from hpcpar.parallel.spatial import local_slices

        x = x[local_slices(x.shape, grid)]
    return x.contiguous(memory_format=fmt).requires_grad_()


def _models():
    """name -> (plain model maker, input shape). Batch 16: torch then runs every conv on oneDNN
    as hpcpar does (with batch 1 it falls back to im2col, whose column buffer would hide an
    overhead of hpcpar's)."""
    from hpcpar.models import CosmoFlow, UNet3D

    return {
        # a same conv, a 1x1x1 conv (no halo: no extended copy) and a max pool (backward from
        # the argmax indices, not a rebuilt input), then the two models
        "conv3": (lambda: nn.Sequential(nn.Conv3d(8, 8, 3, padding=1), nn.ReLU()),
                  (16, 8, 12, 10, 8)),
        # batch 1: torch's 1x1x1 conv is then one matrix product (no column buffer either)
        "conv1": (lambda: nn.Sequential(nn.Conv3d(8, 4, 1), nn.ReLU()), (1, 8, 24, 20, 16)),
        "maxpool": (lambda: nn.Sequential(nn.Conv3d(4, 8, 3, padding=1), nn.LeakyReLU(0.3),
                                          nn.MaxPool3d(2)), (16, 4, 12, 10, 8)),
        "cosmoflow": (lambda: CosmoFlow.small(input_size=16), (16, 4, 16, 16, 16)),
        "unet3d": (lambda: UNet3D(base_filters=4, depth=2), (16, 1, 16, 16, 16)),
    }


@pytest.mark.parametrize("fmt", FORMATS, ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("name", ["conv3", "conv1", "maxpool", "cosmoflow", "unet3d"])
def test_one_rank_allocates_what_torch_does(name, fmt):
    make, shape = _models()[name]
    grid = one_rank_grid()
    try:
        plain, spatial = _pair(make, grid, fmt)
        ref = alloc_peak(plain, _input(shape, fmt))[0]
        got = alloc_peak(spatial, _input(shape, fmt))[0]
    finally:
        grid.free()
    assert got <= 1.05 * ref, f"{name}: hpcpar allocates {got} bytes, torch {ref} " \
                              f"({got / ref:.2f}x)"


@mpi_case(nprocs=(2,), timeout=300)
def test_two_ranks_allocate_half(comm):
    """Each of 2 ranks (x split) allocates at most 1.1x torch's / 2 plus its ghost faces."""
    from hpcpar.parallel.grid import ProcessGrid

    grid = ProcessGrid(1, 2, 1, 1, comm=comm)
    try:
        for name in ("maxpool", "unet3d"):
            make, shape = _models()[name]
            for fmt in FORMATS:
                plain, spatial = _pair(make, grid, fmt)
                ref = alloc_peak(plain, _input(shape, fmt))[0]
                got, halo = alloc_peak(spatial, _input(shape, fmt, grid))
                assert got <= 1.1 * ref / 2 + halo, \
                    f"{name} {fmt}: {got} bytes per rank, torch {ref} / 2, halo {halo}"
    finally:
        grid.free()


@mpi_case(nprocs=(4,), timeout=300)
def test_memory_paths_are_exact(comm):
    """The paths this file keeps lean, against torch: a 1x1x1 conv where torch picks oneDNN
    (batch 32) takes the boundary fast path with nothing to exchange (it sent empty faces
    and failed before); a max pool whose backward writes into a trimmed region of the
    gradient buffer (uneven pieces: odd lengths leave an item no window of this rank reads)."""
    from hpcpar.nn import SpatialConv3d, SpatialMaxPool3d
    from hpcpar.testing.oracles import compare_with_twin, on_subgrid

    for data, dims in ((1, (2, 1, 1)), (1, (2, 2, 1)), (2, (2, 1, 1))):
        def check(grid, what=f"on {data}x{dims}"):
            torch.manual_seed(0)
            twin, spatial = nn.Conv3d(6, 4, 1), SpatialConv3d(6, 4, 1, grid=grid)
            compare_with_twin(grid, twin, spatial, (9, 7, 5), 6, torch.float32, batch=32,
                              what=f"1x1x1 conv {what}")
            for fmt in (None, torch.channels_last_3d):
                for ceil in (False, True):
                    compare_with_twin(grid, nn.MaxPool3d(2, ceil_mode=ceil),
                                      SpatialMaxPool3d(2, ceil_mode=ceil, grid=grid),
                                      (13, 12, 11), 4, torch.float64, memory_format=fmt,
                                      what=f"max pool {fmt} ceil_mode={ceil} {what}")
        on_subgrid(comm, data, dims, check)
