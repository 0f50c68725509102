"""Shared pytest fixtures. Shared oracles live in :mod:`hpcpar.testing.oracles`, the suite's
own helpers in ``tests/support/`` (both importable inside the MPI workers too); test modules
never import each other."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from hpcpar.testing.cluster import virtual_cluster  # noqa: E402,F401
from hpcpar.testing.slurm import shipped_profiles_only, slurm_cluster  # noqa: E402,F401

pytest_plugins = ["hpcpar.testing.pytest_plugin"]


# The one door from the tests into the CLI (tests/test_layout.py refuses any other import of
# hpcpar.cli under tests/ and benchmarks/): commands are reached as a user reaches them, by
# name and arguments, never by importing what a command module holds.
@pytest.fixture(scope="session")
def cli_main():
    """``cli_main(args)``: ``hpcpar ARGS`` in this process; exits with SystemExit like the
    command (session-scoped, so hypothesis tests may use it)."""
    from hpcpar.cli import main

    return main


@pytest.fixture(scope="session")
def cli_group():
    """The ``hpcpar`` click group: for click's CliRunner and for walking every command."""
    from hpcpar.cli import cli

    return cli


@pytest.fixture()
def run_cli(capsys, cli_main):
    """``run_cli(args)`` -> (exit code, stdout, stderr) of ``hpcpar ARGS`` run in this process."""
    def run(args):
        with pytest.raises(SystemExit) as exc:
            cli_main(args)
            raise SystemExit(0)
        out = capsys.readouterr()
        return exc.value.code or 0, out.out, out.err

    return run
