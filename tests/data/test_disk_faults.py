"""Issue 35 (item 4): a full disk or a read-only directory under `hpcpar data make`, dataset
generation inside `hpcpar run`, and `hpcpar report`. Each is a real CLI process writing into a
tiny tmpfs (or a read-only one) mounted in a private mount namespace (invisible outside, gone
with the process; needs root): one `hpcpar: error:` line, exit 2, no traceback or segfault,
nothing half-written left that looks valid, and for `run` a meta.json saying how it ended."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.faults import can_mount

pytestmark = pytest.mark.skipif(not can_mount(), reason="needs root and mount namespaces")

FULL = "mkdir -p small && mount -t tmpfs -o size=64k hpcpar-full small"
READ_ONLY = "mkdir -p ro && mount -t tmpfs -o ro,size=64k hpcpar-ro ro"


def hpcpar(cwd: Path, mounts: str, *args, timeout=180) -> tuple[int, str, str]:
    """(exit code, stderr, listing) of ``hpcpar ARGS`` run after the shell lines ``mounts`` in
    a private mount namespace; ``listing``: every path under the working directory as the
    command left it, mounts included (``find``, before they vanish); stdout is dropped."""
    cmd = subprocess.list2cmdline([sys.executable, "-m", "hpcpar.cli", *map(str, args)])
    script = f"{mounts} && {cmd} >/dev/null; rc=$?; find . -mindepth 1 | sort; exit $rc"
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                       cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                       text=True, timeout=timeout)
    listing, err = p.stdout, p.stderr
    assert f" {cwd}/" not in Path("/proc/mounts").read_text()  # nothing leaked out
    return p.returncode, err, listing


def one_error(err: str) -> str:
    assert "Traceback" not in err and "Segmentation" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("hpcpar: error: ")]
    assert len(errors) == 1, err
    return errors[0]


def test_data_make_into_a_full_disk(tmp_path):
    """Before: an HDF5 traceback, then a segfault (exit 139), the partial directory left."""
    code, err, listing = hpcpar(tmp_path, FULL, "data", "make", "cosmoflow", "small/ds",
                                "--samples", "8", "--size", "16", "--shards", "2", "--quiet")
    assert code == 2, err
    assert one_error(err) == ("hpcpar: error: small/ds: not enough space for the dataset "
                              "(about 0.6 MiB needed: No space left on device); nothing was "
                              "written")
    assert listing.split() == ["./small"]          # no dataset, no partial directory


def test_data_make_under_a_read_only_parent(tmp_path):
    """Before: a PermissionError/OSError traceback from tempfile.mkdtemp (exit 1)."""
    code, err, listing = hpcpar(tmp_path, READ_ONLY, "data", "make", "cosmoflow", "ro/ds",
                                "--samples", "2", "--size", "8", "--shards", "1", "--quiet")
    assert code == 2, err
    assert one_error(err) == (f"hpcpar: error: {tmp_path}/ro/ds: cannot create the dataset "
                              f"in {tmp_path}/ro (Read-only file system)")
    assert listing.split() == ["./ro"]


JOB = """[job]
name = "gen"
[model]
kind = "cosmoflow"
n_conv_blocks = 1
base_filters = 2
dense = [4]
[data]
path = "small/ds"
generate = true
size = 16
samples = 8
shards = 2
[train]
steps = 2
global_batch = 2
"""


def test_generation_inside_run_on_a_full_disk(tmp_path):
    """Before: a segfault with no meta.json and empty logs."""
    (tmp_path / "job.toml").write_text(JOB)
    code, err, listing = hpcpar(tmp_path, FULL, "run", "job.toml", "-n", "1", "--run-dir",
                                "rd")
    assert code == 2, err
    line = one_error(err)
    assert line == ("hpcpar: error: [rank 0] small/ds: not enough space for the dataset (about "
                    "0.6 MiB needed: No space left on device); nothing was written")
    assert "./small/ds" not in listing.split()
    meta = json.loads((tmp_path / "rd" / "meta.json").read_text())
    assert meta["status"] == "failed" and meta["end_time"], meta
    assert meta["end_reason"] == line.removeprefix("hpcpar: error: ")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("run")
    (root / "job.toml").write_text(JOB.replace('path = "small/ds"', 'source = "synthetic"')
                                   .replace("size = 16", "size = 4"))
    p = subprocess.run([sys.executable, "-m", "hpcpar.cli", "run", "job.toml", "-n", "1",
                        "--run-dir", "rd"], cwd=root, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=180)
    assert p.returncode == 0, p.stderr
    return root / "rd"


def test_report_into_a_full_disk(tmp_path, finished_run):
    """Before: one line, but runs.csv and scaling.csv were left in OUT, a report without its
    report.md. (A read-only OUT was one line with nothing written already.)"""
    code, err, listing = hpcpar(tmp_path, FULL.replace("64k", "16k"), "report", finished_run,
                                "--out", "small/rep")
    assert code == 2, err
    assert one_error(err) == ("hpcpar: error: small/rep: cannot write the report "
                              "(No space left on device); the files it had written are removed")
    assert listing.split() == ["./small"]            # nothing of the report left behind


def test_graph_make_into_a_full_disk(tmp_path):
    """Issue 67: before, an OSError traceback and a partial graph file."""
    code, err, listing = hpcpar(tmp_path, FULL, "data", "graph", "make", "small/g.h5",
                                "--nodes", "2000")
    assert code == 2, err
    line = one_error(err)
    assert line.startswith(f"hpcpar: error: {tmp_path}/small/g.h5: not enough space for the "
                           f"graph file (about "), line
    assert line.endswith("MiB needed: No space left on device); nothing was written"), line
    assert listing.split() == ["./small"]          # no graph file, no partial one


def test_graph_partition_into_a_full_disk(tmp_path):
    """Issue 67: before, a segfault (exit 139) leaving a partial part file."""
    made = subprocess.run([sys.executable, "-m", "hpcpar.cli", "data", "graph", "make", "g.h5",
                           "--nodes", "2000"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=180)
    assert made.returncode == 0, made.stderr
    code, err, listing = hpcpar(tmp_path, FULL.replace("64k", "1m"), "data", "graph",
                                "partition", "g.h5", "small/p", "--parts", "2")
    assert code == 2, err
    line = one_error(err)
    assert line.startswith("hpcpar: error: small/p: not enough space for the partitioned graph "
                           "(about "), line
    assert line.endswith("MiB needed: No space left on device); nothing was written"), line
    assert listing.split() == ["./g.h5", "./small"]     # no part, no work folder


def test_run_into_a_read_only_file_system(tmp_path):
    """Issue 67: a run directory to make on a read-only file system was an OSError traceback
    (an existing one there: one line already, the lock's)."""
    (tmp_path / "job.toml").write_text(JOB.replace('path = "small/ds"', 'source = "synthetic"'))
    code, err, listing = hpcpar(tmp_path, READ_ONLY, "run", "job.toml", "-n", "1",
                                "--run-dir", "ro/rd")
    assert code == 2, err
    assert one_error(err) == ("hpcpar: error: --run-dir ro/rd: cannot create it (Read-only file "
                              "system)")
    assert listing.split() == ["./job.toml", "./ro"]
