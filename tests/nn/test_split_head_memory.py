"""Memory of a split head that divides by the spatial ranks beyond the step (issue 29): the
full weight built at start-up is gone once ``settle`` cut it (no copy kept by ``spatialize``,
the first-step check, the settle forward, the gradient sync or the optimizer), and a
checkpoint gathers the full weight and optimizer state on the rank writing each file only,
with the same values as gathering everywhere."""

from __future__ import annotations

import gc
import math
import os
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import batch_slice, on_grids, piece_of, randn, spatial_slices

GRIDS = [(1, 2, 1, 1), (1, 2, 2, 1), (2, 2, 1, 1)]
SIZE = (7, 5, 6)          # odd edges: uneven pieces on every split axis


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(3 * math.prod(SIZE), 5), nn.Tanh(), nn.Linear(5, 2)).double()


def _watched(model):
    """Put the head's weight in memory owned by a numpy array (same values) and return a
    weak reference to the array: it dies when no tensor holds that memory any more."""
    head = model[3]
    arr = head.weight.detach().numpy().copy()
    head.weight = nn.Parameter(torch.from_numpy(arr))
    return weakref.ref(arr)


def _full_size(weight, before=()) -> list:
    """Live tensors of ``weight``'s shape but ``weight`` and those alive ``before`` the model
    was built (a test sharing the process may hold one): copies of it."""
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)
            and o is not weight and not any(o is b for b in before)
            and not o.is_meta and o.shape == weight.shape]


def _piece(x, grid):
    return piece_of(x, grid).clone()


def _full_weight_freed(grid):
    import hpcpar
    from hpcpar.nn import settle, spatialize
    from hpcpar.nn.split_head import column_split

    for check in (False, True):
        what = f"check={check} on {grid.spec()}"
        gc.collect()
        before = _full_size(torch.empty(5, 3 * math.prod(SIZE)))
        plain = _model()
        want = plain[3].weight.detach().clone()
        full = _watched(plain)
        sp = spatialize(plain, grid, check=check, inplace=True)
        del plain
        gc.collect()
        assert full() is not None, what      # the model holds it until the cut
        settle(sp, torch.zeros(1, 2, *SIZE, dtype=torch.float64)[spatial_slices(SIZE, grid)])
        gc.collect()
        assert full() is None, f"{what}: the full head weight survived settle"
        assert not _full_size(want, before), f"{what}: a full-size copy survived settle"
        head = sp[3].weight
        info = column_split(head)
        assert info is not None and torch.equal(head.detach(), info.take(want)), what
        ddp = hpcpar.DDP(sp, grid)
        opt = torch.optim.Adam(sp.parameters(), lr=0.01)
        x = randn((2 * grid.data, 2, *SIZE), 1, torch.float64)
        y = randn((2 * grid.data, 2), 2, torch.float64)
        F.mse_loss(ddp(_piece(x, grid)), y[batch_slice(x.shape[0], grid)]).backward()
        opt.step()   # the first forward ran the check (a small probe) with check=True
        assert all(not p.is_meta for p in sp.parameters()), what
        gc.collect()
        assert full() is None and not _full_size(want, before), f"{what}: after the first step"


@mpi_case(nprocs=(4,), timeout=300)
def test_the_full_head_weight_is_freed_by_settle(comm):
    on_grids(comm, GRIDS, _full_weight_freed)


def test_spatialize_copies_unless_inplace_and_check_keeps_no_weights():
    """The plain model is the caller's (untouched) without ``inplace``; the check keeps only
    a skeleton of it, whose parameters hold no memory."""
    from hpcpar.nn import spatialize
    from hpcpar.testing.oracles import one_rank_grid

    plain = _model()
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    sp = spatialize(plain, one_rank_grid(), check=True)
    assert sp is not plain and all(a is not b for a, b in zip(sp.parameters(),
                                                               plain.parameters()))
    skel = sp._hpcpar_split.plain
    assert all(p.is_meta for p in skel.parameters())
    sp(torch.randn(1, 2, *SIZE, dtype=torch.float64))   # the check runs, and passes
    assert sp._hpcpar_split.plain is None
    assert all(torch.equal(v, before[k]) for k, v in plain.state_dict().items())
    same = spatialize(plain, one_rank_grid(), inplace=True)
    assert same is plain


