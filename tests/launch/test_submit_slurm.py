"""``hpcpar submit`` / ``status`` against a real single-node Slurm (hpcpar.testing.slurm).

Scheduling tests use a stub in place of ``python`` (no torch start-up) and the real rendered
scripts; the training tests run ``hpcpar run`` on the CosmoFlow demo shrunk by ``--set``.
Requeued jobs wait for a BeginTime Slurm sets (about two minutes); the tests move it to now.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hpcpar.launch.submit import sweep_status
from hpcpar.testing.slurm import (
    TINY_STEPS,
    read_argv,
    requeue_now,
    submit_job,
    tiny_job,
    usr1_then_resume,
    write_stub_python,
    write_test_job,
)

# slurm_cluster and shipped_profiles_only: fixtures of tests/conftest.py (hpcpar.testing.slurm)
pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("shipped_profiles_only")]

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "jobs" / "demo-cosmoflow.toml"
NASTY = """sp ace 'q' "dq" $(touch PWNED) `touch PWNED2` #c %j;&|<>*?~"""


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    d = tmp_path_factory.mktemp("slurm-jobs")
    return {"dir": d, "job": write_test_job(d / "cosmo.toml"),
            "python": str(write_stub_python(d / "python"))}


def test_quoting_on_slurm(slurm_cluster, sandbox):
    """Job name and paths with spaces, quotes, backslash, #, %, $(...) reach Slurm and the
    job literally; nothing is executed."""
    out = sandbox["dir"] / NASTY
    name = NASTY + " back\\slash"    # not in the path: Slurm's log patterns drop backslashes
    [rec] = submit_job(slurm_cluster, sandbox, out, ranks=[1], sets=[f"job.name={name}"])
    info = slurm_cluster.wait(rec["id"], 60)
    log = out / "slurm" / f"ranks-1-{rec['id']}.out"
    assert info["JobState"] == "COMPLETED", log.read_text() if log.exists() else info
    assert info["JobName"] == f"{name}-ranks-1"
    assert log.is_file() and "job step exited with 0" in log.read_text()
    argv = read_argv(out / "ranks-1" / "argv.0.0")
    assert argv[4:7] == ["--run-dir", str(out / "ranks-1"), "--resume"]
    assert argv[7:] == ["--grid", "1x1x1x1", "--set", f"job.name={name}"]
    for where in (REPO, sandbox["dir"], Path.cwd()):
        assert not (where / "PWNED").exists() and not (where / "PWNED2").exists()


