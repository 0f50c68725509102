"""Group, instance and layer norm of split volumes (hpcpar.nn.global_norm) against torch's
modules (which call F.group_norm / F.instance_norm / F.layer_norm) on the whole sample:
output, input gradient, parameter gradients summed over the spatial group, running statistics
after two training steps (equal to torch's, the same bits on every rank), then eval mode.

The reference runs in float64 on the same data also for float32 cases (torch's own float32
group norm loses ~1e-6 in channels-last), and float32 inputs carry a large offset, so a
single-pass Σx² in float32 would fail the check."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import close, on_grids, randn, spatial_slices

# (data, x, y, z): the 1-rank twin, three spatial splits, and data parallel (per-sample stats)
GRIDS = [(1, 1, 1, 1), (1, 2, 1, 1), (1, 2, 2, 1), (1, 2, 2, 2), (2, 2, 1, 1)]
CL = torch.channels_last_3d
CONFIGS = [  # (what, module factory from the global shape, global spatial shape, dtype, format)
    ("GroupNorm 6ch 3 groups", lambda s: nn.GroupNorm(3, 6), (5, 7, 3), torch.float64, CL),
    ("GroupNorm 6ch 1 group", lambda s: nn.GroupNorm(1, 6), (7, 3, 5), torch.float32, None),
    ("GroupNorm 6ch 6 groups no affine", lambda s: nn.GroupNorm(6, 6, affine=False),
     (3, 5, 7), torch.float32, CL),
    ("InstanceNorm3d affine tracked", lambda s: nn.InstanceNorm3d(
        6, affine=True, track_running_stats=True), (5, 3, 7), torch.float64, None),
    ("InstanceNorm3d tracked momentum None", lambda s: nn.InstanceNorm3d(
        6, track_running_stats=True, momentum=None), (7, 5, 2), torch.float32, CL),
    ("InstanceNorm3d plain", lambda s: nn.InstanceNorm3d(6), (3, 7, 5), torch.float64, CL),
    ("InstanceNorm3d affine untracked", lambda s: nn.InstanceNorm3d(6, affine=True),
     (5, 5, 3), torch.float32, None),
    ("LayerNorm (C,D,H,W)", lambda s: nn.LayerNorm((6, *s)), (5, 7, 3), torch.float32, CL),
    ("LayerNorm (D,H,W) no bias", lambda s: nn.LayerNorm(s, bias=False), (7, 3, 5),
     torch.float64, None),
    ("LayerNorm (C,D,H,W) no affine", lambda s: nn.LayerNorm((6, *s),
                                                             elementwise_affine=False),
     (3, 5, 2), torch.float64, CL),
]
LOCAL_W = ("LayerNorm (W,) unsplit", lambda s: nn.LayerNorm(s[-1]), (5, 3, 7), torch.float64, CL)


def spatial_forward(m, x, grid, gshape):
    """What the dispatch does with a torch norm module on a split tensor."""
    from hpcpar.nn.global_norm import group_norm, instance_norm, layer_norm

    if isinstance(m, nn.GroupNorm):
        return group_norm(x, m.num_groups, m.weight, m.bias, m.eps, grid=grid, gshape=gshape)
    if isinstance(m, nn.InstanceNorm3d):
        return instance_norm(x, m.running_mean, m.running_var, m.weight, m.bias,
                             m.training or not m.track_running_stats,
                             m.momentum if m.momentum is not None else 0.0, m.eps, grid=grid,
                             gshape=gshape)
    return layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps, grid=grid, gshape=gshape)


def _same_everywhere(comm, t, what):
    blobs = comm.allgather(t.numpy().tobytes())
    assert all(b == blobs[0] for b in blobs), f"{what} differs between ranks"


def _step(grid, ref, sp, shape, dtype, fmt, seed, what):
    """One forward + backward of both on this data group's batch; compare everything."""
    from hpcpar.parallel.comm import allreduce_

    fmt = fmt or torch.contiguous_format
    n = 2  # samples per data group: statistics must stay per sample
    X = randn((n * grid.data, 6, *shape), seed, dtype) * 3 + (100 if dtype == torch.float32
                                                              else 1.5)
    X = X[n * grid.coords[0]: n * (grid.coords[0] + 1)]
    dY = randn(X.shape, seed + 1, torch.float64)
    xr = X.double().clone(memory_format=fmt).requires_grad_()
    yr = ref(xr)
    yr.backward(dY)
    own = spatial_slices(shape, grid)
    x = X[own].clone(memory_format=fmt).requires_grad_()
    y = spatial_forward(sp, x, grid, shape)
    assert y.dtype == dtype and y.is_contiguous(memory_format=fmt), f"{what}: output layout"
    close(y.detach(), yr.detach()[own].to(dtype), f"{what}: output")
    y.backward(dY[own].to(dtype))
    close(x.grad, xr.grad[own].to(dtype), f"{what}: input grad")
    for (name, pr), ps in zip(ref.named_parameters(), sp.parameters()):
        close(allreduce_(ps.grad.clone(), grid.spatial_comm), pr.grad.to(dtype),
              f"{what}: grad of {name}")


