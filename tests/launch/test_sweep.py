"""``hpcpar sweep``: grid rule, validation, plumbing (with stand-in runs), a real tiny sweep."""

import json
import re
import sys
from pathlib import Path

import pandas as pd
import pytest

from hpcpar.errors import ConfigError
from hpcpar.launch import sweep as sweep_cmd
from hpcpar.launch.sweep import parse_ranks, plan, point_grid

DEMO = Path(__file__).resolve().parents[2] / "jobs" / "demo-cosmoflow.toml"


def test_point_grid_rule():
    assert point_grid((2, 2, 1, 1), 1) == (1, 1, 1, 1)
    assert point_grid((2, 2, 1, 1), 2) == (1, 2, 1, 1)
    assert point_grid((2, 2, 1, 1), 8) == (4, 2, 1, 1)
    assert point_grid((2, 2, 1, 1), 3) == (3, 1, 1, 1)
    assert point_grid((1, 2, 2, 2), 4) == (1, 2, 2, 1)   # the largest axis shrinks first
    assert point_grid((1, 4, 2, 1), 2) == (1, 2, 1, 1)
    assert point_grid((-1, 3, 1, 1), 6) == (2, 3, 1, 1)
    assert point_grid((-1, -1, 1, 1), 4) == (4, 1, 1, 1)  # a -1 spatial axis counts as 1
    assert parse_ranks("4,1,2,2") == [1, 2, 4]
    for bad in ("", "a,b", "0,2"):
        with pytest.raises(ConfigError, match="--ranks"):
            parse_ranks(bad)


def test_plan_validates_every_point_first():
    points = plan(str(DEMO), [1, 2, 4], False, ())
    assert [p["grid"] for p in points] == ["1x1x1x1", "1x2x1x1", "2x2x1x1"]
    weak = plan(str(DEMO), [1, 2, 4], True, ("train.global_batch=2",))
    assert [p["sets"][-1] for p in weak] == [f"train.global_batch={b}" for b in (2, 4, 8)]
    with pytest.raises(ConfigError, match=r"point 3 ranks \(grid 3x1x1x1\).*global_batch: 8 "
                                         r"does not split over 3"):
        plan(str(DEMO), [1, 3], False, ("train.global_batch=8",))
    with pytest.raises(ConfigError, match="--weak: global batch 3 x 3/2 ranks is not an integer"):
        plan(str(DEMO), [2, 3], True, ("train.global_batch=3",))
    assert sweep_cmd.submit_command("j.toml", "d", [1, 2], False, ("a.b=1",))[3:] == [
        "submit", "j.toml", "--out", "d", "--ranks", "1,2", "--report", "--set", "a.b=1"]


def test_weak_submit_passes_through(run_cli, monkeypatch):
    """``sweep --weak --submit`` hands the sweep, --weak included, to ``hpcpar submit``."""
    seen = []

    class Done:
        returncode = 0

    def fake_run(cmd, *args, **kwargs):
        seen.append(cmd)
        return Done()

    monkeypatch.setattr(sweep_cmd.subprocess, "run", fake_run)
    rc, _, err = run_cli(["sweep", str(DEMO), "--ranks", "1,2", "--out", "d", "--weak",
                          "--submit", "--set", "train.global_batch=2"])
    assert rc == 0, err
    assert seen and seen[0][3:] == ["submit", str(DEMO), "--out", "d", "--ranks", "1,2",
                                    "--report", "--weak", "--set", "train.global_batch=2"]


