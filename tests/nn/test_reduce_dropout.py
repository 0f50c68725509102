"""Global reductions (hpcpar.nn.reduce) against torch on the whole tensor, and split-independent
dropout (hpcpar.nn.dropout): a split run equals one rank with the whole tensor, bit for bit."""

from __future__ import annotations

import itertools

import pytest
import torch

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import (
    batch_slice,
    close,
    on_grids,
    one_rank_grid,
    randn,
    spatial_slices,
)

GRIDS = [(1, 1, 1, 1), (1, 2, 1, 1), (1, 2, 2, 1), (1, 2, 2, 2), (2, 2, 1, 1)]
SHAPES = [(7, 5, 3), (5, 6, 7), (2, 3, 2)]          # prime, uneven, the smallest split
OPS = ["sum", "mean", "amax", "amin", "var", "std", "norm"]
DIMS = [(2, 3, 4), (1, 2, 3, 4), None, (0, 2, 3, 4), (-3, -2, -1), (-4, 2, -2, 4), (1,)]
FORMATS = [torch.contiguous_format, torch.channels_last_3d]


def _torch_reduce(x, op, dim, keepdim, correction):
    """torch's own op: the oracle."""
    if op in ("var", "std"):
        return getattr(torch, op)(x, dim, correction=correction, keepdim=keepdim)
    if op == "norm":
        return torch.linalg.vector_norm(x, 2, dim, keepdim)
    return getattr(torch, op)(x, () if dim is None else dim, keepdim=keepdim)


def _same_everywhere(comm, t, what):
    blobs = comm.allgather(t.detach().numpy().tobytes())
    assert all(b == blobs[0] for b in blobs), f"{what}: differs between ranks"


def _global_data(grid, shape, seed, dtype, op):
    """The global batch (each data group 2 samples); amax/amin data has ties: rounded values,
    and the extreme of every (n, c) at two opposite corners (so on two ranks) plus one more."""
    x = randn((2 * grid.data, 3, *shape), seed, dtype) * 3
    if op in ("amax", "amin"):
        x = x.round()
        sign = 1 if op == "amax" else -1
        top = sign * (x.abs().amax() + 1)
        for corner in ((0, 0, 0), (-1, -1, -1), (0, -1, 0)):
            x[(..., *corner)] = top
    return x


