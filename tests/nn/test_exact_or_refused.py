"""Networks written as other people write them, spatialized: exact against single-process
torch in float64 (output, input gradient, every parameter gradient after hpcpar.DDP) on
1x1x1x1, 1x2x1x1 and 1x2x2x1, or refused in one line naming the user's own line, the same on
every rank. The cases of issue 61: in-place residuals after a 1x1x1 convolution, in-place
writes of split data into a plain tensor, a split head's weight read in the same forward,
local ops that were refused, torch's own errors re-said."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import batch_slice, on_grids, one_rank_grid, piece_of, randn

GRIDS = [(1, 1, 1, 1), (1, 2, 1, 1), (1, 2, 2, 1)]
SIZE = (7, 5, 6)   # odd edges: uneven pieces
RTOL = 1e-10


class InplaceResidual(nn.Module):
    """timm's MbConvBlock ending: ``x = conv_pwl(x); x += shortcut``."""

    def __init__(self, c=4):
        super().__init__()
        self.dw = nn.Conv3d(c, c, 3, padding=1, groups=c)
        self.pw = nn.Conv3d(c, c, 1)

    def forward(self, x):
        h = F.silu(self.dw(x))
        y = self.pw(h)
        y += h
        y *= 0.5
        return y


class OneHotInput(nn.Module):
    """A label volume one-hot encoded and concatenated to the image."""

    def __init__(self, c=4, classes=3):
        super().__init__()
        self.classes = classes
        self.conv = nn.Conv3d(c + classes, 2, 3, padding=1)

    def forward(self, x):
        labels = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
        onehot = F.one_hot(labels, self.classes).permute(0, 4, 1, 2, 3).to(x.dtype)
        return self.conv(torch.cat([x, onehot], 1))


class SoftmaxNoDim(nn.Module):
    """``nn.Softmax()``: torch's implicit dim on a 5D input is 1 (channels)."""

    def __init__(self, c=4):
        super().__init__()
        self.conv = nn.Conv3d(c, 3, 3, padding=1)
        self.act = nn.Softmax()

    def forward(self, x):
        return self.act(self.conv(x))


class Elementwise(nn.Module):
    """Per-voxel ops torch names by alias, in place, in torch.special, across channels."""

    def __init__(self, c=4):
        super().__init__()
        self.conv = nn.Conv3d(c, 4, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)
        a = torch.special.expit(h) * torch.arctan(h) + torch.special.erf(h).multiply(h)
        b = torch.negative(h).abs_().subtract(torch.special.log1p(h.square()))
        c = F.channel_shuffle(h, 2) + F.local_response_norm(h, 3)
        mask = h.greater(0).logical_and(torch.less_equal(h, 1.0))
        return torch.where(mask, a, b) + c


class HeadPenalty(nn.Module):
    """An L2 penalty on the dense head's weight in forward, and its .shape read."""

    def __init__(self, c=4, size=SIZE):
        super().__init__()
        self.conv = nn.Conv3d(c, 2, 3, padding=1)
        self.fc = nn.Linear(2 * math.prod(size), 3)

    def forward(self, x):
        y = self.fc(torch.relu(self.conv(x)).flatten(1))
        penalty = self.fc.weight.pow(2).sum() / self.fc.weight.shape[1]
        return y + penalty


class PenaltyFirst(HeadPenalty):
    """The penalty read before the head in forward (the weight is then used whole: the
    penalty's saved tensor is all of it)."""

    def forward(self, x):
        penalty = self.fc.weight.pow(2).sum() / self.fc.weight.shape[1]
        return self.fc(torch.relu(self.conv(x)).flatten(1)) + penalty


EXACT = [InplaceResidual, OneHotInput, SoftmaxNoDim, Elementwise, HeadPenalty, PenaltyFirst]


def _close(got, want, what):
    scale = max(float(want.abs().max()), 1e-6)
    err = float((got - want).abs().max())
    assert got.shape == want.shape and err <= RTOL * scale, \
        f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}, max |diff| {err:.3e}"


def _exact(grid, factory, seed):
    """Two steps (a split head's weight is cut in the first): output, input gradient, every
    parameter gradient after hpcpar.DDP, against the plain model."""
    import hpcpar
    from hpcpar.nn import local, spatialize
    from hpcpar.nn.split_head import column_split

    what = f"{factory.__name__} on {grid.spec()}"
    torch.manual_seed(seed)
    plain = factory().double()
    model = hpcpar.DDP(spatialize(plain, grid), grid)
    for step in range(2):
        x = randn((2 * grid.data, 4, *SIZE), seed + step, torch.float64).requires_grad_()
        plain.zero_grad()
        model.zero_grad()
        ref = plain(x)
        w = randn(ref.shape, seed + 7, torch.float64)
        (ref * w).sum().backward()
        xl = piece_of(x.detach(), grid).clone().requires_grad_()
        out = model(xl)
        bs = batch_slice(ref.shape[0], grid)
        split = ref.dim() == 5
        want = piece_of(ref.detach(), grid) if split else ref.detach()[bs]
        _close(local(out).detach(), want, f"{what}: output, step {step}")
        (local(out) * (piece_of(w, grid) if split else w[bs])).sum().backward()
        _close(xl.grad, piece_of(x.grad, grid), f"{what}: input grad, step {step}")
        ref_params = dict(plain.named_parameters())
        for name, p in model.module.named_parameters():
            cut = column_split(p)
            g = cut.gather(p.grad) if cut is not None else p.grad
            _close(g * grid.data, ref_params[name].grad, f"{what}: grad {name}, step {step}")