def test_sweep_plumbing_with_stand_in_runs(tmp_path, run_cli, monkeypatch):
    """Each point's command is a stand-in writing synthetic records (fails at 4 ranks)."""
    def fake(job, point, run_dir, resume=False):
        n = point["ranks"]
        code = (f"from hpcpar.analysis import synthetic_run; import sys; "
                f"synthetic_run({str(run_dir)!r}, grid=(1, {n}, 1, 1), steps=4, "
                f"t_step={8.0 / n}, status={'running' if n == 4 else 'ok'!r}); "
                f"print('stand-in'); sys.exit({3 if n == 4 else 0})")
        return [sys.executable, "-c", code]

    monkeypatch.setattr(sweep_cmd, "run_command", fake)
    out = tmp_path / "sw"
    rc, stdout, err = run_cli(["sweep", str(DEMO), "--ranks", "1,2,4", "--out", str(out)])
    assert rc == 2 and "point(s) 4 failed" in err and "exit code 3" in err
    assert "stand-in" in err  # the failed point's log tail
    assert (out / "ranks-2.log").read_text() == "stand-in\n"
    table = pd.read_csv(out / "report" / "scaling.csv").set_index("ranks")
    assert table.loc[2, "speedup"] == 2.0 and table.loc[4, "partial"]
    assert f"report: {out / 'report' / 'report.html'}" in stdout
    assert re.search(r"\| synthetic +\| 2 +\| 1x2x1x1 +\| 4 +\|", stdout)
    plan_file = json.loads((out / "sweep.json").read_text())
    assert [p["grid"] for p in plan_file["points"]] == ["1x1x1x1", "1x2x1x1", "2x2x1x1"]
    rc, _, err = run_cli(["sweep", str(DEMO), "--ranks", "1,3", "--out", str(out)])
    assert rc == 2 and err.count("\n") == 1 and "does not split over 3" in err


@pytest.mark.slow
def test_real_sweep_end_to_end(tmp_path, run_cli):
    """1, 2, 4 ranks of a tiny CosmoFlow (16^3, 5 steps): records, report, plots, numbers."""
    out = tmp_path / "sweep"
    sets = ["train.steps=5", "data.size=16", "data.samples=16", "data.val_samples=8",
            "train.global_batch=8",
            f"data.path={tmp_path / 'data'}", "train.val_every=0", "checkpoint.every=0"]
    args = ["sweep", str(DEMO), "--ranks", "1,2,4", "--out", str(out)]
    for s in sets:
        args += ["--set", s]
    rc, stdout, err = run_cli(args)
    assert rc == 0, err + stdout
    assert f"report: {out / 'report' / 'report.html'}" in stdout
    table = pd.read_csv(out / "report" / "scaling.csv").set_index("ranks")
    assert list(table.index) == [1, 2, 4] and not table["partial"].any()
    assert list(table["grid"]) == ["1x1x1x1", "1x2x1x1", "2x2x1x1"]
    T = {}
    for p in (1, 2, 4):
        meta = json.loads((out / f"ranks-{p}" / "meta.json").read_text())
        assert meta["status"] == "ok" and meta["ranks"] == p
        steps = pd.read_parquet(out / f"ranks-{p}" / "steps.parquet")
        assert sorted(steps["rank"].unique()) == list(range(p))
        per_step = steps[steps["step"] >= 1].groupby("step")["t_step"].max()  # warm-up: 1
        T[p] = per_step.median()
        assert table.loc[p, "t_step_median"] == pytest.approx(T[p], rel=1e-12)
        assert table.loc[p, "steps"] == 4
        assert table.loc[p, "throughput"] == pytest.approx((8 / per_step).median(), rel=1e-12)
        assert re.search(rf"\| demo-cosmoflow +\| {p} +\|", stdout)
    for p in (2, 4):
        assert table.loc[p, "speedup"] == pytest.approx(T[1] / T[p], rel=1e-12)
        assert table.loc[p, "efficiency"] == pytest.approx(T[1] / (p * T[p]), rel=1e-12)
    for name in ("speedup", "efficiency", "breakdown", "throughput", "imbalance"):
        assert (out / "report" / f"{name}.png").stat().st_size > 15_000
    assert (out / "report" / "report.html").stat().st_size > 100_000  # plots embedded


@pytest.mark.parametrize("text", ["١,2", "99999999999", "0,2", "2,x", ""])
def test_rank_lists_take_ascii_counts_only(text):
    """int() takes other scripts' digits and any length; --ranks must not."""
    with pytest.raises(ConfigError, match="--ranks"):
        parse_ranks(text)
    assert parse_ranks(" 4,1,2,2") == [1, 2, 4]
