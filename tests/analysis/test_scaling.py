"""Scaling statistics from synthetic records with known times: exact numbers, partial runs."""

import math
import shutil

import pytest

from hpcpar.analysis import drop_warmup, load, scaling_table, synthetic_run
from hpcpar.errors import RunDirError
from hpcpar.formats.records import LocalGrid, RunRecorder

T_STRONG = {1: 8.0, 2: 4.4, 4: 2.5}


def sweep(tmp_path, times, batch=lambda p: 8, steps=6, slow=1.0, **kw):
    """ranks-p runs with step time times[p] (step 0 is a 3x slower warm-up step); the last
    rank is ``slow`` times slower."""
    for p, t in times.items():
        synthetic_run(tmp_path / f"ranks-{p}", grid=(p, 1, 1, 1), steps=steps,
                      global_batch=batch(p), t_step=lambda r, s, p=p, t=t: t * (3 if s == 0 else 1)
                      * (slow if r == p - 1 and p > 1 else 1), **kw)
    return load([tmp_path])


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-15)


def test_strong_scaling_exact(tmp_path):
    runs, steps = sweep(tmp_path, T_STRONG)
    assert len(runs) == 3 and not runs["partial"].any()
    table = scaling_table(runs, steps).set_index("ranks")
    assert (table["mode"] == "strong").all() and (table["baseline_ranks"] == 1).all()
    for p, t in T_STRONG.items():
        row = table.loc[p]
        assert row["steps"] == 5  # the 3x warm-up step 0 is gone: the mean is exact
        assert row["t_step_mean"] == approx(t) and row["t_step_median"] == approx(t)
        assert row["t_step_cv"] == 0 and row["throughput"] == approx(8 / t)
        S = 8.0 / t
        assert row["speedup"] == approx(S) and row["efficiency"] == approx(S / p)
        assert row["ideal_speedup"] == p
        if p > 1:
            assert row["karp_flatt"] == approx((1 / S - 1 / p) / (1 - 1 / p))
        else:
            assert math.isnan(row["karp_flatt"])
        fr = {k: row[f"frac_{k}"] for k in ("compute", "halo", "comm_exposed", "io", "other")}
        assert fr == {k: approx(v) for k, v in dict(compute=0.65, halo=0.1, comm_exposed=0.1,
                                                    io=0.1, other=0.05).items()}
        assert row["t_compute"] == approx(0.65 * t) and row["imbalance"] == approx(1.0)
        assert row["bytes_allreduce_per_step"] == 4000 * p and row["peak_mem_max"] == 1e6 * p
    assert table.loc[2, "karp_flatt"] == approx(0.1)
    assert table.loc[4, "karp_flatt"] == approx(1 / 12)


def test_step_time_is_max_over_ranks_and_imbalance(tmp_path):
    runs, steps = sweep(tmp_path, {1: 8.0, 2: 4.0}, slow=1.5)
    table = scaling_table(runs, steps).set_index("ranks")
    assert table.loc[2, "t_step_median"] == approx(6.0)  # the slow rank sets the pace
    assert table.loc[2, "speedup"] == approx(8.0 / 6.0)
    assert table.loc[2, "imbalance"] == approx(1.5 / 1.25)  # max / mean of compute
    assert table.loc[2, "t_compute"] == approx(0.65 * 5.0)  # mean over ranks


def test_amdahl_fit_recovers_serial_fraction(tmp_path):
    f = 0.1
    times = {p: 10.0 * (f + (1 - f) / p) for p in (1, 2, 4, 8)}
    table = scaling_table(*sweep(tmp_path, times)).set_index("ranks")
    assert table["amdahl_serial_fraction"].tolist() == [approx(f)] * 4
    assert table.loc[[2, 4, 8], "karp_flatt"].tolist() == [approx(f)] * 3
    assert table.loc[8, "amdahl_speedup"] == approx(table.loc[8, "speedup"])


