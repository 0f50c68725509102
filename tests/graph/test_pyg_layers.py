"""Any PyG message-passing layer on a DistGraph: ``graph.apply(conv, x)`` (``conv(exchange(x),
local_edge_index())[:num_owned]``, or with the sparse ``adj_t``) equals the same layer on the
whole graph in one process: outputs, every parameter gradient and the input gradient.

Graphs: Cora (its first 24 feature columns, to keep 4 ranks on 2 cores quick) and a directed
power-law graph with a self loop and a vertex without in-edges. Partitions: METIS and random
(many halo vertices). float64, tolerance rtol=1e-9, atol=1e-12 (only the summation order
differs from the single-process run).
"""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import load_cora

pytest.importorskip("torch_geometric")

TOL = dict(rtol=1e-9, atol=1e-12)


def _weighted_mean():
    """A message-passing layer of our own: an edge-weighted mean whose weights come from both
    end points, ``out_i = sum_j w_ij W x_j / sum_j w_ij``, ``w_ij = sigmoid(a . [x_i, x_j])``."""
    from torch_geometric.nn import MessagePassing

    class WeightedMean(MessagePassing):
        def __init__(self, cin, cout):
            super().__init__(aggr="add")
            self.lin = nn.Linear(cin, cout)
            self.att = nn.Linear(2 * cin, 1)

        def forward(self, x, edge_index):
            out = self.propagate(edge_index, x=x, h=self.lin(x))
            return out[:, :-1] / out[:, -1:].clamp_min(1e-12)

        def message(self, x_i, x_j, h_j):
            w = torch.sigmoid(self.att(torch.cat([x_i, x_j], -1)))
            return torch.cat([w * h_j, w], -1)

    return WeightedMean


def _layers(cin):
    """name -> (a fresh seeded layer, whether to also run it through the sparse adj_t)."""
    from torch_geometric.nn import GATConv, GINConv, GraphConv, SAGEConv, TransformerConv

    makers = {
        "gat": (lambda: GATConv(cin, 5, heads=3), True),
        "gin": (lambda: GINConv(nn.Sequential(nn.Linear(cin, 8), nn.ReLU(), nn.Linear(8, 5)),
                                train_eps=True), True),
        "graphconv": (lambda: GraphConv(cin, 5), True),
        "transformer": (lambda: TransformerConv(cin, 4, heads=2), False),
        "sage": (lambda: SAGEConv(cin, 5), True),
        "custom": (lambda: _weighted_mean()(cin, 5), False),
    }
    out = {}
    for name, (make, sparse) in makers.items():
        torch.manual_seed(7)
        out[name] = (make().double(), sparse)
    return out


def _directed_graph():
    from hpcpar.graph._csr import csr_to_edges
    from hpcpar.graph.generate import power_law_community_graph

    g = power_law_community_graph(150, 4, communities=4, features=6, classes=3, seed=5,
                                  directed=True)
    e = csr_to_edges(g["indptr"], g["indices"])
    e = np.concatenate([e[:, e[1] != 9], [[4], [4]]], axis=1)  # vertex 9: no in-edges; loop
    return e, g["x"]


def _graphs():
    e, x, _, _ = load_cora()
    return {"cora": (e, x[:, :24]), "directed": _directed_graph()}


def _reference(conv, e, x, weight):
    """Outputs, input gradient and parameter gradients of ``conv`` on the whole graph."""
    from torch_geometric.utils import coalesce

    xr = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    out = conv(xr, coalesce(torch.as_tensor(e), num_nodes=x.shape[0]))
    (out * weight[:, :out.shape[1]]).sum().backward()
    return out.detach(), xr.grad, {k: p.grad for k, p in conv.named_parameters()}


