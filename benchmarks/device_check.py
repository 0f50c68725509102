"""The device check's benchmark (run by benchmarks/device_check.sh): one table of GPU numbers,
every baseline measured in the same run.

    mpiexec -n 2 python benchmarks/device_check.py            # 2 ranks sharing the GPU(s)
    mpiexec -n 2 python benchmarks/device_check.py --size 64 --channels 16 --reps 10

Rows (rank 0 prints them):

* spatial conv3d step: ``SpatialConv3d`` forward + backward on 2 spatial ranks (halo exchange
  included) vs cuDNN ``nn.Conv3d`` (padding 1) on the same local volume, both ranks busy at
  once in both measurements (they share the GPU); target <= 1.10x;
* halo pack: GB/s of packing each face of a (N, C, D, H, W) volume into a message (the Numba
  CUDA kernel, as the exchange does) vs a device memcpy of the same bytes;
* gradient sync: one gradient bucket of 25, 50 and 100 MB reduced by MPI (CUDA-aware or
  staged, whichever this MPI takes) and by NCCL (only with a GPU per rank: NCCL cannot put
  two ranks on one GPU);
* peak GPU memory per rank of the conv step at 2 spatial ranks vs 1 (the 1-rank run is the
  same layer on the whole volume, on rank 0 alone).

Sizes are small by default: the whole script must fit the device check's minutes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _timed(fn, reps: int, comm, warmup: int = 2) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, every rank starting each run together."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(comm.allgather(statistics.median(times)))


def conv_step(comm, size: int, channels: int, reps: int, device, profile=None) -> list:
    """Spatial conv3d forward+backward on all ranks vs cuDNN on the same local volume; with
    ``profile``, rank 0's host time of the spatial step by function is written there."""
    import torch

    from hpcpar.nn import SpatialConv3d
    from hpcpar.parallel.grid import ProcessGrid
    from hpcpar.parallel.spatial import local_slices

    torch.backends.cudnn.benchmark = True
    grid = ProcessGrid(data=1, x=comm.Get_size(), comm=comm)
    X = torch.randn(1, channels, size, size, size, generator=torch.Generator().manual_seed(0))
    x = X[local_slices(X.shape, grid)].contiguous().to(device).requires_grad_()
    layer = SpatialConv3d(channels, channels, 3, padding=1, grid=grid).to(device)
    base = torch.nn.Conv3d(channels, channels, 3, padding=1).to(device)

    def step(mod):
        def run():
            mod.zero_grad(set_to_none=True)
            x.grad = None
            mod(x).square().mean().backward()
        return run

    from hpcpar.nn import _boundary_conv

    t_spatial = _timed(step(layer), reps, comm)
    t_cudnn = _timed(step(base), reps, comm)
    if profile:
        _profile(step(layer), reps, comm, profile)
    _boundary_conv.ENABLED, was = False, _boundary_conv.ENABLED   # exchange, then one conv
    try:
        t_general = _timed(step(layer), reps, comm)
    finally:
        _boundary_conv.ENABLED = was
    local = f"{'x'.join(map(str, x.shape[2:]))}x{channels}"
    return [(f"spatial conv3d step (fwd+bwd), local {local}", f"{t_spatial * 1e3:.2f} ms",
             f"cuDNN Conv3d {t_cudnn * 1e3:.2f} ms", t_spatial / t_cudnn, "<= 1.10"),
            (f"same, general path (halo first, one conv), local {local}",
             f"{t_general * 1e3:.2f} ms", f"cuDNN Conv3d {t_cudnn * 1e3:.2f} ms",
             t_general / t_cudnn, "<= 1.10")]


