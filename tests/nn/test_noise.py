"""Random numbers for a split volume (``randn_like``, ``rand_like``, ``normal_``, ``uniform_``):
the same, bit for bit, on every grid as on one rank; the right distributions; the first-step
check draws what the plain model draws."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import on_grids, one_rank_grid, piece_of, randn

GRIDS = [(1, 2, 1, 1), (1, 1, 2, 2), (1, 2, 2, 1), (2, 2, 1, 1), (1, 1, 1, 3), (4, 1, 1, 1)]
SIZE = (7, 6, 5)   # odd edges: uneven pieces


class _Noisy(nn.Module):
    """Every form, on a volume in each layout a model makes: plain, channels-last, and
    permuted by hand so the split dims are not last (``sdims`` (1, 2, 3))."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 3, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)
        cl = h.contiguous(memory_format=torch.channels_last_3d)
        last = h.permute(0, 2, 3, 4, 1)
        return (torch.randn_like(h), torch.rand_like(h, dtype=torch.float64),
                h.detach().clone().normal_(2.0, 3.0), h.detach().clone().uniform_(-1.0, 1.0),
                torch.randn_like(cl), torch.randn_like(last).permute(0, 4, 1, 2, 3),
                h + torch.randn_like(h) * 0.1)


def _same_as_one_rank(grid):
    from hpcpar.nn import local, spatialize

    torch.manual_seed(0)
    plain = _Noisy()
    one = spatialize(_Noisy(), one_rank_grid())
    one.load_state_dict(plain.state_dict())
    x = randn((2 * grid.data, 2, *SIZE), 1)
    torch.manual_seed(5)
    ref = one(x)
    model = spatialize(plain, grid)
    torch.manual_seed(5)
    out = model(piece_of(x, grid))
    for i, (a, b) in enumerate(zip(out[:-1], ref[:-1])):
        want = piece_of(local(b).detach(), grid)
        assert local(a).shape == want.shape and torch.equal(local(a).detach(), want), \
            f"output {i} on {grid.spec()}"
    cl = local(out[4])
    assert cl.is_contiguous(memory_format=torch.channels_last_3d), "keeps the memory format"
    torch.testing.assert_close(local(out[-1]), piece_of(local(ref[-1]), grid))   # + conv
    local(out[-1]).sum().backward()   # the noise is a constant in the graph


@mpi_case(nprocs=(4,), timeout=240)
def test_noise_is_the_one_rank_noise_on_every_grid(comm):
    """Bit for bit the one-rank numbers on 1-3 split axes, uneven pieces, data width 2 and 4,
    every layout; a conv output plus noise matches to rounding and trains."""
    on_grids(comm, GRIDS, _same_as_one_rank)


def test_distributions_and_independence():
    """Normal: mean 0, variance 1, kurtosis 3, tails; uniform in [0, 1) in every precision
    (bfloat16 included, where rounding up to 1 must not happen); calls and samples differ;
    a seed repeats its numbers."""
    from hpcpar.nn import local, spatialize

    class Draw(nn.Module):
        def forward(self, x):
            return torch.randn_like(x), torch.randn_like(x), torch.rand_like(x), \
                torch.rand_like(x, dtype=torch.bfloat16)

    model = spatialize(Draw(), one_rank_grid())
    x = torch.zeros(2, 1, 64, 64, 64)
    torch.manual_seed(3)
    z, z2, u, ub = (local(t) for t in model(x))
    n = z.numel()
    assert abs(float(z.mean())) < 5 / math.sqrt(n)
    assert abs(float(z.var()) - 1) < 5 * math.sqrt(2 / n)
    assert abs(float((z ** 4).mean()) - 3) < 0.05
    assert 4.0 < float(z.abs().max()) < 6.8
    assert abs(float((z * z2).mean())) < 5 / math.sqrt(n)                 # two calls
    assert abs(float((z[0] * z[1]).mean())) < 5 / math.sqrt(n / 2)       # two samples
    assert abs(float((z[..., 1:] * z[..., :-1]).mean())) < 5 / math.sqrt(n)   # neighbours
    assert float(u.min()) >= 0 and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.002
    assert float(ub.max()) < 1 and ub.dtype == torch.bfloat16
    torch.manual_seed(3)
    assert torch.equal(local(model(x)[0]), z)


@mpi_case(nprocs=(2,), timeout=120)
def test_check_draws_what_the_plain_model_draws(comm):
    """A VAE-style model sampling a split latent volume passes ``check=True`` (its probe
    draws torch's numbers for the whole volume, as the plain model does) and trains; the
    forms with no split-independent draw stay refused in one line."""
    from hpcpar import ProcessGrid
    from hpcpar.errors import LayerError
    from hpcpar.nn import spatialize

    class Latent(nn.Module):
        def __init__(self):
            super().__init__()
            self.mu, self.logvar = nn.Conv3d(2, 2, 3, padding=1), nn.Conv3d(2, 2, 3, padding=1)
            self.dec = nn.Conv3d(2, 1, 3, padding=1)

        def forward(self, x):
            mu, logvar = self.mu(x), self.logvar(x)
            return self.dec(mu + torch.randn_like(mu) * torch.exp(0.5 * logvar))

    grid = ProcessGrid(x=2)
    torch.manual_seed(0)
    model = spatialize(Latent(), grid, check=True)
    x = randn((1, 2, *SIZE), 1)
    out = model(piece_of(x, grid))
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())

    class Ints(nn.Module):
        def forward(self, x):
            return torch.randint_like(x, 3)

    with pytest.raises(LayerError, match="randint_like.*would depend on the split"):
        spatialize(Ints(), grid)(piece_of(x, grid))
