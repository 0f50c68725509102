"""Scaling reports that cannot mislead (issue 18): every number below is recomputed here from
the step records (read with pandas / the CSV files directly), not taken from the analysis."""

import json
import math
import re
import sys

import numpy as np
import pandas as pd
import pytest

from hpcpar.analysis import load, scaling_table, synthetic_run
from hpcpar.formats import records
from hpcpar.testing import mpi_case


def _steps(run_dir, warmup=1):
    """The run's merged steps, read independently, warm-up steps dropped."""
    df = pd.read_parquet(run_dir / "steps.parquet")
    return df[df["step"] >= warmup]


def _sweep(root, times, steps=8, jitter=0.0, **kw):
    for p, t in times.items():
        grid = (max(1, p // 2), min(p, 2), 1, 1)
        synthetic_run(root / f"ranks-{p}", grid=grid, steps=steps,
                      t_step=lambda r, s, t=t: t * (1 + jitter * ((3 * s + r) % 4)), **kw)
    return root


# -- 1. honest phases ----------------------------------------------------------------------
def test_halo_split_recomputed_and_one_rank_has_no_communication(tmp_path):
    root = _sweep(tmp_path / "s", {1: 8.0, 2: 4.4, 4: 2.5}, cores_per_node=4)
    table = scaling_table(*load([root])).set_index("ranks")
    for p in (1, 2, 4):
        st = _steps(root / f"ranks-{p}")
        total = st["t_step"].sum()
        comm = st["t_halo_wait"].sum() / total
        local = (st["t_halo"] - st["t_halo_wait"]).sum() / total
        assert table.loc[p, "frac_halo_comm"] == pytest.approx(comm, rel=1e-12)
        assert table.loc[p, "frac_halo_local"] == pytest.approx(local, rel=1e-12)
        assert table.loc[p, "frac_halo"] == pytest.approx(st["t_halo"].sum() / total)
        assert table.loc[p, "t_halo_comm"] == pytest.approx(st["t_halo_wait"].mean())
        # the disjoint phases add up to the step
        parts = sum(table.loc[p, f"frac_{k}"] for k in ("compute", "halo_comm", "halo_local",
                                                       "comm_exposed", "io", "other"))
        assert parts == pytest.approx(1.0)
    assert table.loc[1, "frac_halo_comm"] == 0.0  # one rank: nothing to wait for
    assert table.loc[1, "bytes_halo_per_step"] == 0
    assert table.loc[2, "frac_halo_comm"] > 0


def test_unmeasured_phase_is_named_not_folded(tmp_path):
    rec = records.RunRecorder(tmp_path / "r", None, {"job_name": "nodata"})
    for s in range(6):  # no t_data, no t_halo_wait: the loop did not time them
        rec.step(step=s, t_step=1.0, t_fwd=0.3, t_bwd=0.4, t_opt=0.1, t_halo=0.1,
                 t_allreduce_exposed=0.0, samples=4)
    rec.finish()
    row = scaling_table(*load([tmp_path / "r"])).iloc[0]
    assert set(row["unmeasured"].split(",")) == {"io", "halo_comm", "halo_local"}
    assert math.isnan(row["frac_io"]) and math.isnan(row["frac_halo_comm"])
    assert row["frac_compute"] == pytest.approx(0.7)
    assert row["frac_other"] == pytest.approx(0.2)  # t_step minus the measured phases
    from hpcpar.analysis import plots
    from hpcpar.analysis.render import BREAKDOWN, _display, rows_of

    header, rows = rows_of(_display(pd.DataFrame([row])), BREAKDOWN)
    cells = dict(zip(header, rows[0]))
    assert cells["I/O wait"] == "unmeasured" and \
        cells[plots.PHASE_LABELS["halo_comm"]] == "unmeasured"


def test_records_without_the_new_column_still_read(tmp_path):
    """A rank file written before t_halo_wait (or only before t_check) existed: read with the
    missing columns empty, and a resume appends rows in the file's own columns."""
    for missing in (("t_check",), ("t_halo_wait", "t_check")):
        run = tmp_path / "-".join(missing)
        rec = records.RunRecorder(run, None, {"job_name": "old"})
        rec.step(step=0, t_step=1.0, t_halo=0.2, t_halo_wait=0.1, t_check=0.5)
        rec.close()
        f = run / "records/rank-00000.csv"
        lines = f.read_text().splitlines()
        gone = records.COLUMN_NAMES[records.COLUMN_NAMES.index(missing[0]):]  # and newer ones
        cut = len(gone)
        f.write_text("\n".join(ln.rsplit(",", cut)[0] for ln in lines) + "\n")  # header too
        rec = records.RunRecorder(run, None, {"job_name": "old"}, resume=True)
        rec.step(step=1, t_step=1.0, t_halo=0.2, t_halo_wait=0.1, t_check=0.5)
        rec.close()
        df = records.read_rank_file(f, notes := [])
        assert not notes and list(df["step"]) == [0, 1]
        assert all(df[c].isna().all() for c in gone), gone
        assert list(df["t_halo"]) == [0.2, 0.2]


@mpi_case(nprocs=(1, 2), timeout=120)
def test_real_halo_exchange_splits_wait_from_local_work(comm):
    import torch

    from hpcpar import ProcessGrid
    from hpcpar.parallel.counters import COUNTERS
    from hpcpar.parallel.halo import halo_exchange
    from hpcpar.parallel.partition import conv_axis_halo, part_range

    grid = ProcessGrid(data=1, x=comm.Get_size(), comm=comm)
    i = grid.spatial_coords[0]
    lo, hi = part_range(16, grid.spatial_shape[0], i)
    x = torch.randn(1, 2, hi - lo, 8, 8, requires_grad=True)
    halos = [conv_axis_halo(16, grid.spatial_shape[0], i, 3, 1, 1),
             conv_axis_halo(8, 1, 0, 3, 1, 1), conv_axis_halo(8, 1, 0, 3, 1, 1)]
    before = COUNTERS.snapshot()
    halo_exchange(x, grid, halos).sum().backward()
    row = records.row_from_counters(COUNTERS.since(before))
    assert row["t_halo"] > 0  # padding is local work, measured on every rank
    assert 0 <= row["t_halo_wait"] <= row["t_halo"]
    if comm.Get_size() == 1:
        assert row["t_halo_wait"] == 0 and row["bytes_halo"] == 0
    else:
        assert row["t_halo_wait"] > 0 and row["bytes_halo"] > 0


# -- 2. machine facts ----------------------------------------------------------------------
def test_machine_facts_from_ranks_and_slurm():
    ranks = [{"host": "a", "cpus": [0, 1], "slurm_cpus": None, "threads": 1} for _ in range(4)]
    f = records.machine_facts(ranks)
    assert (f["cores_per_node"], f["ranks_per_node"], f["threads_per_rank"]) == (2, 4, 1)
    assert f["oversubscribed"] is True and f["cores_source"] == "affinity"
    slurm = [{"host": h, "cpus": [0], "slurm_cpus": 8, "threads": 2} for h in "ab" * 2]
    f = records.machine_facts(slurm)  # bound to one CPU each, but Slurm gave 8 per node
    assert (f["cores_per_node"], f["ranks_per_node"], f["oversubscribed"]) == (8, 2, False)
    assert f["cores_source"] == "SLURM_CPUS_ON_NODE" and set(f["hosts"]) == {"a", "b"}
    unknown = records.machine_facts([{"host": "a", "cpus": [0, 1], "threads": None}])
    assert unknown["oversubscribed"] is None
    env = {"SLURM_CPUS_ON_NODE": "8", "OMP_NUM_THREADS": "3"}
    mine = records.rank_machine_facts(env)
    torch = sys.modules.get("torch")
    assert mine["slurm_cpus"] == 8 and mine["cpus"]
    assert mine["threads"] == (torch.get_num_threads() if torch else 3)


def test_recorder_writes_machine_facts(tmp_path):
    rec = records.RunRecorder(tmp_path / "r", None, {"job_name": "m"})
    rec.finish()
    meta = json.loads((tmp_path / "r/meta.json").read_text())
    m = meta["machine"]
    assert m["ranks_per_node"] == 1 and m["cores_per_node"] >= 1
    assert set(m) >= {"cores_per_node", "ranks_per_node", "threads_per_rank",
                      "oversubscribed", "hosts"}


def test_oversubscribed_points_flagged_in_table_and_html(tmp_path, run_cli):
    root = _sweep(tmp_path / "s", {1: 8.0, 2: 4.4, 4: 2.5}, cores_per_node=2)
    out = tmp_path / "out"
    rc, stdout, _ = run_cli(["report", str(root), "-o", str(out)])
    assert rc == 0
    table = pd.read_csv(out / "scaling.csv").set_index("ranks")
    assert list(table["oversubscribed"]) == [False, False, True]  # 4 ranks x 1 > 2 cores
    assert (table["ranks_per_node"] * table["threads_per_rank"]
            > table["cores_per_node"]).tolist() == [False, False, True]
    line4 = [ln for ln in stdout.splitlines() if re.match(r"\| synthetic +\| 4 +\|", ln)][0]
    assert "OVERSUBSCRIBED" in line4 and "4x1 : 2" in line4
    html = (out / "report.html").read_text()
    assert re.search(r"<tr class='oversub'><td>synthetic</td><td>4</td>", html)


# -- 3. like for like ----------------------------------------------------------------------
def test_different_settings_get_their_own_row_or_fail_strict(tmp_path, run_cli):
    root = _sweep(tmp_path / "s", {1: 8.0, 2: 4.4}, steps=10)
    synthetic_run(root / "debug-2", grid=(1, 2, 1, 1), steps=4, t_step=30.0)  # train.steps
    runs, steps = load([root])
    table = scaling_table(runs, steps)
    main = table[table["config"] == "synthetic"].set_index("ranks")
    st = _steps(root / "ranks-2")
    assert main.loc[2, "t_step_median"] == st.groupby("step")["t_step"].max().median()
    assert main.loc[2, "runs"] == 1
    other = table[table["config"] != "synthetic"].iloc[0]
    assert other["config"].startswith("synthetic [settings ") and other["ranks"] == 2
    assert "train.steps=4 (others 10)" in other["note"] and not other["partial"]
    rc, stdout, _ = run_cli(["report", str(root), "-o", str(tmp_path / "o")])
    assert rc == 0 and re.search(r"OWN ROW synthetic \[settings \w+\] @ 2 ranks: .*"
                                 r"train.steps=4 \(others 10\)", stdout)
    rc, _, err = run_cli(["report", str(root), "-o", str(tmp_path / "o2"), "--strict"])
    assert rc == 2 and "debug-2" in err and "train.steps=4" in err
    assert len(err.strip().splitlines()) == 1


def test_a_cosmetic_key_or_an_old_key_name_does_not_split_a_row(tmp_path):
    """The like-for-like keys come from the job schema (``compare``): runs that differ only in
    ``log_every`` (or that name ``checkpoint.background`` by its old name ``async``) share a row;
    a key that changes what is measured still splits."""
    def run(name, p, train=None, checkpoint=None):
        job = {"job": {"name": "synthetic"}, "grid": {"data": 1, "x": p, "y": 1, "z": 1},
               "train": {"steps": 6, "global_batch": 8, **(train or {})},
               "checkpoint": checkpoint or {"background": True}}
        synthetic_run(tmp_path / name, grid=(1, p, 1, 1), steps=6, t_step=8.0 / p,
                      meta={"job": job})

    run("ranks-1", 1, {"log_every": 10})
    run("ranks-2", 2, {"log_every": 1}, {"async": True})
    run("ranks-4", 4, {"log_every": 1, "lr": 0.5})
    table = scaling_table(*load([tmp_path]))
    assert sorted(table[table["config"] == "synthetic"]["ranks"]) == [1, 2], table["config"]
    other = table[table["config"] != "synthetic"].iloc[0]
    assert other["ranks"] == 4 and "train.lr=0.5" in other["note"], other["note"]


# -- 4. spread -----------------------------------------------------------------------------
def test_intervals_run_spread_and_fit_quality(tmp_path):
    root = tmp_path / "s"
    for rep in range(2):  # two runs per point: run-to-run spread
        for p, t in {1: 8.0, 2: 4.4, 4: 2.5}.items():
            synthetic_run(root / f"rep{rep}/ranks-{p}", grid=(p, 1, 1, 1), steps=10,
                          t_step=lambda r, s, t=t, rep=rep: t * (1 + 0.02 * rep + 0.01 * (s % 3)))
    table = scaling_table(*load([root])).set_index("ranks")
    for p in (1, 2, 4):
        meds = [_steps(root / f"rep{k}/ranks-{p}").groupby("step")["t_step"].max().median()
                for k in range(2)]
        assert table.loc[p, "t_step_run_min"] == pytest.approx(min(meds))
        assert table.loc[p, "t_step_run_max"] == pytest.approx(max(meds))
        assert table.loc[p, "speedup_lo"] <= table.loc[p, "speedup"] <= table.loc[p, "speedup_hi"]
        assert table.loc[p, "efficiency_lo"] == pytest.approx(table.loc[p, "speedup_lo"] / p)
    assert table.loc[4, "speedup_hi"] > table.loc[4, "speedup_lo"]
    assert table.loc[1, "speedup_lo"] == table.loc[1, "speedup_hi"] == 1.0
    # R^2 of the Amdahl fit, recomputed with numpy
    q, S = np.array([1.0, 2, 4]), table["speedup"].to_numpy()
    x, y = 1 - 1 / q[1:], 1 / S[1:] - 1 / q[1:]
    f = (x * y).sum() / (x * x).sum()
    fit = 1 / (f + (1 - f) / q)
    r2 = 1 - ((S - fit) ** 2).sum() / ((S - S.mean()) ** 2).sum()
    assert table.loc[1, "amdahl_serial_fraction"] == pytest.approx(f)
    assert table.loc[1, "fit_law"] == "amdahl"
    assert table.loc[1, "fit_serial_fraction"] == pytest.approx(f)
    assert table.loc[1, "fit_r2"] == pytest.approx(r2) and table.loc[1, "fit_shown"]


def test_constant_times_give_degenerate_intervals(tmp_path):
    root = _sweep(tmp_path / "s", {1: 8.0, 2: 4.0})
    t = scaling_table(*load([root])).set_index("ranks")
    assert t.loc[2, "speedup_lo"] == t.loc[2, "speedup_hi"] == t.loc[2, "speedup"] == 2.0


def test_fit_not_drawn_where_meaningless(tmp_path):
    root = _sweep(tmp_path / "s", {1: 8.0, 2: 4.4, 4: 5.0})  # slower at 4: non-monotonic
    t = scaling_table(*load([root]))
    assert not t["fit_shown"].any() and "non-monotonic" in t["fit_note"].iloc[0]
    two = scaling_table(*load([_sweep(tmp_path / "two", {1: 8.0, 2: 4.4})]))
    assert not two["fit_shown"].any() and "fewer than 3" in two["fit_note"].iloc[0]


# -- 5. comparison, 6. references, 7. verdict ------------------------------------------------
def test_compare_two_sweeps_ratio_per_point(tmp_path, run_cli):
    a = _sweep(tmp_path / "before", {1: 8.0, 2: 4.4, 4: 2.5})
    b = _sweep(tmp_path / "after", {1: 7.0, 2: 4.0, 8: 1.5})
    out = tmp_path / "cmp"
    rc, stdout, _ = run_cli(["report", "--compare", str(a), str(b), "-o", str(out)])
    assert rc == 0 and "Verdict: after vs before" in stdout
    cmp = pd.read_csv(out / "compare.csv").set_index("ranks")
    for p in (1, 2):
        ta = _steps(a / f"ranks-{p}").groupby("step")["t_step"].max().median()
        tb = _steps(b / f"ranks-{p}").groupby("step")["t_step"].max().median()
        assert cmp.loc[p, "ratio"] == pytest.approx(tb / ta)
    assert "only before" in cmp.loc[4, "note"] and "only after" in cmp.loc[8, "note"]
    for name in ("compare.md", "compare.html", "compare.png"):
        assert (out / name).stat().st_size > 500


def test_expect_names_every_short_point_and_exits_5(tmp_path, run_cli):
    root = _sweep(tmp_path / "s", {1: 8.0, 2: 4.4, 4: 2.5})
    exp = tmp_path / "ref.toml"
    exp.write_text('tolerance = 0.05\n'
                   '[[expect]]\nconfig = "synthetic"\nranks = [2, 4]\nmin_efficiency = 0.85\n'
                   '[[expect]]\nranks = 4\nmax_step_time = 2.0\ntolerance = 0.1\n'
                   '[[expect]]\nconfig = "synthetic"\nranks = 16\nmin_efficiency = 0.1\n')
    out = tmp_path / "o"
    rc, _, err = run_cli(["report", str(root), "-o", str(out), "--expect", str(exp),
                          "--force"])
    table = pd.read_csv(out / "scaling.csv").set_index("ranks")
    E4, T4 = table.loc[4, "efficiency"], table.loc[4, "t_step_median"]
    assert E4 == pytest.approx(8.0 * 1.0 / (4 * 2.5 * 1.0)) and T4 == 2.5
    assert rc == 5
    short = [ln for ln in err.splitlines() if ln.startswith("BELOW REFERENCE")]
    assert len(short) == 3  # E(4) = 0.8 < 0.85 * 0.95; T(4) = 2.5 > 2.2; no 16-rank point
    assert any("@ 4 ranks: efficiency 0.800" in s for s in short)
    assert any("@ 4 ranks: step time 2.5 s > 2" in s for s in short)
    assert any("16 ranks: no such point" in s for s in short)
    assert not any("@ 2 ranks" in s for s in short)  # E(2) = 0.909 meets 0.85 - 5%
    exp.write_text('[[expect]]\nranks = [1, 2, 4]\nmin_efficiency = 0.75\n')
    rc, stdout, _ = run_cli(["report", str(root), "-o", str(out), "--expect", str(exp),
                             "--force"])
    assert rc == 0 and "references met" in stdout
    exp.write_text('[[expect]]\nranks = 4\n')
    rc, _, err = run_cli(["report", str(root), "-o", str(out), "--expect", str(exp),
                          "--force"])
    assert rc == 2 and "min_efficiency and/or max_step_time" in err


def test_verdict_line_heads_the_report(tmp_path):
    from hpcpar.analysis import write_report

    root = _sweep(tmp_path / "s", {1: 8.0, 2: 4.4, 4: 3.2, 8: 3.0}, cores_per_node=4)
    rep = write_report([root], tmp_path / "o", threshold=0.7)
    md = (tmp_path / "o/report.md").read_text().splitlines()
    verdict = md[md.index("## Verdict") + 2]
    T = {p: _steps(root / f"ranks-{p}").groupby("step")["t_step"].max().median()
         for p in (1, 2, 4, 8)}
    S = {p: T[1] / T[p] for p in T}
    best = max(S, key=S.get)
    assert f"best speedup {S[best]:.2f}x at {best} ranks" in verdict
    first_low = min(p for p in T if S[p] / p < 0.7)
    assert f"efficiency below 0.7 from {first_low} ranks" in verdict
    assert "largest phase at 8 ranks: compute (65%)" in verdict
    assert "OVERSUBSCRIBED at 8 ranks" in verdict and verdict == rep.verdict
    assert "<p class='verdict'>Verdict:" in (tmp_path / "o/report.html").read_text()


# -- 8. predicted vs measured --------------------------------------------------------------
def test_plan_puts_prediction_beside_measurement(tmp_path, run_cli):
    from hpcpar.formats.jobspec import load_job
    from hpcpar.plan.job import workload_from_job
    from hpcpar.plan.machine import load_machine
    from hpcpar.plan.planner import predict

    job_file = __import__("pathlib").Path(__file__).resolve().parents[2] / \
        "jobs/demo-cosmoflow.toml"
    job = load_job(job_file).to_dict()
    root = tmp_path / "s"
    for p, t in {1: 0.5, 2: 0.3}.items():
        synthetic_run(root / f"ranks-{p}", grid=(1, p, 1, 1), t_step=t, steps=6,
                      global_batch=16, meta={"job": job, "job_name": "demo-cosmoflow"})
    synthetic_run(root / "nojob-2", grid=(1, 2, 1, 1), t_step=0.3, steps=6,
                  meta={"job": None, "config": "nojob"})
    out = tmp_path / "o"
    rc, _, _ = run_cli(["report", str(root), "-o", str(out), "--plan", "local"])
    assert rc == 0
    pred = pd.read_csv(out / "predicted.csv").set_index(["config", "ranks"])
    work, machine = workload_from_job(str(job_file)), load_machine("local")
    for p in (1, 2):
        expect = predict(work, (1, p, 1, 1), machine)
        row = pred.loc[("demo-cosmoflow", p)]
        measured = _steps(root / f"ranks-{p}").groupby("step")["t_step"].max().median()
        assert row["t_step_predicted"] == pytest.approx(expect.t_step)
        assert row["t_halo_predicted"] == pytest.approx(expect.t_halo + expect.t_gather)
        assert row["ratio"] == pytest.approx(measured / expect.t_step)
    assert "no prediction: the run recorded no job spec" in pred.loc[("nojob", 2), "note"]
    md = (out / "report.md").read_text()
    assert "## Predicted vs measured" in md and "predicted.png" in md


def test_weak_scaling_gets_gustafson_fit(tmp_path):
    root = tmp_path / "w"
    for p, t in {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.15}.items():  # work per step grows like p
        synthetic_run(root / f"ranks-{p}", grid=(p, 1, 1, 1), t_step=t, steps=6,
                      global_batch=8 * p)
    t = scaling_table(*load([root])).set_index("ranks")
    q = np.array([1.0, 2, 4, 8])
    S = q * 1.0 / np.array([1.0, 1.05, 1.1, 1.15])  # scaled speedup q T0 / T
    assert (t["mode"] == "weak").all() and t["speedup"].to_numpy() == pytest.approx(S)
    f = ((q[1:] - S[1:]) * (q[1:] - 1)).sum() / ((q[1:] - 1) ** 2).sum()
    fit = q - f * (q - 1)
    r2 = 1 - ((S - fit) ** 2).sum() / ((S - S.mean()) ** 2).sum()
    assert t.loc[1, "fit_law"] == "gustafson" and t.loc[1, "fit_shown"]
    assert t.loc[1, "fit_serial_fraction"] == pytest.approx(f)
    assert t.loc[1, "fit_r2"] == pytest.approx(r2)
