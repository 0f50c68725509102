"""Measure this machine for the planner: message latency and bandwidth between two ranks of
a node and, when the ranks span nodes, between two nodes; the sustained conv3d rate of one
rank (one thread) per input-channel count, the cost of the memory-bound layers, and how much
each slows down with every core busy; the GEMM rate of ``nn.Linear`` by its narrowest
dimension (dense heads, tensor-parallel shards, GNN transforms) and the two GNN kernels (sparse
aggregation per nonzero and column, vertex-hash dropout per element). Layers are hpcpar's own
spatial layers on a one-rank grid, so their halo buffers are in the numbers. Virtual nodes of
one host (one kernel) are recognised, and the machine file says that they share its cores
(``host_cores``).

Run by ``hpcpar plan --calibrate`` as ``mpiexec -n 2 python -m hpcpar.plan.calibrate OUT.toml``
(in a Slurm allocation: ``srun`` over the allocation's tasks, e.g. 2 nodes x 2 ranks).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hpcpar.formats.jobspec import SCHEMA
from hpcpar.nn import SpatialBatchNorm3d, SpatialConv3d, SpatialMaxPool3d
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.plan.machine import Link, Machine
from hpcpar.run._optim import make_optimizer

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["best_time", "pingpong", "placement", "conv_rate", "layer_costs", "oversubscription",
           "gemm_rates", "graph_costs", "opt_costs", "conv_grid", "main"]


def best_time(fn: Callable[[], object], repeat: int = 5) -> float:
    """Seconds of the fastest of ``repeat`` timed calls of ``fn``, after one untimed warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def pingpong(comm: MPI.Comm, nbytes: int, iters: int, peer: int = 1) -> float:
    """Seconds per one-way message of ``nbytes`` between ranks 0 and ``peer`` (half a round
    trip, over ``iters`` round trips) on those two; 0 elsewhere. Collective: the other ranks
    take part only in the barriers (they wait politely, leaving the cores to the two)."""
    import numpy as np

    buf = np.zeros(max(1, nbytes), dtype=np.uint8)
    rank = comm.Get_rank()
    polite_barrier(comm)
    t0 = time.perf_counter()
    for _ in range(iters):
        if rank == 0:
            comm.Send(buf, dest=peer)
            comm.Recv(buf, source=peer)
        elif rank == peer:
            comm.Recv(buf, source=0)
            comm.Send(buf, dest=0)
    took = (time.perf_counter() - t0) / (2 * iters) if rank in (0, peer) else 0.0
    polite_barrier(comm)
    return took


def measure_link(comm: MPI.Comm, peer: int) -> Link:
    """The alpha-beta link between ranks 0 and ``peer``: the best of three pingpongs of 8 B
    (latency) and of 16 MiB (bandwidth beyond the latency). Collective; rank 0's result on
    every rank."""
    small = min(pingpong(comm, 8, 2000, peer) for _ in range(3))
    big_bytes = 16 * 2**20
    big = min(pingpong(comm, big_bytes, 10, peer) for _ in range(3))
    return comm.bcast(Link(small, big_bytes / max(big - small, 1e-9)), root=0)


def placement(comm: MPI.Comm) -> tuple[list[str], bool]:
    """``(hosts, shared)``: each rank's host name, and whether the hosts are virtual nodes of
    one machine (several host names, one running kernel: the same boot id), which then share
    its cores. Collective."""
    hosts = comm.allgather(socket.gethostname())
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = None
    boots = comm.allgather(boot)
    shared = len(set(hosts)) > 1 and boots[0] is not None and len(set(boots)) == 1
    return hosts, shared


def _one_rank_grid():
    """A grid of this rank alone: the spatial layers on it run exactly the code (halo buffers
    included) that training runs, without messages."""
    from mpi4py import MPI

    return ProcessGrid(comm=MPI.COMM_SELF)


def _volume(batch: int, channels: int, size: int):
    """A random input volume, requiring grad, in the memory order training uses by default
    (``[train] channels_last``): oneDNN's rates differ 1.4-2.6x between the two orders."""
    import torch

    x = torch.randn(batch, channels, size, size, size)
    if SCHEMA["train"]["channels_last"].default:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    return x.requires_grad_()


