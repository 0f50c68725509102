"""The oracles and helpers the test modules share (one place; no test module imports another).

Everything here is importable inside the ``mpiexec`` workers of :func:`hpcpar.testing.mpi_case`
(they load a test file by path, so its neighbours are not importable there, this module is).

- Spatial layers: run a check on sub-grids of the launch (:func:`on_grids`, :func:`on_subgrid`)
  and compare a spatial layer with its torch twin on the same seeded global data
  (:func:`check_layer`, :func:`compare_with_twin`).
- GNN: a single-process dense reference of the GNN maths (DESIGN §2), written independently of
  hpcpar.graph (:func:`gnn_forward`, :func:`dense_operators`), Cora, and the Kipf & Welling
  training recipe (:func:`train_cora`)."""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from hpcpar.errors import LayerError
from hpcpar.graph.metrics import masked_loss, split_metrics
from hpcpar.models import GCN
from hpcpar.nn import spatialize
from hpcpar.nn.split import local
from hpcpar.nn.split_head import column_split
from hpcpar.parallel.comm import allreduce_, sum_grads_
from hpcpar.parallel.counters import COUNTERS
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.partition import part_range
from hpcpar.parallel.spatial import local_slices
from hpcpar.sync.tags import reduce_scope

__all__ = ["PROCESS_GRIDS", "SPATIAL_GRIDS", "idle_barrier", "on_grids", "on_subgrid",
           "refused_on_one_rank", "one_rank_grid", "randn", "tol", "close", "rel_err",
           "batch_slice", "piece_of", "spatial_slices", "check_layer", "compare_with_twin",
           "check_spatial_model", "alloc_peak", "cover", "CORA_NPZ", "load_cora",
           "dense_operators", "gnn_forward", "gnn_loss", "train_cora"]

# -- spatial layers ------------------------------------------------------------------------
# (data, x, y, z) process grids; each case runs on the first prod(grid) ranks of the launch
PROCESS_GRIDS = [(1, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2), (1, 2, 2, 1),
                 (1, 2, 2, 2), (1, 3, 1, 1), (1, 1, 3, 2), (2, 2, 1, 1), (2, 1, 2, 1),
                 (2, 1, 1, 2), (2, 2, 2, 1)]
# (x, y, z) spatial grids of the conv / pool cases; data 1 or 2 where the rank count allows
SPATIAL_GRIDS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 2, 2), (3, 1, 1), (1, 3, 2)]

FP32_TOL, FP64_TOL = 1e-5, 1e-12


def idle_barrier(comm) -> None:
    """Barrier that sleeps instead of busy-polling (idle ranks must not steal the cores)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def on_grids(comm, specs, fn) -> None:
    """Run ``fn(grid)`` for each (data, x, y, z) spec on the first prod(spec) ranks."""
    from mpi4py import MPI

    for spec in specs:
        n = math.prod(spec)
        if n > comm.Get_size():
            continue
        sub = comm.Split(0 if comm.Get_rank() < n else MPI.UNDEFINED, comm.Get_rank())
        if sub != MPI.COMM_NULL:
            d, x, y, z = spec
            grid = ProcessGrid(d, x, y, z, comm=sub)
            fn(grid)
            grid.free()
            sub.Free()
        idle_barrier(comm)


def on_subgrid(comm, data, dims, fn) -> None:
    """Run ``fn(grid)`` on the first data*X*Y*Z ranks of ``comm``; the others wait politely."""
    need = data * dims[0] * dims[1] * dims[2]
    if need > comm.Get_size():
        return
    member = comm.Get_rank() < need
    sub = comm.Split(0 if member else 1, comm.Get_rank())
    if member:
        grid = ProcessGrid(data, dims[0], dims[1], dims[2], comm=sub)
        try:
            fn(grid)
        finally:
            grid.free()
    sub.Free()
    idle_barrier(comm)


def one_rank_grid():
    from mpi4py import MPI

    return ProcessGrid(1, 1, 1, 1, comm=MPI.COMM_SELF)


def refused_on_one_rank(model, x, op: str, why: str, source: str) -> None:
    """Spatialize ``model`` on one rank and run it on ``x``: it must be refused with one line
    naming ``op``, saying ``why`` and pointing into ``source`` (the file calling the op)."""
    import pytest  # deferred: pytest is a test dependency, not hpcpar's

    with pytest.raises(LayerError) as info:
        spatialize(model, one_rank_grid())(x)
    msg = str(info.value)
    assert op in msg and why in msg and "\n" not in msg and f"{source}:" in msg, msg


def randn(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-11


def close(got, want, what, slack=1.0):
    """max |got - want| <= slack * tol * max |want| (relative to the output scale); a split
    ``got`` is compared by this rank's piece."""
    got = local(got)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.abs().max().item() if want.numel() else 0.0
    err = (got - want).abs().max().item() if want.numel() else 0.0
    assert err <= slack * tol(want.dtype) * max(scale, 1e-30), \
        f"{what}: max error {err:.3g} vs scale {scale:.3g} ({want.dtype})"


