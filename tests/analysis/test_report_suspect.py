"""``hpcpar report`` on records that cannot be taken at face value (issue 35): a run killed
before its first step, infinite / negative / zero step times, runs of different hpcpar
versions. Each gives a report that names what is missing or suspect, or one line with exit 2:
never a traceback, never a negative or infinite speedup. The runs are real (a 1- and 2-rank
sweep of the tiny job), then their records are edited the way the damage would leave them."""

import json
import math
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from hpcpar.formats.records import merge_records
from tests.support.cli_run import tiny_job_toml


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A real sweep of the tiny job at 1 and 2 ranks (ranks-1/, ranks-2/)."""
    root = tmp_path_factory.mktemp("suspect")
    (root / "tiny.toml").write_text(tiny_job_toml(data=1, x=1, steps="5", checkpoint=(
        "every = 0\nat_end = false")))
    proc = subprocess.run([sys.executable, "-m", "hpcpar.cli", "sweep", "tiny.toml", "--ranks",
                           "1,2", "-o", "sweep"], cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    return root / "sweep"


@pytest.fixture()
def runs(sweep, tmp_path):
    """A fresh copy of the sweep's two runs to damage."""
    copy = tmp_path / "runs"
    for p in (1, 2):
        shutil.copytree(sweep / f"ranks-{p}", copy / f"ranks-{p}")
    return copy


def _edit_steps(run, edit) -> pd.DataFrame:
    """Apply ``edit(rank's steps)`` in place to each rank's step file, merge them again as the
    run's end does, and return the merged steps."""
    for f in sorted((run / "records").glob("rank-*.csv")):
        steps = pd.read_csv(f)
        edit(steps)
        steps.to_csv(f, index=False)
    merge_records(run)
    return pd.read_parquet(run / "steps.parquet")


def _report(run_cli, path, out):
    code, stdout, stderr = run_cli(["report", str(path), "-o", str(out)])
    assert "Traceback" not in stdout + stderr
    return code, stdout, stderr


def _no_bad_speedup(out) -> pd.DataFrame:
    """The scaling table written, with every speedup either missing or finite and > 0."""
    table = pd.read_csv(out / "scaling.csv").set_index("ranks")
    for col in ("speedup", "efficiency", "speedup_lo", "speedup_hi", "throughput"):
        shown = table[col].dropna()
        assert all(math.isfinite(v) and v > 0 for v in shown), (col, table[col])
    return table


def test_run_killed_before_its_first_step_is_one_line(runs, run_cli, tmp_path):
    run = runs / "ranks-2"
    (run / "steps.parquet").unlink()
    for f in (run / "records").glob("rank-*.csv"):  # the header line, no step yet
        f.write_text(f.read_text().splitlines(True)[0])
    meta = json.loads((run / "meta.json").read_text())
    (run / "meta.json").write_text(json.dumps({**meta, "status": "running", "end_time": None}))
    code, stdout, stderr = _report(run_cli, run, tmp_path / "out")
    assert code == 2 and stdout == ""
    assert stderr.splitlines() == [
        "hpcpar: error: no step to report: tiny @ 2 ranks: ranks-2: status 'running' (crashed "
        "or still running); no step records; no records from rank(s) 0, 1"]
    assert not (tmp_path / "out").exists()
    # beside a run that has steps, it is a PARTIAL row of a report that is written
    code, stdout, _ = _report(run_cli, runs, tmp_path / "both")
    assert code == 0 and "PARTIAL tiny @ 2 ranks: ranks-2: status 'running'" in stdout
    assert math.isnan(_no_bad_speedup(tmp_path / "both").loc[2, "speedup"])


