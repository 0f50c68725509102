"""The split head (hpcpar/nn/split_head.py): a dense layer after a flatten of the split volume
takes the features split, on every grid exactly as single-process torch (output, input and
every parameter gradient, after hpcpar.DDP, and parameters after SGD and Adam steps), with the
weight cut to this rank's columns; state dicts and checkpoints keep the plain format."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import (
    batch_slice,
    on_grids,
    one_rank_grid,
    piece_of,
    randn,
    refused_on_one_rank,
    spatial_slices,
)

GRIDS = [(1, 1, 1, 1), (1, 2, 1, 1), (1, 2, 2, 1), (2, 2, 1, 1)]
SIZE = (7, 5, 6)          # odd edges: uneven pieces on every split axis
RTOL = 1e-10


def _sequential(c=2, size=SIZE):
    return nn.Sequential(nn.Conv3d(c, 3, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(3 * math.prod(size), 5), nn.LeakyReLU(0.3), nn.Linear(5, 2))


class _FlattenMethod(nn.Module):
    """``x.flatten(1)`` with elementwise ops between the flatten and the dense layer."""

    def __init__(self, c=2, size=SIZE):
        super().__init__()
        self.conv = nn.Conv3d(c, 2, 3, padding=1)
        self.fc = nn.Linear(2 * math.prod(size), 3)

    def forward(self, x):
        h = self.conv(x).flatten(1)
        return self.fc(F.relu(h) * 0.5 + h.sigmoid())


class _ViewHead(nn.Module):
    """``x.view(x.size(0), -1)`` after a pool (the volume shrinks unevenly) into F.linear."""

    def __init__(self, c=2, size=SIZE):
        super().__init__()
        self.conv = nn.Conv3d(c, 4, 3, padding=1)
        self.fc = nn.Linear(4 * math.prod(s // 2 for s in size), 3)
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        h = F.max_pool3d(F.relu(self.conv(x)), 2)
        return self.out(F.linear(h.view(h.size(0), -1), self.fc.weight, self.fc.bias).tanh())


MODELS = [_sequential, _FlattenMethod, _ViewHead]


def _piece(x, grid):
    return piece_of(x, grid).clone()


def _full_grad(p):
    from hpcpar.nn.split_head import column_split

    info = column_split(p)
    g = p.grad if p.grad is not None else torch.zeros_like(p)
    return info.gather(g) if info is not None else g


def _close(got, want, what, rtol=RTOL):
    scale = max(float(want.abs().max()), 1e-6)
    err = float((got - want).abs().max())
    assert got.shape == want.shape and err <= rtol * scale, \
        f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}, max |diff| {err:.3e}"


def _exact(grid):
    import hpcpar
    from hpcpar.nn import spatialize
    from hpcpar.nn.split_head import column_split
    from hpcpar.parallel.partition import box
    from hpcpar.sync.tags import reduce_scope

    for i, factory in enumerate(MODELS):
        what = f"{factory.__name__} on {grid.spec()}"
        torch.manual_seed(i)
        plain = factory().double()
        x = randn((2 * grid.data, 2, *SIZE), i + 1, torch.float64).requires_grad_()
        ref = plain(x)
        w = randn(ref.shape, i + 2, torch.float64)
        (ref * w).sum().backward()
        # the mean over data replicas, as hpcpar.DDP reduces, equals this weighting / data
        model = hpcpar.DDP(spatialize(plain, grid, check=True), grid)
        xl = _piece(x.detach(), grid).requires_grad_()
        out = model(xl)
        bs = batch_slice(ref.shape[0], grid)
        _close(out.detach(), ref.detach()[bs], f"{what}: output")
        (out * w[bs]).sum().backward()
        _close(xl.grad, _piece(x.grad, grid), f"{what}: input grad")
        ref_params = dict(plain.named_parameters())
        for name, p in model.module.named_parameters():
            _close(_full_grad(p) * grid.data, ref_params[name].grad, f"{what}: grad {name}")
        head = next(p for p in model.module.parameters() if p.dim() == 2)
        cut = column_split(head)
        assert cut is not None and reduce_scope(head) == "data", what
        chans = cut.volume[0]
        local = math.prod(b - a for a, b in box(cut.volume[1:], grid.spatial_shape,
                                                grid.spatial_coords))
        assert head.numel() == head.shape[0] * chans * local, what  # only its own columns
        sd = model.state_dict()   # the full weight again (collective)
        assert sd.keys() == plain.state_dict().keys()
        for k, v in plain.state_dict().items():
            assert torch.equal(sd[k], v), f"{what}: state_dict {k}"


@mpi_case(nprocs=(4,), timeout=300)
def test_outputs_and_every_gradient_match_torch(comm):
    on_grids(comm, GRIDS, _exact)


def _train(grid, opt_name, steps=3, model=None, opt_state=None):
    """``steps`` steps of the split-head model on ``grid`` (from ``model``'s weights and
    ``opt_state`` when given); returns (plain state dict, plain optimizer state dict)."""
    import hpcpar
    from hpcpar.nn import settle, spatialize
    from hpcpar.run.checkpoint import capture

    torch.manual_seed(0)
    plain = _sequential().double() if model is None else model
    sp = spatialize(plain, grid)
    settle(sp, torch.zeros(1, 2, *SIZE, dtype=torch.float64)[spatial_slices(SIZE, grid)])
    ddp = hpcpar.DDP(sp, grid)
    opt = (torch.optim.Adam(sp.parameters(), lr=0.01) if opt_name == "adam"
           else torch.optim.SGD(sp.parameters(), lr=0.05, momentum=0.9))
    if opt_state is not None:
        capture.load_full_optimizer_state(sp, opt, opt_state)
    for step in range(steps):
        x = randn((2 * grid.data, 2, *SIZE), 10 + step, torch.float64)
        y = randn((2 * grid.data, 2), 20 + step, torch.float64)
        bs = batch_slice(x.shape[0], grid)
        opt.zero_grad()
        F.mse_loss(ddp(_piece(x, grid)), y[bs]).backward()
        opt.step()
    return capture.full_state_dict(sp), capture.full_optimizer_state(sp, opt)


def _reference(opt_name, steps, data):
    """The same steps in single-process torch on the global batches."""
    torch.manual_seed(0)
    plain = _sequential().double()
    opt = (torch.optim.Adam(plain.parameters(), lr=0.01) if opt_name == "adam"
           else torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9))
    for step in range(steps):
        x = randn((2 * data, 2, *SIZE), 10 + step, torch.float64)
        y = randn((2 * data, 2), 20 + step, torch.float64)
        opt.zero_grad()
        F.mse_loss(plain(x), y).backward()
        opt.step()
    return plain.state_dict(), opt.state_dict()


def _steps_and_resume(grid):
    for opt_name in ("sgd", "adam"):
        what = f"{opt_name} on {grid.spec()}"
        want, want_opt = _reference(opt_name, 4, grid.data)
        got, _ = _train(grid, opt_name, steps=4)
        for k, v in want.items():
            _close(got[k], v, f"{what}: {k} after 4 steps", 1e-9)
        # a checkpoint after 2 steps on this grid, resumed on one rank: the plain format
        half, half_opt = _train(grid, opt_name, steps=2)
        assert {k: tuple(v.shape) for k, v in half.items()} == \
            {k: tuple(v.shape) for k, v in want.items()}
        plain = _sequential().double()
        plain.load_state_dict(half)
        resumed, resumed_opt = _train(one_rank_grid(), opt_name, steps=0, model=plain,
                                      opt_state=half_opt)
        for k, v in half.items():
            assert torch.equal(resumed[k], v), f"{what}: resumed {k}"
        for i, st in half_opt["state"].items():
            for key, v in st.items():
                assert torch.equal(resumed_opt["state"][i][key], v), f"{what}: state {key}"
        for i, st in want_opt["state"].items():   # the state's shapes are the plain model's
            for key, v in st.items():
                assert tuple(half_opt["state"][i][key].shape) == tuple(v.shape), what


@mpi_case(nprocs=(4,), timeout=300)
def test_training_steps_and_checkpoint_match_torch(comm):
    on_grids(comm, GRIDS[1:], _steps_and_resume)


@mpi_case(nprocs=(2,), timeout=120)
def test_checkpoint_resumes_on_another_grid(comm):
    """Saved on 1x2x1x1 after 2 steps, resumed on 1x1x2x1 (other columns per rank) for 2
    more: the same parameters as 4 uninterrupted steps."""
    from hpcpar.parallel.grid import ProcessGrid

    for opt_name in ("adam",):
        grid = ProcessGrid(1, 2, 1, 1, comm=comm)
        half, half_opt = _train(grid, opt_name, steps=2)
        grid.free()
        plain = _sequential().double()
        plain.load_state_dict(half)
        grid = ProcessGrid(1, 1, 2, 1, comm=comm)
        got, _ = _train(grid, opt_name, steps=4, model=plain,
                        opt_state=copy.deepcopy(half_opt))   # the steps update it in place
        grid.free()
        want, _ = _reference_from(half, half_opt, opt_name)
        for k, v in want.items():
            _close(got[k], v, f"{opt_name}: resumed on another grid: {k}", 1e-9)


def _reference_from(state, opt_state, opt_name):
    plain = _sequential().double()
    plain.load_state_dict(state)
    opt = (torch.optim.Adam(plain.parameters(), lr=0.01) if opt_name == "adam"
           else torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9))
    opt.load_state_dict(copy.deepcopy(opt_state))
    for step in range(4):
        x = randn((2, 2, *SIZE), 10 + step, torch.float64)
        y = randn((2, 2), 20 + step, torch.float64)
        opt.zero_grad()
        F.mse_loss(plain(x), y).backward()
        opt.step()
    return plain.state_dict(), opt.state_dict()


class _SoftmaxAfterFlatten(nn.Module):
    def forward(self, x):
        return x.flatten(1).softmax(1)


class _MaxAfterFlatten(nn.Module):
    def forward(self, x):
        return x.flatten(1).amax(1)   # a sum or mean over the features is global (the zoo)


class _PartialFlatten(nn.Module):
    def forward(self, x):
        return x.flatten(3)   # H and W, not D: flatten(2), all three, is hpcpar.nn.tokens


class _ReshapeAfterFlatten(nn.Module):
    def forward(self, x):
        return x.flatten(1).reshape(x.shape[0], 2, -1)


@pytest.mark.parametrize("model, op, why", [
    (_SoftmaxAfterFlatten(), "softmax", "no form on a flattened split tensor"),
    (_MaxAfterFlatten(), "amax", "other than by a sum or mean over its features"),
    (_PartialFlatten(), "flatten", "merges a split dim"),
    (_ReshapeAfterFlatten(), "reshape", "reshapes a flattened split tensor"),
])
def test_other_ops_on_a_flattened_volume_are_refused(model, op, why):
    refused_on_one_rank(model, torch.randn(1, 1, 4, 4, 4), op, why, __file__)


@mpi_case(nprocs=(2,), timeout=120)
def test_full_backward_hooks_on_every_module(comm):
    """Gradient logging as users write it (Captum, a debugging hook): a full backward hook on
    every module, the Flatten included, whose output torch passes through ``view_as`` of
    itself. Exact against one process, and each hook fires as often as there."""
    from hpcpar import ProcessGrid
    from hpcpar.nn import spatialize

    grid = ProcessGrid(x=2)
    torch.manual_seed(0)
    plain = _sequential().double()
    model = spatialize(copy.deepcopy(plain), grid)
    calls: dict = {}

    def hooked(net, tag):
        for name, m in net.named_modules():
            if name:
                m.register_full_backward_hook(
                    lambda m, gi, go, key=(tag, name): calls.__setitem__(key,
                                                                         calls.get(key, 0) + 1))

    hooked(plain, "plain")
    hooked(model, "split")
    x = randn((2, 2, *SIZE), 1, torch.float64).requires_grad_()
    ref = plain(x)
    ref.sum().backward()
    xl = _piece(x.detach(), grid).requires_grad_()
    out = model(xl)
    out.sum().backward()
    _close(out.detach(), ref.detach(), "output")
    _close(xl.grad, _piece(x.grad, grid), "input grad")
    from hpcpar.parallel.comm import allreduce_

    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        g = _full_grad(p).clone()
        if "0." in name:   # a convolution's weight: each rank's part of the sum
            g = allreduce_(g, grid.comm)
        _close(g, q.grad, f"grad {name}")
    names = [n for n, _ in plain.named_modules() if n]
    assert [calls.get(("split", n)) for n in names] == [calls.get(("plain", n)) for n in names]


@mpi_case(nprocs=(2, 4), timeout=300)
def test_hpcpar_runs_clip_grad_norm_is_global_with_a_cut_head(comm):
    """``[train] clip_grad_norm`` (hpcpar.run.grad_clip, as the trainer sums it): the norm
    of a model whose head weight is cut to each rank's columns is torch's
    ``clip_grad_norm_`` of the single-process model, and so are the clipped gradients."""
    import hpcpar
    from hpcpar.nn import spatialize
    from hpcpar.nn.split_head import column_split
    from hpcpar.run.grad_clip import clip_, norm_share, squared_norm

    grid = hpcpar.ProcessGrid(x=2, y=comm.Get_size() // 2, comm=comm)
    torch.manual_seed(0)
    plain = _sequential().double()
    x = randn((2, 2, *SIZE), 3, torch.float64)
    model = hpcpar.DDP(spatialize(plain, grid), grid)
    (model(_piece(x, grid)) ** 2).sum().backward()
    (plain(x) ** 2).sum().backward()
    assert any(column_split(p) is not None for p in model.module.parameters())
    total = math.sqrt(comm.allreduce(squared_norm(norm_share(model, grid))))
    want = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), float("inf")))
    assert abs(total - want) <= RTOL * want, (total, want)
    clip_(list(model.parameters()), 0.5 * want, total)
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5 * want)
    ref = dict(plain.named_parameters())
    for name, p in model.module.named_parameters():
        _close(_full_grad(p), ref[name].grad, f"clipped grad {name}")


@mpi_case(nprocs=(2, 4), timeout=300)
def test_users_own_clip_grad_norm_is_global_with_a_cut_head(comm):
    """A user's own loop calls ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``
    (2-norm, then the inf-norm; foreach and not) after the head weight was cut to each
    rank's columns: the norm it returns is single-process torch's on every rank, and the
    clipped SGD updates are torch's (hpcpar.nn.head_grad)."""
    import hpcpar
    from hpcpar.nn import spatialize

    grid = hpcpar.ProcessGrid(x=2, y=comm.Get_size() // 2, comm=comm)
    torch.manual_seed(0)
    plain = _sequential().double()
    model = hpcpar.DDP(spatialize(copy.deepcopy(plain), grid), grid)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    x = randn((2, 2, *SIZE), 3, torch.float64)
    for norm_type, foreach in ((2.0, None), (math.inf, False), (2.0, False)):
        for net, xs, o in ((plain, x, ref_opt), (model, _piece(x, grid), opt)):
            o.zero_grad()
            (net(xs) ** 2).sum().backward()
        want = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0, norm_type))
        total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type,
                                                     foreach=foreach))
        assert want > 1.0 and abs(total - want) <= RTOL * want, (norm_type, total, want)
        ref_opt.step()
        opt.step()
        full = model.module.state_dict()
        for name, q in plain.named_parameters():
            _close(full[name], q.detach(), f"{name} after a clipped step ({norm_type})")


