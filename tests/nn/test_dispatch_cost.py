"""What a spatialized step costs beyond the layers' own work, counted (never timed): the
messages a forward sends to learn shapes, the calls that come back through the dispatch in
backward, and the walk over the parameters after each forward. The step-time ratio against
the previous implementation is measured by benchmarks/job_ab.py (see the models guide)."""

from __future__ import annotations

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcpar.testing.oracles import one_rank_grid, randn


def _counted(monkeypatch, fn) -> list:
    """Count calls of ``fn`` through every module that holds it by name."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(fn.__name__)
        return fn(*args, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, fn.__name__, None) is fn:
            monkeypatch.setattr(module, fn.__name__, counted)
    return calls


def test_a_forward_learns_the_global_shape_once(monkeypatch):
    """The input's shape is gathered once; every later op knows its global shape from the
    split tensor, U-Net skips (MatchSize, odd sizes: a real pad) included."""
    from hpcpar.models import UNet3D
    from hpcpar.nn import local, spatialize
    from hpcpar.parallel.halo_plan import global_spatial_shape

    torch.manual_seed(0)
    plain = UNet3D(in_channels=1, out_channels=2, base_filters=2, depth=2).double()
    model = spatialize(plain, one_rank_grid())
    calls = _counted(monkeypatch, global_spatial_shape)
    for size in ((9, 7, 5), (8, 8, 8)):
        x = randn((2, 1, *size), 1, torch.float64)
        calls.clear()
        out = model(x)
        assert len(calls) == 1, f"{size}: {len(calls)} shape gathers in one forward"
        torch.testing.assert_close(local(out), plain(x), rtol=1e-12, atol=1e-12)


class _Norms(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.bn = nn.BatchNorm3d(c)
        self.gn = nn.GroupNorm(2, c)
        self.inorm = nn.InstanceNorm3d(c, affine=True)
        self.ln = nn.LayerNorm([c, 4, 5, 3])

    def forward(self, x):
        return self.ln(self.inorm(self.gn(self.bn(x))))


def test_backward_of_the_norms_runs_no_dispatch(monkeypatch):
    """The norms' adjoints work on plain pieces: no op of the backward comes back through a
    split tensor's ``__torch_function__`` (~2 us each, ten per batch norm)."""
    from hpcpar.nn import spatialize
    from hpcpar.nn.split import SplitTensor

    model = spatialize(_Norms().double(), one_rank_grid())
    x = randn((2, 4, 4, 5, 3), 2, torch.float64).requires_grad_()
    loss = F.mse_loss(model(x), randn((2, 4, 4, 5, 3), 3, torch.float64))
    seen = []
    original = SplitTensor.__torch_function__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        seen.append(getattr(func, "__name__", repr(func)))
        return original(cls, func, types, args, kwargs)

    monkeypatch.setattr(SplitTensor, "__torch_function__", classmethod(counting))
    loss.backward()
    assert seen == [], f"backward dispatched {len(seen)} calls: {sorted(set(seen))}"
    assert x.grad is not None and all(p.grad is not None for p in model.parameters())


class _Switch(nn.Module):
    """``scale`` multiplies the split volume, or (``on_mean``) its replicated global mean."""

    def __init__(self, c=3):
        super().__init__()
        self.conv = nn.Conv3d(c, c, 1)
        self.scale = nn.Parameter(torch.ones(1, c, 1, 1, 1))
        self.on_mean = False

    def forward(self, x):
        h = self.conv(x)
        if self.on_mean:
            return h.mean(dim=(2, 3, 4), keepdim=True) * self.scale
        return h * self.scale


def test_tags_are_derived_again_only_when_the_dataflow_changes():
    """A forward that uses the parameters as the last one did leaves the tags as they are
    without walking the model; one that uses them differently re-derives them."""
    from hpcpar.nn import spatialize
    from hpcpar.sync.tags import TAGS_VERSION, reduce_scope

    model = spatialize(_Switch().double(), one_rank_grid())
    walks = []
    original = model.named_parameters

    def named_parameters(*args, **kwargs):
        walks.append(1)
        return original(*args, **kwargs)

    model.named_parameters = named_parameters
    x = randn((1, 3, 4, 4, 4), 4, torch.float64)
    model(x)
    assert reduce_scope(model.scale) == "spatial+data" and len(walks) == 1
    model(x)
    assert len(walks) == 1, "a forward with the same dataflow walked the parameters again"
    model.on_mean = True
    model(x)
    assert len(walks) == 2
    assert reduce_scope(model.scale) == "data", "a replicated use was not tagged"
    assert getattr(model, TAGS_VERSION) == 1
    model.on_mean = False
    model(x)
    assert reduce_scope(model.scale) == "spatial+data" and getattr(model, TAGS_VERSION) == 2
