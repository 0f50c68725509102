"""Kernel taps that only read padding are dropped, exactly (issue 61 item 6): an ASPP block
(DeepLabV3's dilated branches on a small map) against torch on one process, and its per-rank
memory against torch's whole model (the full kernels' halos held a padded copy many times
the map on every rank)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpcpar.nn import spatialize
from hpcpar.nn._tap_trim import tap_trim
from hpcpar.nn.split import local
from hpcpar.parallel.comm import allreduce_
from hpcpar.parallel.partition import live_taps
from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import alloc_peak, close, on_subgrid, randn, spatial_slices

GRIDS = ((1, 2, 1, 1), (1, 2, 2, 1))


class ASPP(nn.Module):
    """A 1x1 branch and 3x3x3 branches with dilation = padding, concatenated, a 1x1 head."""

    def __init__(self, channels: int, rates=(1, 6, 12, 24)):
        super().__init__()
        self.branches = nn.ModuleList(
            [nn.Conv3d(channels, channels, 1)] +
            [nn.Conv3d(channels, channels, 3, padding=r, dilation=r) for r in rates])
        self.head = nn.Conv3d(channels * (len(rates) + 1), channels, 1)

    def forward(self, x):
        return self.head(torch.cat([F.relu(b(x)) for b in self.branches], 1))


def test_live_taps_by_enumeration():
    """The kept taps are exactly those reading some input, on every small geometry."""
    for n in range(1, 8):
        for k in (1, 2, 3, 5):
            for s in (1, 2, 3):
                for d in (1, 2, 5, 9):
                    for lo, hi in ((0, 0), (1, 1), (d, d), (2 * d, 0), (3, 7)):
                        outs = (n + lo + hi - d * (k - 1) - 1) // s + 1
                        live = [t for t in range(k) if any(
                            0 <= i * s - lo + t * d < n for i in range(max(outs, 0)))]
                        want = (live[0], live[-1]) if live else None
                        assert live_taps(n, k, s, d, lo, hi) == want, (n, k, s, d, lo, hi)


def test_aspp_on_a_small_map_trims_to_one_tap():
    trim = tap_trim((6, 5, 7), (3, 3, 3), (1, 1, 1), (12, 12, 12), (12, 12, 12))
    assert trim is not None and trim.kernel == (1, 1, 1) and trim.padding == (0, 0, 0)
    # dilation 6 on an axis of 7: every tap reads data there, only the others shrink
    trim = tap_trim((6, 5, 7), (3, 3, 3), (1, 1, 1), (6, 6, 6), (6, 6, 6))
    assert trim is not None and trim.kernel == (1, 1, 3) and trim.padding == (0, 0, 6)
    assert tap_trim((9, 9, 9), (3, 3, 3), (1, 1, 1), (6, 6, 6), (6, 6, 6)) is None


def _aspp_check(grid, shape, channels=3):
    torch.manual_seed(0)
    model = ASPP(channels).double()
    sp = spatialize(model, grid)
    x = randn((2, channels, *shape), 1, torch.float64).requires_grad_()
    y = model(x)
    w = randn(y.shape, 2, torch.float64)
    (y * w).sum().backward()
    xl = x.detach()[spatial_slices(shape, grid)].clone().requires_grad_()
    yl = local(sp(xl))
    what = f"ASPP on {shape} over {grid.spatial_shape}"
    close(yl, y.detach()[spatial_slices(shape, grid)], f"{what}: output")
    (yl * w[spatial_slices(shape, grid)]).sum().backward()
    close(xl.grad, x.grad[spatial_slices(shape, grid)], f"{what}: input grad")
    for (name, p), (_, q) in zip(sp.named_parameters(), model.named_parameters()):
        close(allreduce_(p.grad.clone(), grid.spatial_comm), q.grad, f"{what}: grad of {name}")


@mpi_case(nprocs=(4,), timeout=120)
def test_aspp_is_exact(comm):
    """Outputs, input gradients and every weight and bias gradient against torch, on maps
    of 5..9 voxels a side with uneven pieces (dilation 6: three taps kept along 7, 8 and 9
    voxels and one along 5 and 6; 12 and 24: one tap everywhere)."""
    for data, *dims in GRIDS:
        for shape in ((7, 6, 5), (9, 8, 7)):
            on_subgrid(comm, data, dims, lambda g, s=shape: _aspp_check(g, s))
    # three ranks on x: the full kernels' halos reached past the adjacent rank (refused)
    on_subgrid(comm, 1, (3, 1, 1), lambda g: _aspp_check(g, (6, 6, 5)))


def _memory_check(grid, shape, batch=16, channels=16):
    torch.manual_seed(0)
    plain = ASPP(channels)
    x = randn((batch, channels, *shape), 1).requires_grad_()
    whole = alloc_peak(plain, x)[0]
    sp = spatialize(plain, grid)
    got = alloc_peak(sp, x.detach()[spatial_slices(shape, grid)].clone().requires_grad_())[0]
    ranks = grid.spatial_size
    bound = 1.5 * (whole / ranks + x.numel() * x.element_size())
    assert got <= bound, f"ASPP on {shape} over {grid.spatial_shape}: {got} bytes per rank, " \
                         f"bound {bound:.0f} (torch's whole model {whole})"


@mpi_case(nprocs=(4,), timeout=120)
def test_aspp_per_rank_memory(comm):
    """Per-rank peak over forward + backward at most 1.5x (torch's whole-model peak / ranks
    + the gathered map): dilations 6..24 reach past a 6-voxel map on every axis. Float32,
    activations outweighing the weights as in DeepLabV3 (batch 16, 16 channels). The full
    kernels held 737 MiB per rank on 1x2x1x1 (bound 3.3 MiB), 700 on 1x2x2x1 (1.78). On
    10 voxels over 2 ranks, dilation 6's halo is the whole neighbour piece (5): the exchange
    held 31 MB a rank (1.6x the bound), the gathered map holds 12."""
    for data, *dims in GRIDS:
        on_subgrid(comm, data, dims, lambda g: _memory_check(g, (6, 6, 5)))
    on_subgrid(comm, 1, (2, 1, 1), lambda g: _memory_check(g, (10, 10, 10)))


@mpi_case(nprocs=(4,), timeout=120)
def test_halos_past_the_neighbour_gather_the_small_map(comm):
    """Dilation 6 on a map of 9x8x7: every tap reads data, and the halo (6) is longer than
    the adjacent rank's piece (2-4 on 4 ranks, 4-5 on 2): the halo exchange refused it in
    one line. The whole map is gathered and each rank convolves its own output piece:
    outputs and all gradients equal torch's, and the per-rank peak is at most torch's
    whole-model peak (the map is held between layers as pieces only)."""
    from hpcpar.nn.conv import SpatialConv3d

    class Dilated(nn.Module):
        def __init__(self, channels=3):
            super().__init__()
            self.a = nn.Conv3d(channels, channels, 3, padding=6, dilation=6)
            self.b = nn.Conv3d(channels, 2, 3, padding=(6, 1, 0), dilation=(6, 1, 2),
                               stride=(1, 2, 1))

        def forward(self, x):
            return self.b(F.relu(self.a(x)) + x)

    taken = []
    route = SpatialConv3d.whole_route

    def spy(self, x, gshape):
        got = route(self, x, gshape)
        taken.append(got is not None)
        return got

    def check(grid, whole_route):
        taken.clear()
        torch.manual_seed(0)
        model = Dilated().double()
        sp = spatialize(model, grid)
        shape = (9, 8, 7)
        x = randn((2, 3, *shape), 1, torch.float64).requires_grad_()
        y = model(x)
        w = randn(y.shape, 2, torch.float64)
        (y * w).sum().backward()
        xl = x.detach()[spatial_slices(shape, grid)].clone().requires_grad_()
        yl = local(sp(xl))
        out = y.detach()[spatial_slices(y.shape[2:], grid)]
        what = f"dilated convs over {grid.spatial_shape}"
        close(yl, out, f"{what}: output")
        (yl * w[spatial_slices(y.shape[2:], grid)]).sum().backward()
        close(xl.grad, x.grad[spatial_slices(shape, grid)], f"{what}: input grad")
        for (name, p), (_, q) in zip(sp.named_parameters(), model.named_parameters()):
            close(allreduce_(p.grad.clone(), grid.spatial_comm), q.grad, f"{what}: {name}")
        assert any(taken) == whole_route, f"{what}: whole-map route taken {any(taken)}"
        # float32 memory, activations outweighing the weights (batch 8, 16 channels)
        plain = nn.Sequential(nn.Conv3d(16, 16, 3, padding=6, dilation=6), nn.ReLU(),
                              nn.Conv3d(16, 16, 3, padding=6, dilation=6))
        big = randn((8, 16, *shape), 3).requires_grad_()
        whole = alloc_peak(plain, big)[0]
        sp32 = spatialize(plain, grid)
        got = alloc_peak(sp32, big.detach()[spatial_slices(shape, grid)].clone()
                         .requires_grad_())[0]
        # every rank's window is most of the map here, so its convolutions' backward holds
        # map-sized buffers as torch's does: no more than torch's whole model (the bound of
        # issue 61 item 6, whole / ranks + the map, x1.5, is not met on this geometry)
        assert got <= whole, f"{what}: {got} bytes per rank, torch's whole model {whole}"

    SpatialConv3d.whole_route = spy
    try:
        # 4 ranks on x or y: pieces of 2-3, halos of 6; on 2x2 the halos (4) fit the
        # neighbours' pieces, but the halo buffer with its padding (17x16x19) would be 6x
        # the map: the map is cheaper (the exchange held 8.0 MiB a rank, 6x torch's whole)
        for data, *dims in ((1, 4, 1, 1), (1, 1, 4, 1), (1, 2, 2, 1)):
            on_subgrid(comm, data, dims, lambda g: check(g, True))
    finally:
        SpatialConv3d.whole_route = route