def _rooted_checkpoint_state(grid):
    from hpcpar.nn import settle, spatialize
    from hpcpar.nn.split_head import column_split
    from hpcpar.run.checkpoint import capture

    sp = spatialize(_model(), grid, inplace=True)
    settle(sp, torch.zeros(1, 2, *SIZE, dtype=torch.float64)[spatial_slices(SIZE, grid)])
    opt = torch.optim.Adam(sp.parameters(), lr=0.01)
    x = randn((2 * grid.data, 2, *SIZE), 3, torch.float64)
    F.mse_loss(sp(_piece(x, grid)), torch.zeros(2, 2, dtype=torch.float64)).backward()
    opt.step()
    head = sp[3].weight
    info = column_split(head)
    want_sd, want_opt = capture.full_state_dict(sp), capture.full_optimizer_state(sp, opt)
    index = [i for i, p in enumerate(sp.parameters()) if p is head][0]
    for root in range(grid.size):
        what = f"root {root} on {grid.spec()}"
        sd, st = capture.full_state_dict(sp, root), capture.full_optimizer_state(sp, opt, root)
        mine = grid.rank == root
        for k, v in want_sd.items():
            expect = v if mine or k != "3.weight" else head.detach()
            assert torch.equal(sd[k], expect), f"{what}: {k}"
        for key in ("exp_avg", "exp_avg_sq"):
            got, full = st["state"][index][key], want_opt["state"][index][key]
            expect = full if mine else opt.state[head][key]
            assert torch.equal(got, expect), f"{what}: {key}"
            assert mine or torch.equal(info.take(full), got), what
        assert sd["3.weight"].untyped_storage().data_ptr() != \
            head.untyped_storage().data_ptr(), f"{what}: shares the live weight"
        live = capture.full_state_dict(sp, root, copy=mine)   # collective: on every rank
        own = dict((*sp.named_parameters(), *sp.named_buffers()))
        assert live.keys() == sd.keys() and all(torch.equal(live[k], sd[k]) for k in sd), what
        assert mine or all(live[k].untyped_storage().data_ptr() ==
                           own[k].untyped_storage().data_ptr() for k in sd), \
            f"{what}: a rank that only checks the state copied it"
    _spilled_on_the_root(grid, sp, opt, want_sd["3.weight"], want_opt["state"][index])


def _spilled_on_the_root(grid, sp, opt, weight, moments):
    """With a spill directory, what the root gathers is backed by an (unlinked) file there,
    with the same values; the other ranks' state is as without one."""
    import os
    import tempfile

    from hpcpar.run.checkpoint import capture

    index = [i for i, p in enumerate(sp.parameters()) if p is sp[3].weight][0]
    before = os.environ.get("HPCPAR_CHECKPOINT_SPILL")
    os.environ["HPCPAR_CHECKPOINT_SPILL"] = "1"   # any size
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = grid.size - 1
            sd = capture.full_state_dict(sp, root, spill_dir=tmp)
            st = capture.full_optimizer_state(sp, opt, root, spill_dir=tmp)["state"][index]
            got = [sd["3.weight"], st["exp_avg"], st["exp_avg_sq"]]
            want = [weight, moments["exp_avg"], moments["exp_avg_sq"]]
            files = [t.untyped_storage().filename for t in got]
            if grid.rank == root:
                assert all(torch.equal(a, b) for a, b in zip(got, want)), grid.spec()
                assert all(f and os.path.dirname(f) == tmp for f in files), files
            else:
                assert files == [None] * 3 and got[0].shape != weight.shape, grid.spec()
            assert os.listdir(tmp) == [], "a spill file was left behind"
    finally:
        if before is None:
            del os.environ["HPCPAR_CHECKPOINT_SPILL"]
        else:
            os.environ["HPCPAR_CHECKPOINT_SPILL"] = before


@mpi_case(nprocs=(4,), timeout=300)
def test_a_checkpoint_gathers_the_head_on_its_writer_only(comm):
    on_grids(comm, GRIDS, _rooted_checkpoint_state)


