"""Slurm client commands retried on transient failures, never on a rejection (issue 32), and
the submit hint safe to paste into a shell (issue 35). The Slurm commands are real processes:
scripts on PATH that fail the first N calls with Slurm's own messages, then answer."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hpcpar.errors import LaunchError
from hpcpar.launch.slurmcmd import run_slurm

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "jobs" / "demo-cosmoflow.toml")
UNREACHABLE = ("sbatch: error: Batch job submission failed: Unable to contact slurm controller "
               "(connect failure)")
TIMED_OUT = "slurm_load_jobs error: Socket timed out on send/recv operation"
REJECTED = "sbatch: error: Batch job submission failed: Invalid partition name specified"


def _flaky(bin_dir: Path, name: str, failures: int, message: str, answer: str = "") -> Path:
    """``bin_dir/name``: fails its first ``failures`` calls with ``message`` (exit 1, as Slurm's
    clients do), then prints ``answer``; each call's arguments go to ``bin_dir/name.calls``."""
    bin_dir.mkdir(exist_ok=True)
    calls = bin_dir / f"{name}.calls"
    script = bin_dir / name
    script.write_text(f"""#!/bin/bash
echo "$*" >> {shlex.quote(str(calls))}
if [ "$(wc -l < {shlex.quote(str(calls))})" -le {failures} ]; then
    echo {shlex.quote(message)} >&2; exit 1
fi
printf '%s\\n' {shlex.quote(answer)}
""")
    script.chmod(0o755)
    return calls


def _calls(calls: Path) -> int:
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def _hpcpar(args, path_first: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{path_first}:{os.environ['PATH']}"}
    return subprocess.run([str(Path(sys.executable).with_name("hpcpar")), *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def test_submit_retries_an_unreachable_controller_not_a_rejection(tmp_path):
    """Twice unreachable, then accepted: submitted (three sbatch calls). Rejected: one call,
    one line. The hint printed after submitting is a command safe to paste into a shell."""
    rejecting = _flaky(tmp_path / "no", "sbatch", 99, REJECTED)
    proc = _hpcpar(["submit", DEMO, "--out", str(tmp_path / "no" / "s"), "--ranks", "1"],
                   tmp_path / "no", tmp_path)
    assert proc.returncode == 2 and _calls(rejecting) == 1
    assert proc.stderr.splitlines() == [f"hpcpar: error: sbatch {tmp_path}/no/s/slurm/"
                                        f"ranks-1.sbatch failed: {REJECTED}"]

    bin_dir = tmp_path / "bin"
    sbatch = _flaky(bin_dir, "sbatch", 2, UNREACHABLE, "4242;cluster")
    scontrol = _flaky(bin_dir, "scontrol", 2, TIMED_OUT,
                      "JobId=4242 JobState=RUNNING Reason=None ExitCode=0:0 Restarts=0 "
                      "RunTime=00:00:05 NodeList=n1")
    out = tmp_path / "sweep $(touch pwned) 'q'"
    proc = _hpcpar(["submit", DEMO, "--out", str(out), "--ranks", "1"], bin_dir, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _calls(sbatch) == 3 and proc.stdout.startswith("4242\tranks-1\t")
    hint = f"hpcpar: submitted; follow with `hpcpar status {shlex.quote(str(out))}`"
    assert proc.stderr.splitlines() == [hint]
    # the hint, pasted into a shell, shows the sweep and runs nothing else
    command = hint.split("`")[1]
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    shown = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert not (tmp_path / "pwned").exists()
    assert _calls(scontrol) == 3  # two timeouts, then the states
    assert "RUNNING" in shown.stdout and "4242" in shown.stdout


def test_sbatch_reply_timed_out_is_not_resubmitted(tmp_path):
    calls = _flaky(tmp_path / "bin", "sbatch", 99, "sbatch: error: " + TIMED_OUT.split(": ")[1])
    with pytest.raises(LaunchError, match=r"^sbatch's reply timed out \(sbatch: error: Socket "
                       r"timed out on send/recv operation\): the job may have been submitted; "
                       r"check `squeue --me` before submitting again$"):
        run_slurm([str(tmp_path / "bin" / "sbatch"), "x.sbatch"], delays=(0, 0))
    assert _calls(calls) == 1


def test_transient_failures_are_bounded(tmp_path):
    calls = _flaky(tmp_path / "bin", "squeue", 99, TIMED_OUT)
    with pytest.raises(LaunchError, match=r"failed 3 times on a transient Slurm error \(last: "
                       r"slurm_load_jobs error: Socket timed out"):
        run_slurm([str(tmp_path / "bin" / "squeue")], delays=(0, 0))
    assert _calls(calls) == 3
