"""Activation checkpointing (``[train] activation_checkpointing``): exact against single-process
torch and against the same model without it, on split grids with uneven sizes; the
recomputation reuses the forward's halo faces and collectives (no message, counted), and the
count sees the messages when the reuse is switched off."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import batch_slice, close, on_grids, randn

GRIDS = [(1, 1, 1, 1), (1, 2, 1, 1), (1, 2, 2, 1), (2, 2, 1, 1)]


def conv_stack() -> nn.Sequential:
    """A user's plain conv stack: in-place ReLUs, a pool, odd sizes."""
    return nn.Sequential(nn.Conv3d(2, 3, 3, padding=1), nn.ReLU(inplace=True),
                         nn.Conv3d(3, 3, 3, padding=1, bias=False), nn.BatchNorm3d(3),
                         nn.ReLU(inplace=True),
                         nn.MaxPool3d(2), nn.Conv3d(3, 4, 3, padding=1), nn.ReLU(),
                         nn.Conv3d(4, 2, 1))


def unet():
    from hpcpar.models import UNet3D

    return UNet3D(in_channels=1, out_channels=2, base_filters=2, depth=2)


def _step(grid, model, x, w, setting, reuse=True):
    """Spatialize, checkpoint, one forward + backward of sum(y * w) (``reuse``: False turns
    the replay's reuse off); returns the spatialized model, this rank's output piece, input
    gradient and the counter differences."""
    from hpcpar.nn import local, spatialize
    from hpcpar.nn.checkpointing import checkpoint_activations
    from hpcpar.parallel import replay
    from hpcpar.parallel.counters import COUNTERS
    from hpcpar.parallel.spatial import local_slices

    sp = spatialize(model, grid)
    checkpoint_activations(sp, setting)
    xl = x[local_slices(x.shape, grid)].clone().requires_grad_()
    before = COUNTERS.snapshot()
    replay.REUSE = reuse
    try:
        y = local(sp(xl))
        (y * w[local_slices(w.shape, grid)]).sum().backward()
    finally:
        replay.REUSE = True
    return sp, y.detach(), xl.grad, COUNTERS.since(before)


def _reference(grid, model, shape, seed):
    """This rank's share of a global fp64 batch, and one forward + backward of sum(y * w) of
    a copy of ``model`` on it in one process: (x, the copy, its input, output and w)."""
    x = randn((2 * grid.data, *shape), seed, torch.float64)[batch_slice(2 * grid.data, grid)]
    ref = copy.deepcopy(model)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    w = randn(yr.shape, seed + 1, torch.float64)
    (yr * w).sum().backward()
    return x, ref, xr, yr, w


def _against_torch(tag, grid, sp, y, gx, ref, xr, yr):
    """A spatialized step (:func:`_step`) against one process's (:func:`_reference`): the
    output, input gradient, every parameter gradient (summed over the spatial group where
    it is split) and every buffer."""
    from hpcpar.parallel.comm import allreduce_
    from hpcpar.parallel.spatial import local_slices
    from hpcpar.sync.tags import reduce_scope

    close(y, yr[local_slices(yr.shape, grid)].detach(), f"{tag}: output")
    close(gx, xr.grad[local_slices(xr.shape, grid)], f"{tag}: input grad")
    grads = dict(ref.named_parameters())
    for name, p in sp.named_parameters():
        g = p.grad.clone()
        if reduce_scope(p) == "spatial+data":
            allreduce_(g, grid.spatial_comm)
        close(g, grads[name].grad, f"{tag}: grad of {name}")
    for (name, b), rb in zip(sp.named_buffers(), ref.buffers()):
        close(b.double(), rb.double(), f"{tag}: buffer {name}")


def check(grid, make, shape, seed, what, settings, reuse_off=False):
    """fp64: the checkpointed model against torch on one process and against itself without
    checkpointing, for each setting; messages during recomputation: none; buffers updated
    once, not twice. ``reuse_off``: also with the reuse switched off, where the count must
    see the messages."""
    torch.manual_seed(seed)
    model = make().double()
    x, ref, xr, yr, w = _reference(grid, model, shape, seed)
    base, y0, gx0, _ = _step(grid, model, x, w, False)
    split = grid.spatial_size > 1
    for setting in settings:
        tag = f"{what} on {grid.spec()}, activation_checkpointing = {setting!r}"
        sp, y, gx, counts = _step(grid, model, x, w, setting)
        _against_torch(tag, grid, sp, y, gx, ref, xr, yr)
        assert torch.equal(y, y0), f"{tag}: output differs from the run without it"
        close(gx, gx0, f"{tag}: input grad vs no checkpointing")
        for (name, p), q in zip(sp.named_parameters(), base.parameters()):
            close(p.grad, q.grad, f"{tag}: local grad of {name} vs no checkpointing")
        assert counts["recompute_msgs"] == 0 and counts["recompute_bytes"] == 0, \
            f"{tag}: the recomputation sent {counts['recompute_msgs']} messages"
        assert (counts["bytes_halo"] > 0) == split, tag
    if not reuse_off:
        return
    # the reuse switched off: the same gradients, but the recomputation communicates again
    # and the count sees it (so the zeros above are measured, not assumed)
    sp, y, gx, counts = _step(grid, model, x, w, 1, reuse=False)
    close(gx, gx0, f"{what} on {grid.spec()} without reuse: input grad")
    assert (counts["recompute_msgs"] > 0) == split, counts
    assert (counts["recompute_bytes"] > 0) == split, counts


