"""Data-parallel training with hpcpar.DDP: run with ``mpiexec -n 4 python examples/ddp.py``.

Every rank trains on its own quarter of each global batch; after ``loss.backward()`` the
gradients are the average over ranks, i.e. the gradient of the mean loss over the global
batch. Every second step accumulates two micro-batches with ``no_sync()`` first.
"""

import contextlib

import torch
from torch import nn

import hpcpar
from hpcpar.parallel.counters import COUNTERS

grid = hpcpar.ProcessGrid(data=-1)              # all ranks on the data axis
torch.manual_seed(0)                            # (rank 0's weights are broadcast anyway)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
ddp = hpcpar.DDP(model, grid)                   # also hpcpar.DistributedDataParallel
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

per_rank = 8
data = torch.Generator().manual_seed(1)         # the same global data stream on every rank
w_true = torch.randn(16, 1, generator=data)
start = COUNTERS.snapshot()
for step in range(20):
    micro = 2 if step % 2 else 1                # gradient accumulation on odd steps
    opt.zero_grad()
    for m in range(micro):
        x = torch.randn(per_rank * grid.size, 16, generator=data)
        y = x @ w_true
        mine = slice(grid.rank * per_rank, (grid.rank + 1) * per_rank)
        last = m == micro - 1
        with contextlib.nullcontext() if last else ddp.no_sync():  # no_sync: local only
            loss = ((ddp(x[mine]) - y[mine]) ** 2).mean() / micro  # mean over micro-batches
            loss.backward()                     # the last one syncs all accumulated grads
    opt.step()
    if grid.is_root and step % 5 == 4:
        print(f"step {step + 1:2d}  loss {loss.item() * micro:.4f}", flush=True)

stats = COUNTERS.since(start)
same = len(set(grid.comm.allgather(model[0].weight.sum().item()))) == 1
if grid.is_root:
    print(f"{ddp.sync_steps} syncs, {stats['bytes_allreduce'] / 1e6:.2f} MB reduced, "
          f"comm {stats['t_allreduce_total'] * 1e3:.1f} ms of which exposed "
          f"{stats['t_allreduce_exposed'] * 1e3:.1f} ms; ranks identical: {same}")
