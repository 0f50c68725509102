"""Faults a careful user meets with ``hpcpar run``, each driven through the real CLI on 2 ranks
with a tiny job (16^3 synthetic volumes, a few steps): the exit code, the one-line message (no
traceback) and that nothing the user had in the run directory changed or was lost.

* divergence: a NaN loss on ONE rank stops every rank at that step (exit 4, status "diverged",
  the last finite checkpoint kept, no NaN checkpoint); ``on_nonfinite = "skip"`` skips it;
* run directory: the default is ``runs/<job name>``; the same command after the end changes
  nothing (exit 0); changed settings are refused naming the keys; a busy directory is refused;
  a stale lock is taken over; ``--fresh`` moves the old files aside, deleting nothing;
* checkpoints: Ctrl-C checkpoints (exit 3, no KeyboardInterrupt), a second Ctrl-C exits at
  once (130, status not "running"); a corrupt newest checkpoint is kept aside (warned once) and
  the launcher names the step the ranks really resumed from; another optimizer or model is one
  line;
  no valid checkpoint left is exit 2 naming them; a killed rank is exit 1 (as documented).

Fault injection: a ``sitecustomize`` on PYTHONPATH registers the kind ``cosmoflow-fault``, whose
forward returns a NaN loss on one rank at one step (``FAULT_NAN_AT=step:rank``) or sleeps
(``FAULT_SLEEP_S``); the CLI and the ranks all see it.
"""

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from hpcpar.run.checkpoint import store
from tests.support.cli_run import CliRun, rank_pids, tiny_job_toml, tree_hashes

JOB = tiny_job_toml(data=2, x=1, kind="{kind}", steps="{steps}",
                    train='on_nonfinite = "{on_nonfinite}"', checkpoint="every = {every}\nkeep = 3")

SITECUSTOMIZE = '''
import os
if os.environ.get("FAULT_KIND"):
    import time

    from hpcpar.run.workloads.base import register_workload
    from hpcpar.run.workloads.volume import CosmoFlowWorkload

    @register_workload("cosmoflow-fault")
    class Fault(CosmoFlowWorkload):
        """CosmoFlow with a NaN loss on one rank at one step of this process
        (FAULT_NAN_AT=step:rank), or a slow forward (FAULT_SLEEP_S)."""

        def forward_loss(self, model, batch):
            time.sleep(float(os.environ.get("FAULT_SLEEP_S", "0")))
            res = super().forward_loss(model, batch)
            self.calls = getattr(self, "calls", 0) + 1
            step, rank = map(int, os.environ.get("FAULT_NAN_AT", "0:0").split(":"))
            if self.calls == step and self.grid.rank == rank:
                res.loss = res.loss * float("nan")
                res.loss_value = float("nan")
            return res
'''


def write_job(tmp: Path, name="tiny.toml", kind="cosmoflow", steps=8, every=2,
              on_nonfinite="stop") -> Path:
    path = tmp / name
    path.write_text(JOB.format(kind=kind, steps=steps, every=every, on_nonfinite=on_nonfinite))
    return path


class Run(CliRun):
    """``hpcpar run JOB -n 2 ARGS`` with ``tmp`` as the working directory."""

    def __init__(self, tmp: Path, job: Path, *args: str, env: dict | None = None):
        super().__init__([job, "-n", "2", *args], tmp / f"out-{time.monotonic_ns()}.txt",
                         cwd=tmp, env=env)

def run(tmp, job, *args, env=None, timeout=120.0) -> tuple[int, str]:
    r = Run(tmp, job, *args, env=env)
    rc = r.finish(timeout)
    return rc, r.log()


def error_lines(log: str) -> list[str]:
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    return [line for line in log.splitlines() if line.startswith("hpcpar: error:")]


def meta(d: Path) -> dict:
    return json.loads((d / "meta.json").read_text())


def steps_of(d: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in store.list_checkpoints(d / "checkpoints")]


def rows(d: Path) -> int:
    f = d / "records" / "rank-00000.csv"
    return sum(1 for line in f.read_text().splitlines() if line[:1].isdigit()) if f.exists() \
        else 0


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def finite_weights(step_dir: Path) -> bool:
    sd = torch.load(step_dir / "model.pt", weights_only=True)
    return all(bool(torch.isfinite(v).all()) for v in sd.values() if v.is_floating_point())