@pytest.mark.parametrize("allocator", ["system", "jemalloc"])
@pytest.mark.parametrize("spill", ["off", "16MiB"])
def test_the_planner_counts_start_up_and_the_checkpoint_writer(spill, allocator, monkeypatch):
    """Start-up holds the full parameters once (plus one settled sample); the writer of the
    optimizer state holds it whole, but for a split head's, which it gathers into a file
    (HPCPAR_CHECKPOINT_SPILL): on top of the step's peak under glibc (which keeps the step's
    freed blocks), beside the step's state alone under jemalloc (which reuses them); the
    total is the largest of them."""
    from hpcpar.plan import memory
    from hpcpar.plan.job import workload_from_job
    from hpcpar.plan.memory import RUNTIME_BYTES, _local_out, estimate, optimizer_states

    monkeypatch.setenv("HPCPAR_CHECKPOINT_SPILL", spill)
    monkeypatch.setattr(memory, "_ranks_allocator", lambda: allocator)
    job = "jobs/demo-cosmoflow.toml"
    for sets in ([], ["checkpoint.at_end=false", "checkpoint.every=0"]):
        work = workload_from_job(job, ["train.global_batch=1", *sets], size=192)
        est = estimate(work, (1, 2, 2, 2))
        full = work.params * 4   # the whole model, on every rank alike
        assert work.local_params(8, (2, 2, 2)) * 4 < full / 4
        # batch 1, fp32: the settle forward holds the step's data and two of the largest
        # layer outputs
        biggest = max(_local_out(layer, (2, 2, 2)) for layer in work.layers) * 4
        assert est.startup == pytest.approx(RUNTIME_BYTES + full + est.data + 2 * biggest)
        whole = full if spill == "off" else full - work.head_params * 4
        assert work.head_params * 4 > 16 << 20      # the head is large enough to spill
        state = optimizer_states(work.optimizer)
        one = estimate(work, (1, 1, 1, 1))
        if sets:
            assert est.checkpoint == 0 and est.total == max(est.step, est.startup)
            assert one.checkpoint == 0
        elif allocator == "system":
            assert est.checkpoint == est.step + state * whole > est.step
            assert one.checkpoint == one.step + state * full, "one rank gathers nothing"
        else:
            assert est.checkpoint == est.runtime + est.data + est.params + state * whole
            assert one.checkpoint == one.runtime + one.data + one.params + state * full


def test_a_spilled_tensor_is_a_mapping_of_an_unlinked_file(tmp_path, monkeypatch):
    """Large enough: file-backed in the directory (nothing left there), zeros, writable;
    smaller, or a directory that cannot hold the file: memory."""
    from hpcpar.nn import spill

    monkeypatch.setenv("HPCPAR_CHECKPOINT_SPILL", "1KiB")
    big = spill.zeros((64, 8), torch.float32, tmp_path / "ckpt")   # made if missing
    assert big.untyped_storage().filename.startswith(str(tmp_path / "ckpt"))
    assert os.listdir(tmp_path / "ckpt") == [] and not big.any()
    big[3, 2] = 7.0
    assert big.sum() == 7.0 and big.shape == (64, 8)
    small = spill.zeros((16, 8), torch.float32, tmp_path)
    assert small.untyped_storage().filename is None
    (tmp_path / "a-file").write_text("")
    moved = spill.zeros((64, 8), torch.float32, tmp_path / "a-file")
    assert moved.untyped_storage().filename is None and not moved.any()
    monkeypatch.setenv("HPCPAR_CHECKPOINT_SPILL", "off")
    assert spill.zeros((64, 8), torch.float32, tmp_path).untyped_storage().filename is None


def test_a_state_is_written_without_a_copy_in_memory(tmp_path):
    """``_save`` streams to the file and hashes what it writes: the manifest's checksum and
    size are the file's."""
    import hashlib

    from hpcpar.run.checkpoint.store import _save

    state = {"w": torch.randn(300, 200), "n": 3}
    got = _save(state, tmp_path / "s.pt")
    data = (tmp_path / "s.pt").read_bytes()
    assert got == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    back = torch.load(tmp_path / "s.pt", weights_only=True)
    assert torch.equal(back["w"], state["w"]) and back["n"] == 3
