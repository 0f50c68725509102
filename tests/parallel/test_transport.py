"""The halo transport: what each ``[train] halo_transport`` value resolves to on each device
(and its one-line refusals), and the torch.distributed path run with Gloo against the MPI
path: halos, their adjoint, the fused and boundary convolutions and every spatial collective
bitwise equal, on 2 and 4 ranks, float64, uneven pieces."""

from __future__ import annotations

import math

import pytest
import torch

from hpcpar.errors import ConfigError
from hpcpar.parallel.transport import resolve_transport
from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import on_grids, randn, spatial_slices

GSHAPE = (9, 7, 10)   # uneven over 2 and 4 ranks on every axis
GRIDS = [(1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2), (1, 2, 2, 1), (1, 4, 1, 1), (1, 1, 2, 2),
         (2, 2, 1, 1)]   # the last: two spatial groups, each with its own Gloo group


# ------------------------------------------------------------------------------ no MPI --
def test_auto_picks_a_transport_measured_on_the_device():
    def pick(device, nccl, aware, shared=False):
        return resolve_transport("auto", device, nccl_available=nccl, aware=aware,
                                 shared_gpu=shared)

    assert pick("cpu", True, True) == "mpi"
    # NCCL halos have not run on a device yet: named only, never picked by auto
    assert pick("cuda", True, False) == "staged"
    assert pick("cuda", True, True) == "mpi"
    assert pick("cuda", False, True) == "mpi"
    assert pick("cuda", False, False) == "staged"
    assert pick("cuda", True, True, shared=True) == "mpi"
    assert pick("cuda", True, False, shared=True) == "staged"


def test_named_transports_and_their_refusals():
    def res(name, device, nccl=True, aware=False):
        return resolve_transport(name, device, nccl_available=nccl, aware=aware)

    assert res("gloo", "cpu") == "gloo" and res("mpi", "cpu") == "mpi"
    assert res("staged", "cpu") == "mpi"          # host memory: nothing to stage
    assert res("nccl", "cuda") == "nccl" and res("staged", "cuda") == "staged"
    assert res("mpi", "cuda", aware=True) == "mpi"
    for name, device, kw, says in [
            ("nccl", "cpu", {}, "'nccl' moves CUDA tensors, but this run is on cpu"),
            ("nccl", "cuda", {"nccl": False}, "this torch build has no NCCL"),
            ("gloo", "cuda", {}, "'gloo' moves CPU tensors, but this run is on CUDA"),
            ("mpi", "cuda", {}, "which is not CUDA-aware here"),
            ("ucx", "cpu", {}, "expected one of 'auto', 'mpi', 'nccl', 'gloo', 'staged'")]:
        with pytest.raises(ConfigError) as info:
            res(name, device, **kw)
        msg = str(info.value)
        assert msg.startswith("[train] halo_transport") and says in msg and "\n" not in msg


# ---------------------------------------------------------------------------- 2-4 ranks --
def _gloo_vs_mpi(grid, cases: dict):
    """Each ``cases[what]()`` on the MPI path, then with a Gloo group bound to the grid: the
    tensors they return must be bitwise equal."""
    from hpcpar.parallel.transport import torch_group, use_transport

    want = {what: fn() for what, fn in cases.items()}
    transport = use_transport(grid, "gloo", "cpu")
    try:
        assert transport.name == "gloo"
        assert torch_group(grid.spatial_comm, torch.zeros(1)) is not None
        got = {what: fn() for what, fn in cases.items()}
    finally:
        transport.close()
    assert torch_group(grid.spatial_comm, torch.zeros(1)) is None
    for what in cases:
        assert len(got[what]) == len(want[what]), what
        for i, (g, w) in enumerate(zip(got[what], want[what])):
            assert g.dtype == w.dtype and g.shape == w.shape, (what, i)
            assert torch.equal(g, w), f"{what}: output {i} differs, max {(g - w).abs().max()}"


