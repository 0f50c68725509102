"""Fused halos (``spatialize(..., fuse_halos=k)``, hpcpar.nn.fused_halo): runs of
convolutions sharing one exchange are exact against single-process torch (output and every
gradient, float64) on split grids with uneven and thin pieces, on the first forward (the
guess) and after it learned where runs end; in steady state no margin is cropped; with
activation checkpointing the recomputation sends no message; runs go through batch norm
(training and eval); a bad setting is one line."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import on_grids, randn, spatial_slices

TOL = 1e-11


class Stack(nn.Module):
    """Four 3^3 convolutions with module, functional and in-place activations between."""

    def __init__(self, c=3, dilation=1):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv3d(c, c, 3, padding=dilation, dilation=dilation)
                                   for _ in range(4))
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        x = self.act(self.convs[0](x))
        x = F.leaky_relu(self.convs[1](x), 0.1) * 0.5
        x = torch.sigmoid(self.convs[2](x))
        return self.convs[3](x)


class Residual(nn.Module):
    """A residual block with batch norm: the run is cropped at the add and at the norm."""

    def __init__(self, c=3):
        super().__init__()
        self.body = nn.Sequential(nn.Conv3d(c, c, 3, padding=1), nn.ReLU(),
                                  nn.Conv3d(c, c, 3, padding="same"), nn.GELU(),
                                  nn.Conv3d(c, c, 3, padding=1))
        self.bn = nn.BatchNorm3d(c)

    def forward(self, x):
        return F.max_pool3d(torch.tanh(self.bn(self.body(x) + x)), 2)


class DoubleConv(nn.Module):
    """U-Net's block, conv -> batch norm -> ReLU twice: a run through the norms."""

    def __init__(self, c=3):
        super().__init__()
        self.block = nn.Sequential(nn.Conv3d(c, 4, 3, padding=1, bias=False), nn.BatchNorm3d(4),
                                   nn.ReLU(inplace=True), nn.Conv3d(4, c, 3, padding=1),
                                   nn.BatchNorm3d(c), nn.ReLU(inplace=True))

    def forward(self, x):
        return self.block(x)


def _check(grid, factory, shape, fuse, steps=2, segments=None):
    """Every step's output and gradients equal one process's (with ``segments``: under
    activation checkpointing); returns the spatial model."""
    from hpcpar.nn import local, spatialize
    from hpcpar.parallel.comm import allreduce_

    torch.manual_seed(0)
    plain = factory().double()
    x = randn(shape, 1, torch.float64).requires_grad_(True)
    ref = plain(x)
    ref.square().sum().backward()
    sp = spatialize(copy.deepcopy(plain), grid, fuse_halos=fuse)
    if segments:
        from hpcpar.nn.checkpointing import checkpoint_activations

        checkpoint_activations(sp, segments)
    mine = spatial_slices(shape[2:], grid)
    for step in range(steps):
        for p in sp.parameters():
            p.grad = None
        xl = x.detach()[mine].clone().requires_grad_(True)
        out = sp(xl)
        out.square().sum().backward()
        what = f"{factory.__name__} fuse {fuse} on {grid.spec()}, step {step}"
        want = ref.detach()[spatial_slices(ref.shape[2:], grid)]
        assert (local(out).detach() - want).abs().max() <= TOL * want.abs().max(), what
        assert (xl.grad - x.grad[mine]).abs().max() <= TOL * x.grad.abs().max(), what
        # one scale for all: a conv bias before batch norm has a gradient of 0 in exact
        # arithmetic, rounding noise (1e-11) in both runs
        scale = max(float(q.grad.abs().max()) for q in plain.parameters())
        for (name, p), q in zip(sp.named_parameters(), plain.parameters()):
            g = allreduce_(p.grad.clone(), grid.spatial_comm)
            assert float((g - q.grad).abs().max()) <= TOL * scale, f"{what}: grad {name}"
    return sp