def rel_err(a, b):
    """max |a - b| / max |b|; a split ``a`` by this rank's piece."""
    a = local(a)
    scale = b.abs().max().item() if b.numel() else 0.0
    return (a - b).abs().max().item() / max(scale, 1e-30) if a.numel() else 0.0


def batch_slice(n_global, grid):
    nb = n_global // grid.data
    d = grid.coords[0]
    return slice(d * nb, (d + 1) * nb)


def piece_of(t, grid):
    """This rank's piece of a whole ``(N, C, D, H, W)`` tensor: its samples, its sub-box."""
    return t[batch_slice(t.shape[0], grid)][spatial_slices(t.shape[2:], grid)]


def spatial_slices(spatial_shape, grid):
    """This rank's piece of an (N, C, *spatial_shape) tensor, from the partition rule itself
    (independent of hpcpar.parallel.spatial.local_slices)."""
    return (slice(None), slice(None), *(
        slice(*part_range(n, p, i))
        for n, p, i in zip(spatial_shape, grid.spatial_shape, grid.spatial_coords)))


def check_spatial_model(grid, model, x, seed, what, replicated_output=False, slack=None,
                        device=None):
    """``spatialize(model)`` on ``grid`` vs ``model`` itself on the global batch ``x``, on
    ``device`` (default: the model's; compared on the CPU): output, every parameter gradient (summed
    over the spatial group; a split head's weight gathered from its columns) and the buffers.
    ``replicated_output``: the output is whole on every rank (a head); ``slack``: tolerance factor,
    by default 10 in fp32 (whole models sum over many voxels and layers), 1 in fp64."""
    slack = slack or (10.0 if x.dtype == torch.float32 else 1.0)
    if device is not None:
        model, x = model.to(device), x.to(device)
    sp = spatialize(model, grid)
    xr = x[batch_slice(x.shape[0], grid)]
    yr = model(xr)
    w = randn(yr.shape, seed, x.dtype).to(x.device)
    (yr * w).sum().backward()
    yl = local(sp(xr[local_slices(xr.shape, grid)]))  # this rank's piece, old-style
    assert yl.device == x.device, f"{what}: output on {yl.device}, input on {x.device}"
    ys = (slice(None),) * yr.dim() if replicated_output else local_slices(yr.shape, grid)
    close(yl.cpu(), yr[ys].detach().cpu(), f"{what}: output", slack)
    (yl * w[ys]).sum().backward()
    ref = dict(model.named_parameters())
    assert [n for n, _ in sp.named_parameters()] == list(ref), f"{what}: parameter names differ"
    for name, p in sp.named_parameters():
        g = p.grad.clone()
        cut = column_split(p)   # a split head's weight: this rank's columns
        if cut is not None:
            g = cut.gather(g)
        elif reduce_scope(p) == "spatial+data":
            allreduce_(g, grid.spatial_comm)
        close(g.cpu(), ref[name].grad.cpu(), f"{what}: grad of {name} ({reduce_scope(p)})",
              slack)
    for (name, b), (_, rb) in zip(sp.named_buffers(), model.named_buffers()):
        if b.is_floating_point():   # BN running statistics follow the whole-volume model
            close(b.cpu(), rb.cpu(), f"{what}: buffer {name}", slack)


