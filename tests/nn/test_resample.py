"""The spatial functional ops that change the global shape (``hpcpar.nn.padding.pad``,
``hpcpar.nn.resample.interpolate`` / ``adaptive_avg_pool3d`` / ``adaptive_max_pool3d``) against
torch on the whole volume: outputs, new global shapes, input gradients and memory formats,
float64 and float32, uneven and prime sizes, on 1, 2, 4 and 8 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import close, on_grids, one_rank_grid, randn, spatial_slices

# the grids of the issue, with the one-rank twin; pads also on 4 ranks along x (data moving
# past the neighbour) and with two data groups (each its own axis lines)
GRIDS = [(1, 1, 1, 1), (1, 2, 1, 1), (1, 2, 2, 1), (1, 2, 2, 2)]
FORMATS = (torch.contiguous_format, torch.channels_last_3d)
DTYPES = (torch.float64, torch.float32)


def _check(grid, op, ref, shape, case, what, replicated=False, ties=False):
    """``op`` on this rank's piece vs ``ref`` on the whole (2, 3, *shape) batch; dtype and
    memory format vary with ``case``. ``ties``: integer data, so maxima tie."""
    dtype, fmt = DTYPES[case % 2], FORMATS[(case // 2) % 2]
    what = f"{what} {shape} {dtype} {fmt} on {grid.spec()}"
    X = randn((2, 3, *shape), 1000 + case, dtype)
    if ties:
        X = X.round()
    Xr = X.clone().requires_grad_()
    Y = ref(Xr)
    W = randn(Y.shape, 2000 + case, dtype)
    (Y * W).sum().backward()
    x = X[spatial_slices(shape, grid)].contiguous(memory_format=fmt).requires_grad_()
    out = op(x, grid=grid, gshape=shape)
    y, gshape = out if isinstance(out, tuple) else (out, tuple(Y.shape[2:]))  # a module
    assert gshape == tuple(Y.shape[2:]), f"{what}: global shape {gshape} != {tuple(Y.shape)}"
    own = (slice(None),) * 5 if replicated else spatial_slices(gshape, grid)
    close(y, Y.detach()[own], f"{what}: output")
    assert y.is_contiguous(memory_format=fmt), f"{what}: output memory format"
    (y * W[own]).sum().backward()
    close(x.grad, Xr.grad[spatial_slices(shape, grid)], f"{what}: input grad")
    if replicated:  # the same bytes on every rank of the spatial group
        blobs = grid.spatial_comm.allgather(y.detach().numpy().tobytes())
        assert all(b == blobs[0] for b in blobs), f"{what}: not replicated"


def _fits(shape, grid):
    return all(n >= p for n, p in zip(shape, grid.spatial_shape))


PADS = [  # (global spatial shape, pad, mode, value)
    ((7, 6, 5), (1, 2, 0, 3, 2, 1), "constant", 0.5),
    ((7, 6, 5), (2, 1, 1, 1, 3, 0), "replicate", None),
    ((7, 6, 5), (3, 2, 1, 4, 2, 1), "reflect", None),
    ((7, 6, 5), (4, 2, 3, 1, 2, 5), "circular", None),
    # wider than a rank's piece (4 or 3 items on 2 ranks, 2 on 4 ranks)
    ((7, 6, 5), (4, 0, 5, 0, 6, 2), "reflect", None),
    ((7, 6, 5), (0, 5, 6, 0, 7, 3), "circular", None),
    ((7, 6, 5), (9, 0, 0, 11, 0, 13), "constant", -1.0),
    ((7, 6, 5), (6, 7, 0, 9, 10, 0), "replicate", None),
    # negative pads crop (circular wraps around the cropped volume, as torch)
    ((9, 8, 7), (-2, 1, -3, -1, 2, -4), "constant", None),
    ((9, 8, 7), (-3, 2, 1, -2, -4, 3), "replicate", None),
    ((9, 8, 7), (-2, 3, 2, -3, -1, -1), "reflect", None),
    ((9, 8, 7), (-2, 3, 3, -2, -5, 4), "circular", None),
    ((9, 8, 7), (0, 0, 0, 0, -6, 0), "constant", None),     # x piece 0 reads piece 1's data
    # fewer entries; channel and batch entries (local, constant mode)
    ((7, 6, 5), (2, 3), "constant", None),
    ((5, 7, 6), (1, 1, 1, 1, 1, 1, 2, -1, 1, 0), "constant", 2.0),
]


@mpi_case(nprocs=(8,), timeout=300)
def test_pad_matches_torch(comm):
    from hpcpar.nn.padding import pad

    def run(grid):
        for i, (shape, p, mode, value) in enumerate(PADS):
            if _fits(shape, grid):
                _check(grid, lambda x, p=p, mode=mode, value=value, **kw: pad(
                    x, p, mode, value, **kw), lambda t, p=p, mode=mode, value=value: F.pad(
                    t, p, mode, value), shape, i + sum(grid.shape), f"pad {mode} {p}")

    on_grids(comm, GRIDS + [(1, 4, 1, 1), (2, 2, 1, 1)], run)


INTERPOLATIONS = [  # (F.interpolate kwargs, global spatial shape)
    (dict(scale_factor=2), (7, 5, 6)),
    (dict(scale_factor=(1.7, 2.0, 2.5)), (9, 5, 4)),
    (dict(size=(11, 3, 9)), (6, 7, 5)),
    (dict(scale_factor=1.6, mode="nearest-exact"), (7, 5, 6)),
    (dict(size=(11, 3, 9), mode="nearest-exact"), (6, 7, 5)),
    (dict(scale_factor=(2.5, 1.5, 1.3), mode="trilinear"), (7, 5, 6)),
    (dict(scale_factor=1.5, mode="trilinear", align_corners=True), (5, 7, 6)),
    (dict(size=(13, 11, 4), mode="trilinear", align_corners=True), (6, 5, 7)),
    (dict(size=(13, 11, 4), mode="trilinear", align_corners=False), (6, 5, 7)),
    (dict(scale_factor=0.6, mode="trilinear", recompute_scale_factor=True), (9, 8, 7)),
    (dict(scale_factor=1.7, mode="nearest", recompute_scale_factor=True), (5, 6, 7)),
    (dict(size=(4, 3, 5), mode="area"), (9, 8, 7)),
]


@mpi_case(nprocs=(8,), timeout=300)
def test_interpolate_matches_torch(comm):
    from hpcpar.nn.resample import interpolate
    from hpcpar.nn.upsample import SpatialUpsample

    def run(grid):
        for i, (kw, shape) in enumerate(INTERPOLATIONS):
            _check(grid, lambda x, kw=kw, **g: interpolate(x, **kw, **g),
                   lambda t, kw=kw: F.interpolate(t, **kw), shape, i + sum(grid.shape),
                   f"interpolate {kw}")
        # the module form shares the implementation: nearest-exact through SpatialUpsample
        kw = dict(scale_factor=1.6, mode="nearest-exact")
        up = SpatialUpsample(**kw, grid=grid)
        _check(grid, lambda x, **g: up(x), nn.Upsample(**kw), (7, 5, 6), sum(grid.shape),
               "SpatialUpsample")

    on_grids(comm, GRIDS, run)


ADAPTIVE = [(1, (7, 6, 5)), (2, (13, 6, 7)), (3, (7, 11, 5)), (5, (13, 6, 7)),
            ((None, 4, 1), (7, 11, 5)), ((3, None, 2), (5, 7, 6))]


@mpi_case(nprocs=(8,), timeout=300)
def test_adaptive_pools_match_torch(comm):
    from hpcpar.errors import LayerError
    from hpcpar.nn.resample import adaptive_avg_pool3d, adaptive_max_pool3d

    def run(grid):
        if grid.spatial_shape[0] == 4:  # cells wider than a neighbour's piece: refused
            x = randn((1, 2, 13, 7, 7), 0)[spatial_slices((13, 7, 7), grid)]
            with pytest.raises(LayerError, match=r"adaptive_max_pool3d: local extent .* at "
                                                 r"least \d+ items on x"):
                adaptive_max_pool3d(x, (2, 7, 7), grid=grid, gshape=(13, 7, 7))
            return
        for i, (size, shape) in enumerate(ADAPTIVE):
            case = i + sum(grid.shape)
            for ours, theirs in ((adaptive_avg_pool3d, F.adaptive_avg_pool3d),
                                 (adaptive_max_pool3d, F.adaptive_max_pool3d)):
                for ties in (False, True) if ours is adaptive_max_pool3d else (False,):
                    _check(grid, lambda x, ours=ours, size=size, **g: ours(x, size, **g),
                           lambda t, theirs=theirs, size=size: theirs(t, size), shape, case,
                           f"{ours.__name__}({size}) ties={ties}", replicated=size == 1,
                           ties=ties)

    on_grids(comm, GRIDS + [(1, 4, 1, 1)], run)


def test_refusals_are_one_line():
    """torch's own refusals on the whole volume, a wrong gshape and return_indices: one
    LayerError line naming the op."""
    from hpcpar.errors import LayerError
    from hpcpar.nn.padding import pad
    from hpcpar.nn.resample import adaptive_max_pool3d, interpolate

    grid = one_rank_grid()
    x = randn((1, 2, 5, 6, 7), 0)
    g = dict(grid=grid, gshape=(5, 6, 7))
    cases = [
        (lambda: pad(x, (0, 0, 0, 0, 5, 0), "reflect", **g), r"pad on the global volume "
         r"\(1, 2, 5, 6, 7\): .*[Pp]adding size should be less than"),
        (lambda: pad(x, (1, 1), "replicate", **g), "pad on the global volume .*Padding size 2"),
        (lambda: pad(x, (1,) * 8, "circular", **g), "pad on the global volume .*Padding size 8"),
        (lambda: pad(x, (1,) * 6, "reflect", 1.0, **g), "doesn't take in value"),
        (lambda: pad(x, (0, 0, 0, 0, 0, 6), "circular", **g), "wrapping around more than once"),
        (lambda: pad(x, (1, 1), grid=grid, gshape=(6, 6, 7)),
         "pad: this rank holds 5 items on axis x, but the partition rule gives 6"),
        (lambda: interpolate(x, scale_factor=2, mode="bilinear", **g), "interpolate on the "
         "global volume .*bilinear mode needs 4D input"),
        (lambda: interpolate(x, size=4, scale_factor=2, **g), "only one of size"),
        (lambda: adaptive_max_pool3d(x, 2, True, **g), "return_indices=True is not supported"),
        (lambda: adaptive_max_pool3d(x, (1, 2), **g), "adaptive_max_pool3d on the global"),
    ]
    for call, message in cases:
        with pytest.raises(LayerError, match=message) as info:
            call()
        assert "\n" not in str(info.value)
