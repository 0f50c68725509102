"""Issue 32: a sweep on a loaded machine compares like for like, or says it does not.

A busy process per core (started here, killed at the end) makes the host the issue's busy
one. The 1/2-rank sweep of the tiny job must run both points with the same threads per rank
(meta.json machine facts: the 1-rank point ran in the launcher's process with torch's default
threads, all cores, before), record the host's load before and after each run, and never
report an efficiency above 1 without flagging it SUSPECT.
"""

import json
import math
import os
import subprocess
import sys

import pandas as pd

from tests.support.cli_run import tiny_job_toml


def _busy_cores() -> list[subprocess.Popen]:
    """One spinning process per core this test may run on."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in os.sched_getaffinity(0)]


def test_loaded_sweep_same_threads_per_rank_and_flagged(tmp_path):
    (tmp_path / "tiny.toml").write_text(tiny_job_toml(data=1, x=1, steps="6", checkpoint=(
        "every = 0\nat_end = false")))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                                             "NUMBA_NUM_THREADS")}
    busy = _busy_cores()
    try:
        proc = subprocess.run([sys.executable, "-m", "hpcpar.cli", "sweep", "tiny.toml",
                               "--ranks", "1,2", "-o", "sweep"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sweep = tmp_path / "sweep"
    metas = {p: json.loads((sweep / f"ranks-{p}" / "meta.json").read_text()) for p in (1, 2)}
    threads = {p: m["machine"]["threads_per_rank"] for p, m in metas.items()}
    assert threads == {1: 1, 2: 1}, threads    # the job's cpus_per_task = 1, at every point
    plan = json.loads((sweep / "sweep.json").read_text())
    assert [pt["threads"] for pt in plan["points"]] == [1, 1]
    for m in metas.values():
        load = m["host_load"]
        for when in ("before", "after"):
            assert len(load[when]) == 3 and all(math.isfinite(v) and v >= 0
                                                for v in load[when]), load
    table = pd.read_csv(sweep / "report" / "scaling.csv")
    for row in table.to_dict("records"):
        if row["efficiency"] > 1.0:
            flag = f"{row['config']} @ {row['ranks']} ranks: SUSPECT: speedup"
            assert str(row["suspect"]).startswith("SUSPECT: speedup"), row
            assert f"hpcpar: warning: {flag}" in proc.stderr, proc.stderr
        else:
            assert not isinstance(row["suspect"], str), row


def test_threads_option_pins_every_point(tmp_path, monkeypatch):
    """``--threads N``: every planned point, and the job each runs, has N threads per rank,
    whatever OMP_NUM_THREADS says (the sweep hands each point N; here planned only)."""
    from hpcpar.launch.sweep import plan

    job = tmp_path / "tiny.toml"
    job.write_text(tiny_job_toml(data=1, x=1))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert [p["threads"] for p in plan(str(job), [1, 2], False, ())] == [2, 2]
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert [p["threads"] for p in plan(str(job), [1, 2], False, ())] == [1, 1]
    assert [p["threads"] for p in plan(str(job), [1, 2], False, (), threads=3)] == [3, 3]


def test_dry_run_shows_the_threads_it_will_set(run_cli, tmp_path, monkeypatch):
    """``run --dry-run`` names the threads per rank: [resources] cpus_per_task, or
    OMP_NUM_THREADS when set (a bad value is one line, exit 2)."""
    job = tmp_path / "tiny.toml"
    job.write_text(tiny_job_toml(data=1, x=1))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    args = ["run", str(job), "-n", "1", "--run-dir", str(tmp_path / "r"), "--dry-run"]
    code, out, err = run_cli([*args, "--set", "resources.cpus_per_task=2"])
    assert code == 0, err
    assert "threads per rank: 2 (OMP_NUM_THREADS, torch)" in out.splitlines()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    code, out, err = run_cli([*args, "--json"])
    assert code == 0 and json.loads(out)["threads_per_rank"] == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    code, out, err = run_cli(args)
    assert code == 2 and err.splitlines() == [
        "hpcpar: error: OMP_NUM_THREADS='many': expected a positive integer (the threads of "
        "each rank), or unset it to use [resources] cpus_per_task"]
