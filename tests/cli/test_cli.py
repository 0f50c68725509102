"""The CLI skeleton: help, version, info, the rank table, one-line errors with exit code 2."""

import subprocess
import sys

import hpcpar


def hp(*args):
    return subprocess.run([sys.executable, "-m", "hpcpar.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_help_and_version():
    r = hp("--help")
    assert r.returncode == 0
    for cmd in ("info", "run", "sweep", "report", "submit", "data", "plan"):
        assert cmd in r.stdout
    r = hp("--version")
    assert r.returncode == 0 and hpcpar.__version__ in r.stdout


def test_info_reports_environment():
    r = hp("info")
    assert r.returncode == 0, r.stderr
    for label in ("python", "torch", "mpi4py", "MPI library", "numba", "h5py",
                  "CUDA available", "CUDA-aware MPI", "inside Slurm"):
        assert label in r.stdout


def test_info_rank_table():
    r = hp("info", "--ranks", "8", "--grid", "2x2x2x1", "--ranks-per-node", "4")
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()[2:]]
    assert len(rows) == 8
    assert rows[5] == ["5", "1", "1", "0", "0", "1"]  # rank 5 = data 1, x 1, node 1


def test_user_errors_are_one_line_exit_2():
    for args in (["info", "--ranks", "6", "--grid", "2x2x1x1"], ["info", "--grid", "2xq"],
                 ["no-such-command"], ["info", "--ranks", "0"]):
        r = hp(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = hp("info", "--ranks", "6", "--grid", "2x2x1x1")
    assert "grid 2x2x1x1 needs 4 ranks, the job has 6" in r.stderr