@mpi_case(nprocs=(4,), timeout=600)
def test_models_are_exact_on_every_grid(comm):
    def each(grid):
        for i, factory in enumerate(EXACT):
            _exact(grid, factory, 10 * i)

    on_grids(comm, GRIDS, each)


class BufferEMA(nn.Module):
    """A volume-shaped running average updated in place in forward."""

    def __init__(self, c=4, size=SIZE):
        super().__init__()
        self.conv = nn.Conv3d(c, 3, 3, padding=1)
        self.register_buffer("avg", torch.zeros(1, 3, *size))

    def forward(self, x):
        h = self.conv(x)
        self.avg.mul_(0.9).add_(0.1 * h.detach().mean(0, keepdim=True))
        return h - self.avg.mean()


class PriorNoGrad(nn.Module):
    """A plain tensor with the global shape, filled in place under no_grad."""

    def __init__(self, c=4):
        super().__init__()
        self.conv = nn.Conv3d(c, 3, 3, padding=1)

    def forward(self, x):
        prior = torch.zeros(x.shape[0], 3, *x.shape[2:])
        with torch.no_grad():
            prior.add_(self.conv(x))
        return self.conv(x) * prior.sum()


class PriorGrad(PriorNoGrad):
    """The same with gradients on (torch's "Output 0 of Slice is a view" before)."""

    def forward(self, x):
        prior = torch.zeros(x.shape[0], 3, *x.shape[2:], dtype=x.dtype)
        prior += self.conv(x)
        return prior * 2


class TiedDecoder(HeadPenalty):
    """An autoencoder whose decoder is the encoder head's weight transposed."""

    def forward(self, x):
        z = self.fc(self.conv(x).flatten(1))
        return F.linear(z, self.fc.weight.t()).view(x.shape[0], 2, *x.shape[2:])


class OneHotInferred(OneHotInput):
    """``F.one_hot`` with the class count taken from the labels' maximum."""

    def forward(self, x):
        return F.one_hot((x[:, 0] > 0).long()).sum()


class LeafInplace(nn.Module):
    """An in-place write into the input, which requires its gradient (torch's own error)."""

    def forward(self, x):
        return x.mul_(2)


REFUSED = [(BufferEMA, "add_", "writes a split tensor in place into a plain tensor"),
           (PriorNoGrad, "add_", "writes a split tensor in place into a plain tensor"),
           (PriorGrad, "add_", "writes a split tensor in place into a plain tensor"),
           (TiedDecoder, "t at", "reads a split head's weight"),
           (OneHotInferred, "one_hot", "takes the class count from the largest label"),
           (LeafInplace, "mul_", "could not write in place")]


@mpi_case(nprocs=(4,), timeout=300)
def test_refusals_are_one_line_naming_this_file_the_same_on_every_rank(comm):
    from hpcpar.errors import LayerError
    from hpcpar.nn import spatialize

    def each(grid):
        for factory, op, why in REFUSED:
            torch.manual_seed(0)
            model = spatialize(factory().double(), grid)
            x = randn((2, 4, *SIZE), 1, torch.float64).requires_grad_()
            with pytest.raises(LayerError) as info:
                for _ in range(2):   # a split head is cut in the first forward
                    model(piece_of(x, grid))
            msg = str(info.value)
            assert op in msg and why in msg and "\n" not in msg, msg
            assert f"{__file__}:" in msg, msg
            assert len(set(grid.comm.allgather(msg))) == 1, msg

    on_grids(comm, GRIDS, each)


def test_a_package_named_like_torch_is_the_users(tmp_path, monkeypatch):
    """The user's frame is the first outside torch's own directory: a network in a package
    whose path starts like torch's (torch_geometric, torchio) is named, not skipped."""
    import importlib.util

    from hpcpar.errors import LayerError
    from hpcpar.nn import spatialize, split

    fake_torch = tmp_path / "torch"
    (tmp_path / "torchio").mkdir()
    net = tmp_path / "torchio" / "net.py"
    net.write_text("import torch.nn.functional as F\n\n\ndef forward(x):\n"
                   "    return F.one_hot((x[:, 0] > 0).long()).sum()\n")
    spec = importlib.util.spec_from_file_location("torchio_net", net)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(split, "_OWN", split.own_dirs(str(fake_torch), split._HPCPAR))

    class Net(nn.Module):
        def forward(self, x):
            return mod.forward(x)

    with pytest.raises(LayerError, match=f"one_hot at {net}:5 "):
        spatialize(Net(), one_rank_grid())(torch.randn(1, 2, 3, 3, 3))