def test_weak_scaling_detected_and_override(tmp_path):
    times = {1: 1.0, 2: 1.25, 4: 1.6}
    runs, steps = sweep(tmp_path, times, batch=lambda p: 8 * p)
    table = scaling_table(runs, steps).set_index("ranks")
    assert (table["mode"] == "weak").all()
    for p, t in times.items():
        assert table.loc[p, "efficiency"] == approx(1.0 / t)  # T(p0) / T(p)
        assert table.loc[p, "speedup"] == approx(p * 1.0 / t)  # scaled speedup
        assert table.loc[p, "throughput"] == approx(8 * p / t)
    forced = scaling_table(runs, steps, mode="strong").set_index("ranks")
    assert forced.loc[4, "efficiency"] == approx(1.0 / (4 * 1.6))
    assert "strong scaling forced; the runs look weak" in forced.loc[4, "note"]
    mixed = scaling_table(*sweep(tmp_path / "m", times, batch=lambda p: 8 + p)).set_index("ranks")
    assert (mixed["mode"] == "mixed").all() and "work-rate ratio" in mixed.loc[2, "note"]
    assert mixed.loc[2, "speedup"] == approx((10 / 1.25) / (9 / 1.0))


def test_crashed_rank_gives_marked_partial_row(tmp_path):
    synthetic_run(tmp_path / "ranks-1", grid=(1, 1, 1, 1), t_step=8.0, steps=8)
    synthetic_run(tmp_path / "ranks-2", grid=(2, 1, 1, 1), t_step=4.0, steps=8,
                  status="running", stop={1: 4})
    runs, steps = load([tmp_path])
    r2 = runs.set_index("ranks").loc[2]
    assert r2["partial"] and r2["steps_complete"] == 5 and r2["steps_recorded"] == 8
    assert "status 'running'" in r2["note"] and "rank 1 stopped at step 4" in r2["note"]
    table = scaling_table(runs, steps).set_index("ranks")
    assert table.loc[2, "partial"] and not table.loc[1, "partial"]
    assert table.loc[2, "steps"] == 4  # complete steps 0..4 minus the warm-up step
    assert table.loc[2, "speedup"] == approx(2.0)  # only steps every rank recorded
    # a rank that left no records at all: no numbers, never a wrong one
    (tmp_path / "ranks-2/records/rank-00001.csv").unlink()
    table = scaling_table(*load([tmp_path])).set_index("ranks")
    assert table.loc[2, "partial"] and math.isnan(table.loc[2, "t_step_median"])
    assert "no records from rank(s) 1" in table.loc[2, "note"]
    assert math.isnan(table.loc[2, "speedup"])


def test_partial_baseline_marks_dependents(tmp_path):
    synthetic_run(tmp_path / "a", grid=(1, 1, 1, 1), t_step=8.0, status="failed")
    synthetic_run(tmp_path / "b", grid=(2, 1, 1, 1), t_step=4.0)
    table = scaling_table(*load([tmp_path])).set_index("ranks")
    assert table["partial"].all() and "baseline (1 ranks) is partial" in table.loc[2, "note"]


def test_resume_drops_warmup_of_each_segment_and_pools_runs(tmp_path):
    run = tmp_path / "r"
    rec = RunRecorder(run, LocalGrid(), {"job_name": "j"})
    for s in range(6):
        rec.step(step=s, t_step=5.0 if s == 0 else 1.0, samples=4)
    rec.close()  # crash after step 5; the checkpoint was step 3
    rec = RunRecorder(run, LocalGrid(), {"job_name": "j"}, resume=True)
    for s in range(4, 12):
        rec.step(step=s, t_step=7.0 if s == 4 else 2.0, samples=4)
    rec.finish()
    runs, steps = load(run)
    assert runs.loc[0, "segment_starts"] == [0, 4] and not runs.loc[0, "partial"]
    kept = drop_warmup(steps, runs, warmup=1)
    assert sorted(kept["step"]) == [1, 2, 3, 5, 6, 7, 8, 9, 10, 11]
    assert kept["t_step"].tolist() == [1.0] * 3 + [2.0] * 7
    shutil.copytree(run, tmp_path / "r2")  # a second run of the same config and ranks: pooled
    table = scaling_table(*load([tmp_path]), warmup=1)
    assert table.loc[0, "runs"] == 2 and table.loc[0, "steps"] == 20


