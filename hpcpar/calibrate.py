"""Measure this machine for the planner: message latency and bandwidth between two ranks,
allreduce, the sustained conv3d rate and memory bandwidth of one rank (one thread).

Run by ``hpcpar plan --calibrate`` as ``mpiexec -n 2 python -m hpcpar.calibrate OUT.toml``.
"""

from __future__ import annotations

import os
import sys
import time


def _best(fn, repeat=5):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def pingpong(comm, nbytes: int, iters: int) -> float:
    """One-way time of an ``nbytes`` message between ranks 0 and 1 (half a round trip)."""
    import numpy as np

    buf = np.zeros(max(1, nbytes), dtype=np.uint8)
    rank = comm.Get_rank()
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        if rank == 0:
            comm.Send(buf, dest=1)
            comm.Recv(buf, source=1)
        elif rank == 1:
            comm.Recv(buf, source=0)
            comm.Send(buf, dest=0)
    return (time.perf_counter() - t0) / (2 * iters)


def conv_rate(cin: int, size: int = 24, batch: int = 4, seconds: float = 0.6) -> float:
    """Forward + backward conv3d (k=3, cin -> 2*cin) of one thread, as 3x forward FLOP/s,
    averaged over a fixed time window (so ranks measuring together really overlap)."""
    import torch

    torch.set_num_threads(1)
    x = torch.randn(batch, cin, size, size, size, requires_grad=True)
    conv = torch.nn.Conv3d(cin, 2 * cin, 3, padding=1)

    def step():
        conv(x).sum().backward()

    step()
    n, t0 = 0, time.perf_counter()
    while n < 2 or time.perf_counter() - t0 < seconds:
        step()
        n += 1
    return n * 3 * 2.0 * batch * cin * 2 * cin * 27 * size**3 / (time.perf_counter() - t0)


def polite_barrier(comm) -> None:
    """A barrier that sleeps instead of spinning, so waiting ranks leave the cores alone."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.001)


def compute_rates() -> tuple[float, float, tuple]:
    """(conv3d FLOP/s, memory bytes/s, per-channel-count conv rates) of one thread, measured
    the way training uses a conv: forward + backward (input and weight gradients)."""
    import torch

    torch.set_num_threads(1)
    rates = tuple((c, conv_rate(c)) for c in (2, 4, 8, 16, 32, 64))
    a = torch.randn(8_000_000)
    b = torch.empty_like(a)
    tm = _best(lambda: b.copy_(a), 5)
    return max(r for _, r in rates), 2 * a.numel() * 4 / tm, rates


def main(argv=None) -> int:
    from mpi4py import MPI

    from .machine import Link, Machine

    argv = sys.argv[1:] if argv is None else argv
    out = argv[0]
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        print("calibrate needs 2 ranks (mpiexec -n 2)", file=sys.stderr)
        return 2
    small = min(pingpong(comm, 8, 2000) for _ in range(3))
    big_bytes = 16 * 2**20
    big = min(pingpong(comm, big_bytes, 10) for _ in range(3))
    beta = big_bytes / max(big - small, 1e-9)
    flops, mem_bw, rates = compute_rates() if comm.Get_rank() == 0 else (0.0, 0.0, ())
    polite_barrier(comm)
    together = conv_rate(8)  # every rank at once: memory bandwidth and caches are shared
    mean_together = comm.allreduce(together) / comm.Get_size()
    if comm.Get_rank() == 0:
        contention = min(1.0, mean_together / dict(rates)[8])
        cores = os.cpu_count() or 1
        m = Machine(name="local", ranks_per_node=max(8, cores), cores=cores, conv_rates=rates,
                    contention=contention,
                    flops=flops, mem_bw=mem_bw,
                    mem_per_rank=_mem_per_rank(cores), io_bw=_io_bw(), intra=Link(small, beta),
                    inter=Link(max(small, 2e-6), min(beta, 12.5e9)),
                    description=f"calibrated on {os.uname().nodename} by hpcpar plan "
                                f"--calibrate (inter-node link assumed)")
        tmp = out + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(m.to_toml())
        os.replace(tmp, out)
        print(f"latency {small * 1e6:.1f} us, bandwidth {beta / 1e9:.2f} GB/s, conv3d "
              f"{flops / 1e9:.1f} GFLOP/s (x{contention:.2f} with all ranks busy), memory "
              f"{mem_bw / 1e9:.1f} GB/s -> {out}")
    return 0


def _mem_per_rank(cores: int) -> float:
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages / cores
    except (ValueError, OSError):
        return 4e9


def _io_bw() -> float:
    """Read bandwidth of a freshly written 64 MB file (page cache: an upper bound)."""
    import tempfile

    data = os.urandom(64 * 2**20)
    with tempfile.NamedTemporaryFile() as fh:
        fh.write(data)
        fh.flush()
        t = _best(lambda: open(fh.name, "rb").read(), 3)
    return len(data) / t


if __name__ == "__main__":
    sys.exit(main())
