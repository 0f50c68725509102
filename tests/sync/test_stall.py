"""The stall detector: a rank that skips a step is named and the whole job aborts; so is a
rank that stops running inside a sync (issue 67: "every rank has reached it" before).

Run as a script (``mpiexec -n 3 python tests/sync/test_stall.py [skip|stop]``) it is the
scenario: rank 1 skips one training step, so the others wait in the last gradient sync; or
rank 1 suspends itself (SIGSTOP) right after it has launched that sync.
"""

import os
import signal
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
    assert describe(0, 5, [5, 5, 4], 9.0, 8.0, "gradient sync", stopped=[1]) == (
        "hpcpar: stall: rank 0 waited 9.0 s (HPCPAR_STALL_TIMEOUT=8) in gradient sync #5; "
        "rank(s) 1 stopped running (at gradient sync #5: no heartbeat; suspended or frozen?); "
        "rank(s) 2 have not reached gradient sync #5 (rank 2 is at #4); aborting the job")
    # stopped before this sync (the multinode test's SIGSTOP between two steps): both said
    line = describe(0, 2, [2, 2, 2, 1], 9.0, 8.0, "gradient sync", stopped=[3])
    assert "rank(s) 3 stopped running (at gradient sync #1" in line
    assert "rank(s) 3 have not reached gradient sync #2 (rank 3 is at #1)" in line


def _launch(case: str) -> str:
    """Run the scenario on 3 ranks; its output (the job must fail, in time)."""
    nprocs = 3
    env = rank_env({"HPCPAR_STALL_TIMEOUT": str(TIMEOUT)})
    start = time.monotonic()
    proc = subprocess.run([find_mpiexec(), "-n", str(nprocs), sys.executable,
                           os.path.abspath(__file__), case], env=env, capture_output=True,
                          text=True, timeout=startup_allowance(nprocs) + TIMEOUT + 30)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert time.monotonic() - start < startup_allowance(nprocs) + TIMEOUT + 30
    return out


def test_rank_that_skips_a_step_is_named_and_job_aborts():
    out = _launch("skip")
    assert "rank(s) 1 have not reached gradient sync #3" in out, out
    assert "rank 1 is at #2" in out, out
    assert "rank 0 finished" not in out and "rank 2 finished" not in out, out


def test_rank_stopped_inside_a_sync_is_named():
    out = _launch("stop")
    assert "rank(s) 1 stopped running (at gradient sync #3: no heartbeat; suspended or " \
           "frozen?); aborting the job" in out, out
    assert "every rank has reached it" not in out, out


def _scenario():
    import torch
    from torch import nn

    import hpcpar

    case = sys.argv[1] if len(sys.argv) > 1 else "skip"
    grid = hpcpar.ProcessGrid()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    # a bucket per parameter: rank 1 stops between its two launches of sync #3, so the
    # others cannot finish it (stopped after its last launch, its messages could already
    # complete theirs, and they finished while mpiexec waited for it: a flaky hang)
    ddp = hpcpar.DDP(model, grid, bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
    ready = []

    def suspend(param):     # runs after DDP's own hook (registered first): launched by then
        ready.append(param)
        if len(ready) == 2 * 2 + 1:
            os.kill(os.getpid(), signal.SIGSTOP)   # e.g. a node that froze mid-step

    if case == "stop" and grid.rank == 1:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(suspend)
    for step in range(3):
        if case == "skip" and grid.rank == 1 and step == 1:
            continue  # e.g. a data loader that gave this rank one batch less
        ddp(torch.randn(2, 4)).sum().backward()
    print(f"rank {grid.rank} finished", flush=True)


if __name__ == "__main__":
    _scenario()
