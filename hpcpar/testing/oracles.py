"""Single-process dense reference of the GNN maths (DESIGN §2), written independently of
hpcpar.graph: the oracle of the distributed tests."""

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from hpcpar.graph.dropout import keep_mask

CORA = "/work/shared/datasets/cora.npz"


def load_cora(path=None):
    """Cora as (edge_index, x dense row-normalised, y, masks)."""
    import os

    path = path or os.path.join(os.path.dirname(__file__), "..", "hpcpar", "graph", "datasets",
                                "cora.npz")
    d = np.load(path)
    x = sp.csr_matrix((d["x_data"], d["x_indices"], d["x_indptr"]),
                      shape=tuple(d["x_shape"])).toarray()
    x = x / np.maximum(x.sum(1, keepdims=True), 1e-30)
    n = x.shape[0]
    masks = {}
    for m in ("train", "val", "test"):
        masks[m] = np.zeros(n, bool)
        masks[m][d[f"{m}_idx"]] = True
    return d["edge_index"], x.astype(np.float32), d["y"], masks


def operators(edge_index, n, dtype=torch.float64):
    """Dense (gcn, mean) matrices: A[dst, src] = 1 (duplicates once)."""
    a = np.zeros((n, n))
    a[edge_index[1], edge_index[0]] = 1.0
    at = a.copy()
    diag = np.diag(at).copy()
    at[np.arange(n), np.arange(n)] = np.where(diag > 0, diag, 1.0)  # loops not doubled
    deg = at.sum(1)
    dinv = np.where(deg > 0, deg ** -0.5, 0.0)
    gcn = dinv[:, None] * at * dinv[None, :]
    indeg = a.sum(1)
    mean = a / np.where(indeg > 0, indeg, 1.0)[:, None]
    return {"gcn": torch.tensor(gcn, dtype=dtype), "mean": torch.tensor(mean, dtype=dtype),
            "sum": torch.tensor(a, dtype=dtype)}


def drop(t, p, seed, call, layer):
    if p == 0:
        return t
    m = keep_mask(np.arange(t.shape[0]), t.shape[1], p, seed, call, layer).to(t.dtype)
    return t * m / (1 - p)


def forward(state, x, ops, conv="gcn", p=0.0, seed=0, call=0, layers=2, aggr="mean"):
    """Logits of the GCN / SAGE model with parameters ``state`` (a state_dict)."""
    h = x
    for i in range(layers):
        if i:
            h = torch.relu(h)
        h = drop(h, p, seed, call, i)
        if conv == "gcn":  # A (h W^T): the cheap association of the same product
            h = ops["gcn"] @ (h @ state[f"convs.{i}.lin.weight"].t()) + state[f"convs.{i}.bias"]
        else:
            h = (ops[aggr] @ (h @ state[f"convs.{i}.lin_l.weight"].t())
                 + state[f"convs.{i}.lin_l.bias"] + h @ state[f"convs.{i}.lin_r.weight"].t())
    return h


def loss(logits, y, train_mask):
    return F.cross_entropy(logits[train_mask], y[train_mask])
