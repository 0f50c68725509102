"""The 1M-vertex synthetic GCN job at 1, 2, 4 ranks, against PyG on 1 process given the same
cores (torch threads), same run.

    python benchmarks/gnn_scale.py                       # jobs/gcn-synthetic.toml, 1,2,4 ranks
    python benchmarks/gnn_scale.py --ranks 1,2 --epochs 5
    python benchmarks/gnn_scale.py --ranks 2 --rounds 5 --no-pyg   # issue 34: 2-rank limit

Run it as a plain process (not under mpiexec): it makes the job's graph file if missing, then
launches ``mpiexec -n K`` per rank count and one PyG process per thread count (by default
min(K, cores) of each K; each row's "vs PyG" is PyG's fastest run on at most its cores), each
a fresh process so its memory is its own; memory is shown per rank and summed over the ranks.
Graph, model and optimiser come from the job file (``[data]``, ``[model]``, ``[train]``); each
rank reads only its rows of the file (``DistGraph.from_hdf5``).
A ``[data] path`` that is a sharded graph (``hpcpar data graph partition``) is built per rank
(``DistGraph.from_shards``: each rank reads its own part, as many ranks as parts), and PyG reads
its parts end to end (the same graph, renumbered), e.g. the 4M-vertex check of the GNN guide.

Per rank count it prints:

* epoch time (forward + backward + gradient Allreduce + Adam; the slowest rank's time per
  epoch): median over ``--epochs`` timed epochs after one warm-up, with min..max;
* memory per rank, from /proc/self/status: *peak* = ``VmHWM`` over the whole job (build +
  training), *above base* = peak minus the RSS before the build (the interpreter, torch and
  MPI, the same in every process); both the largest over ranks, then the ratio to 1 rank
  (target at 4 ranks: <= 0.35). The training-only peak (high-water mark reset after the build)
  is printed too, since the build peak of rank 0 is METIS on the whole graph;
* halo bytes per epoch: what each rank sends (forward + backward exchanges of one epoch),
  largest and mean over ranks;
* at more than one rank, the machine's limit (``limit K``): the same K processes at once,
  each training the job's model on its own partition alone (the local subgraph: its owned
  vertices and the edges among them, a graph of one rank, so no halo, no messages and no
  gradient Allreduce) with hpcpar's 1-rank path, the fastest single process here. It runs
  in the same processes, alternating with hpcpar's epochs for ``--rounds`` rounds of
  ``--epochs`` epochs, and hpcpar's K ranks are printed as a fraction of it (limit epoch /
  hpcpar epoch per round: median and min-max; benchmarks/limits.py). Its graph is built
  after hpcpar's first round, so the memory columns are hpcpar's alone.

It prints the command that reproduces it; ``--json PATH`` writes every launch's results.

PyG's ``GCNConv`` (cached normalisation, the in-edge CSR passed as a ``torch.sparse`` adjacency,
which is PyG's memory-lean SpMM path; an ``edge_index`` would materialise ``E x 128`` messages)
runs the same model (widths, dropout, Adam) on the whole graph in one process.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import statistics
import subprocess
import sys
import time
import tomllib

from limits import command, fraction, quiet_barrier, verdict, write_json

HERE = os.path.abspath(__file__)
TAG = "GNN-SCALE "


# ---- memory -----------------------------------------------------------------------------
def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def rss_mb() -> float:
    """Resident memory now (MB)."""
    return _status_kb("VmRSS") / 1024


def peak_mb() -> float:
    """Resident high-water mark since the process started or the last reset (MB)."""
    return _status_kb("VmHWM") / 1024


def reset_peak() -> None:
    """Restart the high-water mark at the current RSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# ---- job --------------------------------------------------------------------------------