def _check_reduce(grid, i, op, dim, shape):
    from hpcpar.nn.reduce import global_reduce, split_dims

    keepdim, correction = bool(i % 2), (1, 0)[(i // 2) % 2]
    dtype = (torch.float64, torch.float32)[(i // 3) % 2]
    fmt = FORMATS[(i // 5) % 2]
    what = (f"{op} dim={dim} keepdim={keepdim} correction={correction} {shape} {dtype} "
            f"{fmt} on {grid.spec()}")
    X = _global_data(grid, shape, 1000 + i, dtype, op)[batch_slice(2 * grid.data, grid)]
    xr = X.clone().requires_grad_()
    ref = _torch_reduce(xr, op, dim, keepdim, correction)
    w = randn(ref.shape, 2000 + i, dtype)
    (ref * w).sum().backward()
    x = X[spatial_slices(shape, grid)].contiguous(memory_format=fmt).requires_grad_()
    got = global_reduce(x, op, dim, keepdim, grid=grid, gshape=shape, correction=correction)
    dims = range(5) if dim is None else {d % 5 for d in dim}
    replicated = set(split_dims(grid)) <= set(dims)
    piece = (..., *spatial_slices(shape, grid)[2:])
    if replicated:
        _same_everywhere(grid.spatial_comm, got, what)
    else:  # every split axis survives the reduction: this rank's piece of torch's result
        ref, w = ref[piece], w[piece]
    close(got, ref.detach(), f"{what}: output")
    (got * w).sum().backward()
    close(x.grad, xr.grad[spatial_slices(shape, grid)], f"{what}: input grad")


def _check_refused(grid):
    """A reduction over some split axes but not all is refused on every rank, same line."""
    from hpcpar.errors import LayerError
    from hpcpar.nn.reduce import global_reduce, split_dims

    split = split_dims(grid)
    if len(split) < 2:
        return
    shape = (5, 4, 3)
    x = randn((1, 2, *shape), 5, torch.float64)[spatial_slices(shape, grid)]
    for op in OPS:
        with pytest.raises(LayerError) as err:
            global_reduce(x, op, (1, split[0]), grid=grid, gshape=shape)
        line = str(err.value)
        assert "\n" not in line and op in line and "(2, 3, 4)" in line, line
        lines = grid.spatial_comm.allgather(line)
        assert all(m == lines[0] for m in lines), lines


def _check_constant(grid):
    """A constant tensor: std and norm are 0 with gradient 0, as torch's (not nan)."""
    from hpcpar.nn.reduce import global_reduce

    shape = (4, 3, 5)
    for op in ("std", "norm"):
        x = torch.zeros(1, 2, *shape, dtype=torch.float64)[spatial_slices(shape, grid)]
        x = x.clone().requires_grad_()
        out = global_reduce(x, op, (2, 3, 4), grid=grid, gshape=shape)
        out.sum().backward()
        assert not out.any() and not x.grad.any() and not x.grad.isnan().any(), op


@mpi_case(nprocs=(8,), timeout=300)
def test_global_reductions_match_torch(comm):
    def run(grid):
        cases = list(itertools.product(OPS, DIMS))
        for i, (op, dim) in enumerate(cases):
            shape = SHAPES[(i + sum(grid.shape)) % len(SHAPES)]
            _check_reduce(grid, i + len(cases) * sum(grid.shape), op, dim, shape)
        _check_refused(grid)
        _check_constant(grid)

    on_grids(comm, GRIDS, run)


DROPOUTS = [  # (global spatial shape, p, feature, dtype, memory format, inplace)
    ((7, 5, 3), 0.3, False, torch.float64, torch.contiguous_format, False),
    ((5, 6, 7), 0.5, False, torch.float32, torch.channels_last_3d, True),
    ((6, 3, 5), 0.2, True, torch.float32, torch.contiguous_format, False),
    ((3, 7, 4), 0.6, True, torch.float64, torch.channels_last_3d, True),
]


def _dropout_run(x, grid, shape, p, feature, inplace, seed, w):
    """Output and input gradient of spatial_dropout on piece ``x`` (a leaf)."""
    from hpcpar.nn.dropout import spatial_dropout

    src = x.clone() if inplace else x   # in place needs a non-leaf, as torch's dropout
    y = spatial_dropout(src, p, True, inplace, grid=grid, gshape=shape, feature=feature,
                        seed=seed)
    assert (y is src) == inplace
    (y * w).sum().backward()
    return y.detach(), x.grad


@mpi_case(nprocs=(8,), timeout=300)
def test_dropout_is_split_independent(comm):
    def run(grid):
        whole = one_rank_grid()
        for i, (shape, p, feature, dtype, fmt, inplace) in enumerate(DROPOUTS):
            what = f"dropout p={p} feature={feature} {shape} {dtype} {fmt} on {grid.spec()}"
            X = randn((2 * grid.data, 3, *shape), 50 + i, dtype).contiguous(memory_format=fmt)
            W = randn(X.shape, 60 + i, dtype)
            # the oracle: the same function on one rank with the whole batch and volume
            y1, g1 = _dropout_run(X.clone().requires_grad_(), whole, shape, p, feature, inplace,
                                  70 + i, W)
            sl = (batch_slice(X.shape[0], grid), *spatial_slices(shape, grid)[1:])
            x = X[sl].contiguous(memory_format=fmt).requires_grad_()
            y, g = _dropout_run(x, grid, shape, p, feature, inplace, 70 + i, W[sl])
            assert y.is_contiguous(memory_format=fmt), f"{what}: memory format not kept"
            assert torch.equal(y, y1[sl]), f"{what}: output differs from one rank"
            assert torch.equal(g, g1[sl]), f"{what}: input grad differs from one rank"
            dropped = (y1 == 0).double().mean().item()
            assert 0 < dropped < 1, f"{what}: nothing or everything dropped"

    on_grids(comm, [(1, 2, 1, 1), (1, 2, 2, 1), (1, 2, 2, 2), (2, 2, 1, 1)], run)


# --------------------------------------------------------------------------------------------
# one process
# --------------------------------------------------------------------------------------------
def _keep(x, p, feature, seed, training=True):
    from hpcpar.nn.dropout import spatial_dropout

    y = spatial_dropout(x, p, training, grid=one_rank_grid(), gshape=x.shape[2:],
                        feature=feature, seed=seed)
    return y != 0


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_rate_and_independence(p):
    """The drop rate is p within 3 sigma over 2^20 voxels; neighbours along w, h and the
    sample are dropped together at rate p^2 (within 4 sigma): the hash has no visible
    structure along the axes it is built from."""
    x = torch.ones(2, 4, 64, 64, 32)
    drop = ~_keep(x, p, False, seed=11)
    n = drop.numel()
    assert abs(drop.double().mean().item() - p) < 3 * (p * (1 - p) / n) ** 0.5
    for a, b in [(drop[..., 1:], drop[..., :-1]), (drop[..., 1:, :], drop[..., :-1, :]),
                 (drop[1:], drop[:-1]), (drop[:, 1:], drop[:, :-1])]:
        both = (a & b).double().mean().item()
        assert abs(both - p * p) < 4 * (p * p * (1 - p * p) / a.numel()) ** 0.5, both
    # kept values scaled by exactly 1/(1 - p)
    from hpcpar.nn.dropout import spatial_dropout

    v = randn((1, 2, 5, 6, 7), 3, torch.float64)
    y = spatial_dropout(v, p, grid=one_rank_grid(), gshape=(5, 6, 7), feature=False, seed=2)
    kept = y != 0
    assert torch.equal(y[kept], v[kept] * (1.0 / (1.0 - p)))


def test_feature_dropout_drops_whole_channels_at_rate_p():
    x = torch.ones(64, 256, 2, 3, 2)
    keep = _keep(x, 0.25, True, seed=4)
    assert torch.equal(keep, keep[:, :, :1, :1, :1].expand_as(keep)), "channel partly dropped"
    n = 64 * 256
    assert abs((~keep[:, :, 0, 0, 0]).double().mean().item() - 0.25) < 3 * (0.25 * 0.75 / n) ** 0.5


def test_dropout_seeds():
    """Different seeds give independent masks (they disagree on ~2p(1-p) of the voxels);
    next_dropout_seed follows torch.manual_seed and successive calls differ."""
    from hpcpar.nn.dropout import next_dropout_seed

    x = torch.ones(1, 2, 32, 32, 32)
    p = 0.4
    a, b = _keep(x, p, False, 1), _keep(x, p, False, 2)
    differ = (a != b).double().mean().item()
    n = a.numel()
    assert abs(differ - 2 * p * (1 - p)) < 4 * (2 * p * (1 - p) / n) ** 0.5, differ
    assert torch.equal(a, _keep(x, p, False, 1))
    torch.manual_seed(3)
    s1, s2 = next_dropout_seed(), next_dropout_seed()
    torch.manual_seed(3)
    assert s1 != s2 and next_dropout_seed() == s1


def test_dropout_edge_cases_and_errors():
    from hpcpar.errors import LayerError
    from hpcpar.nn.dropout import spatial_dropout

    grid = one_rank_grid()
    x = randn((2, 3, 4, 5, 6), 1, torch.float32)
    kw = dict(grid=grid, gshape=(4, 5, 6), feature=False, seed=1)
    assert spatial_dropout(x, 0.5, False, **kw) is x
    assert spatial_dropout(x, 0.0, True, **kw) is x
    assert torch.equal(spatial_dropout(x, 1.0, True, **kw), torch.zeros_like(x))
    for bad, args in [("between 0 and 1", (x, 1.5)), ("5D float", (x[0], 0.5)),
                      ("not this rank's piece", (x[..., :5], 0.5))]:
        with pytest.raises(LayerError, match=bad) as err:
            spatial_dropout(*args, True, **kw)
        assert "\n" not in str(err.value) and "Dropout" in str(err.value)


def test_reduce_errors():
    from hpcpar.errors import LayerError
    from hpcpar.nn.reduce import global_reduce

    grid = one_rank_grid()
    x = randn((2, 3, 4, 5, 6), 1, torch.float64)
    for op, dim, msg in [("median", None, "unknown op"), ("sum", (5,), "out of range"),
                         ("mean", (2, -3), "repeats")]:
        with pytest.raises(LayerError, match=msg) as err:
            global_reduce(x, op, dim, grid=grid, gshape=(4, 5, 6))
        assert "\n" not in str(err.value) and "global_reduce" in str(err.value)


class _Apply(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


# (op along one spatial dim, that dim, refused where the grid splits it): where the grid does
# not split the dim every rank holds all of it, so the op runs on the piece
WHOLE_DIM_OPS = [
    (lambda h: torch.softmax(h, dim=4) * h, 4, True),
    (lambda h: h.cumsum(2) * 0.1, 2, True),
    (lambda h: h.sort(dim=3).values, 3, True),
    # its dim after p, read where torch reads it (p = 2.0 read as the dim was silently wrong)
    (lambda h: torch.nn.functional.normalize(h, 2.0, 4) * h, 4, True),
    (lambda h: h - h.mean(dim=4, keepdim=True), 4, False),  # split: the global mean
    # a (N, C, 1, H, W) piece times the whole: split, the maximum is global (replicated)
    (lambda h: h.amax(2, keepdim=True) * h, 2, False),
]


@mpi_case(nprocs=(2,), timeout=300)
def test_ops_along_a_spatial_dim_the_grid_does_not_split_run_on_the_pieces(comm):
    """Refused before on every grid (over-cautious; amax(2, True) * h was exact where D was
    split and refused where it was whole)."""
    from hpcpar.errors import LayerError
    from hpcpar.nn import local, spatialize

    def run(grid):
        shape = (6, 5, 7)
        x = randn((1, 2, *shape), 3)
        own = spatial_slices(shape, grid)
        for fn, dim, refused_where_split in WHOLE_DIM_OPS:
            whole = x.clone().requires_grad_()
            want = fn(whole)
            want.square().sum().backward()
            piece = x[own].clone().requires_grad_()
            model = spatialize(_Apply(fn), grid)
            if refused_where_split and grid.spatial_shape[dim - 2] > 1:
                with pytest.raises(LayerError, match="along a split dim"):
                    model(piece)
                continue
            got = local(model(piece))
            what = f"dim {dim} on {grid.spec()}"
            close(got, want.detach()[own], f"{what}: output")
            got.square().sum().backward()
            close(piece.grad, whole.grad[own], f"{what}: input grad")

    on_grids(comm, [(1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)], run)