def _run_config(grid, seed, config):
    name, factory, shape, dtype, fmt = config
    what = f"{name} {shape} {dtype} {'channels_last' if fmt else 'contiguous'} on {grid.spec()}"
    ref = factory(shape).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(randn(p.shape, seed + 7, torch.float64) * 0.5 + 1)
    sp = copy.deepcopy(ref).to(dtype)
    for step in range(2):  # two steps: running statistics accumulate
        for m in (ref, sp):
            m.zero_grad()
        _step(grid, ref, sp, shape, dtype, fmt, seed + 10 * step, f"{what} step {step}")
    for buf in ("running_mean", "running_var"):
        mine = getattr(sp, buf, None)
        if mine is not None:
            _same_everywhere(grid.spatial_comm, mine, f"{what}: {buf}")
            close(mine, getattr(ref, buf).to(dtype), f"{what}: {buf}")
    ref.eval()
    sp.eval()
    for m in (ref, sp):
        m.zero_grad()
    _step(grid, ref, sp, shape, dtype, fmt, seed + 50, f"{what} eval")


@mpi_case(nprocs=(8,), timeout=600)
def test_global_norms_match_torch(comm):
    def run(grid):
        for i, config in enumerate(CONFIGS):
            _run_config(grid, 100 * i, config)
        if grid.spatial_shape[2] == 1:  # (W,) with W not split: plain local layer norm
            _run_config(grid, 999, LOCAL_W)

    on_grids(comm, GRIDS, run)


@mpi_case(nprocs=(8,), timeout=300)
def test_refusals_are_one_line_on_every_rank(comm):
    """What cannot be exact is refused with a LayerError naming the op, on every rank."""
    from hpcpar.errors import LayerError
    from hpcpar.nn.global_norm import group_norm, instance_norm, layer_norm

    def run(grid):
        shape = (5, 7, 3)
        x = randn((2, 6, *shape), 1)[spatial_slices(shape, grid)]
        kw = {"grid": grid, "gshape": shape}
        cases = [
            ("group_norm: 6 channels", lambda: group_norm(x, 4, **kw)),
            # D=6 instead of 5: only the ranks at x=1 hold a wrong extent, all of them refuse
            ("pieces of spatial ranks [1, 3] are not", lambda: group_norm(
                x, 3, gshape=(6, 7, 3), grid=grid)),
            ("use_input_stats=False needs", lambda: instance_norm(x, use_input_stats=False,
                                                                 **kw)),
            ("running_mean and running_var", lambda: instance_norm(x, torch.zeros(6), **kw)),
            ("is not the trailing part", lambda: layer_norm(x, x.shape[2:], **kw)),
            ("weight has shape", lambda: layer_norm(x, shape, torch.ones(x.shape[2:]), **kw)),
            # (H, W) holds the y split but leaves out the split x axis (dim 2)
            ("leaves out dim 2", lambda: layer_norm(x, shape[1:], **kw)),
        ]
        for needle, call in cases:
            with pytest.raises(LayerError) as err:
                call()
            msg = str(err.value)
            assert needle in msg and "\n" not in msg, msg

    on_grids(comm, [(1, 2, 2, 1)], run)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_types_compute_in_float32(dtype):
    """16-bit pieces: the arithmetic runs in float32, so the output is the float64 result
    rounded once (within one step of the dtype, elementwise; a 16-bit chain x - mean, * rstd
    is off by ~100 steps on values near 0), and the gradients are in the input's dtype."""
    from hpcpar.nn.global_norm import group_norm
    from hpcpar.testing.oracles import one_rank_grid

    x = (randn((2, 4, 9, 10, 11), 3) * 2 + 100).to(dtype).requires_grad_()
    w = torch.linspace(0.5, 1.5, 4, dtype=dtype, requires_grad=True)
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    y = group_norm(x, 2, w, None, grid=one_rank_grid(), gshape=x.shape[2:])
    yr = torch.nn.functional.group_norm(xr, 2, wr)
    dy = randn(x.shape, 4)
    y.backward(dy.to(dtype))
    yr.backward(dy)
    assert y.dtype == x.grad.dtype == w.grad.dtype == dtype
    step = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10  # relative spacing of dtype
    assert ((y.double() - yr).abs() <= step * (yr.abs() + 1e-3 * yr.abs().max())).all()
    assert (w.grad.double() - wr.grad).abs().max() <= step * wr.grad.abs().max()
    assert (x.grad.double() - xr.grad).abs().max() <= 2 * step * xr.grad.abs().max()