def _grids(comm):
    """The grids of exactly ``comm``'s ranks (the 2-rank ones run at 2 ranks only)."""
    return [g for g in GRIDS if math.prod(g) == comm.Get_size()]


def _piece(grid, seed, channels=3, layout=torch.contiguous_format):
    whole = randn((2, channels, *GSHAPE), seed, torch.float64)
    return whole[spatial_slices(GSHAPE, grid)].contiguous(memory_format=layout)


def _grads(out, inputs, seed):
    """``out`` and the gradients of <out, w> for a fixed random w."""
    w = randn(out.shape, seed, out.dtype)
    grads = torch.autograd.grad(out, inputs, w)
    return [out.detach(), *grads]


def _halo_cases(grid):
    from hpcpar.nn._boundary_conv import boundary_conv, boundary_spec
    from hpcpar.nn.conv import SpatialConv3d
    from hpcpar.parallel.halo import halo_exchange
    from hpcpar.parallel.partition import conv_axis_halo

    cases = {}
    for layout in (torch.contiguous_format, torch.channels_last_3d):
        x = _piece(grid, 1, layout=layout)
        for k, s, p in ((3, 1, 1), (5, 2, 2), (2, 3, 0)):   # the last one trims
            halos = [conv_axis_halo(n, grid.spatial_shape[a], grid.spatial_coords[a], k, s, p)
                     for a, n in enumerate(GSHAPE)]

            def exchanged(halos=halos, x=x):
                xx = x.clone().requires_grad_()
                return _grads(halo_exchange(xx, grid, halos), [xx], 2)

            cases[f"halo_exchange k{k} s{s} {layout}"] = exchanged
        torch.manual_seed(0)
        conv = SpatialConv3d(3, 4, 3, padding=1, grid=grid, dtype=torch.float64)

        def fused(conv=conv, x=x):   # the general path: halo_stencil
            xx = x.clone().requires_grad_()
            return _grads(conv(xx), [xx, conv.weight, conv.bias], 3)

        cases[f"SpatialConv3d {layout}"] = fused
        spec = boundary_spec(conv, GSHAPE, grid)
        assert spec is not None

        def overlapped(conv=conv, x=x, spec=spec):   # the overlap path: boundary_conv
            xx = x.clone().requires_grad_()
            out = boundary_conv(xx, conv.weight, conv.bias, spec)
            return _grads(out, [xx, conv.weight, conv.bias], 4)

        cases[f"boundary_conv {layout}"] = overlapped
    _gloo_vs_mpi(grid, cases)


@mpi_case(nprocs=(2, 4), timeout=180)
def test_halos_and_adjoint_bitwise_gloo_vs_mpi(comm):
    on_grids(comm, _grids(comm), _halo_cases)


