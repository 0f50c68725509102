"""Asynchronous checkpoints (issue 31, item 2): written by a background thread, committed at a
later step boundary, flushed before a stop and at the end.

- Exactness: a run checkpointing asynchronously every step on 2 ranks, stopped by a signal and
  resumed, ends bit-identical to an uninterrupted run; its records carry ``t_ckpt``.
- kill -9 at random moments (seeded) of a run checkpointing every step: every checkpoint left
  verifies, loads and holds exactly the uninterrupted run's state at its step; the newest
  resumes to exactly the uninterrupted run's next step; a killed write is never a checkpoint.
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpcpar.formats.jobspec import build_job
from hpcpar.run.checkpoint import store
from hpcpar.run.workloads.base import register_workload
from hpcpar.run.workloads.volume import CosmoFlowWorkload
from hpcpar.testing import mpi_case, shared_tmpdir

TRIALS = 20


@register_workload("cosmoflow-async-stop")
class StopAtFifth(CosmoFlowWorkload):
    """CosmoFlow that sends itself SIGUSR1 during its 5th forward, on the last rank."""

    def forward_loss(self, model, batch):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 5 and self.grid.rank == self.grid.size - 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return super().forward_loss(model, batch)


def job(steps, x=1, kind="cosmoflow", keep=3):
    """The tiny job, a checkpoint (asynchronous) after every step; a loss logged every step,
    so a checkpoint's state does not depend on ``steps``."""
    return build_job({
        "job": {"name": "async"}, "grid": {"data": 1, "x": x},
        "model": {"kind": kind, "n_conv_blocks": 2, "base_filters": 4, "dense": [16]},
        "data": {"source": "synthetic", "size": 16, "channels": 2, "samples": 32},
        "train": {"steps": steps, "global_batch": 4, "lr": 0.003, "log_every": 1},
        "checkpoint": {"every": 1, "keep": keep, "background": True}})


def tensors_equal(a, b) -> bool:
    """Bitwise equality of two nested checkpoint states."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


def state_of(path: Path) -> dict:
    """A checkpoint's files, loaded (what a resume reads), less the schedule's total steps
    (the killed runs were given more steps than the uninterrupted one: a constant schedule)."""
    out = {name: torch.load(path / name, map_location="cpu", weights_only=True)
           for name in ("model.pt", "trainer.pt", store.rank_file(0))}
    for lam in out["trainer.pt"]["scheduler"].get("lr_lambdas", []):
        if isinstance(lam, dict):
            lam.pop("total", None)
    return out


@mpi_case(nprocs=2, timeout=300)
def test_async_stop_resume_is_bit_identical(comm):
    from mpi4py import MPI

    from hpcpar.formats.records import read_steps
    from hpcpar.run.trainer import train

    with shared_tmpdir(comm, prefix="hpcpar-async-checkpoint-") as base:
        ref = train(job(10, x=2), base / "ref", comm=MPI.COMM_WORLD)
        cut = train(job(10, x=2, kind="cosmoflow-async-stop"), base / "cut", comm=MPI.COMM_WORLD)
        assert ref.step == 10 and cut.stopped and cut.step == 5
        # the stop waited for the background write: the stopped step's checkpoint is committed
        assert store.list_checkpoints(base / "cut" / "checkpoints")[0].name == "step-000005"
        again = train(job(10, x=2), base / "cut", comm=MPI.COMM_WORLD)
        assert again.step == 10
        if comm.rank == 0:
            logged = (base / "cut" / "logs" / "rank-00000.log").read_text()
            assert "checkpoint step-000003 (writing in the background" in logged
            newest = [store.list_checkpoints(base / d / "checkpoints")[0] for d in ("ref", "cut")]
            assert [p.name for p in newest] == ["step-000010"] * 2
            a, b = (state_of(p) for p in newest)
            assert tensors_equal(a, b), "resumed asynchronous run differs from uninterrupted"
            steps = read_steps(base / "cut")
            assert (steps["t_ckpt"] > 0).all() and len(steps) == 20


def _trial_job_json(tmp: Path) -> Path:
    path = tmp / "job.json"
    path.write_text(job(100000, keep=2).to_json())    # keep=2: kills land in rotations too
    return path


def _kill_during_training(job_json: Path, run_dir: Path, delay: float) -> None:
    """One rank (``python -m hpcpar.run.trainer``), killed with SIGKILL ``delay`` seconds
    after its first checkpoint exists."""
    proc = subprocess.Popen([sys.executable, "-m", "hpcpar.run.trainer", str(job_json),
                             "--run-dir", str(run_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    try:
        end = time.monotonic() + 120
        while not store.list_checkpoints(run_dir / "checkpoints"):
            assert proc.poll() is None and time.monotonic() < end, f"{run_dir}: no checkpoint"
            time.sleep(0.01)
        time.sleep(delay)
        assert proc.poll() is None, "the run ended before it was killed"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture()
def one_thread():
    """The checks train in this process: one thread, as the killed ranks, for equal bits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_kill9_at_random_moments_leaves_only_whole_checkpoints(tmp_path, one_thread):
    from concurrent.futures import ThreadPoolExecutor

    from hpcpar.run.trainer import train

    rng = random.Random(31)
    delays = [rng.uniform(0.0, 0.6) for _ in range(TRIALS)]
    job_json = _trial_job_json(tmp_path)
    runs = [tmp_path / f"trial-{trial}" for trial in range(TRIALS)]
    with ThreadPoolExecutor(2) as pool:       # two trials at a time
        list(pool.map(_kill_during_training, [job_json] * TRIALS, runs, delays))
    outcomes = []
    for run_dir in runs:
        found = store.list_checkpoints(run_dir / "checkpoints")
        left = sorted(p.name for p in (run_dir / "checkpoints").iterdir()
                      if store.checkpoint_step(p) is None)
        outcomes.append((run_dir, [store.checkpoint_step(p) for p in found], left))
    newest = max(steps[0] for _, steps, _ in outcomes)
    train(job(newest + 1, keep=1000), tmp_path / "ref")        # the uninterrupted run
    ref = tmp_path / "ref" / "checkpoints"
    for trial, (run_dir, steps, left) in enumerate(outcomes):
        assert steps, f"{run_dir}: no checkpoint survived"
        for step in steps:      # each verifies, loads and is the uninterrupted run's state
            path = run_dir / "checkpoints" / store.step_dir_name(step)
            store.verify(path)
            assert tensors_equal(state_of(path), state_of(ref / store.step_dir_name(step))), \
                f"{path} differs from the uninterrupted run's step {step}"
        # a write or removal cut short keeps a name that is never a checkpoint's
        assert all(name.startswith((".tmp-", ".old-")) for name in left), left
        if trial % 5 == 0:      # the newest resumes exactly (a few trials: each is a set-up)
            result = train(job(steps[0] + 1, keep=2), run_dir)
            assert result.step == steps[0] + 1
            resumed = run_dir / "checkpoints" / store.step_dir_name(steps[0] + 1)
            assert tensors_equal(state_of(resumed), state_of(ref / resumed.name)), resumed
    # the kills did land during writes: most trials left a write unfinished
    writing = sum(any(n.startswith(".tmp-") for n in left) for _, _, left in outcomes)
    assert writing >= TRIALS // 2, outcomes


