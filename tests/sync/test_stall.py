"""The stall detector: a rank that skips a step is named and the whole job aborts.

Run as a script (``mpiexec -n 3 python tests/sync/test_stall.py``) it is the scenario:
rank 1 skips one training step, so the others wait in the last gradient sync.
"""

import os
import subprocess
import sys
import time

import pytest

from hpcpar.errors import ConfigError
from hpcpar.launch.mpiexec import find_mpiexec, rank_env
from hpcpar.sync._stall import describe, stall_timeout
from hpcpar.testing.mpi import startup_allowance

TIMEOUT = 3  # HPCPAR_STALL_TIMEOUT in the scenario


def test_stall_timeout_parsing_and_message():
    assert stall_timeout({}) == 600.0
    assert stall_timeout({"HPCPAR_STALL_TIMEOUT": "off"}) == 0.0
    assert stall_timeout({"HPCPAR_STALL_TIMEOUT": "2.5"}) == 2.5
    with pytest.raises(ConfigError, match="HPCPAR_STALL_TIMEOUT"):
        stall_timeout({"HPCPAR_STALL_TIMEOUT": "soon"})
    line = describe(0, 5, [5, 4, None, 5], 9.0, 8.0, "gradient sync")
    assert "rank(s) 1, 2 have not reached gradient sync #5" in line
    assert "rank 1 is at #4" in line and "rank 2 did not answer" in line
    assert "every rank has reached it" in describe(0, 5, [5, 5], 9.0, 8.0, "gradient sync")


def test_rank_that_skips_a_step_is_named_and_job_aborts():
    nprocs = 3
    env = rank_env({"HPCPAR_STALL_TIMEOUT": str(TIMEOUT)})
    start = time.monotonic()
    proc = subprocess.run([find_mpiexec(), "-n", str(nprocs), sys.executable,
                           os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=startup_allowance(nprocs) + TIMEOUT + 30)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "rank(s) 1 have not reached gradient sync #3" in out, out
    assert "rank 1 is at #2" in out, out
    assert "rank 0 finished" not in out and "rank 2 finished" not in out, out
    assert time.monotonic() - start < startup_allowance(nprocs) + TIMEOUT + 30


def _scenario():
    import torch
    from torch import nn

    import hpcpar

    grid = hpcpar.ProcessGrid()
    torch.manual_seed(0)
    ddp = hpcpar.DDP(nn.Linear(4, 2), grid)
    for step in range(3):
        if grid.rank == 1 and step == 1:
            continue  # e.g. a data loader that gave this rank one batch less
        ddp(torch.randn(2, 4)).sum().backward()
    print(f"rank {grid.rank} finished", flush=True)


if __name__ == "__main__":
    _scenario()