#: per-voxel ops that were refused (torch leaves aliases, in-place forms, Python's reflected
#: and in-place operators and torch.special's names untagged), found by classifying every
#: callable of torch, torch.Tensor, torch.nn.functional and torch.special
_WERE_REFUSED = [
    torch.abs_, torch.Tensor.abs_, torch.arccos, torch.Tensor.arctan2, torch.divide,
    torch.Tensor.multiply_, torch.subtract, torch.negative, torch.fix, torch.Tensor.greater,
    torch.Tensor.less_equal_, torch.Tensor.not_equal, torch.Tensor.eq_,
    torch.Tensor.masked_fill_, torch.Tensor.copysign_, torch.Tensor.floor_divide,
    torch.Tensor.__rtruediv__, torch.Tensor.__ifloordiv__, torch.Tensor.__imod__,
    torch.Tensor.__rand__, torch.special.erf, torch.special.expit, torch.special.gammaln,
    torch.special.xlogy, torch.isclose]


@pytest.mark.parametrize("func", _WERE_REFUSED, ids=lambda f: f.__name__)
def test_elementwise_ops_are_local(func):
    from hpcpar.nn import optable, rules

    assert optable.rule_for(func) is rules.pointwise


def test_per_voxel_ops_across_channels_are_local():
    from hpcpar.nn import optable, rules

    for func in (F.channel_shuffle, F.local_response_norm):
        assert optable.rule_for(func) is rules.channelwise, func
    assert optable.rule_for(F.one_hot) is rules.one_hot
    assert optable.rule_for(torch.Tensor.cumsum_) is rules.dim_local


class LabelsOutOfRange(nn.Module):
    """Labels read from the input for ``F.one_hot`` are out of its range in the last slab
    along D only: the rank holding that slab raises there alone; its neighbour goes on to the
    convolution's halo exchange."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(3, 2, 3, padding=1)

    def forward(self, x):
        onehot = F.one_hot(x[:, 0].round().long(), 3)
        return self.conv(onehot.permute(0, 4, 1, 2, 3).to(x.dtype))


def _one_rank_raises(case: str) -> None:
    """Under ``mpiexec -n 2``: each rank prints the error it stops with, as the CLI does.
    ``halo``: rank 0 goes on to the convolution's halo exchange and waits there for rank 1;
    ``finished``: rank 0's forward has no exchange after the op (it returns), and it starts
    another forward."""
    import hpcpar
    from hpcpar.errors import HpcparError
    from hpcpar.nn import spatialize
    from hpcpar.nn.error_notice import POLL

    grid = hpcpar.ProcessGrid(x=2)
    x = torch.zeros(1, 1, *SIZE, dtype=torch.float64)
    x[:, :, -1] = 3.0
    model = spatialize(LabelsOutOfRange().double(), grid)
    if case == "finished":
        model.conv = nn.Identity()
    try:
        model(piece_of(x, grid))
        time.sleep(20 * POLL)   # rank 1's word has arrived
        model(piece_of(x, grid))
    except HpcparError as exc:
        print(f"hpcpar: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)


@pytest.mark.parametrize("case", ["halo", "finished"])
def test_an_op_raising_on_one_rank_stops_every_rank_with_its_line(case):
    """Only rank 1's ``F.one_hot`` raises (its piece holds the out-of-range labels): rank 0,
    waiting for it in the next halo exchange or starting its next forward, stops too, with
    the same one line naming this file's line, and the job ends in seconds instead of hanging
    (hpcpar.nn.error_notice)."""
    from hpcpar.errors import LayerError
    from hpcpar.launch.mpiexec import find_mpiexec, rank_env
    from hpcpar.nn.error_notice import DEAD_WAIT
    from hpcpar.testing.mpi import startup_allowance

    limit = startup_allowance(2) + DEAD_WAIT + 30
    start = time.monotonic()
    proc = subprocess.run([find_mpiexec(), "-n", "2", "-prepend-rank", sys.executable,
                           os.path.abspath(__file__), "one_rank_raises", case],
                          env=rank_env({}), capture_output=True, text=True, timeout=limit)
    out = proc.stdout + proc.stderr
    # -prepend-rank: "[r] " before each line (and before an unfinished last one)
    lines = {line[:3]: re.sub(r"\[\d\] ?$", "", line[3:]).strip()
             for line in out.splitlines() if "hpcpar: error:" in line}
    assert sorted(lines) == ["[0]", "[1]"], out
    assert lines["[0]"] == lines["[1]"], out
    line = next(n for n, text in enumerate(open(__file__), 1) if "F.one_hot(x[:, 0]" in text)
    assert f"one_hot at {os.path.abspath(__file__)}:{line} " in lines["[0]"], out
    assert proc.returncode == LayerError.exit_code, out
    assert time.monotonic() - start < limit - 20, out


if __name__ == "__main__" and sys.argv[1:2] == ["one_rank_raises"]:
    _one_rank_raises(sys.argv[2])
