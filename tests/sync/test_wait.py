"""The end-of-backward wait of hpcpar.DDP: a rank whose peer is late sleeps, it does not spin."""

import time

import torch
from torch import nn

import hpcpar
from hpcpar.testing import mpi_case

LATE = 0.4  # seconds rank 1 arrives after rank 0


def _wait_for_late_peer(comm, width: int, plan: str):
    """Rank 1 starts its backward LATE seconds after rank 0; returns rank 0's (wall, cpu)
    seconds in backward and checks the gradients are the exact average."""
    r = comm.Get_rank()
    torch.manual_seed(0)
    model = nn.Linear(width, width)
    ddp = hpcpar.DDP(model, hpcpar.ProcessGrid())
    assert {b.plan for b in ddp._buckets} == {plan}
    x = torch.full((2, width), float(r + 1))
    loss = ddp(x).square().mean()
    comm.Barrier()
    if r == 1:
        time.sleep(LATE)
    t0, c0 = time.perf_counter(), time.process_time()
    loss.backward()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    ref = nn.Linear(width, width)
    ref.load_state_dict(model.state_dict())
    every = []
    for q in range(comm.Get_size()):
        ref.zero_grad()
        ref(torch.full((2, width), float(q + 1))).square().mean().backward()
        every.append(ref.weight.grad.clone())
    want = (every[0] + every[1]) / 2
    assert torch.equal(model.weight.grad, want)
    return wall, cpu


@mpi_case(nprocs=(2,), timeout=60)
def test_late_peer_wait_sleeps_small_and_shared_buckets(comm):
    for width, plan in ((40, "gather"), (400, "shared")):
        wall, cpu = _wait_for_late_peer(comm, width, plan)
        if comm.Get_rank() == 0:
            assert wall >= 0.8 * LATE, (plan, wall)
            assert cpu < 0.3 * wall, (plan, wall, cpu)  # a polling wait burns all of it
