"""Per-rank memory levers of the graph build (what lets the 1M-vertex job scale, see
benchmarks/gnn_scale.py): METIS takes an undirected graph file's CSR without a symmetrised
copy and partitions exactly as before; only rank 0, only for METIS on several ranks, reads
the whole structure; every rank holds only its own rows plus its halo."""

import os

import numpy as np

from hpcpar.graph import partition_csr, power_law_community_graph
from hpcpar.graph._csr import csr_to_edges, edges_to_csr
from hpcpar.graph.vertex_partition import _metis_graph
from hpcpar.testing import mpi_case, shared_tmpdir


def _with_loops(g, every=97):
    e = csr_to_edges(g["indptr"], g["indices"])
    n = g["indptr"].shape[0] - 1
    loops = np.arange(0, n, every)
    return edges_to_csr(np.concatenate([e, np.stack([loops, loops])], axis=1), n)


def test_symmetric_csr_goes_to_metis_without_copy_and_partitions_alike():
    g = power_law_community_graph(6000, 8, 16, 4, 4, seed=2)
    ip, ix = g["indptr"], g["indices"]
    xadj, adj = _metis_graph(ip, ix, symmetric=True)
    assert xadj is ip and adj is ix  # zero copy
    ref = partition_csr(ip, ix, 4, "metis", seed=1)
    np.testing.assert_array_equal(partition_csr(ip, ix, 4, "metis", seed=1, symmetric=True),
                                  ref)
    # self loops: dropped from METIS's graph on both paths, same adjacency, same parts
    lip, lix = _with_loops(g)
    fast, slow = _metis_graph(lip, lix, True), _metis_graph(lip, lix, False)
    for a, b in zip(fast, slow):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(partition_csr(lip, lix, 3, "metis", symmetric=True),
                                  partition_csr(lip, lix, 3, "metis"))


def test_a_directed_graph_claimed_symmetric_is_still_symmetrised():
    g = power_law_community_graph(3000, 6, 8, 4, 4, seed=4, directed=True)
    ip, ix = g["indptr"], g["indices"]
    for a, b in zip(_metis_graph(ip, ix, True), _metis_graph(ip, ix, False)):
        np.testing.assert_array_equal(a, b)


@mpi_case(nprocs=(1, 2, 4), timeout=180)
def test_each_rank_holds_its_rows_and_halo_only(comm):
    from hpcpar.graph import DistGraph
    from hpcpar.graph.format import GraphFile, write_graph

    n = 3000
    g = power_law_community_graph(n, 8, 16, 12, 4, seed=5)
    with shared_tmpdir(comm, prefix="hpcpar-graph-memory-") as tmp:
        path = os.path.join(tmp, "g.h5")
        if comm.Get_rank() == 0:
            write_graph(path, n, g["x"], g["y"], g["masks"], csr=(g["indptr"], g["indices"]))
        comm.Barrier()
        reads = []
        original = GraphFile.read_structure

        def counting(self):
            reads.append(1)
            return original(self)

        GraphFile.read_structure = counting
        try:
            for method in ("metis", "block"):
                reads.clear()
                dg = DistGraph.from_hdf5(path, comm, method=method)
                whole = method == "metis" and comm.Get_size() > 1 and comm.Get_rank() == 0
                assert len(reads) == int(whole), (method, comm.Get_rank(), reads)
                ids = dg.global_ids
                assert dg.x.shape == (dg.num_owned, 12)
                np.testing.assert_array_equal(dg.x.numpy(), g["x"][ids])
                assert dg.src_ids.shape[0] == dg.cols.shape[0] == \
                    int(np.diff(g["indptr"])[ids].sum())
                # the halo is exactly the off-rank in-neighbours, nothing more
                src = np.concatenate([g["indices"][g["indptr"][i]:g["indptr"][i + 1]] for i in ids])
                need = np.setdiff1d(src, ids)
                np.testing.assert_array_equal(np.sort(dg.halo_ids), need)
                assert comm.allreduce(dg.num_owned) == n
                if comm.Get_size() == 4 and method == "metis":
                    assert dg.num_owned + dg.num_halo < n  # a part, not the graph
        finally:
            GraphFile.read_structure = original
