"""Gradient synchronisation: hpcpar DDP vs raw MPI Allreduce vs torch DDP (gloo), one run.

    mpiexec -n 2 python benchmarks/allreduce.py [--mb 16] [--rounds 6] [--steps 4]
        [--compute-buckets 25,1]

(a) raw mpi4py ``Allreduce`` of one flat float32 buffer of B bytes (our limit);
(b) hpcpar gradient sync of a model whose gradients total B bytes;
(c) ``torch.nn.parallel.DistributedDataParallel`` with the gloo backend, same model, ranks,
    batch, optimizer and bucket sizes.

Configurations: ``comm`` (wide MLP, batch of 4 per rank: communication-bound) and ``compute``
(a small 3D CNN on 24^3 volumes: compute-bound; by default both DDPs at torch DDP's default
buckets, 25 MB with a first bucket of 1 MB, ``--compute-buckets`` to change). Printed per
configuration:

* sync bandwidth / raw bandwidth: B / (first bucket launch -> last bucket done) for a
  backward pass that produces every gradient at once, vs B / raw Allreduce time, with the
  default buckets (25 MB, first 1 MB: the target) and with the step's smaller buckets;
* DDP(gloo) step time / hpcpar step time (step = zero_grad + forward + backward + SGD step),
  median and min-max over rounds of the per-round ratio, beside gloo / local (the same step
  without any sync: no sync can beat it, so this is the ceiling of the ratio);
* exposed vs total communication per hpcpar step (``hpcpar.parallel.counters.COUNTERS``): the
  part of the sync the step waited for vs first launch -> last completion (overlap proof).

A step's time is its slowest rank's; a round runs ``--steps`` steps of every implementation
interleaved step by step (local, hpcpar, gloo, local, ...; reversed every other round), so
load drift on a shared machine hits all of them alike; its ratio compares the round's
medians. Ranks wait for each other between steps without spinning (a spinning barrier would
take the core from a rank that is still computing on an oversubscribed node and bill it to
the next step). One torch thread per rank (``OMP_NUM_THREADS``). Targets: sync/raw >= 0.9,
gloo/hpcpar >= 1.25 (comm) and >= 1.10 (compute), exposed clearly below total.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from torch import nn

import hpcpar
from hpcpar.parallel.counters import COUNTERS

MB = 1 << 20


def wide_mlp(grad_bytes: int, depth: int = 3) -> nn.Module:
    """``depth`` square Linear layers whose weights total about ``grad_bytes`` of fp32."""
    width = max(8, int((grad_bytes / 4 / depth) ** 0.5))
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv3d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv3d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool3d(2),
        nn.Conv3d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool3d(2),
        nn.Conv3d(64, 64, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(64, 8))


def configs(args):
    """name -> (model factory, input shape per rank, output features, bucket caps in MB)."""
    mlp_width = wide_mlp(args.mb * MB)[0].in_features
    out = {
        "comm": (lambda: wide_mlp(args.mb * MB), (4, mlp_width), mlp_width,
                 (args.bucket_mb or max(1.0, args.mb / 4), 1.0)),
        "compute": (small_cnn, (2, 1, args.cnn, args.cnn, args.cnn), 8, args.compute_buckets),
    }
    return {k: out[k] for k in args.configs.split(",")}


def quiet_barrier(comm, nap: float = 20e-6) -> None:
    """A barrier that sleeps between polls (MPI's spins: on an oversubscribed node the spin
    takes the core from the rank still computing)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(nap)


def cores_here() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def spread(ratios) -> str:
    """Median [min-max] of per-round ratios."""
    return (f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] over "
            f"{len(ratios)} rounds")


def slowest_median(comm, times) -> float:
    from mpi4py import MPI

    return comm.allreduce(statistics.median(times), op=MPI.MAX)