def load_job(path: str) -> dict:
    """``data`` (graph workload defaults filled in), ``model`` and ``train`` of a job file."""
    from hpcpar.run.workloads.graph import DATA_PARAMS, MODEL_PARAMS

    with open(path, "rb") as f:
        job = tomllib.load(f)
    data = {k: p.default for k, p in DATA_PARAMS.items()} | job["data"]
    model = {k: p.default for k, p in MODEL_PARAMS.items()} | job["model"]
    if data["make"] != "synthetic" or model.get("kind", "gcn") != "gcn":
        sys.exit(f"{path}: expected a [model] kind = \"gcn\" job with [data] make = "
                 "\"synthetic\"")
    return {"data": data, "model": model, "train": job.get("train", {})}


def adam(params_first, params_rest, train: dict):
    """Adam as the job sets it: weight decay on the first layer only (Kipf & Welling)."""
    import torch

    return torch.optim.Adam([{"params": params_first},
                             {"params": params_rest, "weight_decay": 0.0}],
                            lr=train.get("lr", 0.01), weight_decay=train.get("weight_decay", 0.0))


def summary(ts: list[float]) -> dict:
    return {"median": statistics.median(ts), "min": min(ts), "max": max(ts), "n": len(ts)}


# ---- hpcpar worker (under mpiexec) --------------------------------------------------------
#: Issue 34: hpcpar's fraction of its K-partition limit (the median over rounds) at K ranks.
TARGETS = {2: 0.90}


def trainer(graph, job: dict, comm=None):
    """One training epoch of the job's model on ``graph``, as a function (gradients summed
    over ``comm`` when given)."""
    import torch

    from hpcpar.graph.metrics import masked_loss
    from hpcpar.models import GCN
    from hpcpar.parallel.comm import sum_grads_

    m = job["model"]
    torch.manual_seed(0)
    model = GCN(graph.num_features, m["hidden"], graph.num_classes, num_layers=m["layers"],
                dropout=m["dropout"], conv="gcn")
    first = list(model.convs[0].parameters())
    rest = [p for c in model.convs[1:] for p in c.parameters()]
    opt = adam(first, rest, job["train"])

    def epoch():
        model.train()
        opt.zero_grad()
        masked_loss(model(graph.x, graph), graph).backward()
        if comm is not None:
            sum_grads_(first + rest, comm)
        opt.step()

    return epoch


def timed_epochs(epoch, n: int, comm) -> list[float]:
    """Seconds of ``n`` epochs started together on every rank, each the slowest rank's."""
    from mpi4py import MPI

    times = []
    for _ in range(n):
        quiet_barrier(comm)
        t0 = time.perf_counter()
        epoch()
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return times


def local_subgraph(graph):
    """This rank's partition alone, as a graph of one rank (``COMM_SELF``): its owned
    vertices with their features, labels and masks, and the in-edges among them (those from
    halo vertices dropped). Training on it is the rank's share of the work with no halo."""
    import numpy as np
    from mpi4py import MPI

    from hpcpar.graph import DistGraph
    from hpcpar.graph.format import MASKS

    n = graph.num_owned
    own = graph.cols < n  # local columns: owned vertices first, then the halo
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(np.repeat(np.arange(n), graph.in_degree)[own], minlength=n),
              out=indptr[1:])
    block = {"indptr": indptr, "indices": graph.cols[own], "x": graph.x.numpy(),
             "y": graph.y.numpy(), **{k: graph.masks[k].numpy() for k in MASKS}}
    return DistGraph(MPI.COMM_SELF, n, np.zeros(n, np.int64), block, 0,
                     num_classes=graph.num_classes, directed=graph.directed,
                     backend=graph.backend)