def _segment(run, grid, steps, t_step, resume):
    """One segment of a run on ``grid``: every rank records ``steps`` at ``t_step``."""
    size = math.prod(grid)
    recs = [RunRecorder(run, LocalGrid(grid, rank=r), {"job_name": "j", "global_batch": 4},
                        resume=resume) for r in range(size)]
    for s in steps:
        for rec in recs:
            rec.step(step=s, t_step=t_step, samples=4)
    for rec in recs[::-1]:
        rec.finish()


def test_segments_on_other_grids_are_never_pooled_under_one_grid(tmp_path):
    """Issue 67, item 4: a run resumed on another grid is one row per grid, each with its
    own steps, ranks and segment starts; a point names every grid it holds."""
    run = tmp_path / "r"
    _segment(run, (2, 1, 1, 1), range(0, 4), 1.0, resume=False)
    _segment(run, (1, 2, 1, 1), range(4, 8), 3.0, resume=True)
    runs, steps = load(run)
    assert runs["name"].tolist() == ["r [grid 2x1x1x1]", "r [grid 1x2x1x1]"]
    assert runs["grid_spec"].tolist() == ["2x1x1x1", "1x2x1x1"]
    assert runs["spatial_size"].tolist() == [1, 2] and runs["ranks"].tolist() == [2, 2]
    assert runs["segment_starts"].tolist() == [[0], [4]] and not runs["partial"].any()
    for name, t in (("r [grid 2x1x1x1]", 1.0), ("r [grid 1x2x1x1]", 3.0)):
        mine = steps[steps["run"] == runs.set_index("name").loc[name, "run"]]
        assert set(mine["t_step"]) == {t} and len(mine) == 8
    table = scaling_table(runs, steps, warmup=1)
    assert table.loc[0, "grid"] == "1x2x1x1/2x1x1x1" and table.loc[0, "runs"] == 2

    other = tmp_path / "grow"   # 1 rank, then 2: a point each, both complete
    _segment(other, (1, 1, 1, 1), range(0, 4), 2.0, resume=False)
    _segment(other, (2, 1, 1, 1), range(4, 8), 1.0, resume=True)
    table = scaling_table(*load(other), warmup=1).set_index("ranks")
    assert table["grid"].to_dict() == {1: "1x1x1x1", 2: "2x1x1x1"}
    assert table["t_step_median"].to_dict() == {1: 2.0, 2: 1.0} and not table["partial"].any()


def test_missing_and_malformed_records(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match=r"empty: no hpcpar run records \(no meta.json"):
        load([tmp_path / "empty"])
    with pytest.raises(RunDirError, match="no such file or directory"):
        load([tmp_path / "nope"])
    run = synthetic_run(tmp_path / "old", grid=(1, 1, 1, 1))
    meta = (run / "meta.json").read_text().replace('"schema_version": 1', '"schema_version": 0')
    (run / "meta.json").write_text(meta)
    with pytest.raises(RunDirError, match=r"old/meta.json: schema version 0, this hpcpar reads"):
        load([tmp_path])
    (run / "meta.json").write_text("{not json")
    with pytest.raises(RunDirError, match="unreadable JSON"):
        load([run])
    with pytest.raises(ValueError, match="mode must be"):
        scaling_table(*load([synthetic_run(tmp_path / "x")]), mode="fast")
    # a run that crashed before its first step: a partial row without numbers
    RunRecorder(tmp_path / "nostep", LocalGrid(), {"job_name": "n"}).close()
    runs, steps = load([tmp_path / "nostep"])
    assert runs.loc[0, "partial"] and "no step records" in runs.loc[0, "note"]
    table = scaling_table(runs, steps)
    assert table.loc[0, "partial"] and math.isnan(table.loc[0, "t_step_median"])