@mpi_case(nprocs=(2,), timeout=120)
def test_autocast_fp16_keeps_torchs_dtypes(comm):
    """Under an fp16 autocast (``precision = "fp16"``) every module gives the dtype it gives in
    plain torch, the split head as a plain nn.Linear: float16 for a float32 model (the bias
    cast too, not promoted to float32), float64 for a float64 one, which autocast leaves
    alone (the first-step check's float64 rerun of an fp16 job; the spatial convolutions
    once cast it to half, and the head refused "Half != double"). The float64 run is exact."""
    from hpcpar import ProcessGrid
    from hpcpar.nn import spatialize

    grid = ProcessGrid(x=2)
    for dtype, rtol in ((torch.float64, RTOL), (torch.float32, 1e-2)):
        torch.manual_seed(0)
        plain = _sequential().to(dtype)
        model = spatialize(copy.deepcopy(plain), grid, check=True)
        x = randn((2, 2, *SIZE), 1, dtype).requires_grad_()
        xl = _piece(x.detach(), grid).requires_grad_()
        dtypes: dict = {"plain": [], "split": []}
        for tag, net in (("plain", plain), ("split", model)):
            for m in net.children():
                m.register_forward_hook(lambda m, i, o, seen=dtypes[tag]: seen.append(o.dtype))
        with torch.autocast("cpu", dtype=torch.float16):
            ref = plain(x)
            out = model(xl)
        assert dtypes["split"] == dtypes["plain"], f"{dtype}: module outputs {dtypes}"
        _close(out.detach().to(dtype), ref.detach().to(dtype), f"{dtype}: output", rtol)
        ref.to(dtype).sum().backward()
        out.to(dtype).sum().backward()
        _close(xl.grad, _piece(x.grad, grid), f"{dtype}: input grad", rtol)
