"""``[train] precision = "fp16"``: dynamic loss scaling agreed by all ranks, real MPI.

* the scale follows torch's ``GradScaler`` step for step (its own oracle, one process);
* an overflow that only ONE rank sees after the gradient sync (injected into that rank's
  synced gradient) skips the optimizer step on every rank alike: the parameters stay equal
  everywhere and do not move at that step, the scale halves, the records show the skip on
  every rank, and the run ends "ok" (no divergence); grids 1x2x1x1 and 2x2x1x1;
* a resume from the checkpoint after the overflow is bit-identical to the uninterrupted run
  (the halved scale comes back from trainer.pt);

CosmoFlow (conv3d, batch norm, pooling, dense) runs under CPU fp16 autocast in torch 2.13.
"""

import hashlib
import math

import torch

from hpcpar.formats.jobspec import build_job
from hpcpar.formats.records import read_steps
from hpcpar.nn.split_head import COLUMNS_ATTR
from hpcpar.run.callbacks import Callback
from hpcpar.run.loss_scale import LossScaler
from hpcpar.run.trainer import Trainer
from hpcpar.testing import mpi_case, shared_tmpdir

STEPS = 6
OVERFLOW_AT = 2     # the 0-based step whose gradient overflows on the last rank


def job(grid, every=0):
    return build_job({
        "job": {"name": "fp16"}, "grid": dict(zip(("data", "x", "y", "z"), grid)),
        "model": {"kind": "cosmoflow", "n_conv_blocks": 2, "base_filters": 4, "dense": [16]},
        "data": {"source": "synthetic", "size": 16, "channels": 2, "samples": 32},
        "train": {"steps": STEPS, "global_batch": 4, "optimizer": "adam", "lr": 1e-3,
                  "precision": "fp16", "log_every": 1, "check_replicas_every": 1},
        "checkpoint": {"every": every}})


class OverflowOnLastRank(Trainer):
    """Only the last rank's synced gradient overflows, at step ``OVERFLOW_AT``: as a
    rank-local piece (a tensor-parallel shard) can, where no sync would spread the inf."""

    def _unscaled_grads_ok(self) -> bool:
        if self.step == OVERFLOW_AT and self.rank == self.grid.size - 1:
            next(p for p in self.model.parameters() if p.grad is not None).grad[0] = math.inf
        return super()._unscaled_grads_ok()


class ParamDigests(Callback):
    """A digest of the model's parameters after every step, as this rank sees them: a split
    head's weight (each rank holds its columns) gathered whole first (collective)."""

    def __init__(self):
        self.digests = []

    def on_step_end(self, trainer, row, mean_loss):
        h = hashlib.sha256()
        for p in trainer.model.parameters():
            columns = getattr(p, COLUMNS_ATTR, None)
            h.update((columns.gather(p) if columns else p).detach().numpy().tobytes())
        self.digests.append(h.hexdigest())


def train_overflowing(the_job, run_dir, comm, **kw):
    digests = ParamDigests()
    trainer = OverflowOnLastRank(the_job, run_dir, comm=comm, callbacks=[digests], **kw)
    try:
        return trainer.run(), digests.digests
    finally:
        trainer.close()


def test_scale_follows_torch_grad_scaler():
    """The same overflow pattern through torch's GradScaler and ours: the same scale after
    every step, growth (interval 3) and backoff alike; its state loads into ours."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    theirs = torch.amp.GradScaler("cpu", growth_interval=3)
    ours = LossScaler(growth_interval=3)
    for found_inf in [0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]:
        theirs.scale(p.sum()).backward()
        if found_inf:
            p.grad[1] = math.inf
        theirs.step(opt)
        opt.zero_grad()
        theirs.update()
        ours.update(bool(found_inf))
        assert ours.scale == theirs.get_scale()
        assert ours.growth_tracker == theirs.state_dict()["_growth_tracker"]
    copy = LossScaler()
    copy.load_state_dict(theirs.state_dict())
    assert (copy.scale, copy.growth_interval) == (ours.scale, 3)


@mpi_case(nprocs=(2, 4), timeout=300)
def test_overflow_on_one_rank_is_skipped_on_every_rank(comm):
    grid = (comm.Get_size() // 2, 2, 1, 1)
    with shared_tmpdir(comm, prefix="hpcpar-fp16-") as tmp:
        run = tmp / "run"
        result, digests = train_overflowing(job(grid), run, comm)
        assert result.step == STEPS and result.overflow_steps == 1 and result.skipped_steps == 0
        # not a divergence: the run ends ok, and the skipped step left the parameters as they were
        everywhere = comm.allgather(digests)
        assert all(d == everywhere[0] for d in everywhere), "replicas differ after a step"
        assert digests[OVERFLOW_AT] == digests[OVERFLOW_AT - 1]
        assert len(set(digests)) == STEPS - 1, "a step that was not skipped did not train"
        comm.Barrier()
        if comm.Get_rank() == 0:
            steps = read_steps(run)
            first = LossScaler().scale
            for rank, rows in steps.groupby("rank"):
                rows = rows.sort_values("step")
                assert list(rows["skipped"]) == [int(s == OVERFLOW_AT) for s in range(STEPS)], rank
                assert list(rows["loss_scale"]) == [first if s <= OVERFLOW_AT else first / 2
                                                    for s in range(STEPS)], rank
            assert steps["rank"].nunique() == comm.Get_size()


@mpi_case(nprocs=2, timeout=300)
def test_fp16_resume_is_bit_identical(comm):
    """Continue from the checkpoint after the overflow: the same weights, optimizer and scale
    as the run that never stopped, to the bit."""
    with shared_tmpdir(comm, prefix="hpcpar-fp16-resume-") as tmp:
        the_job = job((1, 2, 1, 1), every=OVERFLOW_AT + 1)
        train_overflowing(the_job, tmp / "whole", comm)
        middle = tmp / "whole" / "checkpoints" / f"step-{OVERFLOW_AT + 1:06d}"
        result, _ = train_overflowing(the_job, tmp / "resumed", comm, start_from=middle)
        assert result.overflow_steps == 1          # the count came back with the checkpoint
        comm.Barrier()
        if comm.Get_rank() == 0:
            end = f"step-{STEPS:06d}"
            for name in ("model.pt", "trainer.pt"):
                want = torch.load(tmp / "whole" / "checkpoints" / end / name, weights_only=True)
                got = torch.load(tmp / "resumed" / "checkpoints" / end / name, weights_only=True)
                assert _bits(got) == _bits(want), name
            state = torch.load(tmp / "resumed" / "checkpoints" / end / "trainer.pt",
                               weights_only=True)["loss_scale"]
            assert state["scale"] == LossScaler().scale / 2
            whole, resumed = read_steps(tmp / "whole"), read_steps(tmp / "resumed")
            later = whole[whole["step"] > OVERFLOW_AT].sort_values(["step", "rank"])
            assert list(resumed.sort_values(["step", "rank"])["loss_scale"]) == \
                list(later["loss_scale"])


def _bits(obj):
    """A nested state dict with every tensor as its bytes (bitwise comparison, NaN-safe)."""
    if isinstance(obj, torch.Tensor):
        return (obj.dtype, tuple(obj.shape), obj.numpy().tobytes())
    if isinstance(obj, dict):
        return {k: _bits(v) for k, v in obj.items() if k != "time"}
    if isinstance(obj, list | tuple):
        return [_bits(v) for v in obj]
    return obj

