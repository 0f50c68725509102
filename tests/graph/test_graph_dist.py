"""DistGraph + DistGCNConv/DistSAGEConv equal the single-process model: forward output, every
parameter gradient and the input gradient, on Cora and a synthetic directed graph, for every
partition method and 1, 2, 3, 4, 8 ranks; plus collective user errors."""

import os

import numpy as np
import pytest
import torch

from hpcpar.testing import mpi_case, shared_tmpdir
from hpcpar.testing.oracles import (
    CORA_NPZ,
    dense_operators,
    gnn_forward,
    gnn_loss,
    load_cora,
    train_cora,
)


def synthetic_directed():
    """A small directed power-law graph with a self loop, a duplicate edge and a vertex
    without in-edges (exercises: loop not doubled, dedupe, zero in-degree)."""
    from hpcpar.graph._csr import csr_to_edges
    from hpcpar.graph.generate import power_law_community_graph

    g = power_law_community_graph(120, 4, communities=4, features=6, classes=3, seed=3,
                                  directed=True)
    e = csr_to_edges(g["indptr"], g["indices"])
    e = e[:, e[1] != 7]                                         # vertex 7: no in-edges
    e = np.concatenate([e, [[5, 0], [5, 0]], e[:, :3]], axis=1)  # self loop 5->5, duplicates
    e[1, -5] = 5
    return e, g["x"], g["y"], g["masks"]


def _model(x, y, conv, dtype):
    from hpcpar.models import GCN

    torch.manual_seed(0)
    model = GCN(x.shape[1], 8, int(y.max()) + 1, dropout=0.5, conv=conv, seed=11).to(dtype)
    model.train()
    model.calls = 3
    return model


def _reference(dense, x, y, masks, conv, dtype):
    """Single-process logits, input gradient and parameter gradients (float64)."""
    state = {k: v.detach().clone().to(torch.float64).requires_grad_(True)
             for k, v in _model(x, y, conv, dtype).state_dict().items() if k != "_extra_state"}
    xr = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    logits = gnn_forward(state, xr, dense, conv, p=0.5, seed=11, call=3)
    gnn_loss(logits, torch.as_tensor(y), torch.as_tensor(masks["train"])).backward()
    return logits.detach(), xr.grad, {k: v.grad for k, v in state.items()}


def _check_model(comm, graph, expected, x, y, conv, dtype, what):
    from hpcpar.graph.metrics import masked_loss
    from hpcpar.parallel.comm import allreduce_

    tol = dict(rtol=2e-4, atol=2e-5) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-11)
    model = _model(x, y, conv, dtype)
    xl = graph.x.detach().to(dtype).clone().requires_grad_(True)
    out = model(xl, graph)
    masked_loss(out, graph).backward()
    for p in model.parameters():
        allreduce_(p.grad, comm)
    logits, x_grad, grads = expected
    what = f"{what} {conv} {dtype} rank {comm.Get_rank()}"
    torch.testing.assert_close(graph.gather(out).double(), logits, **tol, msg=what)
    torch.testing.assert_close(graph.gather(xl.grad).double(), x_grad, **tol, msg=what)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), grads[name], **tol, msg=f"{what} {name}")


@mpi_case(nprocs=(1, 2, 3, 4, 8), timeout=240)
def test_matches_single_process(comm):
    from hpcpar.graph import DistGraph

    graphs = {"cora": load_cora(), "directed": synthetic_directed()}
    for name, (e, x, y, masks) in graphs.items():
        n = x.shape[0]
        dense = dense_operators(e, n)
        # fp64 on the small graph is enough
        cases = [(c, d) for c in ("gcn", "sage") for d in (torch.float32, torch.float64)
                 if name != "cora" or d == torch.float32]
        expected = {c: _reference(dense, x, y, masks, *c) for c in cases}
        for method in ("metis", "block", "random"):
            backend = "numba" if method == "random" else "auto"  # both SpMM paths, distributed
            g = DistGraph.from_global(e, n, x, comm, y=y, masks=masks, method=method, seed=1,
                                      backend=backend)
            assert g.num_train == int(masks["train"].sum())
            assert comm.allreduce(g.num_owned) == n
            assert np.all(np.diff(g.global_ids) > 0)  # owned vertices in global-id order
            for c in cases:
                _check_model(comm, g, expected[c], x, y, *c, f"{name} {method}")


@mpi_case(nprocs=(2, 4), timeout=120)
def test_masked_loss_is_the_global_loss_on_every_rank(comm):
    """``masked_loss`` of every split is the single-process loss on every rank (one loss
    convention with the volume side), and its gradients, summed over the ranks, are the
    single-process gradients: the value is not counted once per rank."""
    import torch.nn.functional as F

    from hpcpar.graph import DistGraph
    from hpcpar.graph.metrics import masked_loss

    e, x, y, masks = synthetic_directed()
    g = DistGraph.from_global(e, x.shape[0], x, comm, y=y, masks=masks, method="random", seed=2)
    torch.manual_seed(0)
    w = torch.randn(x.shape[1], int(y.max()) + 1, dtype=torch.float64)
    xs = torch.as_tensor(x, dtype=torch.float64)
    for split in ("train", "val", "test"):
        w_ref = w.clone().requires_grad_(True)
        mask = torch.as_tensor(masks[split])
        ref = F.cross_entropy((xs @ w_ref)[mask], torch.as_tensor(y)[mask])
        ref.backward()
        w_dist = w.clone().requires_grad_(True)
        loss = masked_loss(xs[g.global_ids] @ w_dist, g, split)
        loss.backward()
        what = f"{split} rank {comm.Get_rank()} of {comm.Get_size()}"
        torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-12, atol=0, msg=what)
        grad = comm.allreduce(w_dist.grad.numpy())
        torch.testing.assert_close(torch.from_numpy(grad), w_ref.grad, rtol=1e-12, atol=1e-15,
                                   msg=what)


