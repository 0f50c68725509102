"""SpatialBatchNorm3d against torch's BatchNorm3d on the whole volume (and whole batch with
``include_data``): output, input and parameter gradients, running statistics (identical on
every rank, equal to torch's) and eval mode."""

from __future__ import annotations

import torch
import torch.nn as nn

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import PROCESS_GRIDS, check_layer, close, on_grids, one_rank_grid, randn

CONFIGS = [  # (global spatial shape, dtype, BatchNorm3d kwargs, include_data)
    ((17, 6, 5), torch.float32, {}, False),
    ((5, 7, 31), torch.float64, {"momentum": None}, True),
    ((6, 17, 6), torch.float64, {"affine": False}, False),
    ((7, 6, 8), torch.float32, {"track_running_stats": False}, True),
]


def _same_everywhere(comm, t, what):
    blobs = comm.allgather(t.numpy().tobytes())
    assert all(b == blobs[0] for b in blobs), f"{what} differs between ranks"


def _run_config(grid, i, shape, dtype, kw, include_data):
    from hpcpar.nn.norm import SpatialBatchNorm3d

    what = f"BN {shape} {dtype} {kw} include_data={include_data} on {grid.spec()}"
    ref = nn.BatchNorm3d(3, **kw).to(dtype)
    if ref.affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-0.5, 0.5)
    sp = SpatialBatchNorm3d(3, **kw, grid=grid, include_data=include_data).to(dtype)
    sp.load_state_dict(ref.state_dict())
    group = grid.comm if include_data else grid.spatial_comm
    for step in range(2):  # two steps: running statistics accumulate
        x = randn((2 * grid.data, 3, *shape), 10 * i + step, dtype) * 3 + 1.5
        for m in (ref, sp):
            m.zero_grad()
        check_layer(grid, ref, sp, x, 99 + step, f"{what} step {step}",
                    whole_batch=include_data)
    if ref.track_running_stats:
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            mine = getattr(sp, name)
            _same_everywhere(group, mine, f"{what}: {name}")
            if name == "num_batches_tracked":
                assert int(mine) == int(getattr(ref, name)) == 2
            else:
                close(mine, getattr(ref, name), f"{what}: {name}")
    ref.eval()
    sp.eval()
    x = randn((2 * grid.data, 3, *shape), 77, dtype)
    check_layer(grid, ref, sp, x, 78, f"{what} eval", whole_batch=include_data)


@mpi_case(nprocs=(8,), timeout=300)
def test_batchnorm_matches_torch(comm):
    def run(grid):
        for i, (shape, dtype, kw, include_data) in enumerate(CONFIGS):
            if any(n < p for n, p in zip(shape, grid.spatial_shape)):
                continue
            if include_data and grid.data == 1 and i % 2:
                continue  # same as include_data=False there; sample fewer cases
            _run_config(grid, i, shape, dtype, kw, include_data)

    on_grids(comm, PROCESS_GRIDS, run)


def test_batchnorm_state_dict_and_16bit():
    from hpcpar.nn.norm import SpatialBatchNorm3d

    grid = one_rank_grid()
    ref = nn.BatchNorm3d(4)
    sp = SpatialBatchNorm3d(4, grid=grid)
    assert sp.state_dict().keys() == ref.state_dict().keys()
    ref.load_state_dict(sp.state_dict())
    x = randn((2, 4, 5, 6, 7), 5, torch.bfloat16)
    y_ref = ref.to(torch.bfloat16)(x.float().to(torch.bfloat16))
    y = sp.to(torch.bfloat16)(x)
    assert y.dtype == torch.bfloat16
    assert (y.float() - y_ref.float()).abs().max() < 0.05


def test_batchnorm_channels_last_and_any_gradient_layout():
    """Channels-last inputs (the jobs' default) and gradients in either order, or expanded
    from a sum, give torch's output and gradients (the fused kernels see dy in x's order)."""
    from hpcpar.nn.norm import SpatialBatchNorm3d

    grid = one_rank_grid()
    for fmt in (torch.contiguous_format, torch.channels_last_3d):
        for dy_kind in ("contiguous", "channels_last", "expanded"):
            x = (randn((3, 5, 6, 7, 8), 3, torch.float32) * 3 + 1.5).contiguous(
                memory_format=fmt).requires_grad_()
            xr = x.detach().clone().requires_grad_()
            ref = nn.BatchNorm3d(5)
            with torch.no_grad():
                ref.weight.uniform_(0.5, 1.5)
                ref.bias.uniform_(-0.5, 0.5)
            sp = SpatialBatchNorm3d(5, grid=grid)
            sp.load_state_dict(ref.state_dict())
            dy = randn((3, 5, 6, 7, 8), 4, torch.float32)
            dy = {"contiguous": dy, "channels_last": dy.contiguous(
                memory_format=torch.channels_last_3d), "expanded": dy[:1, :1, :1, :1, :1].expand(
                3, 5, 6, 7, 8)}[dy_kind]
            y, yr = sp(x), ref(xr)
            y.backward(dy)
            yr.backward(dy)
            what = f"BN {fmt} dy {dy_kind}"
            close(y, yr, what)
            if dy_kind == "expanded":   # a constant dy: input and weight gradients are zero
                n = x.numel() // 5
                assert x.grad.abs().max() < 1e-5 and sp.weight.grad.abs().max() < 1e-6 * n, what
            else:
                close(x.grad, xr.grad, f"{what}: input grad")
                close(sp.weight.grad, ref.weight.grad, f"{what}: weight grad")
            close(sp.bias.grad, ref.bias.grad, f"{what}: bias grad")
