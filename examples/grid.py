"""The 4D process grid and tensor collectives: run with ``mpiexec -n 4 python examples/grid.py``."""

import torch
from mpi4py import MPI

import hpcpar
from hpcpar.parallel import comm as hc

grid = hpcpar.ProcessGrid(data=2, x=-1)        # 4 ranks -> 2 data groups x 2 spatial ranks
d, i, j, k = grid.coords
lo, hi = grid.neighbors("x")                    # ranks in grid.spatial_comm, PROC_NULL at edges

# Sum a tensor over my spatial group (the ranks holding pieces of the same samples) ...
t = torch.full((3,), float(grid.rank))
hc.allreduce_(t, grid.spatial_comm)
# ... and average it over the data axis (16-bit tensors travel as int16, reduce in fp32).
h = torch.ones(3, dtype=torch.bfloat16)
hc.allreduce_(h, grid.data_comm)

for r in range(grid.size):
    if r == grid.rank:
        print(f"rank {grid.rank}: coords (data={d}, x={i}, y={j}, z={k}) "
              f"x-neighbours ({'-' if lo == MPI.PROC_NULL else lo}, "
              f"{'-' if hi == MPI.PROC_NULL else hi}) spatial sum {t.tolist()} "
              f"data sum {h.tolist()} node {grid.node_index}/{grid.num_nodes}", flush=True)
    grid.comm.Barrier()
