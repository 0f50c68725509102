"""Issue 16, report side: ``hpcpar report`` over a sweep where runs are damaged the ways real
runs get damaged. Every damaged run becomes a PARTIAL row with its reason, or (meta.json
unusable) is skipped with one warning line naming the file; the rest of the report is built,
nothing is a traceback, and no record file changes. One CLI call covers every case."""

import hashlib
import json
import os
from pathlib import Path

import pandas as pd
import pytest

from hpcpar.analysis import synthetic_run
from hpcpar.formats.records import LocalGrid, RunRecorder, write_json_atomic


def snapshot(root) -> dict:
    """{relative path: sha256} of every file below ``root``."""
    root = Path(root)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _rank_file(run, rank):
    return run / "records" / f"rank-{rank:05d}.csv"


def _damage(sweep: Path) -> None:
    """The sweep: a healthy config, and one run per damage (config = damage name)."""
    for p, t in ((1, 2.0), (2, 1.1)):
        synthetic_run(sweep / f"ok-{p}", grid=(p, 1, 1, 1), steps=6, t_step=t)

    def run(name, status="ok", **kw):
        return synthetic_run(sweep / name, grid=(2, 1, 1, 1), steps=6, t_step=0.6,
                             status=status, meta={"config": name}, **kw)

    # killed before its first step: meta.json and empty rank files only
    for r in range(2):
        RunRecorder(sweep / "nostep", LocalGrid((2, 1, 1, 1), rank=r), {"config": "nostep"}).close()
    os.unlink(_rank_file(run("missing", status="running"), 1))
    garbage = _rank_file(run("garbage", status="running"), 1)
    lines = garbage.read_text().splitlines(True)
    lines[4:4] = ["3,1,oops,0.1\n", "\0\0\0junk\n"]          # a text cell, binary junk
    garbage.write_text("".join(lines))
    bad = _rank_file(run("badheader", status="running"), 0)
    bad.write_text("PK\x03\x04 not a record\n" + bad.read_text())
    parquet = run("parquet") / "steps.parquet"
    parquet.write_bytes(parquet.read_bytes()[: parquet.stat().st_size // 2])
    meta = run("diverged", status="diverged") / "meta.json"
    write_json_atomic(meta, {**json.loads(meta.read_text()),
                             "diverged": {"step": 4, "reason": "loss nan on rank 1 at step 4"}})
    meta = run("halfmeta") / "meta.json"
    meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
    meta = run("badranks") / "meta.json"
    meta.write_text(meta.read_text().replace('"ranks": 2', '"ranks": "two"'))


@pytest.fixture(scope="module")
def report(tmp_path_factory, cli_main):
    """(exit code, stdout, stderr, sweep, out, files before, files after) of one report."""
    root = tmp_path_factory.mktemp("faults")
    sweep, out = root / "sweep", root / "out"
    _damage(sweep)
    before = snapshot(sweep)
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            cli_main(["report", str(sweep), "-o", str(out)])
            code = 0
        except SystemExit as exc:
            code = exc.code or 0
    return code, stdout.getvalue(), stderr.getvalue(), sweep, out, before, snapshot(sweep)


def _partial(stdout, config):
    lines = [line for line in stdout.splitlines() if line.startswith(f"PARTIAL {config} @ ")]
    assert len(lines) == 1, stdout
    return lines[0]


def test_report_built_and_records_untouched(report):
    code, stdout, stderr, sweep, out, before, after = report
    assert code == 0 and "Traceback" not in stderr
    assert after == before
    table = pd.read_csv(out / "scaling.csv")
    ok = table[table["config"] == "synthetic"].set_index("ranks")
    assert not ok["partial"].any() and ok.loc[2, "speedup"] == pytest.approx(2.0 / 1.1)
    assert set(table["config"]) == {"synthetic", "nostep", "missing", "garbage", "badheader",
                                    "parquet", "diverged"}
    assert table[table["config"] != "synthetic"]["partial"].all()
    md = (out / "report.md").read_text()
    assert "skipped (unreadable): " in md and "halfmeta/meta.json" in md


def test_killed_before_first_step(report):
    line = _partial(report[1], "nostep")
    assert line == ("PARTIAL nostep @ 2 ranks: nostep: status 'running' (crashed or still "
                    "running); no step records; no records from rank(s) 0, 1")


def test_missing_rank_file(report):
    assert _partial(report[1], "missing").endswith(
        "missing: status 'running' (crashed or still running); no records from rank(s) 1; "
        "6 step(s) not recorded by every rank ignored")


def test_garbage_lines_left_out(report):
    line = _partial(report[1], "garbage")
    assert "records/rank-00001.csv: 2 unreadable line(s) left out (first: '3,1,oops,0.1')" in line
    table = pd.read_csv(report[4] / "scaling.csv").set_index("config")
    assert table.loc["garbage", "t_step_median"] == 0.6  # the good rows still count


def test_unreadable_rank_file_skipped(report):
    line = _partial(report[1], "badheader")
    assert ("records/rank-00000.csv skipped: not an hpcpar step record (first line "
            "'PK\\x03\\x04 not a record')") in line and "no records from rank(s) 0" in line


def test_truncated_parquet_falls_back_to_rank_files(report):
    line = _partial(report[1], "parquet")
    assert "parquet: steps.parquet unreadable (" in line
    assert line.endswith("): read records/rank-*.csv instead")
    table = pd.read_csv(report[4] / "scaling.csv").set_index("config")
    assert table.loc["parquet", "t_step_median"] == 0.6 and table.loc["parquet", "steps"] == 5


def test_diverged_run_says_why(report):
    assert _partial(report[1], "diverged").endswith(
        "diverged: status 'diverged' (non-finite loss or gradient: loss nan on rank 1 at step 4)")


def test_bad_meta_skipped_with_one_warning_each(report):
    stderr, sweep = report[2], report[3]
    warnings = [line for line in stderr.splitlines() if line.strip()]
    assert len(warnings) == 2, stderr
    assert warnings[0].startswith(f"hpcpar: warning: skipped run: {sweep}/badranks/meta.json: "
                                  f"field 'ranks' is 'two', expected a positive integer")
    assert warnings[1].startswith(f"hpcpar: warning: skipped run: {sweep}/halfmeta/meta.json: "
                                  f"unreadable JSON (")


def test_only_damaged_runs_is_one_error(run_cli, tmp_path):
    run = synthetic_run(tmp_path / "r", steps=3)
    meta = run / "meta.json"
    meta.write_bytes(meta.read_bytes()[:100])
    before = snapshot(tmp_path)
    code, out, err = run_cli(["report", str(run), "-o", str(tmp_path / "out")])
    assert code == 2 and out == "" and "Traceback" not in err
    assert len(err.splitlines()) == 1
    assert err.startswith(f"hpcpar: error: no readable run records: {meta}: unreadable JSON (")
    assert snapshot(tmp_path) == before  # no report directory made for nothing


def test_unwritable_output_is_one_error(run_cli, tmp_path):
    run = synthetic_run(tmp_path / "r", steps=3)
    (tmp_path / "file").write_text("mine")
    before = snapshot(tmp_path)
    code, out, err = run_cli(["report", str(run), "-o", str(tmp_path / "file" / "out")])
    assert code == 2 and out == ""
    assert err.splitlines() == [f"hpcpar: error: {tmp_path}/file/out: cannot write the report "
                                f"(Not a directory)"]
    assert snapshot(tmp_path) == before


def test_metrics_json_is_strict(tmp_path):
    """The writer of metrics.json and meta.json: NaN/inf become null, never bare NaN."""
    import numpy as np

    path = tmp_path / "metrics.json"
    write_json_atomic(path, {"final_train_loss": float("nan"), "val": [1.5, float("inf")],
                             "np": np.float32("nan"), "n": np.int64(3), "ok": 0.25})
    got = json.loads(path.read_text(), parse_constant=pytest.fail)
    assert got == {"final_train_loss": None, "val": [1.5, None], "np": None, "n": 3, "ok": 0.25}
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]
