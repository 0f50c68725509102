"""``[train] halo_transport`` through real ``hpcpar run`` processes: a spatially split
CosmoFlow trained with its halos and spatial collectives over Gloo has the MPI run's losses,
bit for bit, and each run's ``meta.json`` names the transport it used; a transport that
cannot move this run's tensors is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from hpcpar.errors import ConfigError
from hpcpar.formats.jobspec import SCHEMA, load_job
from hpcpar.parallel.transport import TRANSPORTS

CLI = [sys.executable, "-m", "hpcpar.cli"]
JOB = """[job]
name = "ht"
[grid]
data = 1
x = 2
[model]
kind = "cosmoflow"
n_conv_blocks = 1
base_filters = 2
dense = [8]
check = false
[data]
source = "synthetic"
size = 8
channels = 1
samples = 4
[train]
steps = 2
global_batch = 2
channels_last = false
"""


def _run(tmp_path, name, transport, *more):
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    return subprocess.run([*CLI, "run", str(job), "-n", "2", "--run-dir", str(tmp_path / name),
                           "--set", f"train.halo_transport={transport}", *more],
                          capture_output=True, text=True, timeout=300)


def _losses(run) -> list[float]:
    steps = pd.read_parquet(run / "steps.parquet").sort_values(["step", "rank"])
    return steps["loss"].tolist()


def test_job_key_takes_exactly_the_transports(tmp_path):
    assert SCHEMA["train"]["halo_transport"].choices == TRANSPORTS
    assert SCHEMA["train"]["halo_transport"].default == "auto"
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    assert load_job(job, ["train.halo_transport=gloo"]).train.halo_transport == "gloo"
    with pytest.raises(ConfigError, match=r"\[train\] halo_transport"):
        load_job(job, ["train.halo_transport=udp"])


@pytest.fixture(scope="module")
def mpi_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("transport")
    r = _run(root, "mpi", "mpi")
    assert r.returncode == 0, r.stderr
    return root / "mpi"


def test_gloo_run_has_the_mpi_runs_losses_and_says_so(mpi_run, tmp_path):
    r = _run(tmp_path, "gloo", "gloo")
    assert r.returncode == 0, r.stderr
    assert json.loads((mpi_run / "meta.json").read_text())["halo_transport"] == "mpi"
    assert json.loads((tmp_path / "gloo" / "meta.json").read_text())["halo_transport"] == "gloo"
    want, got = _losses(mpi_run), _losses(tmp_path / "gloo")
    assert len(want) == 4 and got == want


def test_nccl_on_a_cpu_run_is_one_line(tmp_path):
    r = _run(tmp_path, "nccl", "nccl", "-n", "1", "--grid", "1x1x1x1")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert errors == ["hpcpar: error: [train] halo_transport = 'nccl' moves CUDA tensors, but "
                      "this run is on cpu; use 'gloo', 'mpi' or 'auto'"], r.stderr