class _Killed(BaseException):
    """Stands for a SIGKILL: nothing after it runs."""


def test_a_rotation_cut_short_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    """A kill while rotation deletes an old checkpoint (here: after its first file) leaves
    every ``step-N`` whole: the deleted one is renamed out of the checkpoint names first."""
    import shutil

    from mpi4py import MPI

    def save(step, keep):
        return store.save(tmp_path, step, comm=MPI.COMM_SELF, model_state={"w": torch.ones(3)},
                         trainer_state={}, rank_state={"rng": step}, info={"grid": "1x1x1x1"},
                         keep=keep)

    def killed_midway(path, ignore_errors=False):
        files = sorted(Path(path).glob("*")) if Path(path).is_dir() else []
        if files:
            files[0].unlink()
            raise _Killed

    for step in (1, 2, 3):
        save(step, keep=3)
    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(_Killed):
        save(4, keep=1)
    left = store.list_checkpoints(tmp_path)
    assert [store.checkpoint_step(p) for p in left][0] == 4
    for path in left:
        store.verify(path)


def test_background_writes_use_one_idle_ending_thread_and_the_state_at_the_step(tmp_path,
                                                                                monkeypatch):
    """Five background checkpoints in a row: written by one long-lived thread (not one
    started per checkpoint), which ends once idle; each file holds the state as it was at
    its step, though training changed it (a list of ints here, as the data state's sample
    order, which the copy keeps by value) while the thread wrote."""
    import threading

    from mpi4py import MPI

    from hpcpar.run.checkpoint_writer import CheckpointWriter

    writer = CheckpointWriter(tmp_path, MPI.COMM_SELF, keep=5, background=True)
    writer._writes.idle = writer._finishes.idle = 3.0   # > a step here, even on a busy host
    order, weight, started = [7, 7], torch.zeros(3), []
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start",
                        lambda thread: (started.append(thread.name), start(thread))[1])
    for step in range(1, 6):
        weight += 1
        order.append(step)
        writer.save(step, model_state={"w": weight.clone()}, trainer_state={"seen": order},
                    rank_state={"data": {"order": order}}, info={"grid": "1x1x1x1"})
        order.append(-step)     # the next step changes the state the writer holds a copy of
        writer.poll()
    writer.flush()
    assert len(started) <= 2, f"a thread started per checkpoint: {started}"
    for step in range(1, 6):
        path = tmp_path / store.step_dir_name(step)
        store.verify(path)
        data = torch.load(path / store.rank_file(0), weights_only=True)["data"]["order"]
        assert data == [7, 7, *[v for s in range(1, step) for v in (s, -s)], step], data
        assert torch.equal(torch.load(path / "model.pt", weights_only=True)["w"],
                           torch.full((3,), float(step)))
    end = time.monotonic() + 30
    while [t for t in threading.enumerate() if t.name.startswith("hpcpar-ckpt")]:
        assert time.monotonic() < end, "the writer's threads outlive their idle time"
        time.sleep(0.1)