def sync_vs_raw(ddp, model, nbytes: int, reps: int) -> tuple[float, float]:
    """(raw Allreduce seconds, hpcpar sync seconds), alternated rep by rep so load drift on a
    shared machine hits both alike; each is the slowest rank's median.

    raw: one in-place MPI Allreduce of ``nbytes`` of float32. hpcpar: first bucket launch ->
    last bucket done for a backward that hands every parameter a ready-made gradient, so the
    sync is all it does (the counters' ``t_allreduce_total``)."""
    from mpi4py import MPI

    from hpcpar.parallel.buffers import message_buffer

    comm = ddp.grid.comm
    buf = message_buffer((nbytes // 4,), torch.float32).numpy()  # huge pages, as the buckets
    buf[:] = 1.0
    raw, sync = [], []
    for i in range(reps + 1):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf)
        t_raw = time.perf_counter() - t0
        model.zero_grad(set_to_none=False)
        comm.Barrier()
        before = COUNTERS.snapshot()
        _AllGradsAtOnce.apply(*model.parameters()).backward()
        if i:  # the first of each is a warm-up
            raw.append(t_raw)
            sync.append(COUNTERS.since(before)["t_allreduce_total"])
    return slowest_median(comm, raw), slowest_median(comm, sync)


class _AllGradsAtOnce(torch.autograd.Function):
    """A backward that hands every parameter a ready-made gradient: the sync is all it does."""

    @staticmethod
    def forward(ctx, *params):
        ctx.grads = [torch.ones_like(p) for p in params]
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return tuple(ctx.grads)


def init_gloo(comm):
    import torch.distributed as dist

    path = tempfile.mkdtemp(prefix="hpcpar-gloo-") if comm.Get_rank() == 0 else None
    path = comm.bcast(path)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{path}/store",
                            rank=comm.Get_rank(), world_size=comm.Get_size())
    return dist


