"""ProcessGrid: factorisations, inferred axes, rank order, sub-communicators, neighbours."""

import itertools
from types import MappingProxyType

import pytest

from hpcpar import GridError, ProcessGrid
from hpcpar.parallel.grid import coords_of, layout, parse_spec, rank_of, resolve_shape
from hpcpar.testing import mpi_case


def factorisations(n):
    for d, x, y in itertools.product(range(1, n + 1), repeat=3):
        if n % (d * x * y) == 0:
            yield (d, x, y, n // (d * x * y))


# ---- serial ---------------------------------------------------------------------------------
def test_coords_roundtrip_and_x_fastest():
    shape = (2, 3, 2, 2)
    seen = [coords_of(r, shape) for r in range(24)]
    assert len(set(seen)) == 24
    assert all(rank_of(c, shape) == r for r, c in enumerate(seen))
    assert seen[1] == (0, 1, 0, 0) and seen[3] == (0, 0, 1, 0) and seen[6] == (0, 0, 0, 1)
    assert seen[12] == (1, 0, 0, 0)


def test_resolve_and_errors():
    assert resolve_shape((-1, 2, 1, 1), 8) == (4, 2, 1, 1)
    assert resolve_shape((2, -1, 1, 1), 6) == (2, 3, 1, 1)
    with pytest.raises(GridError, match=r"grid 2x2x1x1 needs 4 ranks, the job has 6"):
        resolve_shape((2, 2, 1, 1), 6)
    with pytest.raises(GridError, match="axis x must be positive"):
        resolve_shape((1, 0, 1, 1), 1)
    with pytest.raises(GridError, match="at most one axis"):
        resolve_shape((-1, -1, 1, 1), 4)
    with pytest.raises(GridError, match="not divisible"):
        resolve_shape((-1, 3, 1, 1), 4)
    assert parse_spec("2x2x1x1") == (2, 2, 1, 1)
    assert parse_spec("4") == (4, 1, 1, 1)
    with pytest.raises(GridError, match="expected integers"):
        parse_spec("2xax1")


def test_layout_blocks_spatial_groups_on_nodes():
    table = layout((2, 2, 2, 1), ranks_per_node=4)
    # each spatial group (same data coordinate) sits on one node
    for entry in table:
        assert entry.node == entry.coords[0]


# ---- MPI ------------------------------------------------------------------------------------
@mpi_case(nprocs=(1, 2, 3, 4, 6, 8), timeout=120)
def test_every_factorisation(comm):
    from mpi4py import MPI

    n = comm.Get_size()
    for shape in factorisations(n):
        g = ProcessGrid(*shape, comm=comm)
        assert g.shape == shape and g.size == n and g.rank == comm.Get_rank()
        assert g.coords == coords_of(g.rank, shape)
        # sub-communicator membership
        members = g.spatial_comm.allgather(g.coords)
        assert all(c[0] == g.coords[0] for c in members)
        assert len(members) == shape[1] * shape[2] * shape[3]
        dmembers = g.data_comm.allgather(g.coords)
        assert [c[0] for c in dmembers] == list(range(shape[0]))
        assert all(c[1:] == g.coords[1:] for c in dmembers)
        for a, name in enumerate(("data", "x", "y", "z")):
            ac = g.axis_comm(name)
            assert ac.Get_size() == shape[a] and ac.Get_rank() == g.coords[a]
            got = ac.allgather(g.coords)
            for c in got:
                assert all(c[b] == g.coords[b] for b in range(4) if b != a)
        # neighbours: symmetric, PROC_NULL on the boundary
        for a, name in enumerate(("x", "y", "z")):
            lo, hi = g.neighbors(name)
            assert (lo == MPI.PROC_NULL) == (g.coords[a + 1] == 0)
            assert (hi == MPI.PROC_NULL) == (g.coords[a + 1] == shape[a + 1] - 1)
            # my hi's lo is me: exchange my spatial rank with both neighbours
            me = g.spatial_comm.Get_rank()
            from_lo = g.spatial_comm.sendrecv(me, dest=hi, source=lo)
            from_hi = g.spatial_comm.sendrecv(me, dest=lo, source=hi)
            assert from_lo == (None if lo == MPI.PROC_NULL else lo)
            assert from_hi == (None if hi == MPI.PROC_NULL else hi)
        g.free()


@mpi_case(nprocs=(2, 4), timeout=60)
def test_inferred_axes_and_parse(comm):
    n = comm.Get_size()
    assert ProcessGrid(comm=comm).shape == (n, 1, 1, 1)
    assert ProcessGrid(data=1, x=-1, comm=comm).shape == (1, n, 1, 1)
    assert ProcessGrid.parse(f"1x1x1x{n}", comm=comm).shape == (1, 1, 1, n)
    assert ProcessGrid.from_spec({"data": -1, "x": 2}, comm=comm).shape == (n // 2, 2, 1, 1)
    # any mapping, not only a dict (it read a read-only mapping's keys as the axes)
    read_only = MappingProxyType({"data": -1, "x": 2})
    assert ProcessGrid.from_spec(read_only, comm=comm).shape == (n // 2, 2, 1, 1)
    with pytest.raises(GridError, match=f"needs {n + 1} ranks, the job has {n}"):
        ProcessGrid(n + 1, 1, 1, 1, comm=comm)


@mpi_case(nprocs=(4, 6), timeout=60)
def test_fake_nodes(comm):
    import os

    os.environ["HPCPAR_FAKE_NODES"] = "2"
    try:
        g = ProcessGrid(comm=comm)
        assert g.num_nodes == 2
        assert g.node_comm.Get_size() == comm.Get_size() // 2
        assert g.node_index == comm.Get_rank() // (comm.Get_size() // 2)
    finally:
        del os.environ["HPCPAR_FAKE_NODES"]
    g = ProcessGrid(comm=comm)
    assert g.num_nodes == 1 and g.node_comm.Get_size() == comm.Get_size()