@mpi_case(nprocs=(4,), timeout=300)
def test_checkpointed_models_match(comm):
    # UNet3D: "auto" is 1 (one segment per conv block); the stack: 5 moves a boundary off
    # an in-place ReLU, "auto" is 3
    on_grids(comm, GRIDS, lambda g: check(g, unet, (1, 17, 13, 11), 5, "UNet3D", (1, 2),
                                          reuse_off=True))
    on_grids(comm, GRIDS, lambda g: check(g, conv_stack, (2, 9, 7, 10), 6, "conv stack",
                                          (5, "auto")))


def test_segments_keys_and_setting():
    from hpcpar.errors import ConfigError
    from hpcpar.nn.checkpointing import chains, checkpoint_activations, plan_segments

    model = unet()
    keys = list(model.state_dict())
    assert len(chains(model)) == 5  # every conv block of a depth-2 UNet3D
    assert checkpoint_activations(model, "auto") == [[6]] * 5  # sqrt(30) / 5 -> 1 each
    assert list(model.state_dict()) == keys
    twin = copy.deepcopy(model)   # the patched forward follows the copy
    x = torch.randn(1, 1, 8, 8, 8)
    assert torch.allclose(twin(x), model(x))
    stack = conv_stack()
    # a segment never starts with an in-place ReLU (it would overwrite the kept input)
    assert [s for _, s in plan_segments(stack, 4)] == [[3, 2, 2, 2]]
    assert [s for _, s in plan_segments(stack, 5)] == [[2, 3, 2, 2]]  # not 2+2+2+2+1
    assert [s for _, s in plan_segments(stack, "auto")] == [[3, 3, 3]]  # sqrt(9) = 3
    for bad in (True, 0, -1, "all", 1.5):
        with pytest.raises(ConfigError, match=r"activation_checkpointing: expected false, "
                                              r"\"auto\" or a number"):
            checkpoint_activations(stack, bad)
    assert checkpoint_activations(stack, False) == []


def test_replay_mismatch_is_one_line():
    from hpcpar.errors import LayerError
    from hpcpar.parallel.replay import Tape, received

    tape = Tape()
    with tape.recording():
        received(("halo exchange", (1, 2)), lambda: 1)
    with tape.replaying(), pytest.raises(LayerError, match=r"communication #1 is \('halo "
                                                           r"exchange', \(1, 3\)\)"):
        received(("halo exchange", (1, 3)), lambda: 2)


