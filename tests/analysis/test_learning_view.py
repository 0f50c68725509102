"""Issue 64: a report says whether the points learnt the same (loss curves overlaid across rank
counts, final loss and metric per point, a verdict judged against the run-to-run spread of
repeats or a stated tolerance), and flags numbers that mean nothing (a serial fraction outside
[0, 1], an efficiency above 1) and points measured on a busy host. Runs are written through the
real recorder (``synthetic_run``) with their metrics.json; the report is the real
``hpcpar report``."""

import re

import pandas as pd

from hpcpar.analysis import learning
from hpcpar.analysis.synthetic import synthetic_run


def _metrics(final: float, val: float | None = None, steps: int = 10) -> dict:
    val = final if val is None else val
    return {"final_train_loss": final, "steps": steps, "val_loss": val, "val_mae": 2 * val,
            "train_loss_history": [[1, 1.0], [steps // 2, (1 + final) / 2], [steps, final]],
            "validation_history": [{"step": steps // 2, "val_loss": (1 + val) / 2}]}


def _sweep(root, finals: dict, times=None, **kw):
    """One run per rank count (or per ``(ranks, repeat)`` key), its metrics.json holding
    ``finals[key]`` as its final losses."""
    for key, final in finals.items():
        ranks, rep = key if isinstance(key, tuple) else (key, 0)
        synthetic_run(root / f"rep-{rep}" / f"ranks-{ranks}", grid=(ranks, 1, 1, 1), steps=6,
                      t_step=(times or {}).get(ranks, 1.0 / ranks), cores_per_node=4,
                      metrics=_metrics(final), **kw)


def _report(run_cli, root):
    code, out, err = run_cli(["report", str(root), "-o", str(root / "report")])
    assert code == 0, err
    return out, (root / "report")


def test_alike_points_pass_and_a_point_that_learnt_differently_is_flagged(tmp_path, run_cli):
    # the demo sweep: 0.18251 / 0.18258 / 0.18251, then a 4-rank point made to differ
    _sweep(tmp_path / "same", {1: 0.18251, 2: 0.18258, 4: 0.18251})
    out, rep = _report(run_cli, tmp_path / "same")
    assert "Learning: synthetic: every point learnt the same (final validation loss within " \
           "the stated tolerance 2% of the 1-rank point)." in out.splitlines()
    md = (rep / "report.md").read_text()
    assert "## Learning" in md and "| final loss (train)" in md and "| final metric" in md
    assert "val_mae 0.36502" in md
    assert "![loss curves: training loss against samples seen" in md
    assert (rep / "loss.png").stat().st_size > 10_000 and (rep / "val_loss.png").is_file()
    html = (rep / "report.html").read_text()
    assert re.search(r"<img alt='loss curves[^']*' src='data:image/png", html)

    _sweep(tmp_path / "odd", {1: 0.18251, 2: 0.18258, 4: 0.25})
    out, rep = _report(run_cli, tmp_path / "odd")
    line = next(ln for ln in out.splitlines() if ln.startswith("Learning:"))
    assert "LEARNT DIFFERENTLY" in line and "at 4 ranks (+36.98%)" in line, line
    assert " 2 ranks" not in line
    learn = pd.read_csv(rep / "learning.csv").set_index("ranks")
    assert learn["learnt_same"].tolist() == [True, True, False]
    assert "+36.98% LEARNT DIFFERENTLY" in (rep / "report.md").read_text()


def test_repeats_set_the_tolerance(tmp_path, run_cli):
    """Two runs at 1 rank differing by 5.4% make that the tolerance: a point 2.7% off their
    mean passes (it would fail 2%), one 8% off is flagged."""
    finals = {(1, 0): 0.18, (1, 1): 0.19, (2, 0): 0.19, (4, 0): 0.2}
    _sweep(tmp_path, finals)
    out, rep = _report(run_cli, tmp_path)
    line = next(ln for ln in out.splitlines() if ln.startswith("Learning:"))
    assert "beyond 5.41% at 4 ranks (+8.11%)" in line, line
    learn = pd.read_csv(rep / "learning.csv").set_index("ranks")
    assert learn.loc[1, "runs"] == 2 and learn.loc[1, "final_loss"] == 0.185
    assert learn["learnt_same"].tolist() == [True, True, False]


def test_runs_without_metrics_say_so(tmp_path):
    synthetic_run(tmp_path / "r", steps=4)
    runs = pd.DataFrame([{"run": str(tmp_path / "r"), "config": "c", "ranks": 1,
                          "global_batch": 8}])
    assert learning.learning_verdict(learning.learning_table(runs)) == \
        "Learning: c: no training metrics recorded (metrics.json)."
    assert learning.learning_curves(runs).empty


def test_meaningless_numbers_and_busy_hosts_are_flagged(tmp_path, run_cli):
    """A superlinear point (efficiency 1.25, Karp-Flatt -0.2) and one slower than its
    baseline (Karp-Flatt 2.33) are flagged, not printed as plain numbers; a point whose host
    had 3.5 of load on 4 cores before it is marked BUSY HOST like an oversubscribed one."""
    busy = {"host_load": {"before": [3.5, 3.0, 2.0], "after": [4.1, 3.0, 2.0]}}
    quiet = {"host_load": {"before": [0.2, 0.1, 0.1], "after": [1.0, 0.5, 0.2]}}
    for ranks, t, meta in ((1, 1.0, quiet), (2, 0.4, busy), (4, 2.0, quiet)):
        synthetic_run(tmp_path / f"ranks-{ranks}", grid=(ranks, 1, 1, 1), steps=6, t_step=t,
                      cores_per_node=4, meta=meta, metrics=_metrics(0.2))
    out, rep = _report(run_cli, tmp_path)
    verdict = out.splitlines()[0]
    assert "BUSY HOST at 2 ranks" in verdict and "FLAGGED" in verdict, verdict
    md = (rep / "report.md").read_text()
    rows = {int(r.split("|")[2]): r for r in md.splitlines()
            if r.startswith("| synthetic ") and "x1x1x1" in r}
    assert "1.250 FLAGGED >1" in rows[2] and "-0.2000 FLAGGED <0" in rows[2]
    assert "3.50 / 4.10" in rows[2] and "BUSY HOST" in rows[2]
    assert "0.125 " in rows[4] and "2.3333 FLAGGED >1" in rows[4] and "BUSY" not in rows[4]
    assert "0.20 / 1.00" in rows[4]
    assert "FLAGGED: a number outside the range where it means" in md
    assert "BUSY HOST: the load before exceeded the cores the point left idle" in md
    html = (rep / "report.html").read_text()
    assert re.search(r"<tr class='oversub'><td>synthetic</td><td>2</td>", html)
    assert "<td class='flag'>1.250 FLAGGED &gt;1</td>" in html
    table = pd.read_csv(rep / "scaling.csv").set_index("ranks")
    assert table["busy_host"].tolist() == [False, True, False]
    assert table.loc[2, "load_before"] == 3.5 and table.loc[2, "load_after"] == 4.1
