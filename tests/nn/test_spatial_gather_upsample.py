"""Spatial layers without weights that reshape the partitioned world: upsample, match-size,
gather, global pool, whole-volume scatter/gather, rank-consistent dropout. Each against
single-process torch on the same global data."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import (
    PROCESS_GRIDS,
    batch_slice,
    check_layer,
    close,
    on_grids,
    one_rank_grid,
    randn,
)

# --------------------------------------------------------------------------------------------
# MPI cases
# --------------------------------------------------------------------------------------------
UPSAMPLES = [  # (kwargs, global spatial shape)
    (dict(scale_factor=2, mode="nearest"), (7, 5, 6)),
    (dict(scale_factor=(1.7, 2.0, 3.0), mode="nearest"), (9, 5, 4)),
    (dict(size=(17, 11, 10), mode="nearest"), (6, 5, 7)),
    (dict(scale_factor=2, mode="trilinear", align_corners=False), (7, 5, 6)),
    (dict(scale_factor=2, mode="trilinear", align_corners=True), (5, 6, 7)),
    (dict(scale_factor=1.5, mode="trilinear", align_corners=False,
          recompute_scale_factor=True), (8, 7, 6)),
    (dict(size=(17, 13, 9), mode="trilinear", align_corners=True), (6, 4, 5)),
]


@mpi_case(nprocs=(8,), timeout=240)
def test_upsample_and_match_size(comm):
    from hpcpar.nn.upsample import MatchSize, SpatialMatchSize, SpatialUpsample

    def run(grid):
        for i, (kw, shape) in enumerate(UPSAMPLES):
            if (sum(grid.shape) + i) % 2:
                continue  # sample: each configuration on half of the grids
            if any(n < p for n, p in zip(shape, grid.spatial_shape)):
                continue
            dtype = (torch.float32, torch.float64)[i % 2]
            x = randn((2 * grid.data, 2, *shape), 100 + i, dtype)
            check_layer(grid, nn.Upsample(**kw), SpatialUpsample(**kw, grid=grid), x, 200 + i,
                        f"Upsample({kw}) {shape} on {grid.spec()}")
        # MatchSize: pad and crop by odd and even amounts, per axis
        for i, (src, dst) in enumerate([((6, 7, 8), (7, 9, 8)), ((9, 8, 7), (8, 5, 7)),
                                        ((6, 9, 5), (7, 6, 9))]):
            bs = batch_slice(2 * grid.data, grid)
            x = randn((2 * grid.data, 2, *src), 300 + i, torch.float64)[bs]
            like = torch.zeros(x.shape[0], 1, *dst, dtype=torch.float64)
            ref_x = x.clone().requires_grad_()
            yr = MatchSize()(ref_x, like)
            w = randn(yr.shape, 400 + i, torch.float64)
            (yr * w).sum().backward()
            from hpcpar.parallel.spatial import local_slices
            xl = x[local_slices(x.shape, grid)].clone().requires_grad_()
            yl = SpatialMatchSize(grid)(xl, like[local_slices(like.shape, grid)])
            close(yl, yr.detach()[local_slices(yr.shape, grid)], f"MatchSize {src}->{dst}")
            (yl * w[local_slices(w.shape, grid)]).sum().backward()
            close(xl.grad, ref_x.grad[local_slices(x.shape, grid)], f"MatchSize {src} grad")

    on_grids(comm, PROCESS_GRIDS, run)


@mpi_case(nprocs=(8,), timeout=240)
def test_gather_pool_scatter(comm):
    from hpcpar.nn.gather import ReplicatedDropout, SpatialAdaptiveAvgPool3d, SpatialGather
    from hpcpar.parallel import spatial

    def run(grid):
        rank = grid.spatial_comm.Get_rank()
        for i, (shape, dtype) in enumerate([((17, 6, 5), torch.float32),
                                            ((5, 31, 7), torch.float64),
                                            ((6, 6, 17), torch.float32)]):
            if any(n < p for n, p in zip(shape, grid.spatial_shape)):
                continue
            what = f"{shape} {dtype} on {grid.spec()}"
            bs = batch_slice(2 * grid.data, grid)
            x = randn((2 * grid.data, 3, *shape), 500 + i, dtype)[bs]
            sl = spatial.local_slices(x.shape, grid)
            assert spatial.local_shape(x.shape, grid) == tuple(x[sl].shape)
            # scatter / gather round trip through spatial rank `root`
            root = grid.spatial_size - 1
            mine = spatial.scatter(x if rank == root else None, grid, root=root)
            assert torch.equal(mine, x[sl]), what
            back = spatial.gather(mine, grid, root=root)
            assert (back is None) == (rank != root) and (back is None or torch.equal(back, x))
            # SpatialGather: full tensor everywhere, backward = own slice
            xl = x[sl].clone().requires_grad_()
            full = SpatialGather(grid)(xl)
            assert torch.equal(full, x), what
            w = randn(full.shape, 600 + i, dtype)
            (full * w).sum().backward()
            assert torch.equal(xl.grad, w[sl]), what
            # global average pool: replicated mean, gradient w / count
            xl = x[sl].clone().requires_grad_()
            xr = x.clone().requires_grad_()
            yr = nn.AdaptiveAvgPool3d(1)(xr)
            yl = SpatialAdaptiveAvgPool3d(1, grid=grid)(xl)
            close(yl, yr.detach(), f"global pool {what}")
            w = randn(yr.shape, 700 + i, dtype)
            (yr * w).sum().backward()
            (yl * w).sum().backward()
            close(xl.grad, xr.grad[sl], f"global pool grad {what}")
        # replicated dropout: same mask on the spatial group, another one per data group
        drop = ReplicatedDropout(0.5, grid=grid)
        out = drop(torch.ones(4, 64))
        masks = grid.comm.allgather(out.numpy().tobytes())
        group = [r for r in range(grid.size) if r // grid.spatial_size == grid.coords[0]]
        assert all(masks[r] == masks[grid.rank] for r in group)
        if grid.data > 1:
            assert masks[0] != masks[grid.spatial_size]

    on_grids(comm, PROCESS_GRIDS, run)


def test_errors_without_mpi_launch():
    from hpcpar.errors import LayerError
    from hpcpar.nn.gather import SpatialAdaptiveAvgPool3d
    from hpcpar.nn.upsample import SpatialUpsample
    from hpcpar.parallel.spatial import local_shape

    grid = one_rank_grid()
    with pytest.raises(LayerError, match="output_size"):
        SpatialAdaptiveAvgPool3d(2, grid=grid)
    with pytest.raises(LayerError, match="mode 'bicubic'"):
        SpatialUpsample(scale_factor=2, mode="bicubic", grid=grid)
    assert local_shape((2, 3, 5, 6, 7), grid) == (2, 3, 5, 6, 7)
    with pytest.raises(LayerError, match="at least 3"):
        local_shape((4, 4), grid)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_like_torch(dtype):
    from hpcpar.nn.gather import SpatialAdaptiveAvgPool3d
    from hpcpar.nn.upsample import SpatialUpsample

    grid = one_rank_grid()
    x = randn((2, 3, 5, 6, 7), 9, dtype)
    for kw in (dict(scale_factor=2, mode="nearest"),
               dict(scale_factor=2, mode="trilinear", align_corners=False)):
        y = SpatialUpsample(**kw, grid=grid)(x)
        assert y.dtype == dtype and torch.equal(y, nn.Upsample(**kw)(x)), kw
    y = SpatialAdaptiveAvgPool3d(1, grid=grid)(x)
    want = x.float().mean((2, 3, 4), keepdim=True)
    assert y.dtype == dtype and (y.float() - want).abs().max() < 1e-2
