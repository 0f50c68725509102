"""Checkpoints: atomic layout, manifest checksums, keep-K, corrupt fallback, full state dict
hooks, RNG round trip, weights_only loading into the plain model."""

import copy
import json
import random

import numpy as np
import pytest
import torch
from torch import nn

from hpcpar.errors import RunDirError
from hpcpar.formats.records.history import PackedHistory, history_rows
from hpcpar.run.checkpoint import capture, finite, resume, store


@pytest.fixture
def comm():
    from mpi4py import MPI

    return MPI.COMM_SELF


def _save(comm, d, step, model, keep=2):
    return store.save(d, step, comm=comm, model_state=capture.full_state_dict(model),
                     trainer_state={"step": step}, rank_state={"rng": capture.rng_state()},
                     info={"grid": "1x1x1x1"}, keep=keep)


def test_layout_keep_and_weights_only(tmp_path, comm):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    for step in (2, 4, 6):
        path = _save(comm, tmp_path, step, model)
    assert path.name == "step-000006"
    assert [p.name for p in store.list_checkpoints(tmp_path)] == ["step-000006", "step-000004"]
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "model.pt",
                                                      "rank-00000.pt", "trainer.pt"]
    manifest = store.verify(path)
    assert manifest["step"] == 6 and manifest["world_size"] == 1
    assert set(manifest["files"]) == {"model.pt", "rank-00000.pt", "trainer.pt"}
    assert not list(tmp_path.glob(".tmp-*"))
    plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    plain.load_state_dict(torch.load(path / "model.pt", weights_only=True))
    for a, b in zip(plain.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    man, model_sd, trainer_sd, rank_sd = resume.load(path, 0)
    assert trainer_sd == {"step": 6} and set(rank_sd) == {"rng"}


def test_corrupt_newest_falls_back_with_warning(tmp_path, comm):
    model = nn.Linear(2, 2)
    for step in (1, 2, 3):
        _save(comm, tmp_path, step, model, keep=3)
    # a leftover temporary directory from a crash mid-write is never picked
    (tmp_path / ".tmp-step-000009").mkdir()
    newest = tmp_path / "step-000003" / "model.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    (tmp_path / "step-000002" / "manifest.json").write_text("{not json")
    logged = []
    with pytest.warns(RuntimeWarning, match="corrupt"):
        chosen = resume.find_resumable(tmp_path, comm, log=logged.append)
    assert chosen.name == "step-000001"
    assert any("step-000003: model.pt is corrupt" in m for m in logged)
    assert any("step-000002: unreadable manifest" in m for m in logged)
    (tmp_path / "step-000001" / "rank-00000.pt").unlink()
    with pytest.warns(RuntimeWarning):
        assert resume.find_resumable(tmp_path, comm, log=logged.append) is None
    assert resume.find_resumable(tmp_path / "missing", comm) is None


def test_any_grid_resumes_and_takes_the_rank_files_of_its_data_group(tmp_path, comm):
    path = _save(comm, tmp_path, 1, nn.Linear(2, 2))
    for shape in ((2, 1, 1, 1), (1, 2, 1, 1), (2, 1, 2, 2)):   # data width, spatial split
        assert resume.check_compatible(path, shape)["grid"] == "1x1x1x1"
        assert resume.grid_change(resume.check_compatible(path, shape), shape) == \
            f"resuming step 1 of grid 1x1x1x1 on grid {'x'.join(map(str, shape))}"
    assert resume.grid_change({"grid": "1x1x1x1", "step": 1}, (1, 1, 1, 1)) is None
    # the same spatial split: the same spatial place, data index modulo the old width
    old = {"grid": "4x2x1x1"}
    assert [resume.source_rank(old, (d, i, 0, 0)) for d in range(2) for i in range(2)] == \
        [0, 1, 2, 3]
    assert resume.source_rank({"grid": "1x2x1x1"}, (1, 1, 0, 0)) == 1
    assert resume.source_rank({"grid": "2x2x1x1"}, (3, 0, 0, 0)) == 2
    # another split: the first rank of data group d modulo the old width
    assert resume.source_rank({"grid": "2x2x1x1"}, (3, 0, 2, 0)) == 2
    assert resume.source_rank({"grid": "1x1x2x1"}, (0, 1, 0, 0)) == 0


class Sharded(nn.Module):
    """A stand-in for a tensor-parallel layer: stores half a weight, gathers on request."""

    def __init__(self):
        super().__init__()
        self.part = nn.Parameter(torch.arange(4.0))

    def full_state_dict(self):
        return {"weight": torch.cat([self.part.detach(), self.part.detach() + 10])}

    def load_full_state_dict(self, sd):
        with torch.no_grad():
            self.part.copy_(sd["weight"][:4])


def test_full_state_dict_hooks_roundtrip():
    model = nn.Sequential(nn.Linear(2, 2), Sharded())
    sd = capture.full_state_dict(model)
    assert set(sd) == {"0.weight", "0.bias", "1.weight"} and sd["1.weight"].shape == (8,)
    other = nn.Sequential(nn.Linear(2, 2), Sharded())
    with torch.no_grad():
        other[1].part.zero_()
    capture.load_full_state_dict(other, sd)
    assert torch.equal(other[1].part, model[1].part)
    assert torch.equal(other[0].weight, model[0].weight)
    with pytest.raises(RunDirError, match="does not fit"):
        capture.load_full_state_dict(nn.Sequential(nn.Linear(2, 3), Sharded()),
                                  {k: v for k, v in sd.items() if k != "0.bias"})


def test_the_unfinished_checkpoints_of_a_killed_run_are_removed_before_the_next_ones(
        tmp_path, comm):
    """A run killed before renaming a checkpoint leaves its temporary directory; the next
    run's writer removes every one of them once, at its start, so a checkpoint of the same
    step gains no stale file (a larger grid's rank file here), and a file of the user's
    beside them is kept. The background writer makes each temporary directory itself."""
    from hpcpar.run.checkpoint_writer import CheckpointWriter

    for step in (5, 9):
        (tmp_path / f".tmp-step-{step:06d}").mkdir()
        (tmp_path / f".tmp-step-{step:06d}" / "rank-00003.pt").write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("mine")
    writer = CheckpointWriter(tmp_path, comm, keep=2, background=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    model = nn.Linear(2, 2)
    writer.save(5, model_state=capture.full_state_dict(model), trainer_state={"step": 5},
                rank_state={"rng": capture.rng_state()}, info={"grid": "1x1x1x1"})
    assert writer.flush() == tmp_path / "step-000005"
    assert sorted(p.name for p in (tmp_path / "step-000005").iterdir()) == [
        "manifest.json", "model.pt", "rank-00000.pt", "trainer.pt"]
    assert store.verify(tmp_path / "step-000005")["step"] == 5
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_rng_state_roundtrip_weights_only(tmp_path):
    state = capture.rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expect = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(5)  # move on
    capture.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expect[0] and got[1] == expect[1] and torch.equal(got[2], expect[2])
    # Python's state is one tensor; checkpoints before 2026-12 hold a list of ints
    assert isinstance(state["python"][1], torch.Tensor) and state["python"][1].numel() == 625
    capture.set_rng_state(dict(state, python=[state["python"][0], state["python"][1].tolist(),
                                           state["python"][2]]))
    assert random.random() == expect[0]


def test_manifest_is_json_with_checksums(tmp_path, comm):
    path = _save(comm, tmp_path, 5, nn.Linear(1, 1))
    manifest = json.loads((path / "manifest.json").read_text())
    assert all(len(v["sha256"]) == 64 and v["bytes"] > 0 for v in manifest["files"].values())
    assert manifest["grid"] == "1x1x1x1" and manifest["format"] == store.FORMAT_VERSION


def test_the_two_shared_files_are_written_by_different_ranks(tmp_path):
    """Rank 0 serialises the model, the last rank the trainer state (a checkpoint every step
    must not load all of it on one rank); one rank writes both, and every file once."""
    assert [store.writes(n, 0, 1) for n in ("model.pt", "trainer.pt")] == [True, True]
    size, files = 3, {}
    for rank in range(size):
        part = store.write_part(tmp_path, rank, model_state={"w": torch.ones(2)},
                               trainer_state={"step": 1}, rank_state={}, size=size)
        assert not files.keys() & part.keys()
        files.update(part)
    assert sorted(files) == ["model.pt", "rank-00000.pt", "rank-00001.pt", "rank-00002.pt",
                             "trainer.pt"]
    assert "trainer.pt" in store.write_part(tmp_path, 2, model_state=None, trainer_state={},
                                           rank_state={}, size=size)


def test_optimizer_state_saved_in_one_memory_order_resumes_in_the_other():
    """Adam state written while a convolution's weights were NCDHW (an older hpcpar ran
    ``[train] channels_last`` jobs so) loads into channels-last weights laid out like them:
    torch's fused Adam walks parameter and state as raw memory, so the next steps must equal
    the NCDHW run's."""
    def cnn():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv3d(2, 3, 3), nn.ReLU(), nn.Conv3d(3, 4, 2))

    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 2, 5, 4, 6, generator=g) for _ in range(4)]

    def steps(model, opt, batch):
        for x in batch:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

    ncdhw = cnn()
    opt = torch.optim.Adam(ncdhw.parameters(), lr=1e-2, fused=True)
    steps(ncdhw, opt, xs[:2])
    saved = copy.deepcopy(opt.state_dict())   # as read from a file: shares nothing
    cl = cnn().to(memory_format=torch.channels_last_3d)
    cl.load_state_dict(ncdhw.state_dict())
    cl_opt = torch.optim.Adam(cl.parameters(), lr=1e-2, fused=True)
    capture.load_full_optimizer_state(cl, cl_opt, saved)
    steps(ncdhw, opt, xs[2:])
    steps(cl, cl_opt, [x.contiguous(memory_format=torch.channels_last_3d) for x in xs[2:]])
    for p, q in zip(cl.parameters(), ncdhw.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert all(v.stride() == p.stride() for v in cl_opt.state[p].values() if v.dim())


def test_nonfinite_entries_finds_nan_and_inf_in_every_float_dtype_and_only_them():
    """The check before a checkpoint (one sum per tensor, confirmed element by element when it
    is not finite): NaN and inf anywhere are found in fp32, fp64, fp16 and bf16, in the
    state's order; finite values whose sum overflows (the largest fp32 values, fp16 values
    summing past 65504), empty and integer tensors and plain values are not."""
    big = torch.full((3,), torch.finfo(torch.float32).max)
    assert not torch.isfinite(big.sum()) and not torch.isfinite(
        torch.full((4,), 60000.0, dtype=torch.float16).sum())
    hole = torch.zeros(5000)
    hole[4321] = float("nan")
    state = {"huge": big, "late_nan": hole, "empty": torch.zeros(0),
             "ints": torch.arange(4), "neg_inf": torch.tensor([1.0, -float("inf")]).double(),
             "bf16_nan": torch.tensor([float("nan"), 1.0], dtype=torch.bfloat16),
             "ok": torch.ones(2, 2), "plain": float("nan"),
             "fp16_big": torch.full((4,), 60000.0, dtype=torch.float16),
             "fp16_inf": torch.tensor([1.0, float("inf"), 2.0], dtype=torch.float16)}
    assert finite.nonfinite_entries(state) == ["late_nan", "neg_inf", "bf16_nan", "fp16_inf"]
    assert finite.nonfinite_entries({"ok": torch.ones(3)}) == []


def test_the_histories_are_tensors_in_a_checkpoint_and_come_back_exactly():
    """trainer.pt holds the loss history's [step, loss] pairs as one float64 tensor and the
    validation records as columns and a tensor, made incrementally (a tensor handed to an
    earlier checkpoint is never changed); they come back exactly, steps as ints; a history
    float64 would change (an int metric, a bool, other keys) stays the list it was; the lists
    of older checkpoints are read as they were; a tensor of another kind gives no rows."""
    rng = random.Random(3)
    history = [[10 * i, rng.random() * 10 ** rng.randint(-8, 8)] for i in range(1, 6)]
    pack = PackedHistory()
    first = pack(history)
    kept = first.clone()
    history += [[60, 0.1 + 2 ** -40], [70, float("inf")]]
    second = pack(history)
    assert torch.equal(first, kept) and second.shape == (7, 2) and second.dtype == torch.float64
    rows = history_rows(second)
    assert rows == history and all(type(s) is int for s, _ in rows)
    assert history_rows(pack(history[:3])) == history[:3]   # a shorter list: anew

    records = [{"step": 30 * i, "val_loss": np.float64(rng.random()), "val_mae": rng.random()}
               for i in range(1, 4)]
    vpack = PackedHistory()
    saved = vpack(records)
    assert saved["columns"] == ["step", "val_loss", "val_mae"] and saved["rows"].shape == (3, 3)
    back = history_rows(saved)
    assert back == records and all(type(r["step"]) is int for r in back)
    records.append({"step": 120, "val_loss": 0.5, "val_mae": 0.25})
    assert history_rows(vpack(records)) == records

    for stays in ([{"step": 1, "val_acc": 0.5}, {"step": 2, "val_acc": 1}],
                  [{"step": 1, "ok": True}], [{"step": 1, "a": 0.5}, {"step": 2, "b": 0.5}],
                  [[1, 0.5], [2, 0.5, 0.1]], [[2.5, 0.5]], [[2 ** 60, 0.5]]):
        assert PackedHistory()(stays) is stays and history_rows(stays) == stays
    assert history_rows([(5, 0.5), [6, 0.25]]) == [[5, 0.5], [6, 0.25]]
    for junk in (torch.zeros(4), torch.zeros(2, 0), torch.zeros(2, 2, dtype=torch.int64),
                 {"columns": ["loss"], "rows": torch.zeros(1, 1)},
                 {"columns": ["step", "a"], "rows": torch.zeros(1, 3)}, "history", None):
        assert history_rows(junk) == []


def test_a_saved_history_past_the_manifest_step_is_refused(tmp_path, comm):
    """The resume cross-check reads the history's tensor: a loss logged after the
    checkpoint's step means its files belong to another step."""
    pack = PackedHistory()
    path = store.save(tmp_path, 6, comm=comm, model_state=nn.Linear(2, 2).state_dict(),
                     trainer_state={"scheduler": {"last_epoch": 6},
                                    "history": pack([[5, 0.5], [8, 0.25]])},
                     rank_state={}, info={"grid": "1x1x1x1"}, keep=2)
    with pytest.raises(RunDirError, match=r"loss logged to step 8"):
        resume.load(path, 0)
