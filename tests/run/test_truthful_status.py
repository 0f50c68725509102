"""Issue 35 (items 4-5): meta.json never says "running" for a run that ended, and never "ok" for
a run that trained on nothing. Each case runs the real CLI (``hpcpar run``, one rank in-process
or two under mpiexec) on a tiny synthetic job and reads meta.json afterwards: a checkpoint on a
full disk (exit 2), a records directory that fills up (exit 2), a lost rank followed by
SIGTERM and SIGKILL (what Slurm does on a node failure), every step skipped as non-finite, and
steps that used no sample."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cli_run import CliRun, rank_pids
from tests.support.faults import can_mount

JOB = """[job]
name = "tiny"
[grid]
data = 1
x = 1
[model]
kind = "{kind}"
n_conv_blocks = 1
base_filters = 2
dense = [4]
[data]
source = "synthetic"
size = 4
samples = 4
[train]
steps = {steps}
global_batch = {batch}
lr = 1e-3
log_every = 1000
on_nonfinite = "skip"
[checkpoint]
at_end = true
"""

# kinds for the "trained on nothing" cases, registered in the CLI and the rank processes
SITECUSTOMIZE = '''
from hpcpar.run.workloads.base import register_workload
from hpcpar.run.workloads.volume import CosmoFlowWorkload


@register_workload("cosmoflow-nan")
class AlwaysNan(CosmoFlowWorkload):
    def forward_loss(self, model, batch):
        res = super().forward_loss(model, batch)
        res.loss = res.loss * float("nan")
        res.loss_value = float("nan")
        return res


@register_workload("cosmoflow-empty")
class NoSamples(CosmoFlowWorkload):
    def forward_loss(self, model, batch):
        res = super().forward_loss(model, batch)
        res.samples = 0
        return res
'''


def job_file(where: Path, kind="cosmoflow", steps=3, batch=1) -> Path:
    path = where / "job.toml"
    path.write_text(JOB.format(kind=kind, steps=steps, batch=batch))
    return path


def meta(run_dir: Path) -> dict:
    return json.loads((run_dir / "meta.json").read_text())


def one_error(err: str) -> str:
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("hpcpar: error: ")]
    assert len(errors) == 1, err
    return errors[0]


def hpcpar(cwd: Path, *args, mounts: str = "", env=None, timeout=180) -> tuple[int, str]:
    """(exit code, stderr) of ``hpcpar ARGS``; with ``mounts`` (shell lines) first run in a
    private mount namespace, invisible outside and gone with the process."""
    cmd = [sys.executable, "-m", "hpcpar.cli", *map(str, args)]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    if mounts:
        full_env["HPCPAR"] = subprocess.list2cmdline(cmd)
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", f"{mounts} && $HPCPAR"]
    p = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stderr




needs_mount = pytest.mark.skipif(not can_mount(), reason="needs root and mount namespaces")


@needs_mount
def test_checkpoint_on_a_full_disk_ends_failed(tmp_path):
    """Before: exit 2 with one line, but meta.json kept saying "running"."""
    job = job_file(tmp_path)
    (tmp_path / "rd" / "checkpoints").mkdir(parents=True)
    code, err = hpcpar(tmp_path, "run", job, "-n", "1", "--run-dir", "rd",
                       mounts="mount -t tmpfs -o size=8k hpcpar-full rd/checkpoints")
    assert code == 2
    line = one_error(err)
    assert "checkpoint rd/checkpoints/step-000003 failed" in line
    assert "No space left on device" in line
    m = meta(tmp_path / "rd")
    assert m["status"] == "failed" and m["end_time"], m
    assert m["end_reason"] == line.removeprefix("hpcpar: error: ")


@needs_mount
def test_records_on_a_full_disk_end_failed(tmp_path):
    job = job_file(tmp_path, steps=400)
    (tmp_path / "rd" / "records").mkdir(parents=True)
    code, err = hpcpar(tmp_path, "run", job, "-n", "1", "--run-dir", "rd",
                       mounts="mount -t tmpfs -o size=4k hpcpar-full rd/records")
    assert code == 2
    line = one_error(err)
    assert "cannot write step records (No space left on device)" in line
    m = meta(tmp_path / "rd")
    assert m["status"] == "failed" and "No space left on device" in m["end_reason"], m


def test_lost_rank_then_sigterm_and_sigkill_is_not_running(tmp_path):
    """A node failure as Slurm handles it: one rank is gone (stopped here), the other blocks in
    the step's allreduce, gets SIGTERM (no Python handler can run there), then SIGKILL. Before:
    meta.json said "running" forever."""
    job = job_file(tmp_path, steps=100000, batch=2)
    job.write_text(job.read_text().replace("data = 1", "data = 2"))
    d = tmp_path / "rd"
    run = CliRun([job, "-n", "2", "--run-dir", d], tmp_path / "out.txt", cwd=tmp_path)
    try:
        assert run.wait_until(lambda: (d / "meta.json").exists()
                              and meta(d)["segments"][-1]["first_step"] is not None), run.log()
        pids = rank_pids(d)
        assert len(pids) == 2, pids
        os.kill(pids[1], signal.SIGSTOP)           # the lost node
        time.sleep(1.0)                             # the other rank now waits in MPI
        os.kill(pids[0], signal.SIGTERM)            # srun/slurmstepd
        assert run.wait_until(lambda: meta(d)["status"] != "running", 30), (meta(d), run.log())
    finally:
        run.stop()                                  # SIGKILL, as after Slurm's KillWait
    m = meta(d)
    assert m["status"] == "preempted" and m["end_time"] is None, m
    assert m["end_reason"].startswith("SIGTERM received during step "), m


@pytest.fixture
def kinds_env(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {"PYTHONPATH": os.pathsep.join([str(site)] + [p for p in [os.environ.get(
        "PYTHONPATH")] if p])}


def test_every_step_skipped_is_not_ok(tmp_path, kinds_env):
    """Before: exit 0, status "ok" and a checkpoint, with nothing trained."""
    job = job_file(tmp_path, kind="cosmoflow-nan")
    code, err = hpcpar(tmp_path, "run", job, "-n", "1", "--run-dir", "rd", env=kinds_env)
    assert code == 4, err
    line = one_error(err)
    assert "all 3 optimizer steps were skipped for non-finite values" in line, line
    m = meta(tmp_path / "rd")
    assert m["status"] == "diverged" and "all 3 optimizer steps" in m["end_reason"], m
    assert not (tmp_path / "rd" / "metrics.json").exists()


def test_steps_without_samples_are_not_ok(tmp_path, kinds_env):
    job = job_file(tmp_path, kind="cosmoflow-empty")
    code, err = hpcpar(tmp_path, "run", job, "-n", "1", "--run-dir", "rd", env=kinds_env)
    assert code == 2, err
    line = one_error(err)
    assert line == ("hpcpar: error: cosmoflow-empty: 3 steps used no training sample or "
                    "vertex: nothing was trained (check [data] and the training mask)")
    m = meta(tmp_path / "rd")
    assert m["status"] == "failed" and m["end_reason"] == line.removeprefix("hpcpar: error: ")