def hpcpar_worker(job: dict, epochs: int, rounds: int) -> None:
    from mpi4py import MPI

    from hpcpar.graph import DistGraph
    from hpcpar.graph.shards import is_sharded_graph

    comm = MPI.COMM_WORLD
    d = job["data"]
    base = rss_mb()
    reset_peak()
    t0 = time.perf_counter()
    kw = {"row_normalize": d["normalize"], "backend": d["backend"]}
    if is_sharded_graph(d["path"]):  # each rank reads its own part (a distributed build)
        graph = DistGraph.from_shards(d["path"], comm, **kw)
    else:
        graph = DistGraph.from_hdf5(d["path"], comm, method=d["partition"],
                                    seed=d["partition_seed"], **kw)
    quiet_barrier(comm)
    t_build = time.perf_counter() - t0
    build_peak = peak_mb()
    reset_peak()

    epoch = trainer(graph, job, comm)
    timed_epochs(epoch, 1, comm)  # the warm-up (it builds the operator)
    sent0 = graph.plan.bytes_sent
    times: list[list[float]] = []
    limits: list[list[float]] = []
    for r in range(rounds):  # hpcpar's epochs, then the limit's, in turn
        times.append(timed_epochs(epoch, epochs, comm))
        if r == 0:  # hpcpar's own memory and halo, before the limit's graph exists
            train_peak, halo = peak_mb(), (graph.plan.bytes_sent - sent0) // epochs
            alone = trainer(local_subgraph(graph), job) if comm.Get_size() > 1 else None
            if alone:
                timed_epochs(alone, 1, comm)  # its warm-up
        limits.append(timed_epochs(alone, epochs, comm) if alone else [])
    rank = {"base": base, "build_peak": build_peak, "train_peak": train_peak,
            "owned": graph.num_owned, "halo_vertices": graph.num_halo, "halo_bytes": halo}
    ranks = comm.gather(rank, root=0)
    if comm.Get_rank() == 0:
        print(TAG + json.dumps({
            "who": "hpcpar", "ranks": comm.Get_size(), "build_s": t_build,
            "epoch": summary([t for ts in times for t in ts]), "per_rank": ranks,
            "limit": summary([t for ts in limits for t in ts]) if alone else None,
            "rounds": [{"hpcpar": statistics.median(h),
                        "limit": statistics.median(lim) if lim else None}
                       for h, lim in zip(times, limits)]}), flush=True)


# ---- PyG worker (one process) -------------------------------------------------------------
def whole_graph(path: str) -> tuple[dict, int]:
    """The whole graph in one process: a graph file, or a sharded graph's parts end to end
    (its renumbered ids: the same graph up to a permutation of the vertices)."""
    import numpy as np

    from hpcpar.graph.format import GraphFile
    from hpcpar.graph.shards import is_sharded_graph, read_graph_manifest, read_part

    if not is_sharded_graph(path):
        with GraphFile(path) as gf:
            return gf.read_rows(0, gf.num_nodes), gf.num_classes
    m = read_graph_manifest(path)
    parts = []
    for p in range(m["parts"]):
        parts.append({k: v for k, v in read_part(path, m, p).items()
                      if k in ("indptr", "indices", "x", "y", "train")})
    ends = np.cumsum([q["indptr"][-1] for q in parts])
    g = {"indptr": np.concatenate([[0]] + [q["indptr"][1:] + e - q["indptr"][-1]
                                           for q, e in zip(parts, ends)]),
         **{k: np.concatenate([q[k] for q in parts]) for k in ("indices", "x", "y", "train")}}
    return g, m["num_classes"]