def test_array_of_three_with_report(slurm_cluster, sandbox, monkeypatch, capsys, cli_main):
    out = sandbox["dir"] / "array"
    recs = submit_job(slurm_cluster, sandbox, out, ranks=[1, 2, 4], array=True, report=True)
    runs, report = recs[:3], recs[3]
    assert [r["id"] for r in runs] == [f"{runs[0]['array_job']}_{i}" for i in range(3)]
    assert report["dependency"] == f"afterany:{runs[0]['array_job']}"
    slurm_cluster.wait(report["id"], 90)
    rows = {r["label"]: r for r in sweep_status(out, env=slurm_cluster.env())}
    assert [rows[f"ranks-{n}"]["state"] for n in (1, 2, 4)] == ["COMPLETED"] * 3
    assert rows["report"]["state"] == "COMPLETED"
    for i, n in enumerate((1, 2, 4)):
        run = out / f"ranks-{n}"
        envs = [dict(line.split("=", 1) for line in (run / f"env.{r}.0").read_text().split())
                for r in range(n)]   # one file per rank: every rank started
        assert {e["SLURM_PROCID"] for e in envs} == {str(r) for r in range(n)}
        assert all(e["SLURM_NTASKS"] == str(n) and e["SLURM_ARRAY_TASK_ID"] == str(i)
                   and e["SLURM_CPUS_PER_TASK"] == "1" for e in envs)
    argv = read_argv(out / "report" / "argv.0.0")
    assert argv[2:] == ["report", *(str(out / f"ranks-{n}") for n in (1, 2, 4)),
                        "-o", str(out / "report"), "--force"]
    assert (out / "jobs.json").is_file() and (out / "slurm" / "array.sbatch").is_file()
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    cli_main(["status", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["JOBID", "LABEL", "RANKS", "STATE"] and len(lines) == 5
    assert all(" COMPLETED " in line for line in lines[1:]), lines


def test_dependency_chain(slurm_cluster, sandbox):
    """B runs after A succeeded; D, after a failing C, is cancelled (kill_invalid_depend)."""
    d = sandbox["dir"] / "chain"
    [a] = submit_job(slurm_cluster, sandbox, d / "a", ranks=[1])
    [b] = submit_job(slurm_cluster, sandbox, d / "b", ranks=[1], after=[a["id"]])
    [c] = submit_job(slurm_cluster, sandbox, d / "c", ranks=[1], sets=["job.name=fail"])
    [dd] = submit_job(slurm_cluster, sandbox, d / "d", ranks=[1], after=[c["id"]])
    assert b["dependency"] == f"afterok:{a['id']}"
    ia, ib = slurm_cluster.wait(a["id"], 60), slurm_cluster.wait(b["id"], 60)
    assert ia["JobState"] == ib["JobState"] == "COMPLETED"
    assert ib["StartTime"] >= ia["EndTime"]
    assert slurm_cluster.wait(c["id"], 60)["JobState"] == "FAILED"
    idd = slurm_cluster.wait(dd["id"], 60)
    assert idd["JobState"] == "CANCELLED" and not (d / "d" / "ranks-1").exists()
    [row] = sweep_status(d / "c", env=slurm_cluster.env())
    assert row["state"] == "FAILED" and row["exit"].startswith("1:")


def test_usr1_requeue_contract(slurm_cluster, sandbox):
    """USR1 to the batch shell -> forwarded to both ranks -> exit 3 -> scontrol requeue ->
    the restarted job (SLURM_RESTART_COUNT=1) completes."""
    out = sandbox["dir"] / "preempt"
    [rec] = submit_job(slurm_cluster, sandbox, out, ranks=[2], sets=["job.name=preempt"])
    run = out / "ranks-2"
    log = usr1_then_resume(slurm_cluster, rec, out, 60, lambda: (
        (run / "ready.0.0").exists() and (run / "ready.1.0").exists()))
    assert (run / "checkpointed.0.0").exists() and (run / "checkpointed.1.0").exists()
    assert (run / "argv.0.1").exists() and (run / "argv.1.1").exists()
    assert "forwarding to the job step" in log and "requeueing" in log
    [row] = sweep_status(out, env=slurm_cluster.env())
    assert row["state"] == "COMPLETED" and row["restarts"] == "1"


def test_time_limit_signal(slurm_cluster, sandbox):
    """Slurm itself sends --signal=B:USR1@55 near the 1-minute limit (its timer ticks about
    every 30 s): the job checkpoints, requeues itself and completes."""
    out = sandbox["dir"] / "timelimit"
    [rec] = submit_job(slurm_cluster, sandbox, out, ranks=[1], sets=["job.name=preempt"],
                    time="1", grace=55)
    requeue_now(slurm_cluster, rec["id"], timeout=90)
    info = slurm_cluster.wait(rec["id"], 60)
    log = (out / "slurm" / f"ranks-1-{rec['id']}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log
    assert (out / "ranks-1" / "checkpointed.0.0").exists() and "SIGUSR1" in log


# -- real training through sbatch -----------------------------------------------------------
@pytest.fixture(scope="module")
def reference_run(slurm_cluster, sandbox):
    """An uninterrupted 2-rank training job through sbatch (shared by the tests below)."""
    out = sandbox["dir"] / "train-ref"
    [rec] = submit_job(slurm_cluster, sandbox, out, job=DEMO, ranks=[2],
                    sets=tiny_job(sandbox["dir"] / "data"), python=sys.executable)
    info = slurm_cluster.wait(rec["id"], 180)
    log = out / "slurm" / f"ranks-2-{rec['id']}.out"
    assert info["JobState"] == "COMPLETED", log.read_text()
    return rec, out / "ranks-2"


def test_training_job_records(reference_run):
    rec, run = reference_run
    meta = json.loads((run / "meta.json").read_text())
    assert meta["ranks"] == 2 and meta["status"] == "ok" and meta["grid_spec"] == "2x1x1x1"
    assert rec["id"] in json.dumps(meta["slurm"])
    import pandas as pd

    steps = pd.read_parquet(run / meta["steps_file"])
    assert len(steps) == 2 * TINY_STEPS and set(steps["rank"]) == {0, 1}
    assert sorted(set(steps["step"])) == list(range(TINY_STEPS))
    assert json.loads((run / "metrics.json").read_text())["steps"] == TINY_STEPS


def test_training_requeue_resumes_identically(slurm_cluster, sandbox, reference_run):
    """USR1 mid-run -> checkpoint -> requeue -> resume: same final parameters as the
    uninterrupted run."""
    import torch

    out = sandbox["dir"] / "train-preempt"
    [rec] = submit_job(slurm_cluster, sandbox, out, job=DEMO, ranks=[2],
                    sets=tiny_job(sandbox["dir"] / "data"), python=sys.executable)
    run = out / "ranks-2"
    log = usr1_then_resume(slurm_cluster, rec, out, 180,
                            lambda: any((run / "checkpoints").glob("step-*")))
    meta = json.loads((run / "meta.json").read_text())
    assert len(meta["segments"]) == 2, log
    assert 0 < meta["segments"][1]["first_step"] < TINY_STEPS, log
    final = f"checkpoints/step-{TINY_STEPS:06d}/model.pt"
    mine = torch.load(run / final, weights_only=True)
    ref = torch.load(reference_run[1] / final, weights_only=True)
    assert mine.keys() == ref.keys()
    for k in ref:
        assert torch.equal(mine[k], ref[k]), k