def check_layer(grid, ref, sp, x, seed, what, whole_batch=False):
    """Forward, input gradient and summed parameter gradients of spatial layer ``sp`` vs
    torch layer ``ref`` (same weights) on the global batch ``x``. Each data group takes its
    share of the batch; ``whole_batch``: the reference sees all of it (statistics over data)."""
    bs = batch_slice(x.shape[0], grid)
    xr = (x if whole_batch else x[bs]).clone().requires_grad_()
    yr = ref(xr)
    w = randn(yr.shape, seed, x.dtype)
    (yr * w).sum().backward()
    gr = xr.grad
    if whole_batch:
        yr, w, gr = yr[bs], w[bs], gr[bs]
    xl = x[bs][local_slices(x[bs].shape, grid)].clone().requires_grad_()
    yl = sp(xl)
    ys = local_slices(yr.shape, grid)
    close(yl, yr[ys].detach(), f"{what}: output")
    (yl * w[ys]).sum().backward()
    close(xl.grad, gr[local_slices(gr.shape, grid)], f"{what}: input grad")
    group = grid.comm if whole_batch else grid.spatial_comm
    for (name, pr), ps in zip(ref.named_parameters(), sp.parameters()):
        g = allreduce_(ps.grad.clone(), group)
        close(g, pr.grad, f"{what}: grad of {name}")


def compare_with_twin(grid, twin, spatial, shape, channels, dtype, seed=0, batch=2, what="",
                      memory_format=None):
    """Forward, input grad and summed parameter grads of ``spatial`` vs ``twin`` on a seeded
    global batch of spatial ``shape`` (each data group its own batch); with
    ``memory_format``, both inputs in that memory format."""
    tol_ = FP32_TOL if dtype == torch.float32 else FP64_TOL
    twin = twin.to(dtype)
    spatial.load_state_dict(twin.state_dict())  # the twin's state_dict loads as is
    spatial = spatial.to(dtype)
    gen = torch.Generator().manual_seed(seed + 1000 * grid.coords[0])  # data groups differ
    X = torch.randn(batch, channels, *shape, generator=gen, dtype=dtype)
    if memory_format is not None:
        X = X.contiguous(memory_format=memory_format)
    X.requires_grad_()
    Y = twin(X)
    G = torch.randn(Y.shape, generator=gen, dtype=dtype)
    (Y * G).sum().backward()

    x = X.detach()[spatial_slices(shape, grid)]
    x = (x.clone() if memory_format is None else x.contiguous(memory_format=memory_format))
    x.requires_grad_()
    y = spatial(x)
    oslc = spatial_slices(tuple(Y.shape[2:]), grid)
    ref = Y.detach()[oslc]
    assert y.shape == ref.shape, f"{what}: output shape {tuple(y.shape)} != {tuple(ref.shape)}"
    err = rel_err(y.detach(), ref)
    assert err <= tol_, f"{what}: forward rel err {err:.2e}"
    (y * G[oslc]).sum().backward()
    err = rel_err(x.grad, X.grad[spatial_slices(shape, grid)])
    assert err <= tol_, f"{what}: input grad rel err {err:.2e}"
    for (name, p), (_, q) in zip(spatial.named_parameters(), twin.named_parameters()):
        g = allreduce_(p.grad.clone(), grid.spatial_comm)
        err = rel_err(g, q.grad)
        assert err <= tol_, f"{what}: {name} grad rel err {err:.2e}"


