"""The step's fast paths keep their meaning: the non-finite gradient guard (a sum per gradient,
confirmed element by element) and the fused optimizers (the same updates and state as torch's
default path)."""

from __future__ import annotations

import pytest
import torch

from hpcpar.run._optim import make_optimizer
from hpcpar.run.trainer import grads_finite


def _params(*grads):
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g
        out.append(p)
    return out


def test_grads_finite_sum_first_then_elementwise():
    big = torch.full((4,), 3e38)                   # finite, but its sum overflows to inf
    assert grads_finite(_params(torch.randn(10), big))
    nan = torch.randn(10)
    nan[3] = float("nan")
    assert not grads_finite(_params(torch.randn(5), nan))
    inf = torch.randn(10)
    inf[7] = -float("inf")
    assert not grads_finite(_params(inf))
    assert grads_finite([torch.nn.Parameter(torch.zeros(3))])   # no gradient at all
    assert grads_finite([])


@pytest.mark.parametrize("name, opts", [("adam", {"weight_decay": 1e-3}),
                                        ("adamw", {"weight_decay": 1e-2}),
                                        ("sgd", {"momentum": 0.9, "weight_decay": 1e-4})])
def test_make_optimizer_is_fused_and_matches_torch(name, opts):
    torch.manual_seed(0)
    mine = [torch.nn.Parameter(torch.randn(n)) for n in (1000, 7, 64)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    groups = [{"params": mine[:1]}, {"params": (p for p in mine[1:]), "lr": 0.003}]
    opt = make_optimizer(name, groups, lr=0.01, **opts)
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    ref_opt = cls([{"params": ref[:1]}, {"params": ref[1:], "lr": 0.003}], lr=0.01, **opts)
    assert opt.defaults["fused"] is True
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.003]    # group options kept
    for _ in range(20):
        grads = [torch.randn_like(p) for p in mine]
        for ps in (mine, ref):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
        opt.step()
        ref_opt.step()
    for a, b in zip(mine, ref):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    assert opt.state_dict()["state"][0].keys() == ref_opt.state_dict()["state"][0].keys()


def test_make_optimizer_falls_back_where_torch_has_no_fused_kernel():
    z = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
    assert not make_optimizer("adam", [z], lr=0.1).defaults.get("fused")
    single = torch.nn.Parameter(torch.randn(3))
    assert make_optimizer("sgd", single, lr=0.1).param_groups[0]["params"] == [single]
