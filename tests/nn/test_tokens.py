"""A split volume with its spatial dims merged into one (``x.view(N, C, -1)``, ``x.flatten(2)``):
squeeze-excitation, spatial softmax and soft-argmax, losses on the merged form, exact against
one process on every grid; what has no form refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import on_grids, piece_of, randn, refused_on_one_rank

GRIDS = [(1, 2, 1, 1), (1, 1, 2, 2), (1, 2, 2, 1), (2, 2, 1, 1), (1, 1, 1, 3)]
SIZE = (7, 6, 5)   # odd edges: uneven pieces


class _Everything(nn.Module):
    """Every form the token rules take, in one forward."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1)
        self.fc = nn.Linear(4, 4)
        self.heat = nn.Conv3d(4, 3, 1)

    def forward(self, x, target):
        h = F.relu(self.conv(x))
        b, c, d, hh, w = h.shape
        gate = torch.sigmoid(self.fc(h.view(b, c, -1).mean(-1))).view(b, c, 1, 1, 1)
        t = self.heat(h * gate).flatten(2)                       # (N, 3, L)
        t = t.clone()
        t.mul_(1.5)                                              # in place, through the view
        p = F.softmax(t, dim=-1)
        z = torch.linspace(0, 1, d, dtype=x.dtype).view(d, 1, 1).expand(d, hh, w)
        coord = (p * z.reshape(1, 1, -1)).sum(-1)               # a soft-argmax along D
        terms = [coord.mean(), F.log_softmax(t, dim=2).mean(), t.std(-1).mean(),
                 torch.logsumexp(t, -1).mean(), t.amax(dim=-1, keepdim=True).mean(),
                 torch.softmax(t, dim=1).sum(dim=1, keepdim=True).mean(),
                 t.var(dim=(1, 2)).mean(), t.norm(dim=-1).mean(),
                 (p.view(b, 3, d, hh, w) ** 2).mean(),
                 F.mse_loss(t, target.flatten(2))]
        return sum(terms)


def _exact(grid):
    from hpcpar.nn import spatialize
    from hpcpar.parallel.comm import allreduce_

    torch.manual_seed(0)
    plain = _Everything().double()
    x = randn((2 * grid.data, 2, *SIZE), 1, torch.float64)
    target = randn((2 * grid.data, 3, *SIZE), 2, torch.float64)
    ref = plain(x, target)
    ref.backward()
    model = spatialize(copy.deepcopy(plain), grid, check=True)
    for p in model.parameters():
        p.grad = None
    out = model(piece_of(x, grid), piece_of(target, grid))
    out.backward()
    value = allreduce_(out.detach().reshape(1).clone(), grid.data_comm) / grid.data
    assert abs(float(value) - float(ref.detach())) <= 1e-12 * abs(float(ref.detach())), \
        grid.spec()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        g = p.grad.clone()
        if getattr(p, "hpcpar_reduce", None) != "data":
            g = allreduce_(g, grid.spatial_comm)
        g = allreduce_(g, grid.data_comm) / grid.data
        assert torch.allclose(g, q.grad, rtol=1e-10, atol=1e-13), f"{name} on {grid.spec()}"


@mpi_case(nprocs=(4,), timeout=300)
def test_merged_spatial_dims_are_exact_on_every_grid(comm):
    """Loss and every gradient against one process (float64), through ``check=True``, on
    1-3 split axes, uneven pieces and a data width of 2."""
    on_grids(comm, GRIDS, _exact)


class _Transposed(nn.Module):
    def forward(self, x):
        return x.flatten(2).transpose(1, 2)


class _OtherShape(nn.Module):
    def forward(self, x):
        return x.view(x.shape[0], x.shape[1], -1).view(x.shape[0], -1, 2)



@pytest.mark.parametrize("model, op, why", [
    (_Transposed(), "transpose", "has no form on a tensor whose split dims are merged"),
    (_OtherShape(), "view", "other than back to its volume"),
])
def test_what_has_no_form_is_refused_in_one_line(model, op, why):
    refused_on_one_rank(model, torch.randn(1, 2, 4, 4, 4), op, why, __file__)