def _check(comm, graph, conv, x, weight, expected, sparse, what):
    from hpcpar.parallel.comm import allreduce_

    xl = torch.tensor(x[graph.global_ids], dtype=torch.float64, requires_grad=True)
    out = graph.apply(conv, xl, sparse=sparse)
    assert out.shape[0] == graph.num_owned, what
    (out * weight[graph.global_ids, :out.shape[1]]).sum().backward()
    logits, x_grad, grads = expected
    torch.testing.assert_close(graph.gather(out), logits, **TOL, msg=what)
    torch.testing.assert_close(graph.gather(xl.grad), x_grad, **TOL, msg=what)
    for name, p in conv.named_parameters():
        allreduce_(p.grad, comm)  # the gradient sync: SUM of the ranks' partial gradients
        torch.testing.assert_close(p.grad, grads[name], **TOL, msg=f"{what} {name}")


@mpi_case(nprocs=(1, 2, 4), timeout=300)
def test_pyg_layers_equal_the_full_graph(comm):
    from hpcpar.graph import DistGraph

    for gname, (e, x) in _graphs().items():
        n = x.shape[0]
        for method in ("metis", "random"):
            graph = DistGraph.from_global(e, n, x, comm, method=method, seed=3)
            # the loss sum(out * weight) makes every output entry's gradient differ
            weight = torch.randn(n, 16, generator=torch.Generator().manual_seed(1),
                                 dtype=torch.float64)
            for name, (conv, sparse) in _layers(x.shape[1]).items():
                expected = _reference(copy.deepcopy(conv), e, x, weight)
                for form in (False, True) if sparse else (False,):
                    what = (f"{name} on {gname} ({method}, {comm.Get_size()} ranks, "
                            f"{'adj_t' if form else 'edge_index'}) rank {comm.Get_rank()}")
                    _check(comm, graph, copy.deepcopy(conv), x, weight, expected, form, what)


@mpi_case(nprocs=(2, 4), timeout=120)
def test_exchange_is_the_adjoint_of_its_backward(comm):
    """The halo rows are the global rows at the halo ids, each owned row's gradient is the sum
    of its gradients on every rank that holds it, and <exchange(x), y> = <x, exchange*(y)>;
    the bytes counted as sent are the halo's rows (what the exchange moved, not the plan).
    A halo that sends zeros and drops the halo's gradient fails the first two."""
    from hpcpar.graph import DistGraph
    from hpcpar.parallel.counters import COUNTERS

    e, x = _directed_graph()
    n = x.shape[0]
    graph = DistGraph.from_global(e, n, x, comm, method="random", seed=1)
    rows = torch.randn(n, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    xl = rows[graph.global_ids].clone().requires_grad_(True)
    y = torch.randn(graph.num_local, 3, generator=torch.Generator().manual_seed(comm.rank),
                    dtype=torch.float64)
    before = COUNTERS.bytes_halo
    full = graph.exchange(xl)
    sent = COUNTERS.bytes_halo - before
    assert full.shape == (graph.num_local, 3) and graph.num_halo > 0
    torch.testing.assert_close(full[:graph.num_owned], xl, rtol=0, atol=0)
    torch.testing.assert_close(full[graph.num_owned:], rows[graph.halo_ids], rtol=0, atol=0)
    assert comm.allreduce(sent) == comm.allreduce(graph.num_halo) * 3 * 8
    full.backward(y)
    grads = torch.zeros(n, 3, dtype=torch.float64)
    grads.index_add_(0, torch.from_numpy(np.concatenate([graph.global_ids, graph.halo_ids])), y)
    grads = torch.from_numpy(comm.allreduce(grads.numpy()))
    torch.testing.assert_close(xl.grad, grads[graph.global_ids], **TOL)
    lhs = comm.allreduce(float((full.detach() * y).sum()))
    rhs = comm.allreduce(float((xl * xl.grad).sum()))
    assert abs(lhs - rhs) <= 1e-10 * max(1.0, abs(lhs)), (lhs, rhs)


def test_exchange_refuses_rows_that_are_not_the_owned_vertices():
    from mpi4py import MPI

    from hpcpar.errors import LayerError
    from hpcpar.graph import DistGraph

    e, x = _directed_graph()
    graph = DistGraph.from_global(e, x.shape[0], x, MPI.COMM_SELF)
    with pytest.raises(LayerError, match=r"DistGraph.exchange: x has shape \(3, 6\)"):
        graph.exchange(torch.zeros(3, 6))