@mpi_case(nprocs=(2, 4), timeout=120)
def test_aggregation_reads_the_halo_in_place_with_the_same_bits(comm):
    """``propagate`` on the Numba CPU kernel never builds ``[x; halo]`` (HaloAggregate): its
    output and input gradient are bit-identical to the operator applied to ``with_halo(x)``,
    exact and under a boundary sample, for every aggregation."""
    from hpcpar.graph import DistGraph
    from hpcpar.graph._vertex_halo import HaloAggregate, with_halo

    e, x, y, masks = load_cora()
    g = DistGraph.from_global(e, x.shape[0], x, comm, y=y, masks=masks, backend="numba")
    torch.manual_seed(comm.Get_rank())
    for view in (g, g.boundary_sample(0.5, seed=3, call=7)):
        for kind in ("gcn", "mean", "sum"):
            op = view.operator(kind)
            h = torch.randn(view.num_owned, 40, dtype=torch.float64, requires_grad=True)
            w = torch.randn(view.num_owned, 40, dtype=torch.float64)
            assert op.reads_split(h)
            grads = []
            for way in ("concatenated", "propagate", "in place"):
                h.grad = None
                out = (op(with_halo(h, view.plan)) if way == "concatenated" else
                       view.propagate(h, kind) if way == "propagate" else
                       HaloAggregate.apply(h, view.plan, op))
                (out * w).sum().backward()
                grads.append((out.detach(), h.grad.clone()))
            for out, grad in grads[1:]:
                assert torch.equal(out, grads[0][0]) and torch.equal(grad, grads[0][1]), kind


@mpi_case(nprocs=(2,), timeout=120)
def test_user_errors_on_every_rank(comm):
    from hpcpar import ProcessGrid
    from hpcpar.errors import DataError
    from hpcpar.graph import DistGraph
    from hpcpar.graph.format import write_graph

    e, x, y, masks = synthetic_directed()
    with pytest.raises(DataError, match="data=2"):
        DistGraph.from_global(e, x.shape[0], x, ProcessGrid(2, 1, comm=comm))
    with pytest.raises(DataError, match="2 parts for a graph of 1 vertices"):
        DistGraph.from_global(np.zeros((2, 0), np.int64), 1, np.zeros((1, 2)), comm)
    with pytest.raises(DataError, match="vertex 500, outside 0..119"):
        DistGraph.from_global(np.array([[0, 500], [1, 2]]), 120, x, comm)
    with pytest.raises(DataError, match=r"original_ids has shape \(119,\), expected \(120,\)"):
        DistGraph.from_global(e, 120, x, comm, original_ids=np.arange(119))
    with shared_tmpdir(comm, prefix="hpcpar-graph-dist-") as tmp:
        path = os.path.join(tmp, "bad.h5")
        if comm.Get_rank() == 0:
            write_graph(path, x.shape[0], x, y, masks, edge_index=e)
            import h5py

            with h5py.File(path, "a") as f:
                del f["labels"]
        comm.Barrier()
        with pytest.raises(DataError, match="missing field '/labels'"):
            DistGraph.from_hdf5(path, comm, method="block")
        comm.Barrier()
        if comm.Get_rank() == 0:
            write_graph(path, x.shape[0], x, y, masks, edge_index=e)
            import h5py

            with h5py.File(path, "a") as f:  # an edge past the vertex count, in rank 1's block
                f["csr/indices"][-1] = 999
        comm.Barrier()
        with pytest.raises(DataError, match="vertex 999, outside 0..119"):
            DistGraph.from_hdf5(path, comm, method="block")


@mpi_case(nprocs=(4,), timeout=300)
def test_same_seed_same_accuracy_at_every_rank_count(comm):
    """Cora, Kipf & Welling setup, one seed: the distributed run reaches exactly the accuracy
    of the single-process run (dropout masks follow global vertex ids)."""
    from mpi4py import MPI

    from hpcpar.graph import DistGraph

    e, x, y, masks = load_cora()
    with shared_tmpdir(comm, prefix="hpcpar-graph-dist-") as tmp:
        g = DistGraph.from_hdf5(_cora_file(comm, tmp), comm, method="metis",
                                row_normalize=True)
    dist = train_cora(g, seed=2)
    single = None
    if comm.Get_rank() == 0:
        single = train_cora(DistGraph.from_global(e, x.shape[0], x, MPI.COMM_SELF, y=y,
                                                  masks=masks), seed=2)
    single = comm.bcast(single)
    assert dist["test_acc"] == single["test_acc"] and dist["val_acc"] == single["val_acc"], \
        (dist, single)


def _cora_file(comm, tmp):
    path = None
    if comm.Get_rank() == 0:
        from hpcpar.graph.format import import_npz

        path = os.path.join(tmp, "cora.h5")
        import_npz(str(CORA_NPZ), path)
    return comm.bcast(path)