def bench_config(name, factory, in_shape, out_features, caps, grid, args, dist):
    comm = grid.comm
    r = grid.rank
    cap, first = caps
    g = torch.Generator().manual_seed(100 + r)
    x = torch.randn(*in_shape, generator=g)
    y = torch.randn(in_shape[0], out_features, generator=g)

    def make(wrap):
        torch.manual_seed(0)
        model = wrap(factory())
        return model, torch.optim.SGD(model.parameters(), lr=1e-3)

    local, local_opt = make(lambda m: m)
    hp, hp_opt = make(lambda m: hpcpar.DDP(m, grid, bucket_cap_mb=cap, first_bucket_mb=first,
                                           compression=args.compression))
    th, th_opt = make(lambda m: torch.nn.parallel.DistributedDataParallel(  # None: defaults
        m, bucket_cap_mb=None if (cap, first) == (25, 1) else cap))
    grad_bytes = sum(p.numel() * 4 for p in local.parameters())

    def step(model, opt):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()

    impls = {"local": (local, local_opt), "hpcpar": (hp, hp_opt), "gloo": (th, th_opt)}
    rounds = {k: [] for k in impls}  # per round: median step time (slowest rank per step)
    exposed, total = [], []
    for _ in range(args.warmup):
        for model, opt in impls.values():
            step(model, opt)
    for i in range(args.rounds):
        order = list(impls) if i % 2 == 0 else list(reversed(impls))
        times = {k: [] for k in impls}
        for _ in range(args.steps):
            for key in order:
                quiet_barrier(comm)
                before = COUNTERS.snapshot()
                t0 = time.perf_counter()
                step(*impls[key])
                times[key].append(time.perf_counter() - t0)
                if key == "hpcpar":
                    d = COUNTERS.since(before)
                    exposed.append(d["t_allreduce_exposed"])
                    total.append(d["t_allreduce_total"])
        for key, ts in times.items():
            slowest = [max(per_rank) for per_rank in zip(*comm.allgather(ts))]
            rounds[key].append(statistics.median(slowest))
    raw, span = sync_vs_raw(hp, hp.module, grad_bytes, args.rounds * args.steps)
    if name == "comm":  # the same sync with the default buckets (25 MB, first 1 MB)
        torch.manual_seed(0)
        default = hpcpar.DDP(factory(), grid, compression=args.compression)
        raw_d, span_d = sync_vs_raw(default, default.module, grad_bytes,
                                    args.rounds * args.steps)
    med = {k: statistics.median(v) for k, v in rounds.items()}
    vs_hp = [g / h for g, h in zip(rounds["gloo"], rounds["hpcpar"])]
    vs_local = [g / x for g, x in zip(rounds["gloo"], rounds["local"])]
    exp, tot = slowest_median(comm, exposed), slowest_median(comm, total)
    if r == 0:
        bw_raw, bw_sync = grad_bytes / raw / 1e9, grad_bytes / span / 1e9
        target = 1.25 if name == "comm" else 1.10
        print(f"[{name}] {comm.Get_size()} ranks, gradients {grad_bytes / MB:.2f} MB, buckets "
              f"{first:g}/{cap:g} MB, hierarchical={hp.hierarchical}, "
              f"compression={args.compression}")
        print(f"  raw Allreduce {raw * 1e3:8.2f} ms  {bw_raw:6.2f} GB/s")
        if name == "comm":
            print(f"  hpcpar sync   {span_d * 1e3:8.2f} ms  {grad_bytes / span_d / 1e9:6.2f} GB/s"
                  f"   sync/raw bandwidth = {raw_d / span_d:.2f}  (default buckets "
                  f"1/25 MB: "
                  f"{len(default.bucket_layout)} buckets; target >= 0.9; raw "
                  f"{raw_d * 1e3:.2f} ms beside it)")
        note = f"({len(hp.bucket_layout)} buckets of the step below vs one message" + \
            ("; plans " + ", ".join(sorted({b.plan for b in hp._buckets})) + ")"
             if name == "comm" else ": latency-bound, no target)")
        print(f"  hpcpar sync   {span * 1e3:8.2f} ms  {bw_sync:6.2f} GB/s   sync/raw bandwidth "
              f"= {bw_sync / bw_raw:.2f}  {note}")
        print(f"  {comm.Get_size()} ranks on {cores_here()} cores "
              f"({comm.Get_size() / cores_here():g} ranks per core), "
              f"{torch.get_num_threads()} torch thread(s) per rank, {args.rounds} rounds x "
              f"{args.steps} steps, torch DDP buckets {first:g}/{cap:g} MB"
              f"{' (its defaults)' if (cap, first) == (25, 1) else ''}")
        print(f"  step: local (no sync) {med['local'] * 1e3:.1f} ms | hpcpar "
              f"{med['hpcpar'] * 1e3:.1f} ms | torch DDP gloo {med['gloo'] * 1e3:.1f} ms "
              f"(medians of round medians)")
        print(f"  gloo/hpcpar = {spread(vs_hp)}  (target >= {target}) | ceiling "
              f"gloo/local = {spread(vs_local)}")
        cost = {k: statistics.median(a - b for a, b in zip(rounds[k], rounds["local"]))
                for k in ("hpcpar", "gloo")}
        print(f"  sync cost per step (step - local, median over rounds): hpcpar "
              f"{cost['hpcpar'] * 1e3:.2f} ms, gloo {cost['gloo'] * 1e3:.2f} ms; compute is "
              f"{med['local'] / med['gloo']:.0%} of the gloo step")
        print(f"  hpcpar comm per step: exposed {exp * 1e3:.2f} ms of total {tot * 1e3:.2f} ms "
              f"({exp / tot if tot else 0:.0%} exposed)", flush=True)
    del th
    dist.barrier()


def _caps(text: str) -> tuple[float, float]:
    cap, first = (float(v) for v in text.split(","))
    return cap, first


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=16, help="gradient MB of the wide MLP (B)")
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="bucket cap of the MLP for both DDPs (default: B/4, so buckets can "
                         "overlap backward; DDP's 25 MB would make a 16 MB model one bucket)")
    ap.add_argument("--cnn", type=int, default=24, help="CNN input edge (voxels)")
    ap.add_argument("--configs", default="comm,compute")
    ap.add_argument("--compute-buckets", type=_caps, default=(25.0, 1.0),
                    help="CAP,FIRST bucket MB of the CNN for both DDPs (default 25,1: torch "
                         "DDP's defaults; e.g. 0.25,0.05 to split its 0.7 MB in 4 buckets)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4, help="steps per round per implementation")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compression", default=None, choices=[None, "fp16", "bf16"])
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    grid = hpcpar.ProcessGrid()
    dist = init_gloo(grid.comm)
    for name, (factory, shape, fout, caps) in configs(args).items():
        bench_config(name, factory, shape, fout, caps, grid, args, dist)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
