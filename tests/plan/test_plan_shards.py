"""The planner on a sharded graph (``[data] path`` = ``hpcpar data graph partition``'s output):
its parts are the ones a run reads, counted part by part without loading the whole graph."""

from pathlib import Path

import numpy as np

from hpcpar.testing import mpi_case, shared_tmpdir


def _shards(tmp: Path, parts: int, directed: bool = False) -> str:
    """A 700-vertex power-law graph partitioned into ``parts`` parts (streaming)."""
    from hpcpar.graph.format import write_graph
    from hpcpar.graph.generate import power_law_community_graph
    from hpcpar.graph.stream_partition import partition_graph

    tmp.mkdir(parents=True, exist_ok=True)

    g = power_law_community_graph(700, 6.0, communities=5, features=7, classes=3, seed=1,
                                  directed=directed)
    write_graph(str(tmp / "g.h5"), 700, g["x"], g["y"], g["masks"],
                csr=(g["indptr"], g["indices"]), directed=directed, num_classes=3)
    partition_graph(str(tmp / "g.h5"), str(tmp / "shards"), parts, "stream", block=101)
    return str(tmp / "shards")


def _work(path: str):
    from hpcpar.plan.job import workload_from_job

    return workload_from_job("jobs/demo-gcn-cora.toml", [f"data.path={path}"])


@mpi_case(nprocs=3, timeout=300)
def test_shard_parts_are_what_the_run_builds(comm):
    """Per rank, the planner's owned vertices, in-edges, halo and peers equal
    ``DistGraph.from_shards``'s on 3 uneven parts, directed and not."""
    from hpcpar import ProcessGrid
    from hpcpar.graph.distgraph import DistGraph
    from hpcpar.graph.shards import RangeOwner, read_graph_manifest

    with shared_tmpdir(comm, prefix="hpcpar-plan-shards-") as tmp:
        for directed in (False, True):
            sub = tmp / f"d{int(directed)}"
            path = comm.bcast(_shards(sub, 3, directed) if comm.Get_rank() == 0 else None)
            g = DistGraph.from_shards(path, ProcessGrid(1, 3, 1, 1, comm=comm))
            work = _work(path)
            assert work.graph.sharded == 3 and work.graph.num_nodes == 700
            assert work.graph.widths == (7, 16, 3)
            part = work.graph.partition(3)[comm.Get_rank()]
            owner = RangeOwner(read_graph_manifest(path)["offsets"])
            peers = len(np.unique(owner[g.halo_ids]))
            assert (part.owned, part.halo, part.peers) == (g.num_owned, g.num_halo, peers)
            assert part.edges == int(g.in_degree.sum())
            comm.Barrier()


def test_plan_reads_parts_not_the_graph(tmp_path, monkeypatch, run_cli):
    """The planner never reads a part whole nor opens a graph file; halo ids read in chunks
    are the same as read at once; other rank counts are infeasible, saying why."""
    import hpcpar.graph.format as gformat
    import hpcpar.graph.shards as shards

    path = _shards(tmp_path, 2)
    m = shards.read_graph_manifest(path)
    for p in range(2):
        edges, halo = shards.part_halo(path, m, p)
        assert edges == int(shards.read_part(path, m, p)["indptr"][-1])
        e2, h2 = shards.part_halo(path, m, p, chunk=7)      # 7-entry chunks, many merges
        assert e2 == edges and np.array_equal(h2, halo) and halo.size > 0
        lo, hi = m["offsets"][p], m["offsets"][p + 1]
        assert not np.any((halo >= lo) & (halo < hi)) and np.all(np.diff(halo) > 0)

    def refuse(*a, **k):
        raise AssertionError("the planner read a whole part or graph file")

    monkeypatch.setattr(shards, "read_part", refuse)
    monkeypatch.setattr(gformat, "GraphFile", refuse)
    from hpcpar.plan.machine import Link, Machine
    from hpcpar.plan.planner import plan

    mach = Machine("t", ranks_per_node=4, flops=1e9, mem_bw=1e10, mem_per_rank=1e9,
                   io_bw=1e9, intra=Link(1e-6, 1e9), inter=Link(1e-5, 1e8))
    work = _work(path)
    parts = work.graph.partition(2)
    assert sum(p.owned for p in parts) == 700 and sum(p.edges for p in parts) == m["num_edges"]
    assert [p.peers for p in parts] == [1, 1]
    assert all(p.feasible == (p.grid[0] == 1) for p in plan(work, 2, mach))
    for p in plan(work, 4, mach):
        assert not p.feasible
        if p.grid[0] == 1:
            assert p.reason == ("the sharded graph has 2 parts, a run needs 2 ranks (or "
                                "partition it again with --parts 4)")
    rc, out, err = run_cli(["plan", "jobs/demo-gcn-cora.toml", "-n", "2", "--set",
                            f"data.path={path}"])
    assert rc == 0 and "Traceback" not in err, err
    assert "1x2x1x1" in out


def test_plan_cli_on_the_wrong_rank_count_says_why(tmp_path, run_cli):
    path = _shards(tmp_path, 2)
    rc, out, err = run_cli(["plan", "jobs/demo-gcn-cora.toml", "-n", "3", "--set",
                            f"data.path={path}"])
    assert "the sharded graph has 2 parts, a run needs 2 ranks" in out + err, (out, err)