def pyg_worker(job: dict, epochs: int, threads: int) -> None:
    import torch
    import torch.nn.functional as F
    from torch_geometric.nn import GCNConv

    from hpcpar.graph.distgraph import normalize_rows

    torch.set_num_threads(threads)   # PyG's fastest native form on `threads` cores
    d, m = job["data"], job["model"]
    base = rss_mb()
    reset_peak()
    t0 = time.perf_counter()
    g, classes = whole_graph(d["path"])
    n = g["y"].shape[0]
    x = torch.from_numpy(g["x"])
    if d["normalize"]:  # as DistGraph's row_normalize
        x = normalize_rows(x)
    # in-edge CSR: row = destination, which is PyG's adj_t (transposed adjacency)
    adj_t = torch.sparse_csr_tensor(torch.from_numpy(g["indptr"]),
                                    torch.from_numpy(g["indices"]),
                                    torch.ones(g["indices"].shape[0]), (n, n))
    y, train = torch.from_numpy(g["y"]), torch.from_numpy(g["train"])
    del g
    widths = [x.shape[1]] + [m["hidden"]] * (m["layers"] - 1) + [classes]

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = torch.nn.ModuleList(GCNConv(a, b, cached=True)
                                             for a, b in zip(widths[:-1], widths[1:]))

        def forward(self, h, a):
            for i, conv in enumerate(self.convs):
                if i:
                    h = F.relu(h)
                h = conv(F.dropout(h, m["dropout"], self.training), a)
            return h

    torch.manual_seed(0)
    net = Net()
    opt = adam(list(net.convs[0].parameters()),
               [p for c in net.convs[1:] for p in c.parameters()], job["train"])

    def epoch():
        net.train()
        opt.zero_grad()
        F.cross_entropy(net(x, adj_t)[train], y[train]).backward()
        opt.step()

    t_build = time.perf_counter() - t0
    build_peak = peak_mb()
    reset_peak()
    times = []
    for i in range(epochs + 1):
        t0 = time.perf_counter()
        epoch()
        if i:
            times.append(time.perf_counter() - t0)
    print(TAG + json.dumps({"who": "pyg", "ranks": 1, "threads": threads, "build_s": t_build,
                            "epoch": summary(times),
                            "per_rank": [{"base": base, "build_peak": build_peak,
                                          "train_peak": peak_mb(), "owned": n,
                                          "halo_vertices": 0, "halo_bytes": 0}]}),
          flush=True)


# ---- driver -------------------------------------------------------------------------------
def describe(d: dict) -> str:
    """The graph as it is on disk (not the job's make parameters) and how ranks get parts."""
    from hpcpar.graph.format import GraphFile
    from hpcpar.graph.shards import is_sharded_graph, read_graph_manifest

    if is_sharded_graph(d["path"]):
        m = read_graph_manifest(d["path"])
        counts = [m[k] for k in ("num_nodes", "num_edges", "num_features", "num_classes")]
        how = f"its {m['parts']} parts"
    else:
        with GraphFile(d["path"]) as gf:
            counts = [gf.num_nodes, int(gf.f.attrs["num_edges"]), gf.num_features,
                      gf.num_classes]
        how = f"partition {d['partition']}"
    return ("{:,} vertices, {:,} edges, {} features, {} classes; ".format(*counts) + how)


def launch(cmd: list[str], env: dict, timeout: float, lock: str | None) -> dict:
    """Run one measurement process, holding ``lock`` (an flock file) only while it runs."""
    with open(lock, "a") if lock else contextlib.nullcontext() as held:
        if held:
            fcntl.flock(held, fcntl.LOCK_EX)
        t0 = time.perf_counter()
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(TAG)]
    if p.returncode or not lines:
        sys.exit(f"{' '.join(cmd)} failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n"
                 f"{p.stderr[-4000:]}")
    res = json.loads(lines[-1][len(TAG):])
    res["wall_s"] = time.perf_counter() - t0
    return res


def memory(res: dict) -> dict:
    """Largest peak / above-base / training peak over the ranks of one run (MB)."""
    pr = res["per_rank"]
    return {"peak": max(max(r["build_peak"], r["train_peak"]) for r in pr),
            "above": max(max(r["build_peak"], r["train_peak"]) - r["base"] for r in pr),
            "train": max(r["train_peak"] for r in pr),
            "train_above": max(r["train_peak"] - r["base"] for r in pr),
            "build_rank": max(range(len(pr)), key=lambda i: pr[i]["build_peak"])}


def same_cores(pygs: list[dict], ranks: int, cores: int) -> dict | None:
    """PyG's fastest run on at most the cores ``ranks`` ranks use (threads <= min(ranks,
    cores)): the like-for-like baseline of that row (more threads are not always faster)."""
    fit = [p for p in pygs if p["threads"] <= min(ranks, cores)]
    return min(fit, key=lambda p: p["epoch"]["median"]) if fit else None