def _profile(fn, reps: int, comm, path: str) -> None:
    """Where the spatial step's host time goes (rank 0, cProfile, top 30 by own time)."""
    import cProfile
    import pstats

    import torch

    prof = cProfile.Profile()
    for _ in range(reps):
        comm.Barrier()
        prof.enable()
        fn()
        torch.cuda.synchronize()
        prof.disable()
    if comm.Get_rank() == 0:
        with open(path, "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(30)


def halo_pack(size: int, channels: int, reps: int, device) -> list:
    """Pack GB/s per face axis: the default path (torch's strided copy) and the Numba CUDA
    kernel, each vs a device memcpy of the same bytes."""
    import os

    import torch

    from hpcpar.kernels import halo_pack as hp

    vol = torch.randn(2, channels, size, size, size, device=device)
    rows = []
    for axis, name in ((2, "x"), (3, "y"), (4, "z")):
        face = vol.narrow(axis, 1, 1)
        out = torch.empty(face.shape, device=device)
        src = torch.empty_like(out)
        nbytes = out.numel() * out.element_size()
        t_copy = _device_time(lambda out=out, src=src: out.copy_(src), reps)
        rate = {}
        for mode in ("auto", "numba"):
            os.environ["HPCPAR_HALO_KERNELS"] = mode
            path = hp._path(face, False)
            rate[path] = nbytes / _device_time(lambda face=face, out=out: hp.pack(face, out),
                                               reps)
        os.environ.pop("HPCPAR_HALO_KERNELS")
        best = max(rate, key=rate.__getitem__)
        rows.append((f"halo pack, {name} face {nbytes / 1e6:.2f} MB",
                     ", ".join(f"{p} {r / 1e9:.1f} GB/s" for p, r in rate.items()),
                     f"memcpy {nbytes / t_copy / 1e9:.1f} GB/s",
                     rate[best] * t_copy / nbytes, f"1.0 = memcpy speed; fastest: {best}"))
    return rows


def _device_time(fn, reps: int) -> float:
    import torch

    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def grad_sync(comm, sizes_mb, reps: int, device) -> list:
    """One bucket of each size reduced by the MPI path and the NCCL path."""
    import torch

    from hpcpar.parallel.cuda_aware import cuda_aware
    from hpcpar.sync._buckets import Bucket, Pending, ReduceGroup, TorchGroup

    size = comm.Get_size()
    nccl_ok = torch.cuda.device_count() >= size
    groups = {"MPI (" + ("CUDA-aware" if cuda_aware() else "staged") + ")":
              ReduceGroup(comm, 0, size)}
    if nccl_ok:
        groups["NCCL"] = TorchGroup(comm, size, "nccl", device)
    rows = []
    for mb in sizes_mb:
        p = torch.nn.Parameter(torch.zeros(int(mb * (1 << 20)) // 4, device=device))
        times = {}
        for name, group in groups.items():
            bucket = Bucket(0, [p], group)
            p.grad = torch.ones_like(p)

            def run(bucket=bucket):
                bucket.launch()
                Pending.wait(bucket.pending)
                bucket.finalize()
                bucket.reset()

            times[name] = _timed(run, reps, comm, warmup=1)
        (mpi_name, t_mpi), = [(k, v) for k, v in times.items() if k != "NCCL"]
        t_nccl = times.get("NCCL")
        rows.append((f"gradient sync {mb} MB bucket, {size} ranks", f"{mpi_name} "
                     f"{t_mpi * 1e3:.1f} ms",
                     f"NCCL {t_nccl * 1e3:.1f} ms" if t_nccl else
                     f"NCCL n/a ({torch.cuda.device_count()} GPU for {size} ranks)",
                     t_mpi / t_nccl if t_nccl else None, "MPI / NCCL"))
    return rows


def peak_memory(comm, size: int, channels: int, device) -> list:
    """Peak GPU memory of the conv step per rank: all ranks spatial vs rank 0 alone."""
    import torch
    from mpi4py import MPI

    from hpcpar.nn import SpatialConv3d
    from hpcpar.parallel.grid import ProcessGrid
    from hpcpar.parallel.spatial import local_slices

    def peak(grid):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        full = (1, channels, size, size, size)
        local = torch.empty(full, device="meta")[local_slices(full, grid)].shape
        x = torch.randn(local, device=device, requires_grad=True)  # only this rank's part
        layer = SpatialConv3d(channels, channels, 3, padding=1, grid=grid).to(device)
        layer(x).square().mean().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device) - before

    many = max(comm.allgather(peak(ProcessGrid(data=1, x=comm.Get_size(), comm=comm))))
    one = peak(ProcessGrid(1, 1, 1, 1, comm=MPI.COMM_SELF)) if comm.Get_rank() == 0 else 0
    one = comm.bcast(one, root=0)
    return [(f"peak GPU memory per rank, conv step {size}^3x{channels}",
             f"{comm.Get_size()} ranks {many / 2**20:.0f} MiB", f"1 rank {one / 2**20:.0f} MiB",
             many / one, "ideal 1/ranks + halo")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=96, help="global volume edge (voxels)")
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sync-mb", default="25,50,100", help="bucket sizes for the sync rows")
    ap.add_argument("--profile", default=None,
                    help="write rank 0's host profile of the spatial step to this file")
    ap.add_argument("--tests", default=None,
                    help="pytest -m gpu summary line, shown as the table's first row")
    args = ap.parse_args(argv)

    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if not torch.cuda.is_available():
        if comm.Get_rank() == 0:
            print("device_check.py: no CUDA device visible; nothing measured", file=sys.stderr)
        return 2
    device = torch.device("cuda", comm.Get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    rows = [("pytest -m gpu (tests/gpu)", args.tests, "-", None, "all pass")] if args.tests else []
    rows += conv_step(comm, args.size, args.channels, args.reps, device, args.profile)
    rows += halo_pack(args.size, args.channels, args.reps * 5, device)
    rows += grad_sync(comm, [float(m) for m in args.sync_mb.split(",")], args.reps, device)
    rows += peak_memory(comm, args.size, args.channels, device)
    if comm.Get_rank() == 0:
        print(table(rows, torch.cuda.get_device_name(device), comm.Get_size()))
    return 0


def table(rows, gpu: str, ranks: int) -> str:
    """The one Markdown table the device check prints (pasted into the README as is).

    Args:
        rows: (what, measured, baseline, ratio or None, target or note) per row.
        gpu: The device's name.
        ranks: MPI ranks used.

    Returns:
        The table, headed by the date, GPU and rank count.
    """
    head = (f"device check {time.strftime('%Y-%m-%d')}, {gpu}, {ranks} MPI ranks\n\n"
            "| what | measured | baseline (same run) | ratio | target |\n|---|---|---|---|---|")
    body = [f"| {w} | {m} | {b} | {'-' if r is None else f'{r:.2f}x'} | {t} |"
            for w, m, b, r, t in rows]
    return "\n".join([head, *body])


if __name__ == "__main__":
    sys.exit(main())