@pytest.fixture
def fault_env(tmp_path):
    """Environment that makes the kind ``cosmoflow-fault`` exist (CLI and ranks)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join([str(site)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return {"PYTHONPATH": path, "FAULT_KIND": "1"}


def test_divergence_stop_and_skip(tmp_path, fault_env):
    # stop (default): NaN loss on rank 1 at step 5 -> every rank stops there, exit 4
    fault_env = dict(fault_env, FAULT_NAN_AT="5:1")
    job = write_job(tmp_path, kind="cosmoflow-fault")
    rc, log = run(tmp_path, job, "--run-dir", "stop", env=fault_env)
    d = tmp_path / "stop"
    assert rc == 4, log
    (line,) = error_lines(log)
    assert "diverged at step 5/8" in line and "non-finite loss on rank 1" in line, line
    assert "last finite checkpoint step-000004 kept" in line, line
    m = meta(d)
    assert m["status"] == "diverged" and m["diverged"]["step"] == 5, m
    assert steps_of(d) == [4, 2]                    # nothing written at or after the NaN
    store.verify(d / "checkpoints" / "step-000004")
    assert finite_weights(d / "checkpoints" / "step-000004")
    assert not (d / "metrics.json").exists()        # no results claimed for a diverged run

    # skip: the same NaN skips one optimizer step, counted; the run finishes
    job = write_job(tmp_path, "skip.toml", kind="cosmoflow-fault", on_nonfinite="skip")
    rc, log = run(tmp_path, job, "--run-dir", "skip", env=fault_env)
    d = tmp_path / "skip"
    assert rc == 0, log
    assert not error_lines(log)
    assert "step 5/8: non-finite loss on rank 1 and non-finite gradient on ranks 0, 1: " \
        "optimizer step skipped (1 skipped so far)" in log, log
    metrics = json.loads((d / "metrics.json").read_text())
    assert metrics["skipped_steps"] == 1 and metrics["steps"] == 8
    assert meta(d)["status"] == "ok" and meta(d)["skipped_steps"] == 1
    assert all(finite_weights(p) for p in store.list_checkpoints(d / "checkpoints"))
    assert "nan" not in (d / "metrics.json").read_text().lower()


def test_run_directory_ownership(tmp_path):
    job = write_job(tmp_path, steps=4, every=2)
    d = tmp_path / "runs" / "tiny"                  # the default: stable, no timestamp
    rc, log = run(tmp_path, job)
    assert rc == 0, log
    assert d.is_dir() and meta(d)["status"] == "ok" and not (d / "hpcpar.lock").exists()
    before = tree_hashes(d)

    # the same command again: finished, nothing to do, nothing touched
    rc, log = run(tmp_path, job)
    assert rc == 0, log
    assert "already finished" in log and "nothing to do" in log, log
    assert tree_hashes(d) == before

    # changed settings: refused naming the keys, nothing touched
    rc, log = run(tmp_path, job, "--set", "train.lr=0.1", "--set", "train.optimizer=sgd")
    assert rc == 2, log
    (line,) = error_lines(log)
    assert "settings differ" in line and "train.lr 0.003 -> 0.1" in line, line
    assert 'train.optimizer "adam" -> "sgd"' in line and "--fresh" in line, line
    assert tree_hashes(d) == before

    # --new-settings: continue with them (a new segment); the old job.json is kept
    rc, log = run(tmp_path, job, "--new-settings", "--set", "train.steps=6")
    assert rc == 0, log
    assert "the ranks resumed from step-000004 (step 4)" in log, log
    assert json.loads((d / "job.json").read_text())["job"]["train"]["steps"] == 6
    (kept,) = d.glob("job-*[0-9].json")
    assert json.loads(kept.read_text())["job"]["train"]["steps"] == 4
    assert json.loads(kept.with_suffix(".metrics.json").read_text())["steps"] == 4
    assert json.loads((d / "metrics.json").read_text())["steps"] == 6
    assert not (d / "job.next.json").exists() and len(meta(d)["segments"]) == 2
    before = tree_hashes(d)

    # busy: a live holder (this test process) -> refused with one line, nothing touched
    start = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19]
    lock = d / "hpcpar.lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                "pid_start": start, "since": "earlier"}))
    rc, log = run(tmp_path, job, "--fresh")
    assert rc == 2, log
    (line,) = error_lines(log)
    assert f"in use by another hpcpar run (pid {os.getpid()}" in line, line
    assert tree_hashes(d) == before and lock.exists()

    # stale (its pid is gone): taken over with a warning; --fresh moves, never deletes
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid,
                                "since": "earlier"}))
    rc, log = run(tmp_path, job, "--fresh")
    assert rc == 0, log
    assert "taking over a stale lock" in log and "--fresh: moved the previous run's files" in log
    (previous,) = d.glob("previous-*")
    assert {f"{previous.name}/{k}": v for k, v in before.items()
            if k != "hpcpar-run.json"}.items() <= tree_hashes(d).items()  # the mark stays
    assert meta(d)["status"] == "ok" and len(meta(d)["segments"]) == 1
    assert not lock.exists()


def test_checkpoint_faults(tmp_path, fault_env):
    job = write_job(tmp_path, kind="cosmoflow-fault", steps=400, every=2)
    d = tmp_path / "c"

    # Ctrl-C (SIGINT to the CLI's process group, as a terminal sends it): checkpoint, exit 3
    r = Run(tmp_path, job, "--run-dir", "c", env=fault_env)
    assert r.wait_until(lambda: rows(d) >= 5), r.log()
    os.killpg(r.proc.pid, signal.SIGINT)
    rc = r.finish()
    assert rc == 3, r.log()
    assert not error_lines(r.log()) and "stopped by signal after checkpointing" in r.log()
    assert meta(d)["status"] == "preempted"
    newest, older = steps_of(d)[:2]
    assert newest >= 5 and older < newest

    # corrupt newest: kept aside as .corrupt (one warning), resume from the one before it,
    # the launcher names that step; then Ctrl-C twice during a (slow) step: out at once,
    # without a checkpoint, status not "running"
    corrupt(d / "checkpoints" / store.step_dir_name(newest) / "model.pt")
    r = Run(tmp_path, job, "--run-dir", "c", env=dict(fault_env, FAULT_SLEEP_S="1"))
    assert r.wait_until(lambda: len(meta(d)["segments"]) == 2
                        and meta(d)["segments"][-1]["first_step"] is not None), r.log()
    os.killpg(r.proc.pid, signal.SIGINT)
    time.sleep(0.2)
    t0 = time.monotonic()
    os.killpg(r.proc.pid, signal.SIGINT)
    rc = r.finish(timeout=30)
    assert time.monotonic() - t0 < 5
    log = r.log()
    assert rc == 130, log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert "interrupted twice" in log
    assert log.count("skipping corrupt checkpoint") == 1, log
    assert f"the ranks resumed from {store.step_dir_name(older)} (step {older})" in log, log
    assert (d / "checkpoints" / f"{store.step_dir_name(newest)}.corrupt" / "model.pt").exists()
    assert meta(d)["status"] == "failed"

    # another optimizer or model (settings accepted with --new-settings): one line, nothing
    # changed
    before = tree_hashes(d)
    rc, log = run(tmp_path, job, "--run-dir", "c", "--new-settings",
                  "--set", "train.optimizer=sgd", env=fault_env)
    assert rc == 2, log
    (line,) = error_lines(log)
    assert "written with optimizer 'adam', this run uses 'sgd'" in line, line
    assert tree_hashes(d) == before
    rc, log = run(tmp_path, job, "--run-dir", "c", "--new-settings",
                  "--set", "model.base_filters=8", env=fault_env)
    assert rc == 2, log
    assert len(error_lines(log)) == 1, log
    (line,) = error_lines(log)
    assert "checkpoint model state does not fit this model" in line, line
    assert tree_hashes(d) == before

    # every checkpoint corrupt: exit 2 naming them, never a restart; nothing renamed/rotated
    for p in store.list_checkpoints(d / "checkpoints"):
        corrupt(p / "trainer.pt")
    before = tree_hashes(d)
    rc, log = run(tmp_path, job, "--run-dir", "c", env=fault_env)
    assert rc == 2, log
    (line,) = error_lines(log)
    assert "no valid checkpoint to resume from" in line, line
    assert all(store.step_dir_name(s) in line for s in steps_of(d)), line
    assert tree_hashes(d) == before


def test_killed_rank_exits_1_as_documented(tmp_path):
    job = write_job(tmp_path, steps=400, every=0)
    d = tmp_path / "k"
    r = Run(tmp_path, job, "--run-dir", str(d))
    try:
        assert r.wait_until(lambda: rows(d) >= 2), r.log()
        pids = rank_pids(d)
        assert len(pids) == 2, pids
        os.kill(pids[-1], signal.SIGKILL)
        rc = r.proc.wait(timeout=60)
    finally:
        r.stop()
    assert rc == 1, r.log()
    (line,) = error_lines(r.log())
    assert "the ranks failed (launcher exit code 9)" in line, line
    assert meta(d)["status"] == "failed" and not (d / "hpcpar.lock").exists()


def test_lock_of_an_earlier_slurm_incarnation_is_stale(tmp_path, monkeypatch):
    """A requeued Slurm job may restart on another node: its own earlier lock is stale there,
    another job's lock from another host is not."""
    from hpcpar.errors import RunDirError
    from hpcpar.formats.rundir import RunLock

    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    holder = {"host": "elsewhere", "pid": 1, "slurm_job": "77", "slurm_restart": "0"}
    (tmp_path / "hpcpar.lock").write_text(json.dumps(holder))
    warned = []
    lock = RunLock(tmp_path, warn=warned.append)
    lock.acquire()
    assert len(warned) == 1 and "stale lock" in warned[0]
    assert json.loads((tmp_path / "hpcpar.lock").read_text())["slurm_restart"] == "1"
    lock.release()
    assert not (tmp_path / "hpcpar.lock").exists()
    (tmp_path / "hpcpar.lock").write_text(json.dumps(dict(holder, slurm_job="78")))
    with pytest.raises(RunDirError, match="pid 1 on elsewhere .*another host"):
        RunLock(tmp_path).acquire()