def report(job: dict, runs: list[dict], pygs: list[dict], cores: int) -> None:
    one = next((r for r in runs if r["ranks"] == 1), None)
    m1 = memory(one) if one else None
    e = lambda r: r["epoch"]["median"]  # noqa: E731
    vs = lambda base, t: f"{e(base) / t:.2f}x" if base else "-"  # noqa: E731
    cell = lambda ep: f"{ep['median']:7.2f} ({ep['min']:.2f}..{ep['max']:.2f}){'':>6}"  # noqa: E731
    print(f"{'ranks':>5} {'epoch s (min..max)':>22} {'vs 1 rank':>9} {'vs PyG':>7} "
          f"{'peak MB':>8} {'ratio':>6} {'above-base MB':>13} {'ratio':>6} "
          f"{'train-peak MB':>13} {'halo MB/epoch/rank max (mean)':>30} {'build s':>7} "
          f"{'total peak MB':>13}")
    for r in pygs + runs:
        mem = memory(r)
        hb = [p["halo_bytes"] / 1e6 for p in r["per_rank"]]
        name = f"PyG{r['threads']}t" if r["who"] == "pyg" else str(r["ranks"])
        base = same_cores(pygs, r["ranks"], cores) if r["who"] == "hpcpar" else None
        vs1 = vs(one, e(r)) if r["who"] == "hpcpar" else "-"
        rp = f"{mem['peak'] / m1['peak']:.2f}" if m1 and r["who"] == "hpcpar" else "-"
        ra = f"{mem['above'] / m1['above']:.2f}" if m1 and r["who"] == "hpcpar" else "-"
        if r.get("limit"):  # the limit of this rank count, in the row before it
            lim = r["limit"]["median"]
            print(f"{'lim ' + name:>5} {cell(r['limit'])} {vs(one, lim):>9} "
                  f"{vs(base, lim):>7}  (limit: each rank trains its own partition alone)")
        total = sum(max(p["build_peak"], p["train_peak"]) for p in r["per_rank"])
        print(f"{name:>5} {cell(r['epoch'])} {vs1:>9} {vs(base, e(r)):>7} {mem['peak']:8.0f} "
              f"{rp:>6} {mem['above']:13.0f} {ra:>6} "
              f"{mem['train']:13.0f} {max(hb):17.1f} ({statistics.mean(hb):.1f}){'':>6} "
              f"{r['build_s']:7.1f} {total:13.0f}")
    top = max((r["ranks"] for r in runs), default=1)
    for r in (r for r in runs if r.get("limit")):
        limit, ours = ([rd[k] for rd in r["rounds"]] for k in ("limit", "hpcpar"))
        print(f"hpcpar {r['ranks']} ranks run at {fraction(limit, ours)} of their "
              f"{r['ranks']}-partition limit (limit epoch / hpcpar epoch per round, "
              f"{len(ours)} rounds){verdict(limit, ours, TARGETS.get(r['ranks']))}")
    n = len(runs[0]["rounds"]) if runs else 0
    print(f"epochs: median of {runs[0]['epoch']['n'] if runs else 0} ({n} round(s)) after 1 "
          "warm-up; "
          f"{top} rank(s) shared {cores} core(s)"
          + (" (oversubscribed)" if top > cores else "")
          + "; vs PyG = PyG's epoch / hpcpar's, PyG's fastest run on the same cores (PyGNt: "
            "N torch threads, N <= min(ranks, cores)); vs = speed-up (time ratio); memory = "
            "largest over ranks, total = summed over ranks; peak includes the build (rank "
          + ", ".join(f"{r['ranks']}:{memory(r)['build_rank']}" for r in runs)
          + " had the largest build peak), train-peak is the high-water mark reset after it")
    four = next((r for r in runs if r["ranks"] == 4), None)
    if four and m1:
        print(f"memory per rank at 4 ranks / 1 rank: peak {memory(four)['peak'] / m1['peak']:.3f}, "
              f"above base {memory(four)['above'] / m1['above']:.3f} (target <= 0.35)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default="jobs/gcn-synthetic.toml")
    ap.add_argument("--ranks", default="1,2,4", help="rank counts, comma-separated")
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs after one warm-up")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds of --epochs "
                    "epochs, hpcpar's and its limit's (issue 34: 5)")
    ap.add_argument("--json", metavar="PATH", help="also write the command and every "
                    "launch's results to PATH")
    ap.add_argument("--no-pyg", action="store_true")
    ap.add_argument("--pyg-threads", help="PyG's torch thread counts, comma-separated "
                    "(default: min(ranks, cores) of each rank count, so every row has PyG on "
                    "the same cores)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    ap.add_argument("--lock", help="flock file held during each launch (shared machines: "
                    "each launch is one short locked measurement)")
    ap.add_argument("--worker", choices=("hpcpar", "pyg"), help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds < 1 or args.epochs < 1:
        ap.error("--rounds and --epochs: expected at least 1")
    job = load_job(args.job)
    if args.worker == "hpcpar":
        return hpcpar_worker(job, args.epochs, args.rounds)
    if args.worker == "pyg":
        return pyg_worker(job, args.epochs, args.threads)

    from hpcpar.launch.mpiexec import find_mpiexec, rank_env

    d, m = job["data"], job["model"]
    if not os.path.exists(d["path"]):
        from hpcpar.run.workloads.graph import make_graph_file

        t0 = time.perf_counter()
        make_graph_file(d["path"], d)
        print(f"made {d['path']} in {time.perf_counter() - t0:.1f} s")
    cores = os.cpu_count() or 1
    print(f"job {args.job}: {d['path']}: {describe(d)}; GCN {m['layers']} layers x "
          f"{m['hidden']} hidden, dropout {m['dropout']}; {cores} core(s), one thread per "
          f"process\ncommand: {command()}", flush=True)
    env = rank_env()
    common = [HERE, "--job", args.job, "--epochs", str(args.epochs), "--rounds",
              str(args.rounds)]
    ranks = [int(s) for s in args.ranks.split(",")]
    threads = sorted({int(t) for t in args.pyg_threads.split(",")} if args.pyg_threads
                     else {min(k, cores) for k in ranks})
    pygs = []
    for t in [] if args.no_pyg else threads:
        pyg = launch([sys.executable, *common, "--worker", "pyg", "--threads", str(t)],
                     dict(env, OMP_NUM_THREADS=str(t), MKL_NUM_THREADS=str(t)), args.timeout,
                     args.lock)
        pygs.append(pyg)
        print(f"  PyG, {t} thread(s): build {pyg['build_s']:.1f} s, epoch "
              f"{pyg['epoch']['median']:.2f} s, peak {memory(pyg)['peak']:.0f} MB, "
              f"{pyg['wall_s']:.0f} s wall", flush=True)
    runs = []
    for k in ranks:
        runs.append(launch([find_mpiexec(), "-n", str(k), sys.executable, *common,
                            "--worker", "hpcpar"], env, args.timeout, args.lock))
        r = runs[-1]
        print(f"  {k} rank(s): build {r['build_s']:.1f} s, epoch {r['epoch']['median']:.2f} s, "
              f"peak {memory(r)['peak']:.0f} MB, {r['wall_s']:.0f} s wall; per rank: owned/halo "
              "vertices " + ", ".join(f"{p['owned']}/{p['halo_vertices']}"
                                      for p in r["per_rank"]) + "; MB base+build/train "
              + ", ".join(f"{p['base']:.0f}+build {p['build_peak']:.0f}/train "
                          f"{p['train_peak']:.0f}" for p in r["per_rank"]), flush=True)
    report(job, runs, pygs, cores)
    write_json(args.json, {"command": command(), "job": job, "pyg": pygs, "runs": runs})


if __name__ == "__main__":
    main()
