"""Issue 32: a point whose speedup beats the cores it used is flagged SUSPECT with its likely
cause, in scaling.csv, on the report's stderr and under the verdict: a baseline with other
threads per rank, an oversubscribed baseline, a baseline on a busy host, timing noise, or else
a superlinear effect. Runs are written through the real recorder (``synthetic_run``) with known
step times; the report is the real ``hpcpar report``."""

import json

import pandas as pd

from hpcpar.analysis.synthetic import synthetic_run

QUIET = {"host_load": {"before": [0.0, 0.0, 0.0], "after": None}}
BUSY = {"host_load": {"before": [3.5, 3.0, 2.0], "after": None}}


def _pair(root, config, t1, t2, *, threads1=1, threads2=1, meta1=QUIET, cores1=2, cores2=2):
    """A 1-rank and a 2-rank run of ``config`` with step times ``t1`` and ``t2``."""
    for ranks, t, threads, meta, cores in ((1, t1, threads1, meta1, cores1),
                                           (2, t2, threads2, QUIET, cores2)):
        synthetic_run(root / config / f"ranks-{ranks}", grid=(ranks, 1, 1, 1), steps=8,
                      t_step=t, cores_per_node=cores, threads=threads,
                      meta={**meta, "config": config})


def test_points_beating_their_cores_are_flagged_with_the_likely_cause(tmp_path, run_cli):
    _pair(tmp_path, "threads", 2.0, 0.25, threads1=2)          # the 2-thread baseline
    _pair(tmp_path, "oversub", 2.0, 0.5, threads1=2, threads2=2, cores1=1, cores2=4)
    _pair(tmp_path, "busy", 2.0, 0.5, meta1=BUSY)
    _pair(tmp_path, "noise", lambda r, s: 1.0 + 0.3 * (s % 2), 0.6)   # median 1.3 or 1.0
    _pair(tmp_path, "cache", 2.0, 0.8)
    _pair(tmp_path, "fair", 2.0, 1.2)
    code, out, err = run_cli(["report", str(tmp_path), "-o", str(tmp_path / "report")])
    assert code == 0, err
    table = pd.read_csv(tmp_path / "report" / "scaling.csv").set_index(["config", "ranks"])
    suspect = table["suspect"].fillna("")
    assert (suspect.xs(1, level="ranks") == "").all()          # a baseline is not flagged
    causes = {"threads": "the baseline (1 ranks) ran 2 thread(s) per rank, this point 1",
              "oversub": "the baseline (1 ranks) was oversubscribed",
              "busy": "the host was busy when the baseline ran (load 3.5 on 2 cores",
              "noise": "timing noise: the efficiency's 95% interval",
              "cache": "a superlinear effect"}
    for config, cause in causes.items():
        text = suspect[(config, 2)]
        assert text.startswith("SUSPECT: speedup "), (config, text)
        assert cause in text, (config, text)
        assert f"hpcpar: warning: {config} @ 2 ranks: {text}" in err.splitlines()
    # the 2-thread baseline: 4x the efficiency of 2 ranks, and more than the cores it used
    assert "speedup 8.00x (efficiency 4.00) on 1x the baseline's cores;" in \
        suspect[("threads", 2)]
    assert suspect[("fair", 2)] == "" and table.loc[("fair", 2), "efficiency"] < 1
    html = (tmp_path / "report" / "report.html").read_text()
    assert "Warning: cache @ 2 ranks: SUSPECT" in html
    # every efficiency above 1 is flagged (the rule the loaded-machine sweep test relies on)
    over = table[table["efficiency"] > 1]
    assert len(over) == 5 and (over["suspect"].str.startswith("SUSPECT")).all()


def test_json_report_carries_the_flag(tmp_path, run_cli):
    _pair(tmp_path, "threads", 2.0, 0.25, threads1=2)
    code, out, err = run_cli(["report", str(tmp_path), "-o", str(tmp_path / "r"), "--json"])
    assert code == 0, err
    doc = json.loads(out)
    point = next(p for p in doc["points"] if p["ranks"] == 2)
    assert point["suspect"].startswith("SUSPECT")
    assert any(w.startswith("threads @ 2 ranks: SUSPECT") for w in doc["warnings"])