def alloc_peak(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """Peak bytes allocated above the start during one forward + backward (after a warm-up
    step, so plans and one-off buffers are made), and the halo bytes its forward sent."""
    def step(halo=None):
        before = COUNTERS.snapshot()
        y = model(x)
        if halo is not None:
            halo.append(COUNTERS.since(before)["bytes_halo"])
        y.backward(torch.ones_like(y))

    step()
    x.grad = None  # freed outside the profiled step: it counts only what the step allocates
    model.zero_grad(set_to_none=True)
    halo: list[int] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(halo)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak, halo[0]


def cover(rng: random.Random, n: int, **values):
    """``n`` sampled cases: each listed value of each parameter appears at least once."""
    cols = {}
    for key, vals in values.items():
        reps = -(-n // len(vals))
        col = list(vals) * reps
        rng.shuffle(col)
        cols[key] = col[:n] if len(vals) <= n else col
    assert all(set(map(repr, cols[k])) == set(map(repr, values[k])) for k in values), \
        "too few cases to cover every value"
    return [{k: cols[k][i] for k in values} for i in range(n)]


# -- GNN: dense single-process reference (independent of hpcpar.graph's sparse code) -------
CORA_NPZ = Path(__file__).resolve().parents[1] / "graph" / "datasets" / "cora.npz"


def load_cora(path=None):
    """Cora as (edge_index, x dense row-normalised, y, masks)."""
    import scipy.sparse as sp

    d = np.load(path or CORA_NPZ)
    x = sp.csr_matrix((d["x_data"], d["x_indices"], d["x_indptr"]),
                      shape=tuple(d["x_shape"])).toarray()
    x = x / np.maximum(x.sum(1, keepdims=True), 1e-30)
    n = x.shape[0]
    masks = {}
    for m in ("train", "val", "test"):
        masks[m] = np.zeros(n, bool)
        masks[m][d[f"{m}_idx"]] = True
    return d["edge_index"], x.astype(np.float32), d["y"], masks


def dense_operators(edge_index, n, dtype=torch.float64):
    """Dense (gcn, mean, sum) matrices: A[dst, src] = 1 (duplicates once)."""
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


def reference_dropout(t, p, seed, call, layer):
    """Dropout with the masks of global vertex ids (hpcpar.graph.dropout.keep_mask)."""
    from hpcpar.graph.dropout import keep_mask  # deferred: loads numba

    if p == 0:
        return t
    m = keep_mask(np.arange(t.shape[0]), t.shape[1], p, seed, call, layer).to(t.dtype)
    return t * m / (1 - p)


def gnn_forward(state, x, ops, conv="gcn", p=0.0, seed=0, call=0, layers=2, aggr="mean"):
    """Logits of the GCN / SAGE model with parameters ``state`` (a state_dict)."""
    h = x
    for i in range(layers):
        if i:
            h = torch.relu(h)
        h = reference_dropout(h, p, seed, call, i)
        if conv == "gcn":  # A (h W^T): the cheap association of the same product
            h = ops["gcn"] @ (h @ state[f"convs.{i}.lin.weight"].t()) + state[f"convs.{i}.bias"]
        else:
            h = (ops[aggr] @ (h @ state[f"convs.{i}.lin_l.weight"].t())
                 + state[f"convs.{i}.lin_l.bias"] + h @ state[f"convs.{i}.lin_r.weight"].t())
    return h


def gnn_loss(logits, y, train_mask):
    return F.cross_entropy(logits[train_mask], y[train_mask])


def train_cora(graph, seed: int, epochs: int = 200) -> dict:
    """Train the Kipf & Welling GCN on ``graph`` (row-normalised Cora; 2 layers, 16 hidden,
    dropout 0.5, Adam lr 0.01, weight decay 5e-4 on layer 1); final val/test accuracy."""
    torch.manual_seed(seed)
    model = GCN(graph.num_features, 16, graph.num_classes, dropout=0.5, seed=seed)
    opt = torch.optim.Adam([{"params": model.convs[0].parameters(), "weight_decay": 5e-4},
                            {"params": model.convs[1].parameters(), "weight_decay": 0.0}], lr=0.01)
    for _ in range(epochs):
        model.train()
        opt.zero_grad()
        masked_loss(model(graph.x, graph), graph).backward()
        sum_grads_(model.parameters(), graph.comm)  # the SUM over the graph's ranks
        opt.step()
    model.eval()
    with torch.no_grad():
        out = model(graph.x, graph)
    return {**split_metrics(out, graph, "val"), **split_metrics(out, graph, "test")}