def _seconds_per_step(mod, x, seconds: float, windows: int = 3) -> float:
    """Forward + backward of ``mod`` on ``x``: the mean over a time window (so ranks measuring
    together really overlap), the best of ``windows`` windows (a busy host steals whole
    windows; the validation keeps its fastest run too)."""
    def step():
        x.grad = None
        mod(x).sum().backward()

    step()
    best = float("inf")
    for _ in range(windows):
        n, t0 = 0, time.perf_counter()
        while n < 2 or time.perf_counter() - t0 < seconds / windows:
            step()
            n += 1
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def conv_rate(cin: int, size: int = 24, batch: int = 4, seconds: float = 0.6,
              threads: int = 1, cout: int | None = None, call: float = 0.0) -> float:
    """The convolution rate (FLOP/s) of one thread (or ``threads``) as training runs it.

    Forward + backward of hpcpar's SpatialConv3d (k=3, cin -> ``cout``, by default 2*cin, its
    halo buffers included) on ``batch`` volumes of edge ``size``, counted as 3x the forward
    FLOPs, less ``call``, the layer's fixed cost per call (:func:`call_costs`).
    """
    import torch

    torch.set_num_threads(threads)
    cout = 2 * cin if cout is None else cout
    x = _volume(batch, cin, size)
    conv = SpatialConv3d(cin, cout, 3, padding=1, grid=_one_rank_grid())
    t = _seconds_per_step(conv, x, seconds)
    return 3 * 2.0 * batch * cin * cout * 27 * size**3 / max(t - call, t / 2)


CONV_GRID = (1, 2, 4, 8, 16, 32, 64)


def conv_grid(channels: tuple = CONV_GRID, seconds: float = 0.1, call: float = 0.0) -> tuple:
    """The one-thread conv rate on a grid of input x output channels: it depends on both
    (SIMD lanes fill along each; measured here 8 -> 4 channels ran at a quarter of 8 -> 16's
    rate), which a series over input channels alone cannot say. Returns ``((in_channels,
    out_channels, FLOP/s), ...)``, net of ``call`` as :func:`conv_rate`.
    """
    return tuple((i, o, conv_rate(i, seconds=seconds, cout=o, call=call)) for i in channels
                 for o in channels)


def layer_costs(cin: int = 8, size: int = 24, batch: int = 4, seconds: float = 0.4,
                threads: int = 1, calls: tuple = ()) -> tuple:
    """``((kind, seconds per input byte), ...)`` of the memory-bound layers as hpcpar runs
    them (one thread, or ``threads``): max-pool (``pool``, halo buffers included), LeakyReLU
    (``pointwise``) and batch norm (``bn``), forward + backward, less each one's fixed cost per
    call (``calls``: ``((kind, seconds), ...)``, :func:`call_costs`)."""
    import torch

    torch.set_num_threads(threads)
    grid = _one_rank_grid()
    x = _volume(batch, cin, size)
    mods = {"pool": SpatialMaxPool3d(2, grid=grid), "pointwise": torch.nn.LeakyReLU(),
            "bn": SpatialBatchNorm3d(cin, grid=grid)}
    nbytes = x.numel() * x.element_size()
    fixed = dict(calls)
    out = []
    for k, m in mods.items():
        t = _seconds_per_step(m, x, seconds)
        out.append((k, max(t - fixed.get(k, 0.0), t / 2) / nbytes))
    return tuple(out)


def call_costs(size: int = 2, seconds: float = 0.3) -> tuple:
    """``((kind, seconds), ...)``: the fixed cost of one call of hpcpar's spatial layers
    ``conv``, ``pool`` and ``bn`` (forward + backward, one thread), each timed on a 4-channel
    ``size``-cubed volume, where the arithmetic is negligible and what is left is Python, halo
    planning and kernel launches."""
    import torch

    torch.set_num_threads(1)
    grid = _one_rank_grid()
    x = _volume(1, 4, size)
    mods = {"conv": SpatialConv3d(4, 4, 3, padding=1, grid=grid),
            "pool": SpatialMaxPool3d(2, grid=grid), "bn": SpatialBatchNorm3d(4, grid=grid)}
    return tuple((k, _seconds_per_step(m, x, seconds)) for k, m in mods.items())