@pytest.mark.parametrize("value", [math.inf, -0.02, 0.0])
def test_impossible_step_times_are_left_out_and_named(runs, run_cli, tmp_path, value):
    def every_step(steps):
        steps["t_step"] = value * (steps["rank"] + 1)

    steps = _edit_steps(runs / "ranks-2", every_step)
    code, stdout, _ = _report(run_cli, runs, tmp_path / "out")
    assert code == 0
    assert (f"PARTIAL tiny @ 2 ranks: ranks-2: {steps['step'].nunique()} step(s) with an "
            f"impossible t_step ignored (first: step {steps['step'].iloc[0]} rank "
            f"{steps['rank'].iloc[0]} recorded t_step = {steps['t_step'].iloc[0]})"
            ) in stdout.splitlines()
    table = _no_bad_speedup(tmp_path / "out")
    assert math.isnan(table.loc[2, "speedup"]) and table.loc[1, "speedup"] == 1.0
    # the baseline itself impossible: the other point is not measured against it
    _edit_steps(runs / "ranks-1", every_step)
    code, _, stderr = _report(run_cli, runs, tmp_path / "none")
    assert code == 2 and len(stderr.splitlines()) == 1
    assert stderr.startswith("hpcpar: error: no step to report: tiny @ 1 ranks: ranks-1: ")


def test_one_infinite_step_leaves_the_others(runs, run_cli, tmp_path):
    def one_step(steps):
        steps.loc[(steps["step"] == 3) & (steps["rank"] == 1), "t_step"] = math.inf

    steps = _edit_steps(runs / "ranks-2", one_step)
    code, stdout, _ = _report(run_cli, runs, tmp_path / "out")
    assert code == 0
    assert ("PARTIAL tiny @ 2 ranks: ranks-2: 1 step(s) with an impossible t_step ignored "
            "(first: step 3 rank 1 recorded t_step = inf)") in stdout.splitlines()
    table = _no_bad_speedup(tmp_path / "out")
    kept = steps[(steps["step"] >= 1) & (steps["step"] != 3)].groupby("step")["t_step"].max()
    assert table.loc[2, "t_step_median"] == pytest.approx(kept.median(), rel=1e-12)
    base = pd.read_parquet(runs / "ranks-1" / "steps.parquet")
    T0 = base[base["step"] >= 1]["t_step"].median()
    assert table.loc[2, "speedup"] == pytest.approx(T0 / kept.median(), rel=1e-12)


def test_runs_of_different_versions_are_a_warning_line(runs, run_cli, tmp_path):
    # a plain speedup, whatever the host's load while the sweep ran: no SUSPECT line (a
    # superlinear point) beside the one this test is about
    t1 = pd.read_parquet(runs / "ranks-1" / "steps.parquet")["t_step"].median()
    _edit_steps(runs / "ranks-2", lambda steps: steps.__setitem__("t_step", 0.6 * t1))
    meta_path = runs / "ranks-2" / "meta.json"
    meta = json.loads(meta_path.read_text())
    mine = meta["versions"]["hpcpar"]
    meta["versions"]["hpcpar"] = "0.0.0.dev1"
    meta_path.write_text(json.dumps(meta))
    code, stdout, stderr = _report(run_cli, runs, tmp_path / "out")
    assert code == 0
    old, new = sorted([("0.0.0.dev1", "ranks-2"), (mine, "ranks-1")])
    line = (f"runs recorded by different hpcpar versions: {old[0]} (1 run(s): {old[1]}); "
            f"{new[0]} (1 run(s): {new[1]}); their step times may not time the same work")
    assert stderr.splitlines() == [f"hpcpar: warning: {line}"]
    assert f"Warning: {line}." in (tmp_path / "out" / "report.md").read_text()
    code, stdout, _ = run_cli(["report", str(runs), "-o", str(tmp_path / "j"), "--json"])
    assert code == 0 and json.loads(stdout)["warnings"] == [line]
    # one version: no warning
    meta["versions"]["hpcpar"] = mine
    meta_path.write_text(json.dumps(meta))
    code, _, stderr = _report(run_cli, runs, tmp_path / "same")
    assert code == 0 and stderr == ""