def _cases(grid):
    from hpcpar.parallel.counters import COUNTERS

    for fuse in (2, 3, 5):
        # 13 on x: uneven pieces; 1x3x1x1 gives pieces of 5, 4, 4 (a run of 5 does not fit)
        sp = _check(grid, Stack, (1, 3, 13, 12, 11), fuse)
        runs, crops = sp._hpcpar_split.fuse_counts
        # after the first forward the runs end with their margin used up: nothing cropped
        want = {2: 2, 3: 1, 5: 1}[fuse] if grid.spatial_size > 1 else 0
        assert (runs, crops) == (want, 0), (fuse, grid.spec(), runs, crops)
    _check(grid, lambda: Stack(dilation=2), (1, 3, 14, 12, 13), 3)
    # batch norm continues a run (statistics of the owned voxels), in training and in eval
    sp = _check(grid, DoubleConv, (1, 3, 11, 10, 9), 2)
    assert sp._hpcpar_split.fuse_counts == [int(grid.spatial_size > 1), 0]
    _eval_matches(grid, DoubleConv, (1, 3, 11, 10, 9))
    # where a convolution takes the boundary path (a batch large enough for torch's fast
    # kernel), its ghosts already travel behind the interior: no run starts
    sp = _check(grid, Stack, (4, 3, 13, 12, 11), 3)
    assert sp._hpcpar_split.fuse_counts == [0, 0]
    _check(grid, Residual, (2, 3, 12, 10, 10), 3)
    # activation checkpointing: a run crosses the segments' boundary, and the recomputation
    # makes the forward's exchanges from its faces (no message)
    def chain():
        return nn.Sequential(*[m for _ in range(4) for m in (nn.Conv3d(2, 2, 3, padding=1),
                                                               nn.ReLU())])
    before = COUNTERS.recompute_msgs
    sp = _check(grid, chain, (1, 2, 11, 10, 9), 4, segments=2)
    assert COUNTERS.recompute_msgs == before
    runs, crops = sp._hpcpar_split.fuse_counts   # the recomputation starts the run again
    assert (runs, crops) == ((2, 0) if grid.spatial_size > 1 else (0, 0)), (runs, crops)


def _eval_matches(grid, factory, shape):
    """Eval mode (running statistics, per channel) keeps the run, and matches one process."""
    from hpcpar.nn import local, spatialize

    torch.manual_seed(0)
    plain = factory().double()
    x = randn(shape, 2, torch.float64)
    plain(x)   # running statistics
    plain.eval()
    sp = spatialize(copy.deepcopy(plain), grid, fuse_halos=2)
    mine = spatial_slices(shape[2:], grid)
    with torch.no_grad():
        for _ in range(2):
            out = local(sp(x[mine]))
    want = plain(x)[mine]
    assert (out - want).abs().max() <= TOL * want.abs().max()
    assert sp._hpcpar_split.fuse_counts == [int(grid.spatial_size > 1), 0]


@mpi_case(nprocs=(4,), timeout=600)
def test_fused_runs_are_exact_and_learn_where_they_end(comm):
    on_grids(comm, [(1, 2, 1, 1), (1, 2, 2, 1), (1, 1, 2, 2), (1, 3, 1, 1), (1, 1, 1, 1)],
             _cases)


@pytest.mark.parametrize("value", [0, -1, True, "3", 2.0])
def test_a_bad_setting_is_one_line(value):
    from hpcpar.errors import LayerError
    from hpcpar.nn import spatialize
    from hpcpar.testing.oracles import one_rank_grid

    with pytest.raises(LayerError, match=r"^fuse_halos: expected .* got ") as err:
        spatialize(Stack(), one_rank_grid(), fuse_halos=value)
    assert "\n" not in str(err.value)


@mpi_case(nprocs=(2,), timeout=300)
def test_autocast_runs_unfused(comm):
    """Under autocast (bf16 jobs) no run starts: the layers' own casting path runs, and the
    result is the unfused one."""
    def each(grid):
        from hpcpar.nn import local, spatialize

        torch.manual_seed(0)
        plain = Stack()
        x = randn((1, 3, 10, 8, 8), 1)[spatial_slices((10, 8, 8), grid)]
        outs = []
        for fuse in (1, 3):
            sp = spatialize(copy.deepcopy(plain), grid, fuse_halos=fuse)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outs.append(local(sp(x)))
            assert sp._hpcpar_split.fuse_counts == [0, 0]
        assert torch.equal(outs[0], outs[1])

    on_grids(comm, [(1, 2, 1, 1)], each)