def graph_halo_call(comm: MPI.Comm, rows: int = 1000, halo: int = 100, cols: int = 16,
                    iters: int = 30, rounds: int = 3) -> float:
    """Seconds of one graph halo exchange, forward + backward, between pairs of the ranks of
    ``comm`` (collective; rank 2k pairs with 2k + 1, an odd last rank measures nothing and
    returns 0): a GNN layer's fetch of ``halo`` of its partner's ``rows`` and the return of
    their gradients, as :mod:`hpcpar.graph` runs it (index, all-to-all, scatter-add and Python),
    which the link's latency alone does not carry. ``iters`` exchanges per round (the partners
    must agree), the best of ``rounds``.
    """
    import numpy as np
    import torch

    from hpcpar.graph._vertex_halo import HaloPlan, with_halo  # deferred: loads torch, numpy

    pair = comm.Split(comm.Get_rank() // 2, comm.Get_rank())
    try:
        if pair.Get_size() < 2:
            return 0.0
        me, other = pair.Get_rank(), 1 - pair.Get_rank()
        owned = np.arange(me * rows, (me + 1) * rows, dtype=np.int64)
        wanted = np.arange(other * rows, other * rows + halo, dtype=np.int64)
        plan = HaloPlan.build(pair, owned, wanted, np.full(halo, other, dtype=np.int64))
        x = torch.randn(rows, cols, requires_grad=True)
        best = float("inf")
        for r in range(rounds + 1):   # the first round warms up
            pair.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                x.grad = None
                with_halo(x, plan).sum().backward()
            if r:
                best = min(best, (time.perf_counter() - t0) / iters)
        return best
    finally:
        pair.Free()


def thread_speedups(cores: int, rounds: int = 3) -> tuple[float, float]:
    """How much faster one rank with ``cores`` threads runs than with one: the conv rate
    (8 channels) and the memory-bound layers' summed cost. hpcpar gives a rank alone on a
    node every core as a thread. Each round measures both thread counts back to back; the
    median of the rounds' ratios counts (a spell of a slow host hits one round, not the
    number)."""
    import torch

    if cores <= 1:
        return 1.0, 1.0
    conv, mem = [], []
    conv_rate(8, seconds=0.1, threads=cores)   # the thread pool's start is not the rate
    for _ in range(rounds):
        conv.append(conv_rate(8, seconds=0.3, threads=cores) / conv_rate(8, seconds=0.3))
        one, many = layer_costs(seconds=0.2), layer_costs(seconds=0.2, threads=cores)
        mem.append(sum(c for _, c in one) / sum(c for _, c in many))
    torch.set_num_threads(1)
    return max(1.0, statistics.median(conv)), max(1.0, statistics.median(mem))


def opt_costs(params: int = 8_000_000, tensors: int = 4, repeat: int = 5) -> tuple:
    """Seconds per parameter of one optimizer step, one thread, as training builds the
    optimizers (:func:`hpcpar.run._optim.make_optimizer`: torch's fused kernels).
    The ``tensors`` are larger than caches, as a dense head's weight is: small tensors that stay
    in cache update twice as fast per parameter. Returns ``((optimizer, seconds per parameter),
    ...)`` for ``sgd`` (momentum), ``adam`` and ``adamw``, the best of ``repeat`` steps.
    """
    import torch

    torch.set_num_threads(1)
    ps = [torch.nn.Parameter(torch.randn(params // tensors)) for _ in range(tensors)]
    for p in ps:
        p.grad = torch.randn_like(p)
    out = []
    for name, opt in (("sgd", make_optimizer("sgd", ps, lr=1e-3, momentum=0.9)),
                      ("adam", make_optimizer("adam", ps, lr=1e-3)),
                      ("adamw", make_optimizer("adamw", ps, lr=1e-3))):
        opt.step()   # the state is created on the first step
        out.append((name, best_time(opt.step, repeat) / params))
    return tuple(out)


GEMM_WIDTHS = (4, 16, 64, 256, 1024)


def gemm_rates(features: int = 1024, seconds: float = 0.2) -> tuple:
    """``nn.Linear(features, features)`` forward + backward (input gradient included) on
    ``m`` rows, one thread, as ``((m, FLOP/s), ...)`` for m in :data:`GEMM_WIDTHS`: a GEMM with
    one narrow side runs well below the conv rate."""
    import torch

    torch.set_num_threads(1)
    lin = torch.nn.Linear(features, features)
    out = []
    for m in GEMM_WIDTHS:
        x = torch.randn(m, features, requires_grad=True)
        out.append((m, 6.0 * m * features * features / _seconds_per_step(lin, x, seconds)))
    return tuple(out)


def graph_costs(nodes: int = 20000, degree: int = 6, cols: int = 16,
                seconds: float = 0.2) -> tuple:
    """The GNN kernels as full-graph training runs them, one thread: hpcpar's sparse
    operator ``A @ x`` forward + backward (its transposed CSR) on a random graph, per nonzero
    and column; the vertex-hash dropout (the mask depends on global ids), per element:
    ``(("spmm", s), ("dropout", s))``."""
    import numpy as np
    import torch

    from hpcpar.graph._sparse import SparseOperator  # deferred: loads torch, numba
    from hpcpar.graph.dropout import vertex_dropout  # deferred: loads torch, numba

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    indptr = np.arange(0, nodes * degree + 1, degree, dtype=np.int64)
    indices = np.sort(rng.integers(0, nodes, nodes * degree).reshape(nodes, degree), 1)
    op = SparseOperator(indptr, indices.ravel(), rng.random(nodes * degree), nodes)
    x = torch.randn(nodes, cols, requires_grad=True)
    # twice: the first sparse product of a process pays one-time set-up costs
    spmm = min(_seconds_per_step(op, x, seconds) for _ in range(2)) / (nodes * degree * cols)
    ids = np.arange(nodes, dtype=np.int64)
    wide = torch.randn(nodes, 4 * cols)
    drop = best_time(lambda: vertex_dropout(wide, 0.5, ids, 0, 1, 0, True), 5) / wide.numel()
    return (("spmm", spmm), ("dropout", drop))


def _torch_conv_rate(seconds: float) -> float:
    """Steps per second of a plain torch conv3d (8 -> 16 channels, 24^3 x 4) forward +
    backward on one thread: needs no MPI, so a helper process can run it."""
    import torch

    torch.set_num_threads(1)
    x = _volume(4, 8, 24)
    return 1.0 / _seconds_per_step(torch.nn.Conv3d(8, 16, 3, padding=1), x, seconds)


OVERSUB_WINDOWS = 5
#: seconds the helper processes keep computing after their windows, while the ranks time
#: messages between them (``sync_wait``)
SYNC_WINDOW = 2.0


def _extra_rank(ready, go, out, core: int) -> None:
    """A helper process standing in for a second rank on this rank's core."""
    import torch

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    _torch_conv_rate(0.05)  # warm up
    ready.set()
    go.wait()
    out.put([_torch_conv_rate(0.5) for _ in range(OVERSUB_WINDOWS)])
    _torch_conv_rate(SYNC_WINDOW)   # still busy while the ranks time their messages


def oversubscription(comm: MPI.Comm) -> tuple[float, float]:
    """Compute per core with two ranks per core, relative to one rank per core, and what
    time slicing adds to a message between two ranks (collective).

    Every rank starts a helper process that computes beside it, both pinned to one core per
    rank (left to itself, the kernel at times puts both helpers on one core and the ranks
    alone on the other, and measures something else); while the helpers still compute, ranks
    0 and 1 pingpong small messages (the partner is often descheduled). Returns ``(ratio,
    sync_wait)``: the compute ratio (1.0: time slicing costs nothing) and the extra one-way
    seconds of a message (rank 0's value on every rank).
    """
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[comm.Get_rank() % len(allowed)]
    os.sched_setaffinity(0, {core})
    try:
        return _time_sliced(comm, core)
    finally:
        os.sched_setaffinity(0, allowed)


def _time_sliced(comm: MPI.Comm, core: int) -> tuple[float, float]:
    """:func:`oversubscription` with this rank pinned to ``core``."""
    polite_barrier(comm)
    idle = min(pingpong(comm, 8, 500) for _ in range(3))
    full = comm.allreduce(_torch_conv_rate(1.0)) / comm.Get_size()
    ctx = multiprocessing.get_context("spawn")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    env = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(("PMI", "HYDRA"))}
    try:
        helper = ctx.Process(target=_extra_rank, args=(ready, go, out, core), daemon=True)
        helper.start()
    finally:
        os.environ.update(env)
    ready.wait(120)
    polite_barrier(comm)
    go.set()
    mine = [_torch_conv_rate(0.5) for _ in range(OVERSUB_WINDOWS)]
    theirs = out.get(timeout=120)
    # the helpers still compute (SYNC_WINDOW): three windows of about a quarter of it each
    t0 = time.perf_counter()
    pingpong(comm, 8, 20)
    # rank 0's count for every rank: a count of their own would leave a pingpong unmatched
    iters = comm.bcast(max(10, int(20 * 0.25 * SYNC_WINDOW /
                                   max(time.perf_counter() - t0, 1e-6))), root=0)
    busy = sorted(pingpong(comm, 8, iters) for _ in range(3))[1]
    sync_wait = comm.bcast(max(0.0, busy - idle), root=0)
    helper.join(30)
    # two processes on one core; the median window (the scheduler places 2 per core unevenly
    # at times, and a busy host steals whole windows)
    over = [comm.allreduce(m + t) / comm.Get_size() for m, t in zip(mine, theirs)]
    return min(1.0, sorted(over)[len(over) // 2] / full), sync_wait


def polite_barrier(comm: MPI.Comm) -> None:
    """A barrier that sleeps instead of spinning, so waiting ranks leave the cores alone."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.001)


def compute_rates(calls: tuple = ()) -> tuple[float, float, tuple, tuple]:
    """(conv3d FLOP/s, memory bytes/s, per-channel-count conv rates, memory-bound layer
    costs) of one thread, measured the way training uses the layers: forward + backward,
    less each layer's fixed cost per call (``calls``, :func:`call_costs`).
    (The GEMM and GNN kernels: :func:`gemm_rates`, :func:`graph_costs`.)"""
    import torch

    torch.set_num_threads(1)
    call = dict(calls).get("conv", 0.0)
    rates = tuple((c, conv_rate(c, call=call)) for c in (2, 4, 8, 16, 32, 64))
    a = torch.randn(8_000_000)
    b = torch.empty_like(a)
    tm = best_time(lambda: b.copy_(a), 5)
    return max(r for _, r in rates), 2 * a.numel() * 4 / tm, rates, layer_costs(calls=calls)


def main(argv: list[str] | None = None) -> int:
    """Calibrate this machine and write the machine file ``argv[0]`` (``argv``: default
    ``sys.argv[1:]``); run under ``mpiexec -n 2`` or more. Returns the exit code."""
    from mpi4py import MPI

    argv = sys.argv[1:] if argv is None else argv
    out = argv[0]
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        print("calibrate needs 2 ranks (mpiexec -n 2)", file=sys.stderr)
        return 2
    hosts, shared = placement(comm)
    cores = os.cpu_count() or 1
    same = [r for r in range(1, size) if hosts[r] == hosts[0]]
    other = [r for r in range(1, size) if hosts[r] != hosts[0]]
    intra = measure_link(comm, same[0]) if same else None
    inter = measure_link(comm, other[0]) if other else None
    calls = call_costs() if rank == 0 else ()
    flops, mem_bw, rates, costs = compute_rates(calls) if rank == 0 else (0.0, 0.0, (), ())
    gemms, gcosts, ocosts, cgrid = (gemm_rates(), graph_costs(), opt_costs(),
                                    conv_grid(call=dict(calls).get("conv", 0.0))) \
        if rank == 0 else ((), (), (), ())
    # the others wait politely meanwhile, so rank 0's threads have the node's cores
    threaded = thread_speedups(cores) if rank == 0 else (1.0, 1.0)
    polite_barrier(comm)
    calls = comm.bcast(calls, root=0)   # the rates below are net of it, as rank 0's are
    # as many ranks at once as there are cores (memory bandwidth and caches are shared);
    # the others wait politely, so time slicing stays out of this number
    local = hosts[:rank].count(hosts[rank])
    busy = (rank if shared else local) < cores
    sub = comm.Split(0 if busy else MPI.UNDEFINED, rank)
    if busy:
        together = conv_rate(8, call=dict(calls).get("conv", 0.0))
        mean_together = sub.allreduce(together) / sub.Get_size()
        mem_together = sub.allreduce(dict(layer_costs())["pointwise"]) / sub.Get_size()
        graph_halo = graph_halo_call(sub)
        over, sync_wait = oversubscription(sub) if sub.Get_size() >= cores else (1.0, 0.0)
        sub.Free()
    polite_barrier(comm)
    if rank == 0:
        contention = min(1.0, mean_together / dict(rates)[8])
        mem_contention = min(1.0, dict(costs)["pointwise"] / mem_together)
        nodes = len(set(hosts))
        if inter is None:  # one node: the network is not measured; a typical NIC assumed
            assert intra is not None  # 2+ ranks on one node: a peer on it was measured
            inter = Link(max(intra.alpha, 2e-6), min(intra.beta, 12.5e9))
            where = "inter-node link assumed"
        else:
            where = f"{nodes} nodes, inter-node link measured"
        intra = intra or inter  # one rank per node: no shared-memory peer to measure
        m = Machine(name="local", ranks_per_node=hosts.count(hosts[0]) if nodes > 1
                    else max(8, cores), cores=cores, conv_rates=rates,
                    contention=contention, mem_contention=mem_contention, layer_costs=costs,
                    oversubscription=over, sync_wait=sync_wait, host_cores=cores if shared else 0,
                    gemm_rates=gemms, graph_costs=gcosts, opt_costs=ocosts, conv_grid=cgrid,
                    call_costs=calls + ((("graph_halo", graph_halo),) if graph_halo else ()),
                    thread_speedup=threaded[0], mem_thread_speedup=threaded[1], flops=flops,
                    mem_bw=mem_bw, mem_per_rank=_mem_per_rank(cores), io_bw=_io_bw(),
                    intra=intra, inter=inter,
                    description=f"calibrated on {os.uname().nodename} by hpcpar plan "
                                f"--calibrate ({where}"
                                f"{'; the nodes share one host' if shared else ''})")
        tmp = out + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(m.to_toml())
        os.replace(tmp, out)
        print(f"latency {intra.alpha * 1e6:.1f} us, bandwidth {intra.beta / 1e9:.2f} GB/s "
              f"in a node; {inter.alpha * 1e6:.1f} us, {inter.beta / 1e9:.2f} GB/s between "
              f"nodes ({where}); conv3d {flops / 1e9:.1f} GFLOP/s (x{contention:.2f} with all "
              f"cores busy), memory {mem_bw / 1e9:.1f} GB/s, pool/pointwise/bn "
              f"{'/'.join(f'{v * 1e9:.2f}' for _, v in costs)} ns per input byte "
              f"(x{mem_contention:.2f} with all cores busy), x{over:.2f} per core and "
              f"+{sync_wait * 1e6:.0f} us per message with two ranks per core; GEMM "
              f"{'/'.join(f'{r / 1e9:.0f}' for _, r in gemms)} GFLOP/s "
              f"at {'/'.join(str(m) for m, _ in gemms)} rows; x{threaded[0]:.2f} (dense) "
              f"and x{threaded[1]:.2f} (memory-bound) with {cores} threads; Adam "
              f"{dict(ocosts)['adam'] * 1e9:.2f} ns per parameter; a call of conv/pool/bn "
              f"{'/'.join(f'{v * 1e3:.2f}' for _, v in calls)} ms, a graph halo exchange "
              f"{graph_halo * 1e3:.2f} ms; SpMM {dict(gcosts)['spmm'] * 1e9:.2f} ns per "
              f"nonzero x column -> {out}")
    return 0


def _mem_per_rank(cores: int) -> float:
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages / cores
    except (ValueError, OSError):
        return 4e9


def _io_bw() -> float:
    """Read bandwidth of a freshly written 64 MB file (page cache: an upper bound)."""
    data = os.urandom(64 * 2**20)
    with tempfile.NamedTemporaryFile() as fh:
        fh.write(data)
        fh.flush()
        t = best_time(lambda: open(fh.name, "rb").read(), 3)
    return len(data) / t


if __name__ == "__main__":
    sys.exit(main())
