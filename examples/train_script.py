"""Your own model and training loop, no CLI: spatial + data parallel, records for reports.

    hpcpar data make cosmoflow data/c16 --samples 32 --size 16 --shards 2
    mpiexec -n 2 python examples/train_script.py data/c16 runs/script
    hpcpar report runs/script
"""
import sys
import time

import torch
from torch import nn

import hpcpar
from hpcpar.data import ShardedVolumeDataset
from hpcpar.formats.records import RunRecorder
from hpcpar.nn import spatialize

data_dir, run_dir = sys.argv[1], sys.argv[2]
grid = hpcpar.ProcessGrid(data=1, x=-1)           # every rank holds a slab of each volume
data = ShardedVolumeDataset(data_dir, grid, batch_size=4, seed=0)
torch.manual_seed(0)                              # identical initial weights on every rank
net = nn.Sequential(nn.Conv3d(4, 8, 3, padding=1), nn.ReLU(), nn.MaxPool3d(2),
                    nn.Conv3d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool3d(1),
                    nn.Flatten(), nn.Linear(8, 4))
model = hpcpar.DDP(spatialize(net, grid), grid)  # halo exchanges + gradient sync
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
rec = RunRecorder(run_dir, grid, meta={"job_name": "script", "global_batch": 4})
for epoch in range(2):
    data.set_epoch(epoch)
    for i, (x, y) in enumerate(data):
        t0 = time.perf_counter()
        loss = nn.functional.mse_loss(model(x.log1p()), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        rec.step(step=epoch * len(data) + i, loss=loss.item(), samples=len(x),
                 t_step=time.perf_counter() - t0)
rec.finish()
data.close()
