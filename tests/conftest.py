"""Shared pytest fixtures. Shared oracles and helpers live in :mod:`hpcpar.testing.oracles`
(importable inside the MPI workers too); test modules never import each other."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from hpcpar.testing.cluster import virtual_cluster  # noqa: E402,F401
from hpcpar.testing.slurm import shipped_profiles_only, slurm_cluster  # noqa: E402,F401

pytest_plugins = ["hpcpar.testing.pytest_plugin"]


@pytest.fixture()
def run_cli(capsys):
    """``run_cli(args)`` -> (exit code, stdout, stderr) of ``hpcpar ARGS`` run in this process."""
    from hpcpar.cli import main

    def run(args):
        with pytest.raises(SystemExit) as exc:
            main(args)
            raise SystemExit(0)
        out = capsys.readouterr()
        return exc.value.code or 0, out.out, out.err

    return run