def _collective_cases(grid):
    from mpi4py import MPI

    from hpcpar.nn.gather import SpatialAdaptiveAvgPool3d
    from hpcpar.nn.global_norm import group_norm
    from hpcpar.nn.norm import SpatialBatchNorm3d
    from hpcpar.nn.reduce import global_reduce
    from hpcpar.parallel.comm import (
        allgather,
        allgatherv,
        allreduce_,
        alltoallv,
        bcast_,
        irecv,
        isend,
        reduce_scatter,
        sendrecv,
    )

    comm = grid.spatial_comm
    r, p = comm.Get_rank(), comm.Get_size()

    def messages():
        out = []
        for n in (1, 5, 300, 70000):
            x = randn((n,), 100 + 7 * r + n, torch.float64)
            # a large sum goes through torch's own allreduce, whose order differs from MPI's
            ops = ("sum", "max", "min") if n < 70000 or p == 2 else ("max", "min")
            out += [allreduce_(x.clone(), comm, op) for op in ops]
        out.append(allreduce_(randn((6,), r, torch.float64).exp(), comm, "prod"))
        out.append(allreduce_(torch.arange(5) * (r + 1), comm))
        out.append(allreduce_(torch.tensor([r == p - 1, False, True]), comm))
        out.append(allreduce_(randn((6,), r, torch.float16), comm))
        out.append(allgather(randn((2, 3), r, torch.float64), comm))
        out.append(allgather(randn((2, 3), r, torch.bfloat16), comm))
        out.append(allgatherv(randn((r + 1, 3), r, torch.float64), comm))   # uneven rows
        out.append(bcast_(randn((4,), r, torch.float64), comm, root=p - 1))
        got = irecv(torch.empty(3, dtype=torch.float64), (r - 1) % p, comm, tag=7)
        sent = isend(randn((3,), r, torch.float64), (r + 1) % p, comm, tag=7)
        nothing = isend(torch.ones(2), MPI.PROC_NULL, comm)
        out += [got.wait(), sent.wait(), nothing.wait()]
        out.append(sendrecv(randn((2, 3), r, torch.float64), (r + 1) % p,
                            torch.empty(2, 3, dtype=torch.float64), (r - 1) % p, comm,
                            sendtag=3))
        rows = [(r + q) % 3 for q in range(p)]          # uneven, some blocks empty
        for dtype in (torch.float64, torch.bfloat16, torch.bool):
            send = randn((sum(rows), 2, 3), 40 + r, torch.float64).gt(0).to(dtype) \
                if dtype == torch.bool else randn((sum(rows), 2, 3), 40 + r, dtype)
            out.append(alltoallv(send, rows, comm))
        block = [1 + q % 2 for q in range(p)]
        for dtype, op in ((torch.float64, "max"), (torch.int64, "sum"),
                          (torch.float16, "min")):
            t = randn((sum(block), 3), 50 + r, torch.float64)
            out.append(reduce_scatter((t * 100).to(dtype), block, comm, op))
        if p == 2:   # a + b in either order
            out.append(reduce_scatter(randn((sum(block), 3), 60 + r, torch.float64), block,
                                      comm))
        return out


    x = _piece(grid, 5, channels=4)
    weight, bias = randn((4,), 6, torch.float64), randn((4,), 7, torch.float64)

    def norms():
        xx, ww, bb = (t.clone().requires_grad_() for t in (x, weight, bias))
        return _grads(group_norm(xx, 2, ww, bb, grid=grid, gshape=GSHAPE), [xx, ww, bb], 8)


    def batch_norm():
        torch.manual_seed(0)
        bn = SpatialBatchNorm3d(4, grid=grid, dtype=torch.float64)
        xx = x.clone().requires_grad_()
        return _grads(bn(xx), [xx, bn.weight, bn.bias], 9) + [bn.running_mean, bn.running_var]


    def reductions():
        out = []
        for op in ("sum", "mean", "var", "amax"):
            xx = x.clone().requires_grad_()
            y = global_reduce(xx, op, (2, 3, 4), grid=grid, gshape=GSHAPE)
            out += _grads(y, [xx], 10)
        return out


    def pooled():
        xx = x.clone().requires_grad_()
        return _grads(SpatialAdaptiveAvgPool3d(1, grid=grid)(xx), [xx], 11)

    def padded():   # data moves along each axis line: circular fetches the far end
        from hpcpar.nn.padding import pad

        out = []
        for mode, widths in (("circular", (3, 1, 0, 2, 4, 0)), ("reflect", (2, 2, 1, 0, 0, 3))):
            xx = x.clone().requires_grad_()
            out += _grads(pad(xx, widths, mode, grid=grid, gshape=GSHAPE)[0], [xx], 12)
        return out

    _gloo_vs_mpi(grid, {"comm collectives": messages, "group_norm": norms, "pad": padded,
                        "SpatialBatchNorm3d": batch_norm, "global_reduce": reductions,
                        "SpatialAdaptiveAvgPool3d": pooled})


@mpi_case(nprocs=(2, 4), timeout=180)
def test_spatial_collectives_bitwise_gloo_vs_mpi(comm):
    on_grids(comm, _grids(comm), _collective_cases)
