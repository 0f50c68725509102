"""``hpcpar report``: files, real plots, numbers equal to the records, one-line errors.

Regenerate the golden headline table:
``HPCPAR_REGEN_GOLDEN=1 python -m pytest tests/analysis/test_report.py``.
"""

import base64
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from hpcpar import _env
from hpcpar.analysis import synthetic_run

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "report" / "headline.md"
PLOTS = ("speedup", "efficiency", "breakdown", "step_times", "throughput", "bytes", "memory",
         "imbalance")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("rep")
    times = {1: 8.0, 2: 4.4, 4: 2.5}
    for p, t in times.items():  # 2 spatial ranks from p = 2 on; last rank 10% slower
        grid = (max(1, p // 2), min(p, 2), 1, 1)
        synthetic_run(root / "sweep" / f"ranks-{p}", grid=grid, steps=6, cores_per_node=4,
                      t_step=lambda r, s, p=p, t=t: t * (1.1 if r == p - 1 else 1.0))
    synthetic_run(root / "sweep" / "ranks-8", grid=(4, 2, 1, 1), steps=6, t_step=1.5,
                  status="running", stop={5: 2}, cores_per_node=4)  # 8 ranks on 4 cores
    return root


def test_report_files_plots_and_numbers(report, run_cli):
    out = report / "out"
    rc, stdout, _ = run_cli(["report", str(report / "sweep"), "-o", str(out)])
    assert rc == 0
    for name in ("scaling.csv", "runs.csv", "report.md", "report.html",
                 *(f"{p}.png" for p in PLOTS)):
        assert (out / name).stat().st_size > 0, name
    assert f"report: {out / 'report.html'}" in stdout
    headline = stdout[: stdout.index("\nPARTIAL")]
    if _env.get("HPCPAR_REGEN_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(headline + "\n")
    assert headline + "\n" == GOLDEN.read_text()
    assert "PARTIAL synthetic @ 8 ranks: ranks-8: status 'running'" in stdout
    assert "rank 5 stopped at step 2" in stdout

    table = pd.read_csv(out / "scaling.csv").set_index("ranks")
    for col in ("t_step_median", "speedup", "efficiency", "karp_flatt", "throughput",
                "t_step_cv", "frac_compute", "imbalance", "partial", "note", "mode"):
        assert col in table.columns
    # the numbers are the records': step time = slowest rank, throughput = 8 samples / T
    steps = pd.read_parquet(report / "sweep/ranks-4/steps.parquet")
    T4 = steps[steps["step"] > 0].groupby("step")["t_step"].max().median()
    assert table.loc[4, "t_step_median"] == T4 == 2.5 * 1.1
    assert table.loc[4, "speedup"] == pytest.approx(8.0 / 2.5, rel=1e-12)
    assert table.loc[4, "throughput"] == pytest.approx(8 / T4, rel=1e-12)
    assert bool(table.loc[8, "partial"]) and not table.loc[[1, 2, 4], "partial"].any()

    for name in PLOTS:  # real plots: PNG, sizeable, many colours, not a blank canvas
        data = (out / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 15_000, name
        import matplotlib.image as mpimg

        img = mpimg.imread(out / f"{name}.png")
        assert img.shape[0] > 250 and img.shape[1] > 400
        assert len(np.unique(img[..., :3].reshape(-1, 3), axis=0)) > 50, name

    html = (out / "report.html").read_text()
    embedded = re.findall(r"src='data:image/png;base64,([^']+)'", html)
    assert len(embedded) == len(PLOTS)
    assert base64.b64decode(embedded[0])[:4] == b"\x89PNG"
    assert not re.search(r"(src|href)=['\"](?!data:)", html)  # self-contained
    assert "class='partial'" in html
    md = (out / "report.md").read_text()
    assert "![speedup](speedup.png)" in md
    assert re.search(r"\| synthetic +\| 4 +\| 2x2x1x1 +\| 2.75 +\|", md)
    assert "Karp-Flatt serial fraction e = (1/S - 1/q) / (1 - 1/q)" in md


def test_report_errors_are_one_line(tmp_path, run_cli):
    (tmp_path / "empty").mkdir()
    rc, _, err = run_cli(["report", str(tmp_path / "empty"), "-o", str(tmp_path / "o")])
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("hpcpar: error: ") and "no hpcpar run records" in err
    run = synthetic_run(tmp_path / "run", steps=2)
    (run / "meta.json").write_text((run / "meta.json").read_text().replace(
        '"schema_version": 1', '"schema_version": 7'))
    rc, _, err = run_cli(["report", str(run), "-o", str(tmp_path / "o")])
    assert rc == 2 and "schema version 7, this hpcpar reads version 1" in err
    assert err.count("\n") == 1


def test_analysis_guide_example_runs(tmp_path, monkeypatch, capsys):
    """The guide's pandas example prints the statistics of its synthetic runs' step times:
    each printed value is the formula's (docs/guides/analysis.md) on those times."""
    import ast

    md = (Path(__file__).resolve().parents[2] / "docs/guides/analysis.md").read_text()
    code = re.findall(r"```python\n(.*?)```", md, re.S)[-1]
    times = ast.literal_eval(re.search(r"for p, t in (\{.*?\})\.items\(\)", code).group(1))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    exec(compile(code, "docs/guides/analysis.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["ranks", "t_step_median", "speedup", "efficiency", "karp_flatt"]
    t0 = times[1]
    for line, (p, t) in zip(out[1:], times.items(), strict=False):
        s = t0 / t
        kf = (1 / s - 1 / p) / (1 - 1 / p) if p > 1 else float("nan")
        row = [float(v) for v in line.split()[1:]]
        np.testing.assert_allclose(row, [p, t, s, s / p, kf], rtol=1e-5, err_msg=line)
    steps = out[1 + len(times):-1]   # the slowest rank's step time, per step and rank count
    assert steps[0].split() == ["ranks", *map(str, times)] and steps[1].split() == ["step"]
    for line in steps[2:]:
        assert [float(v) for v in line.split()[1:]] == list(times.values()), line
    report = Path(out[-1])
    assert report.name == "report.html" and report.is_file() and report.stat().st_size > 0


def test_an_existing_report_is_replaced_only_with_force(report, run_cli):
    """Issue 64: a second ``hpcpar report`` into the same directory refuses in one line and
    leaves the first report as it was; ``--force`` replaces it (``--compare`` alike)."""
    out = report / "kept"
    assert run_cli(["report", str(report / "sweep"), "-o", str(out)])[0] == 0
    page = (out / "report.html").read_bytes()
    (out / "notes.txt").write_text("mine")
    rc, _, err = run_cli(["report", str(report / "sweep" / "ranks-1"), "-o", str(out)])
    assert rc == 2 and err.splitlines() == [
        f"hpcpar: error: {out}: holds a report already (report.html); use --force to replace "
        f"it, or -o another directory"]
    assert (out / "report.html").read_bytes() == page and (out / "notes.txt").is_file()
    rc, _, err = run_cli(["report", str(report / "sweep" / "ranks-1"), "-o", str(out),
                          "--force"])
    assert rc == 0, err
    assert (out / "report.html").read_bytes() != page
    sweep = str(report / "sweep")
    assert run_cli(["report", "--compare", sweep, sweep, "-o", str(report / "cmp")])[0] == 0
    rc, _, err = run_cli(["report", "--compare", sweep, sweep, "-o", str(report / "cmp")])
    assert rc == 2 and "holds a report already (compare.html)" in err
