"""Full-graph GCN benchmark; baselines measured in the same run.

    mpiexec -n 4 python benchmarks/gnn.py --nodes 20000 --features 64 --epochs 20

1. epoch time (forward + backward + Adam) of hpcpar's GCN on 1 rank vs PyTorch Geometric's
   GCNConv, same graph, same model (2 layers, dropout 0.5);
2. SpMM of the normalised adjacency: Numba CPU twin vs scipy vs torch.sparse;
3. halo bytes per epoch on the power-law graph, METIS vs block partitioning (world size parts);
4. epoch time on 1, 2, 4, ... ranks (sub-communicators of the world; at most 2 ranks per
   core is sensible, and the line says how many ranks shared how many cores).
Target ratios: hpcpar/PyG <= 1; METIS/block halo bytes <= 1/3.

The 1M-vertex job (jobs/gcn-synthetic.toml) at 1, 2, 4 ranks, with memory per rank and PyG
in the same run: benchmarks/gnn_scale.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcpar.graph import DistGraph, power_law_community_graph  # noqa: E402
from hpcpar.graph._csr import csr_to_edges  # noqa: E402
from hpcpar.graph.metrics import masked_loss  # noqa: E402
from hpcpar.models import GCN  # noqa: E402
from hpcpar.parallel.comm import sum_grads_  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up call."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def quiet_barrier(comm) -> None:
    """A barrier that sleeps instead of busy-polling, so waiting ranks leave the cores to the
    ranks being timed."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def hpcpar_epoch(graph, hidden, classes, comm):
    torch.manual_seed(0)
    model = GCN(graph.num_features, hidden, classes, dropout=0.5)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    params = list(model.parameters())

    def epoch():
        model.train()
        opt.zero_grad()
        masked_loss(model(graph.x, graph), graph).backward()
        sum_grads_(params, comm)
        opt.step()
    return epoch


def pyg_epoch(g, hidden, classes):
    from torch_geometric.nn import GCNConv

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = GCNConv(g["x"].shape[1], hidden, cached=True)
            self.c2 = GCNConv(hidden, classes, cached=True)

        def forward(self, x, e):
            x = F.dropout(x, 0.5, self.training)
            x = F.relu(self.c1(x, e))
            x = F.dropout(x, 0.5, self.training)
            return self.c2(x, e)

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    x = torch.from_numpy(g["x"])
    e = torch.from_numpy(csr_to_edges(g["indptr"], g["indices"]))
    y = torch.from_numpy(g["y"])
    m = torch.from_numpy(g["masks"]["train"])

    def epoch():
        net.train()
        opt.zero_grad()
        F.cross_entropy(net(x, e)[m], y[m]).backward()
        opt.step()
    return epoch


def spmm_rows(graph, features, repeats):
    import scipy.sparse as sp

    op = graph.operator("gcn")
    ip, ix, val = (a.numpy() for a in op.fwd)
    a = sp.csr_matrix((val.astype(np.float32), ix, ip), shape=op.shape)
    x = torch.randn(op.shape[1], features)
    xn = x.numpy()
    t_torch = torch.sparse_csr_tensor(op.fwd[0], op.fwd[1], op.fwd[2].float(), op.shape)
    from hpcpar.kernels.spmm import spmm_cpu

    return {"numba": timed(lambda: spmm_cpu(ip, ix, val.astype(np.float32), xn), repeats),
            "scipy": timed(lambda: a @ xn, repeats),
            "torch.sparse": timed(lambda: t_torch @ x, repeats)}


def halo_bytes_per_epoch(g, parts, widths):
    """Bytes all ranks send per epoch: each layer exchanges min(in, out) columns forward and
    the same backward (halo pairs = distinct (source vertex, destination rank) across a cut)."""
    from hpcpar.graph import partition_csr

    n = g["indptr"].shape[0] - 1
    dst = np.repeat(np.arange(n), np.diff(g["indptr"]))
    src = g["indices"]
    cols = sum(2 * min(a, b) for a, b in zip(widths[:-1], widths[1:]))
    out = {}
    for method in ("metis", "block"):
        owner = partition_csr(g["indptr"], g["indices"], parts, method)
        cut = owner[src] != owner[dst]
        pairs = np.unique(src[cut] * parts + owner[dst[cut]]).shape[0]
        out[method] = pairs * cols * 4
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=20000)
    ap.add_argument("--avg-degree", type=float, default=10.0)
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--classes", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=10, help="timed repeats (median)")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    g = power_law_community_graph(args.nodes, args.avg_degree, 64, args.features,
                                  args.classes, seed=0)
    e = csr_to_edges(g["indptr"], g["indices"])
    say(f"graph: {args.nodes} nodes, {e.shape[1]} edges, {args.features} features; "
        f"{size} rank(s) on {os.cpu_count()} core(s), OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS')}")

    if rank == 0:
        single = DistGraph.from_global(e, args.nodes, g["x"], MPI.COMM_SELF, y=g["y"],
                                       masks=g["masks"], method="block")
        t_h = timed(hpcpar_epoch(single, args.hidden, args.classes, MPI.COMM_SELF),
                    args.epochs)
        try:
            t_p = timed(pyg_epoch(g, args.hidden, args.classes), args.epochs)
            say(f"epoch 1 rank: hpcpar {t_h * 1e3:.2f} ms, PyG GCNConv {t_p * 1e3:.2f} ms, "
                f"ratio hpcpar/PyG {t_h / t_p:.2f} (target <= 1)")
        except ImportError:
            say(f"epoch 1 rank: hpcpar {t_h * 1e3:.2f} ms (torch_geometric not installed)")
        for f in (16, args.features):
            t = spmm_rows(single, f, args.epochs)
            say(f"SpMM F={f}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in t.items())
                + f"; numba/scipy {t['numba'] / t['scipy']:.2f}, numba/torch.sparse "
                  f"{t['numba'] / t['torch.sparse']:.2f}")
        parts = max(size, 4)
        hb = halo_bytes_per_epoch(g, parts, [args.features, args.hidden, args.classes])
        say(f"halo bytes/epoch over {parts} parts: METIS {hb['metis'] / 1e6:.2f} MB, block "
            f"{hb['block'] / 1e6:.2f} MB, ratio {hb['metis'] / hb['block']:.3f} "
            "(target <= 0.333)")
    quiet_barrier(world)

    k = 1
    while k <= size:
        sub = world.Split(0 if rank < k else MPI.UNDEFINED, rank)
        if sub != MPI.COMM_NULL:
            dg = DistGraph.from_global(e, args.nodes, g["x"], sub, y=g["y"],
                                       masks=g["masks"], method="metis")
            t = timed(hpcpar_epoch(dg, args.hidden, args.classes, sub), args.epochs)
            t = sub.allreduce(t, op=MPI.MAX)
            hb = dg.halo_bytes(args.hidden)
            if sub.Get_rank() == 0:
                print(f"epoch on {k} rank(s): {t * 1e3:.2f} ms (METIS; halo "
                      f"{hb / 1e3:.1f} kB per {args.hidden}-column exchange)", flush=True)
            sub.Free()
        quiet_barrier(world)
        k *= 2


if __name__ == "__main__":
    main()