class UserCheckpointed(nn.Module):
    """A model that calls torch.utils.checkpoint itself, four ways: a block module, the
    reentrant form (torch 2.13's default) on another, checkpoint_sequential over a chain
    (batch norm, in-place ReLU, group norm), and a closure of functional ops with a pool, a
    global mean (whose value a recomputation on one rank's piece would get wrong with every
    shape right) and an upsampling."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv3d(2, 4, 3, padding=1)
        self.block = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1, bias=False),
                                   nn.BatchNorm3d(4), nn.ReLU(inplace=True))
        self.chain = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
                                   nn.Conv3d(4, 4, 3, padding=1, bias=False), nn.BatchNorm3d(4),
                                   nn.ReLU(inplace=True))
        self.again = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1, bias=False),
                                   nn.BatchNorm3d(4), nn.Tanh())
        self.pw = nn.Conv3d(4, 4, 1)
        self.head = nn.Conv3d(4, 2, 1)

    def forward(self, x):
        from torch.nn import functional as F
        from torch.utils.checkpoint import checkpoint, checkpoint_sequential

        x = checkpoint(self.block, self.stem(x), use_reentrant=False)
        x = checkpoint(self.again, x, use_reentrant=True)
        x = checkpoint_sequential(self.chain, 2, x, use_reentrant=False)

        def centred(t):
            t = self.pw(t)
            t = t * (t - t.mean(dim=(2, 3, 4), keepdim=True))
            return F.interpolate(F.max_pool3d(t, 2), size=x.shape[2:], mode="nearest")

        return self.head(checkpoint(centred, x, use_reentrant=False))


def check_user(grid, shape, seed, reuse=True, setting=False):
    """fp64: a model's own checkpoint regions against the same model in one
    process (outputs, input and parameter gradients, running statistics, which torch's
    recomputation updates a second time), with hpcpar's ``activation_checkpointing =
    setting`` on top, and what the recomputations sent (returned)."""
    torch.manual_seed(seed)
    model = UserCheckpointed().double()
    x, ref, xr, yr, w = _reference(grid, model, shape, seed)
    sp, y, gx, counts = _step(grid, model, x, w, setting, reuse=reuse)
    _against_torch(f"a model's own checkpoint on {grid.spec()}, activation_checkpointing = "
                   f"{setting!r}", grid, sp, y, gx, ref, xr, yr)
    return counts


@mpi_case(nprocs=(4,), timeout=300)
def test_a_models_own_torch_checkpoint_is_exact_and_recomputes_without_messages(comm):
    """torch.utils.checkpoint called by the model (both forms) recomputes its regions under
    hpcpar's dispatch with the forward's faces: exact on every grid, uneven sizes, no message
    during the recomputations; with the reuse off the count sees them (so the zero is
    measured). Before, the non-reentrant recomputation ran on each rank's plain piece
    (torch's check of the saved tensors failed in backward) and the reentrant form was
    refused. With hpcpar's own segments on top, the chains inside the model's regions run
    plainly (segments nested in a recomputation made their collectives in another order per
    rank: a hang)."""
    def one(grid):
        for setting in (False, "auto"):
            counts = check_user(grid, (2, 9, 7, 10), 7, setting=setting)
            assert counts["recompute_msgs"] == 0 and counts["recompute_bytes"] == 0, counts
        if grid.spatial_size > 1:
            assert check_user(grid, (2, 9, 7, 10), 7, reuse=False)["recompute_msgs"] > 0
    on_grids(comm, GRIDS, one)


def test_a_reentrant_checkpoint_no_split_tensor_enters_is_refused_naming_the_fix():
    """A reentrant region whose inputs are all replicated (a global mean here) may close over
    split tensors hpcpar cannot see: one line, naming the form that works."""
    from torch.utils.checkpoint import checkpoint

    from hpcpar import ProcessGrid
    from hpcpar.errors import LayerError
    from hpcpar.nn import spatialize

    class Reentrant(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.fc = nn.Conv3d(1, 2, 3, padding=1), nn.Linear(2, 2)

        def forward(self, x):
            h = self.stem(x)
            return h * checkpoint(self.fc, h.mean(dim=(2, 3, 4)), use_reentrant=True).sum()

    sp = spatialize(Reentrant(), ProcessGrid(1, 1, 1, 1))
    with pytest.raises(LayerError) as exc:
        sp(torch.randn(1, 1, 6, 6, 6))
    line = str(exc.value)
    assert "\n" not in line and "use_reentrant=False" in line, line


PLAIN_AFTER_SPATIALIZE = """
import torch, torch.nn as nn
import torch.utils.checkpoint as tc
from hpcpar import ProcessGrid
from hpcpar.nn import spatialize

def plain():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Dropout(0.3), nn.Linear(5, 3)).double()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    y = tc.checkpoint(m, x, use_reentrant=False)   # dropout: torch replays the RNG state too
    y.sum().backward()
    return [y.detach(), x.grad, *(p.grad for p in m.parameters())]

generator = tc._checkpoint_without_reentrant_generator
forward = vars(tc.CheckpointFunction)["forward"]
never = plain()
seen = []

class Own(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(1, 2, 3, padding=1)

    def forward(self, x):
        seen.append(tc._checkpoint_without_reentrant_generator is not generator)
        return tc.checkpoint(self.conv, x, use_reentrant=False)

sp = spatialize(Own(), ProcessGrid(1, 1, 1, 1))
sp(torch.randn(1, 1, 6, 6, 6)).sum().backward()
assert seen[-1], "hpcpar's replay was not installed while the spatialized forward ran"
assert tc._checkpoint_without_reentrant_generator is generator, "generator left replaced"
assert vars(tc.CheckpointFunction)["forward"] is forward, "CheckpointFunction left replaced"
after = plain()
assert all(torch.equal(a, b) for a, b in zip(never, after, strict=True))
print("ok")
"""


def test_a_plain_models_torch_checkpoint_is_untouched_after_spatialize():
    """spatialize() installs its torch.utils.checkpoint integration only while a spatialized
    forward runs: in a fresh process, a plain model's non-reentrant checkpoint (with dropout)
    gives bit-identical outputs and gradients before and after a spatialized model's forward
    and backward, and torch's generator and CheckpointFunction are torch's own again after."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", PLAIN_AFTER_SPATIALIZE], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
