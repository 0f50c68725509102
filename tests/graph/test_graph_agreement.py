"""Ranks that disagree about a graph get one error line within seconds, never a hang.

The MPI cases give each rank a different graph (vertex count, edges, features, file); before
the agreement check the build waited forever in Alltoallv (or silently mixed graphs), so a
hang fails the case at its timeout. The scenario (``mpiexec -n 3 python
tests/graph/test_graph_agreement.py``): rank 1 runs one graph layer fewer, so the others wait
in a halo exchange until the stall detector names rank 1 and aborts the job.
"""

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from hpcpar.launch.mpiexec import find_mpiexec, rank_env
from hpcpar.testing import mpi_case, shared_tmpdir
from hpcpar.testing.mpi import startup_allowance

SECONDS = 10  # the error must come this fast (a hang would last until the case's timeout)
STALL = 3  # HPCPAR_STALL_TIMEOUT in the scenario


def _ring(n, extra=()):
    """A directed ring of ``n`` vertices plus ``extra`` edges, 4 features."""
    src = np.arange(n)
    extra = np.asarray(extra, np.int64).reshape(-1, 2).T
    e = np.concatenate([np.stack([src, (src + 1) % n]), extra], axis=1)
    return e, np.arange(4 * n, dtype=np.float32).reshape(n, 4)


def _ranks(ranks):
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _expect_one_line(comm, build, *fragments):
    from hpcpar.errors import CommError

    t0 = time.monotonic()
    with pytest.raises(CommError) as exc:
        build()
    message = str(exc.value)
    assert time.monotonic() - t0 < SECONDS, message
    assert "\n" not in message and "the ranks hold different graphs" in message, message
    for f in fragments:
        assert f in message, (f, message)
    assert comm.allgather(message) == [message] * comm.Get_size()  # the same line everywhere


@mpi_case(nprocs=(2, 4), timeout=90)
def test_ranks_with_different_graphs_get_one_line(comm):
    from torch_geometric.data import Data

    from hpcpar.graph import DistGraph

    size = comm.Get_size()
    odd = comm.Get_rank() % 2

    # a dataset sized by an unseeded RNG: the vertex count differs (this hung in Alltoallv)
    e, x = _ring(40 + odd)
    data = Data(edge_index=torch.as_tensor(e), x=torch.as_tensor(x))
    _expect_one_line(comm, lambda: DistGraph.from_pyg(data, comm, method="block"),
                     f"vertices: 40 on {_ranks(range(0, size, 2))}; "
                     f"41 on {_ranks(range(1, size, 2))}")
    # same counts, one edge elsewhere: only the structure checksum tells
    e, x = _ring(40, extra=[(0, 20 + odd)])
    _expect_one_line(comm, lambda: DistGraph.from_global(e, 40, x, comm, method="block"),
                     "structure checksum: ")
    # same structure, other features
    e, x = _ring(40)
    _expect_one_line(comm, lambda: DistGraph.from_global(e, 40, x + odd, comm),
                     "features/labels/masks checksum: ")
    # after all that, the same graph still builds
    assert comm.allreduce(DistGraph.from_global(e, 40, x, comm).num_owned) == 40


@mpi_case(nprocs=(2,), timeout=90)
def test_ranks_reading_different_files_get_one_line(comm):
    from hpcpar.graph import DistGraph
    from hpcpar.graph.format import write_graph

    rank = comm.Get_rank()
    with shared_tmpdir(comm, prefix="hpcpar-graph-agreement-") as folder:
        path = os.path.join(folder, f"graph-{rank}.h5")
        e, x = _ring(30 + 5 * rank)
        write_graph(path, x.shape[0], x, np.zeros(x.shape[0], np.int64),
                    {m: np.ones(x.shape[0], bool) for m in ("train", "val", "test")}, edge_index=e)
        _expect_one_line(comm, lambda: DistGraph.from_hdf5(path, comm, method="block"),
                         "DistGraph.from_hdf5: ", "vertices: 30 on rank 0; 35 on rank 1",
                         "edges: 30 on rank 0; 35 on rank 1")


def test_rank_that_skips_a_halo_exchange_is_named_and_job_aborts():
    nprocs = 3
    env = rank_env({"HPCPAR_STALL_TIMEOUT": str(STALL)})
    start = time.monotonic()
    proc = subprocess.run([find_mpiexec(), "-n", str(nprocs), sys.executable,
                           os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=startup_allowance(nprocs) + STALL + 30)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "have not reached graph halo exchange #3" in out, out
    assert "rank 1 is at #2" in out, out
    assert "finished" not in out, out
    assert time.monotonic() - start < startup_allowance(nprocs) + STALL + 30


def _scenario():
    """Three layers on ranks 0 and 2, two on rank 1 (e.g. a rank-dependent model depth)."""
    from mpi4py import MPI

    from hpcpar.graph import DistGraph

    comm = MPI.COMM_WORLD
    e, x = _ring(30)
    graph = DistGraph.from_global(e, 30, x, comm, method="block")
    h = graph.x
    for _ in range(2 if comm.Get_rank() == 1 else 3):
        h = graph.propagate(h, "sum")
    comm.Barrier()
    print(f"rank {comm.Get_rank()} finished", flush=True)


if __name__ == "__main__":
    _scenario()
