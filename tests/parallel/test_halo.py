"""Halo exchange: content vs the padded global volume, adjoint test <Fx, y> = <x, F*y>,
global-shape collective (and its cache hazard), counters and user errors."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import compare_with_twin, on_subgrid, spatial_slices

SMALL_GRIDS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2), (3, 1, 1), (4, 1, 1)]


def random_halos(rng, shape, grid):
    """Halos of a random conv or transposed-conv stencil (may trim: stride 3, kernel 1)."""
    from hpcpar.parallel.partition import conv_axis_halo, transposed_axis_halo

    kind = rng.choice(["conv", "conv", "transposed"])
    out = []
    for a in range(3):
        n, parts, i = shape[a], grid.spatial_shape[a], grid.spatial_coords[a]
        if kind == "conv":
            k, s, d = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3]), rng.choice([1, 2])
            p = rng.randrange(0, (d * (k - 1)) + 1)
            out.append(conv_axis_halo(n, parts, i, k, s, p, rng.randrange(0, p + 1), d))
        else:
            k, s = rng.choice([1, 2, 3]), rng.choice([1, 2])
            out.append(transposed_axis_halo(n, parts, i, k, s, rng.randrange(0, k)))
    return out


def padded_slice(X, halos, pad_value):
    """What the exchange must return: the global volume padded with pad_value, cut at
    [needed_start - pad_lo, needed_stop + pad_hi) on each axis."""
    big = max(max(h.pad_lo, h.pad_hi) for h in halos)
    P = torch.full((*X.shape[:2], *(n + 2 * big for n in X.shape[2:])), pad_value,
                   dtype=X.dtype)
    P[(slice(None), slice(None), *(slice(big, big + n) for n in X.shape[2:]))] = X
    return P[(slice(None), slice(None), *(
        slice(big + h.needed[0] - h.pad_lo, big + h.needed[1] + h.pad_hi)
        if h.needed[1] > h.needed[0] else slice(0, 0) for h in halos))]


def _exchange_cases(comm, trials):
    from hpcpar.parallel.comm import allreduce_
    from hpcpar.parallel.halo import halo_exchange

    rng = random.Random(1)
    for t in range(trials):
        dims = SMALL_GRIDS[t % len(SMALL_GRIDS)]
        shape = tuple(rng.randrange(8, 14) for _ in range(3))
        seed = rng.randrange(1 << 30)
        pad_value = [0.0, float("-inf"), 1.5][t % 3]
        dtype = [torch.float64, torch.float32, torch.float16, torch.bfloat16][t % 4]

        def check(grid, shape=shape, seed=seed, pad_value=pad_value, dtype=dtype, dims=dims):
            r = random.Random(seed)
            halos = random_halos(r, shape, grid)
            gen = torch.Generator().manual_seed(seed)
            X = torch.randn(2, 3, *shape, generator=gen, dtype=torch.float64)
            x = X[spatial_slices(shape, grid)].to(dtype).clone().requires_grad_()
            ext = halo_exchange(x, grid, halos, pad_value)
            assert torch.equal(ext.detach(), padded_slice(X.to(dtype), halos, pad_value)), \
                f"content {dims} {shape} {halos}"
            # adjoint of the linear map (pad 0, fp64): sum_ranks <F x, y> == sum_ranks <x, F* y>
            x = X[spatial_slices(shape, grid)].clone().requires_grad_()
            ext = halo_exchange(x, grid, halos)
            y = torch.randn(ext.shape, generator=gen, dtype=torch.float64)
            (fty,) = torch.autograd.grad(ext, x, y)
            lhs = allreduce_(torch.stack([(ext * y).sum()]).detach(), grid.spatial_comm)
            rhs = allreduce_(torch.stack([(x * fty).sum()]).detach(), grid.spatial_comm)
            assert abs(lhs - rhs).item() <= 1e-12 * max(1.0, abs(lhs).item()), \
                f"adjoint {dims} {shape} {halos}: {lhs.item()} vs {rhs.item()}"
        on_subgrid(comm, 1, dims, check)


def test_padded_slice_reference():
    from hpcpar.parallel.partition import conv_axis_halo

    X = torch.arange(5.).view(1, 1, 5, 1, 1)
    h = [conv_axis_halo(5, 1, 0, 3, 1, 1), conv_axis_halo(1, 1, 0, 1), conv_axis_halo(1, 1, 0, 1)]
    assert padded_slice(X, h, -1.0).flatten().tolist() == [-1, 0, 1, 2, 3, 4, -1]


@mpi_case(nprocs=(4,), timeout=240)
def test_exchange_content_and_adjoint(comm):
    _exchange_cases(comm, 28)


@mpi_case(nprocs=(4,), timeout=180)
def test_global_shape_cache_hazard_and_counters(comm):
    """N=10 then N=9 then N=10 over 2 ranks: rank 0 holds 5 every time; must stay exact."""
    from hpcpar.nn import SpatialConv3d
    from hpcpar.parallel.counters import COUNTERS

    def check(grid):
        torch.manual_seed(3)
        twin = nn.Conv3d(2, 2, 3, padding=1)
        layer = SpatialConv3d(2, 2, 3, padding=1, grid=grid)
        before = COUNTERS.snapshot()
        for n in (10, 9, 10, 9):
            compare_with_twin(grid, twin, layer, (n, 6, 5), 2, torch.float64, what=f"N={n}")
        spent = COUNTERS.since(before)
        assert spent["bytes_halo"] > 0 and spent["t_halo"] > 0
        assert len(layer._spatial_plans) == 2
    on_subgrid(comm, 1, (2, 1, 1), check)


@mpi_case(nprocs=(4,), timeout=180)
def test_user_errors_are_raised_on_every_rank(comm):
    from hpcpar.errors import LayerError
    from hpcpar.nn import SpatialConv3d, SpatialMaxPool3d
    from hpcpar.parallel.halo_plan import global_spatial_shape

    def expect(fn, *patterns):
        with pytest.raises(LayerError) as info:
            fn()
        for p in patterns:
            assert p in str(info.value), str(info.value)

    def check(grid):
        # 4 ranks on x, 7 items: extents 2,2,2,1; kernel 7 needs a halo of 3
        # (a map up to WHOLE_MAP_BYTES is gathered instead: tests/nn/test_tap_trim.py)
        from hpcpar.nn import conv as conv_module

        conv = SpatialConv3d(1, 1, 7, padding=3, grid=grid)
        x = torch.zeros(1, 1, *(e for e in (2 if grid.spatial_coords[0] < 3 else 1, 4, 4)))
        cap, conv_module.WHOLE_MAP_BYTES = conv_module.WHOLE_MAP_BYTES, 0
        try:
            expect(lambda: conv(x), "SpatialConv3d", "axis x", "at least 3")
        finally:
            conv_module.WHOLE_MAP_BYTES = cap
        # grid axis longer than the dimension: 3 items over 4 ranks
        x = torch.zeros(1, 1, 1 if grid.spatial_coords[0] < 3 else 0, 4, 4)
        expect(lambda: SpatialMaxPool3d(2, grid=grid)(x), "SpatialMaxPool3d", "axis x",
               "4 ranks")
        # channel count differs between ranks
        x = torch.zeros(1, 1 + (grid.rank == 1), 3, 4, 4)
        expect(lambda: global_spatial_shape(x, grid), "channels")
        # local extents that are not the partition rule (4+2+3+3 = 12 should be 3 each)
        x = torch.zeros(1, 1, [4, 2, 3, 3][grid.spatial_coords[0]], 4, 4)
        expect(lambda: global_spatial_shape(x, grid, "data"), "partition rule")
        # requires_grad must agree (else the backward exchange would hang)
        x = torch.zeros(1, 1, 3, 4, 4, requires_grad=grid.rank == 0)
        expect(lambda: global_spatial_shape(x, grid), "requires_grad")
        with pytest.raises(LayerError, match="padding_mode"):
            SpatialConv3d(1, 1, 3, padding=1, padding_mode="circular", grid=grid)
    on_subgrid(comm, 1, (4, 1, 1), check)
