"""Issue 32, smaller items of ``hpcpar plan``: the first column is the position of a grid in
the ranking (not a rank), the local machine line names this host's cores (the shipped
local.toml says 8 ranks per node, calibrated elsewhere), and ``--set data.size=`` wins over a
dataset of another size already at ``data.path``, with a note saying the run would need
another dataset."""

import os

from hpcpar.data import CosmoflowSource, shard_counts, write_dataset
from tests.support.cli_run import tiny_job_toml


def test_plan_header_host_cores_and_size_override(tmp_path, run_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_dataset("ds", CosmoflowSource(4, 16, 2, 0), shard_counts(4, shards=1), progress=False)
    (tmp_path / "job.toml").write_text(tiny_job_toml(data=1, x=1).replace(
        'source = "synthetic"', 'path = "ds"'))
    code, out, err = run_cli(["plan", "job.toml", "-n", "2", "--top", "2"])
    assert code == 0, err
    head, columns = out.splitlines()[:2]
    cores = len(os.sched_getaffinity(0))
    assert head.startswith(f"tiny: 2 ranks on local (this host, {cores} cores), sample "
                           f"2x16x16x16,"), head
    assert columns.split()[:2] == ["#", "grid"]
    assert err == ""                        # the dataset fits the job: nothing to say
    code, out, err = run_cli(["plan", "job.toml", "-n", "2", "--set", "data.size=32"])
    assert code == 0, err
    assert "sample 2x32x32x32," in out.splitlines()[0]
    lines = err.splitlines()
    assert lines[0] == (
        "hpcpar: note: planned for [data] size = 32; the dataset at [data] path ds holds "
        "16x16x16 samples, so a run needs another --set data.path=DIR (generated there) or "
        "that dataset's size")
    assert all(ln.startswith("hpcpar: note: grids #") for ln in lines[1:])  # ties (issue 64)
