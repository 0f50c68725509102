"""Make a small CosmoFlow-like dataset and read it per rank:
``mpiexec -n 4 python examples/read_shards.py [DIR]``.

Grid 2 data groups x 2 spatial ranks (x splits D): every step each rank gets its half-volume
of its data group's share of the global batch, read by a prefetch process.
"""

import os
import shutil
import sys
import tempfile

from mpi4py import MPI

import hpcpar
from hpcpar.data import CosmoflowSource, ShardedVolumeDataset, shard_counts, write_dataset

comm = MPI.COMM_WORLD
grid = hpcpar.ProcessGrid(data=2 if comm.size % 2 == 0 else 1, x=-1)
keep = len(sys.argv) > 1
root = comm.bcast(sys.argv[1] if keep else tempfile.mkdtemp() if comm.rank == 0 else None)
path = os.path.join(root, "cosmo16")
if not os.path.exists(path):  # same as: hpcpar data make cosmoflow DIR/cosmo16 --samples 16 ...
    write_dataset(path, CosmoflowSource(samples=16, size=32, channels=4, seed=0),
                  shard_counts(16, shards=4), comm=comm, progress=False)

data = ShardedVolumeDataset(path, grid, batch_size=4, shuffle=True, seed=0, prefetch=2)
for epoch in range(2):
    data.set_epoch(epoch)
    for step, (x_local, y) in enumerate(data):
        if step == 0:
            print(f"epoch {epoch} rank {grid.rank} coords {grid.coords}: x_local "
                  f"{tuple(x_local.shape)} y {tuple(y.shape)} first target "
                  f"{y[0].tolist()[:2]}", flush=True)
state = data.state_dict()  # save with the model checkpoint to resume mid-epoch exactly
print(f"rank {grid.rank}: {len(data)} steps/epoch, read {data.bytes_read} bytes, "
      f"next {state['epoch']}:{state['position']}", flush=True)
data.close()
comm.Barrier()
if comm.rank == 0 and not keep:
    shutil.rmtree(root)
