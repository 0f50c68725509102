"""Shape ops on a split dim by their dimension maps (hpcpar/nn/view_maps.py): a split dim cut
with itself outermost, or merged with whole dims after it, is exact where every rank's piece
stays its own piece of the new dim, and refused in one line on every rank where it does not.
(The op sweep, tests/nn/test_op_sweep.py, covers every shape op on axes the grid does not
split; its grids split no axis evenly.)"""

from __future__ import annotations

import torch
import torch.nn as nn

from hpcpar.testing import mpi_case


class _SpaceToDepth(nn.Module):
    """Pairs of planes along D folded into the channels, and back (an invertible network's
    squeeze): ``(N, C, D, H, W) -> (N, 2C, D/2, H, W) -> (N, C, D, H, W)``."""

    def forward(self, x):
        n, c, d, h, w = x.shape
        y = x.view(n, c, d // 2, 2, h, w).transpose(2, 3).reshape(n, 2 * c, d // 2, h, w)
        y = y * torch.arange(1.0, 2 * c + 1, dtype=y.dtype).view(1, -1, 1, 1, 1)
        return y.unflatten(1, (c, 2)).movedim(2, 3).flatten(2, 3) + x


@mpi_case(nprocs=(2,), timeout=120)
def test_a_split_dim_cut_with_itself_outermost_is_exact_or_refused(comm):
    from hpcpar import ProcessGrid
    from hpcpar.errors import LayerError
    from hpcpar.nn import spatialize, whole
    from hpcpar.parallel.spatial import local_slices

    grid = ProcessGrid(x=2)
    x = torch.randn(2, 3, 8, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    xr = x.clone().requires_grad_()
    ref = _SpaceToDepth()(xr)
    ref.square().sum().backward()
    xs = x[local_slices(x.shape, grid)].clone().requires_grad_()
    out = spatialize(_SpaceToDepth(), grid)(xs)   # D = 8: pieces of 4 planes, 2 pairs each
    out.square().sum().backward()
    full = whole(out)   # on the first rank
    if full is not None:
        torch.testing.assert_close(full, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xs.grad, xr.grad[local_slices(x.shape, grid)], rtol=1e-12,
                               atol=1e-12)
    x = torch.randn(2, 3, 6, 3, 5, dtype=torch.float64)   # pieces of 3 planes: not whole pairs
    try:
        spatialize(_SpaceToDepth(), grid)(x[local_slices(x.shape, grid)])
        raise AssertionError("cutting D = 6 into 3 x 2 over 2 ranks was not refused")
    except LayerError as exc:
        msg = str(exc)
    assert "view" in msg and "splits a split dim into pieces that are not the ranks' own" in msg
    assert "\n" not in msg and f"{__file__}:" in msg
