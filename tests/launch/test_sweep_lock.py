"""Issue 35: two ``hpcpar sweep`` into one ``--out`` no longer clobber each other: the first
holds ``OUT/hpcpar.lock`` and the second fails at once with one line naming it, touching
nothing; a sweep never writes into a folder that is not a sweep's. Real CLI processes."""

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.cli_run import tiny_job_toml


def sweep_argv(*args):
    return [sys.executable, "-m", "hpcpar.cli", "sweep", *map(str, args)]


def snapshot(root) -> dict:
    root = Path(root)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.glob("*")) if p.is_file()}


def one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("hpcpar: error: "), err
    return lines[0]


def test_second_sweep_into_the_same_out_is_refused_at_once(tmp_path):
    (tmp_path / "job.toml").write_text(tiny_job_toml(data=1, x=1, steps="100000"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(sweep_argv("job.toml", "--ranks", "1", "--out", "sw"),
                                 cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
    try:
        end = time.monotonic() + 120
        while not (tmp_path / "sw" / "ranks-1.log").exists() and time.monotonic() < end:
            assert first.poll() is None, (tmp_path / "first.log").read_text()
            time.sleep(0.05)
        before = snapshot(tmp_path / "sw")
        assert "sweep.json" in before
        t0 = time.monotonic()
        second = subprocess.run(sweep_argv("job.toml", "--ranks", "1", "--out", "sw", "--set",
                                           "train.steps=3"),
                                cwd=tmp_path, capture_output=True, text=True, env=env,
                                timeout=120)
        took = time.monotonic() - t0
        assert second.returncode == 2, second.stderr
        line = one_error(second.stderr)
        assert f"sw: in use by another hpcpar sweep (pid {first.pid} on " in line, line
        assert line.endswith("wait for it, or use another --out"), line
        assert took < 30 and first.poll() is None  # refused without running a point
        after = snapshot(tmp_path / "sw")
        assert after["sweep.json"] == before["sweep.json"] and "hpcpar.lock" in after
        assert not any((tmp_path / "sw" / "ranks-1").glob("previous-*"))  # its run not moved
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()


def test_sweep_refuses_a_folder_that_is_not_a_sweep(tmp_path):
    (tmp_path / "job.toml").write_text(tiny_job_toml(data=1, x=1, steps="2"))
    (tmp_path / "results.csv").write_text("mine\n")
    before = snapshot(tmp_path)
    p = subprocess.run(sweep_argv("job.toml", "--ranks", "1", "--out", "."), cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert one_error(p.stderr) == (
        "hpcpar: error: --out .: not a sweep directory (it holds 'job.toml' and 1 more and no "
        "hpcpar-run.json, which hpcpar sweep writes); choose a new or empty directory")
    assert snapshot(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["job.toml",
                                                                             "results.csv"]


def test_a_jobs_json_or_a_lock_file_does_not_make_a_sweep_directory(tmp_path):
    """Issue 67: a user's ``jobs.json`` or a stray ``hpcpar.lock`` is no sweep's mark (only
    ``hpcpar-run.json`` a sweep wrote is): their ``report/`` stays untouched."""
    (tmp_path / "job.toml").write_text(tiny_job_toml(data=1, x=1, steps="2"))
    out = tmp_path / "mine"
    (out / "report").mkdir(parents=True)
    (out / "report" / "index.html").write_text("<p>my report</p>\n")
    (out / "jobs.json").write_text('{"jobs": "my cluster jobs"}\n')
    (out / "hpcpar.lock").write_text("")
    os.utime(out / "hpcpar.lock", (0, 0))    # an old (stale) lock
    before = snapshot(out) | snapshot(out / "report")
    p = subprocess.run(sweep_argv("job.toml", "--ranks", "1", "--out", "mine"), cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert one_error(p.stderr) == (
        "hpcpar: error: --out mine: not a sweep directory (it holds 'hpcpar.lock' and 2 more "
        "and no hpcpar-run.json, which hpcpar sweep writes); choose a new or empty directory")
    assert snapshot(out) | snapshot(out / "report") == before
    assert sorted(os.listdir(out)) == ["hpcpar.lock", "jobs.json", "report"]
