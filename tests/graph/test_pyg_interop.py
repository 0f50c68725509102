"""PyTorch Geometric interop: ``DistGraph.from_pyg`` partitions a PyG ``Data``;
DistGCNConv/DistSAGEConv load a PyG layer's state_dict and equal PyG's forward (and weight
gradients) on the whole graph, directed with a self loop and undirected, on 1 and 2 ranks;
``hpcpar data graph import`` takes a saved PyG Data and an edge list + features file."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from hpcpar.testing import mpi_case

pytest.importorskip("torch_geometric")


def _pyg_graph(directed: bool, n: int = 40, f: int = 6, seed: int = 0):
    from torch_geometric.data import Data
    from torch_geometric.utils import coalesce, to_undirected

    g = torch.Generator().manual_seed(seed)
    e = torch.randint(0, n, (2, 4 * n), generator=g)
    e = torch.cat([e, torch.tensor([[3], [3]])], 1)            # a self loop (not doubled)
    e = e[:, e[1] != 7]                                          # vertex 7: no in-edges
    e = to_undirected(e, num_nodes=n) if not directed else coalesce(e, num_nodes=n)
    perm = torch.randperm(n, generator=g)
    masks = {m: torch.zeros(n, dtype=torch.bool) for m in ("train", "val", "test")}
    masks["train"][perm[:20]], masks["val"][perm[20:30]], masks["test"][perm[30:]] = (True,) * 3
    return Data(x=torch.randn(n, f, generator=g), edge_index=e,
                y=torch.randint(0, 3, (n,), generator=g), num_nodes=n,
                **{f"{m}_mask": v for m, v in masks.items()})


@mpi_case(nprocs=(1, 2), timeout=180)
def test_layers_load_pyg_state_and_match_pyg_forward(comm):
    from mpi4py import MPI
    from torch_geometric.nn import GCNConv, SAGEConv

    from hpcpar import ProcessGrid
    from hpcpar.graph import DistGraph
    from hpcpar.nn import DistGCNConv, DistSAGEConv

    grid = ProcessGrid(1, comm.Get_size(), comm=comm)
    for directed in (True, False):
        data = _pyg_graph(directed)
        graph = DistGraph.from_pyg(data, grid, method="random")
        ids = torch.as_tensor(graph.global_ids)
        assert torch.equal(graph.x, data.x[ids]) and torch.equal(graph.y, data.y[ids])
        assert (graph.num_train, graph.num_val, graph.num_test) == (20, 10, 10)
        for width in (3, 9):                       # both sides of the "narrower side" switch
            torch.manual_seed(width)
            pairs = [(GCNConv(6, width), DistGCNConv(6, width)),
                     (SAGEConv(6, width), DistSAGEConv(6, width)),
                     (SAGEConv(6, width, aggr="sum"), DistSAGEConv(6, width, aggr="sum"))]
            for pyg, dist in pairs:
                pyg.double()
                torch.nn.init.normal_(pyg.state_dict()[next(k for k in pyg.state_dict()
                                                            if k.endswith("bias"))])
                dist.load_state_dict(pyg.state_dict())            # strict: same keys
                dist.double()
                want = pyg(data.x.double(), data.edge_index)
                got = dist(graph.x.double(), graph)
                what = f"{type(pyg).__name__} width {width} directed {directed}"
                torch.testing.assert_close(got, want[ids], msg=what)
                weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(1),
                                     dtype=torch.float64)
                (want * weight).sum().backward()
                (got * weight[ids]).sum().backward()
                for (name, p), q in zip(pyg.named_parameters(), dist.parameters()):
                    g = q.grad.clone()
                    comm.Allreduce(MPI.IN_PLACE, g.numpy(), op=MPI.SUM)
                    torch.testing.assert_close(g, p.grad, msg=f"{what}: grad of {name}")


def test_repeated_edges_are_merged_with_a_warning():
    from hpcpar.graph.interop import pyg_arrays

    data = _pyg_graph(directed=True)
    simple = pyg_arrays(data)["edge_index"]
    data.edge_index = torch.cat([data.edge_index, data.edge_index[:, :3]], 1)
    with pytest.warns(UserWarning, match="3 repeated edge"):
        pyg_arrays(data)
    assert simple.shape[1] == data.edge_index.shape[1] - 3


def _hpcpar(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hpcpar.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_import_saved_pyg_data_and_edge_list(tmp_path):
    from hpcpar.graph import GraphFile
    from hpcpar.graph._csr import edges_to_csr

    data = _pyg_graph(directed=True)
    torch.save(data, tmp_path / "g.pt")
    p = _hpcpar("data", "graph", "import", "g.pt", "g.h5", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "40 nodes" in p.stdout and "directed" in p.stdout and "20/10/10" in p.stdout
    indptr, indices = edges_to_csr(data.edge_index.numpy(), 40)
    with GraphFile(tmp_path / "g.h5") as f:
        got_ptr, got_idx = f.read_structure()
        rows = f.read_rows(0, 40)
    np.testing.assert_array_equal(got_ptr, indptr)
    np.testing.assert_array_equal(got_idx, indices)
    np.testing.assert_allclose(rows["x"], data.x.numpy())
    np.testing.assert_array_equal(rows["y"], data.y.numpy())
    np.testing.assert_array_equal(rows["train"], data.train_mask.numpy())

    e = data.edge_index.numpy()
    (tmp_path / "edges.txt").write_text("# src dst\nsource,target\n" + "".join(
        f"{s}\t{d}\n" for s, d in e.T))
    np.save(tmp_path / "x.npy", data.x.numpy())
    np.savetxt(tmp_path / "y.txt", data.y.numpy(), fmt="%d")
    p = _hpcpar("data", "graph", "import", "edges.txt", "e.h5", "--features", "x.npy",
                "--labels", "y.txt", "--split", "0.5,0.25", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    with GraphFile(tmp_path / "e.h5") as f:
        np.testing.assert_array_equal(f.read_structure()[1], indices)
        rows = f.read_rows(0, 40)
    np.testing.assert_array_equal(rows["y"], data.y.numpy())
    assert [int(rows[m].sum()) for m in ("train", "val", "test")] == [20, 10, 10]
    assert (rows["train"].astype(int) + rows["val"] + rows["test"] == 1).all()
    p = _hpcpar("data", "graph", "import", "edges.txt", "e2.h5", cwd=tmp_path)
    assert p.returncode == 2 and "needs --features" in p.stderr
