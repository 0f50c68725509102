"""Spatial layers without weights that reshape the partitioned world: upsample, match-size,
gather, global pool, whole-volume scatter/gather, rank-consistent dropout. Each against
single-process torch on the same global data. Also home of the oracle helpers the other
spatial test modules import (``on_grids``, ``check_layer``, ...)."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn as nn

from hpcpar.testing import mpi_case

# (data, x, y, z) grids; each case runs on the first prod(grid) ranks of the launch
GRIDS = [(1, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2), (1, 2, 2, 1), (1, 2, 2, 2),
         (1, 3, 1, 1), (1, 1, 3, 2), (2, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2), (2, 2, 2, 1)]


# --------------------------------------------------------------------------------------------
# oracle helpers (imported by test_spatial_norm, test_models)
# --------------------------------------------------------------------------------------------
def idle_barrier(comm):
    """Barrier that sleeps instead of busy-polling (idle ranks must not steal the cores)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def on_grids(comm, specs, fn):
    """Run ``fn(grid)`` for each (data, x, y, z) spec on the first prod(spec) ranks."""
    from mpi4py import MPI

    from hpcpar import ProcessGrid

    for spec in specs:
        n = math.prod(spec)
        if n > comm.Get_size():
            continue
        sub = comm.Split(0 if comm.Get_rank() < n else MPI.UNDEFINED, comm.Get_rank())
        if sub != MPI.COMM_NULL:
            grid = ProcessGrid(*spec, comm=sub)
            fn(grid)
            grid.free()
            sub.Free()
        idle_barrier(comm)


def randn(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-11


def close(got, want, what, slack=1.0):
    """max |got - want| <= slack * tol * max |want| (relative to the output scale)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.abs().max().item() if want.numel() else 0.0
    err = (got - want).abs().max().item() if want.numel() else 0.0
    assert err <= slack * tol(want.dtype) * max(scale, 1e-30), \
        f"{what}: max error {err:.3g} vs scale {scale:.3g} ({want.dtype})"


def batch_slice(n_global, grid):
    nb = n_global // grid.data
    d = grid.coords[0]
    return slice(d * nb, (d + 1) * nb)


def check_layer(grid, ref, sp, x, seed, what, whole_batch=False):
    """Forward, input gradient and summed parameter gradients of spatial layer ``sp`` vs
    torch layer ``ref`` (same weights) on the global batch ``x``. Each data group takes its
    share of the batch; ``whole_batch``: the reference sees all of it (statistics over data)."""
    from hpcpar.parallel.comm import allreduce_
    from hpcpar.parallel.spatial import local_slices

    bs = batch_slice(x.shape[0], grid)
    xr = (x if whole_batch else x[bs]).clone().requires_grad_()
    yr = ref(xr)
    w = randn(yr.shape, seed, x.dtype)
    (yr * w).sum().backward()
    gr = xr.grad
    if whole_batch:
        yr, w, gr = yr[bs], w[bs], gr[bs]
    xl = x[bs][local_slices(x[bs].shape, grid)].clone().requires_grad_()
    yl = sp(xl)
    ys = local_slices(yr.shape, grid)
    close(yl, yr[ys].detach(), f"{what}: output")
    (yl * w[ys]).sum().backward()
    close(xl.grad, gr[local_slices(gr.shape, grid)], f"{what}: input grad")
    group = grid.comm if whole_batch else grid.spatial_comm
    for (name, pr), ps in zip(ref.named_parameters(), sp.parameters()):
        g = allreduce_(ps.grad.clone(), group)
        close(g, pr.grad, f"{what}: grad of {name}")


def one_rank_grid():
    from mpi4py import MPI

    from hpcpar import ProcessGrid

    return ProcessGrid(1, 1, 1, 1, comm=MPI.COMM_SELF)


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

    on_grids(comm, GRIDS, run)


@mpi_case(nprocs=(8,), timeout=240)
def test_gather_pool_scatter(comm):
    from hpcpar.parallel import spatial
    from hpcpar.nn.gather import ReplicatedDropout, SpatialAdaptiveAvgPool3d, SpatialGather

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

    on_grids(comm, GRIDS, run)


def test_errors_without_mpi_launch():
    from hpcpar.nn.gather import SpatialAdaptiveAvgPool3d
    from hpcpar.nn.upsample import SpatialUpsample
    from hpcpar.parallel.spatial import SpatialError, local_shape

    grid = one_rank_grid()
    with pytest.raises(SpatialError, match="output_size"):
        SpatialAdaptiveAvgPool3d(2, grid=grid)
    with pytest.raises(SpatialError, match="mode 'bicubic'"):
        SpatialUpsample(scale_factor=2, mode="bicubic", grid=grid)
    assert local_shape((2, 3, 5, 6, 7), grid) == (2, 3, 5, 6, 7)
    with pytest.raises(SpatialError, match="at least 3"):
        local_shape((4, 4), grid)


def test_partition_of_whole_volumes():
    from types import SimpleNamespace

    from hpcpar.parallel.spatial import SpatialError, local_shape, local_slices

    grid = SimpleNamespace(spatial_shape=(3, 1, 2), spatial_coords=(2, 0, 1))
    # 17 over 3: 6, 6, 5 -> rank 2 holds [12, 17); 4 over 2: [2, 4)
    assert local_slices((1, 2, 17, 5, 4), grid)[2:] == (slice(12, 17), slice(0, 5),
                                                         slice(2, 4))
    assert local_shape((17, 5, 4), grid, rank=0) == (6, 5, 2)
    with pytest.raises(SpatialError, match="axis x has 2 voxels .* over 3 ranks"):
        local_shape((1, 1, 2, 5, 4), grid)


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
