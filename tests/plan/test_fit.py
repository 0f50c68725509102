"""Fitting the planner to measured runs (``hpcpar plan --fit-on``): the factor per rank
count, its nearest-count fallback, the scaled steps, and the CLI on a real run directory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hpcpar.plan.fit import apply, ratios, scale
from hpcpar.plan.machine import Link, Machine
from hpcpar.plan.planner import Layer, Workload, plan, predict

M = Machine(name="t", ranks_per_node=4, flops=1e10, mem_bw=1e10, mem_per_rank=8e9,
            io_bw=1e9, intra=Link(1e-6, 1e10), inter=Link(1e-6, 1e9))


def _work():
    relu = Layer("pointwise", True, (4, 8, 8, 8), (4, 8, 8, 8), 0)
    return Workload("w", [relu], (4, 8, 8, 8), global_batch=4)


def test_factor_per_rank_count_and_nearest():
    w = _work()
    p1, p2 = (predict(w, g, M).t_step for g in ((1, 1, 1, 1), (2, 1, 1, 1)))
    table = ratios([(w, (1, 1, 1, 1), 2 * p1), (w, (1, 1, 1, 1), 4 * p1),
                    (w, (2, 1, 1, 1), 1.5 * p2)], M)
    assert sorted(table) == [1, 2]
    assert scale(table, 1) == pytest.approx(3.0)        # the median of that count's runs
    assert scale(table, 2) == pytest.approx(1.5)
    assert scale(table, 8) == pytest.approx(1.5)        # nearest count that ran
    assert scale({1: [2.0], 3: [4.0]}, 2) == 2.0        # a tie: the smaller count
    assert scale({}, 4) == 1.0
    preds = plan(w, 2, M)
    before = {p.grid: p.t_step for p in preds}
    apply(preds, 1.5)
    assert all(p.t_step == pytest.approx(1.5 * before[p.grid]) for p in preds if p.feasible)


def test_cli_fit_on_a_run_directory(tmp_path):
    job = tmp_path / "j.toml"
    job.write_text('[job]\nname = "fit"\n[grid]\ndata = 1\n[model]\nkind = "cosmoflow"\n'
                   'n_conv_blocks = 1\nbase_filters = 2\ndense = [8]\n[data]\n'
                   'source = "synthetic"\nsize = 8\nchannels = 1\nsamples = 8\n[train]\n'
                   'steps = 6\nglobal_batch = 2\n[checkpoint]\nevery = 0\nat_end = false\n')
    run = tmp_path / "run"
    cli = [sys.executable, "-m", "hpcpar.cli"]
    subprocess.run([*cli, "run", str(job), "-n", "1", "--run-dir", str(run)], check=True,
                   capture_output=True, timeout=300)
    plain = json.loads(subprocess.run([*cli, "plan", str(job), "-n", "1", "--json"],
                                      check=True, capture_output=True, text=True).stdout)
    fitted = json.loads(subprocess.run([*cli, "plan", str(job), "-n", "1", "--json",
                                        "--fit-on", str(run)], check=True,
                                       capture_output=True, text=True).stdout)
    f = fitted["fit_scale"]
    assert f > 0 and "fit_scale" not in plain
    # the run itself is then predicted at its measured step
    from hpcpar.analysis import load, scaling_table

    measured = float(scaling_table(*load([str(run)]))["t_step_median"].iloc[0])
    assert fitted["grids"][0]["t_step"] == pytest.approx(measured, rel=1e-6)
    assert fitted["grids"][0]["t_step"] == pytest.approx(f * plain["grids"][0]["t_step"])
    bad = subprocess.run([*cli, "plan", str(job), "-n", "1", "--fit-on", str(tmp_path)],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "no job.json" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
