"""The device check's benchmark (run by benchmarks/device_check.sh): one table of GPU numbers,
every baseline measured in the same run.

    mpiexec -n 2 python benchmarks/device_check.py            # 2 ranks sharing the GPU(s)
    mpiexec -n 2 python benchmarks/device_check.py --size 64 --channels 16 --reps 10

Rows (rank 0 prints them), judged against the device's own limit:

* cuDNN ``Conv3d`` (forward + backward, padding 1) on the whole sample on one rank, and on
  each rank's piece with no halo, every rank at once: THE LIMIT for the ranks sharing the
  device (with one GPU lent, 2 ranks share it; with a GPU per rank, it is each GPU's own);
* the spatial conv3d step (``SpatialConv3d`` forward + backward) on the overlap path (the
  interior convolved while the faces travel) and on the general path (halo first, one
  convolution), over each halo transport this machine offers (staged MPI; the MPI directly
  when CUDA-aware; NCCL with a GPU per rank), each as a fraction of the limit; goal >= 0.90;
* halo pack: GB/s of packing each face of a (N, C, D, H, W) volume into a message (the Numba
  CUDA kernel, as the exchange does) vs a device memcpy of the same bytes;
* gradient sync: one gradient bucket of 25, 50 and 100 MB reduced by MPI (CUDA-aware or
  staged, whichever this MPI takes) and by NCCL (only with a GPU per rank: NCCL cannot put
  two ranks on one GPU);
* a training step of an MLP (``--ddp-mb`` MB) under hpcpar's DDP with NCCL buckets vs torch's
  ``DistributedDataParallel`` (NCCL) per step; goal <= 1.05x (a GPU per rank);
* peak GPU memory per rank of the conv step at 2 spatial ranks vs 1 (the 1-rank run is the
  same layer on the whole volume, on rank 0 alone).

``--cpu`` runs the rows that need no GPU on the CPU (Gloo for NCCL): a check of the script
itself, not a measurement of a device (``mpiexec -n 2 python benchmarks/device_check.py
--cpu --size 12 --channels 4 --reps 2 --ddp-mb 4``).

Sizes are small by default: the whole script must fit the device check's minutes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _sync(device) -> None:
    """Wait for the device's work (timing only: the measured code itself never does this)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, reps: int, comm, warmup: int = 2, device="cuda") -> float:
    """Median seconds of ``fn`` over ``reps`` runs, every rank starting each run together."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(comm.allgather(statistics.median(times)))


def transports(comm, device) -> list[str]:
    """The halo transports this machine offers for tensors on ``device``: on CUDA the staged
    MPI always, the MPI directly when it is CUDA-aware, NCCL with a GPU per rank; on CPU the
    MPI and Gloo."""
    import torch.distributed as dist

    if device.type != "cuda":
        return ["mpi", "gloo"]
    from hpcpar.parallel.cuda_aware import cuda_aware
    from hpcpar.parallel.torchdist import device_ident, shared_devices

    names = ["staged"] + (["mpi"] if cuda_aware() else [])
    shared = shared_devices(comm.allgather(device_ident(device))) is not None
    if dist.is_nccl_available() and not shared:
        names.append("nccl")
    return names


def conv_step(comm, size: int, channels: int, reps: int, device, profile=None) -> list:
    """The spatial conv3d step (forward + backward) judged against the device's own limit:
    cuDNN's ``Conv3d`` on each rank's piece with no halo, every rank at once (they share the
    device as the spatial step's ranks do). Also cuDNN on the whole sample on one rank, and
    hpcpar's overlap path (interior while the faces travel) and general path (halo first,
    one convolution) over each transport, each as a fraction of the limit (goal >= 0.90).
    With ``profile``, rank 0's host time of the spatial step by function is written there."""
    import torch
    from mpi4py import MPI

    from hpcpar.nn import SpatialConv3d, _boundary_conv
    from hpcpar.parallel.grid import ProcessGrid
    from hpcpar.parallel.spatial import local_slices
    from hpcpar.parallel.transport import use_transport

    torch.backends.cudnn.benchmark = True
    ranks = comm.Get_size()
    grid = ProcessGrid(data=1, x=ranks, comm=comm)
    X = torch.randn(1, channels, size, size, size, generator=torch.Generator().manual_seed(0))
    x = X[local_slices(X.shape, grid)].contiguous().to(device).requires_grad_()
    layer = SpatialConv3d(channels, channels, 3, padding=1, grid=grid).to(device)
    base = torch.nn.Conv3d(channels, channels, 3, padding=1).to(device)

    def step(mod, inp):
        def run():
            mod.zero_grad(set_to_none=True)
            inp.grad = None
            mod(inp).square().mean().backward()
        return run

    t_limit = _timed(step(base, x), reps, comm, device=device)
    t_whole = None
    if comm.Get_rank() == 0:   # the others wait at the barrier below: rank 0 has the device
        whole = X.to(device).requires_grad_()
        t_whole = _timed(step(base, whole), reps, MPI.COMM_SELF, device=device)
        del whole
    comm.Barrier()
    t_whole = comm.bcast(t_whole, root=0)
    local = f"{'x'.join(map(str, x.shape[2:]))}x{channels}"
    kind = "cuDNN Conv3d" if device.type == "cuda" else "torch Conv3d"
    rows = [(f"{kind}, whole sample {size}^3x{channels}, 1 rank", f"{t_whole * 1e3:.2f} ms",
             "-", None, f"{ranks} pieces at once below"),
            (f"{kind}, each rank's piece {local} with no halo, {ranks} ranks at once: THE LIMIT",
             f"{t_limit * 1e3:.2f} ms", f"whole sample {t_whole * 1e3:.2f} ms",
             t_whole / t_limit, "whole / limit (the device's speedup from splitting)")]
    for name in transports(comm, device):
        transport = use_transport(grid, name, device)
        try:
            for path, enabled in (("overlap", True), ("general", False)):
                _boundary_conv.ENABLED, was = enabled, _boundary_conv.ENABLED
                try:
                    t = _timed(step(layer, x), reps, comm, device=device)
                    if profile and enabled and name == transports(comm, device)[0]:
                        _profile(step(layer, x), reps, comm, profile)
                finally:
                    _boundary_conv.ENABLED = was
                rows.append((f"spatial conv step (fwd+bwd), {path} path, halos over "
                             f"{transport.name}, local {local}", f"{t * 1e3:.2f} ms",
                             f"limit {t_limit * 1e3:.2f} ms", f"{t_limit / t:.2f} of limit",
                             ">= 0.90 of limit"))
        finally:
            transport.close()
    return rows


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
        _sync("cuda" if torch.cuda.is_available() else "cpu")
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


def ddp_step(comm, mb: float, reps: int, device) -> list:
    """A training step (forward, backward with the gradient buckets reduced, optimizer step)
    of an MLP of ``mb`` MB of parameters under hpcpar's ``DistributedDataParallel`` with the
    torch.distributed bucket path vs torch's own ``DistributedDataParallel`` on the same
    backend (NCCL on CUDA, with a GPU per rank; Gloo on CPU), same 25 MB buckets; goal
    <= 1.05x."""
    import torch
    import torch.distributed as dist

    from hpcpar.parallel.grid import ProcessGrid
    from hpcpar.parallel.torchdist import device_ident, process_group, shared_devices
    from hpcpar.sync.ddp import DistributedDataParallel

    ranks = comm.Get_size()
    backend = "nccl" if device.type == "cuda" else "gloo"
    what = f"training step, MLP {mb:g} MB, {ranks} ranks, hpcpar DDP({backend})"
    if device.type == "cuda" and shared_devices(comm.allgather(device_ident(device))):
        return [(what, "n/a", f"torch DDP({backend}) n/a", None,
                 f"NCCL needs a GPU per rank ({torch.cuda.device_count()} for {ranks} ranks)")]
    width = 1024
    layers = max(1, round(mb * (1 << 20) / 4 / (width * width)))

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width),
                                                         torch.nn.ReLU())
                                     for _ in range(layers)]).to(device)

    x = torch.randn(32, width, device=device)

    def step(model, opt):
        def run():
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
        return run

    grid = ProcessGrid(data=ranks, comm=comm)
    ours_model = mlp()
    ours = DistributedDataParallel(ours_model, grid, grad_sync=backend)
    t_ours = _timed(step(ours, torch.optim.SGD(ours_model.parameters(), lr=1e-3)), reps, comm,
                    device=device)
    ours.remove_hooks()
    _, store, release = process_group(comm, "gloo")   # a rendezvous for torch's own group
    dist.init_process_group(backend, store=dist.PrefixStore("torch-ddp", store),
                            rank=comm.Get_rank(), world_size=ranks)
    try:
        theirs_model = mlp()
        theirs = torch.nn.parallel.DistributedDataParallel(
            theirs_model, device_ids=[device.index] if device.type == "cuda" else None)
        t_theirs = _timed(step(theirs, torch.optim.SGD(theirs_model.parameters(), lr=1e-3)),
                          reps, comm, device=device)
    finally:
        dist.destroy_process_group()
        release()
    return [(what, f"{t_ours * 1e3:.1f} ms", f"torch DDP({backend}) {t_theirs * 1e3:.1f} ms",
             t_ours / t_theirs, "<= 1.05x")]


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
    ap.add_argument("--ddp-mb", type=float, default=64,
                    help="parameter MB of the DDP step row (hpcpar DDP vs torch DDP)")
    ap.add_argument("--tests", default=None,
                    help="pytest -m gpu summary line, shown as the table's first row")
    ap.add_argument("--cpu", action="store_true",
                    help="run the rows that need no GPU on the CPU (conv limit, conv paths "
                         "over MPI and Gloo, DDP over Gloo): a check of the script itself; "
                         "use a tiny --size")
    args = ap.parse_args(argv)

    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if args.cpu:
        device = torch.device("cpu")
        rows = conv_step(comm, args.size, args.channels, args.reps, device, args.profile)
        rows += ddp_step(comm, args.ddp_mb, args.reps, device)
        if comm.Get_rank() == 0:
            print(table(rows, "CPU (script check, not a device measurement)", comm.Get_size()))
        return 0
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
    rows += ddp_step(comm, args.ddp_mb, args.reps, device)
    rows += peak_memory(comm, args.size, args.channels, device)
    if comm.Get_rank() == 0:
        print(table(rows, torch.cuda.get_device_name(device), comm.Get_size()))
    return 0


def table(rows, gpu: str, ranks: int) -> str:
    """The one Markdown table the device check prints (pasted into the README as is).

    Args:
        rows: (what, measured, baseline, ratio (a number: printed as "1.23x"; text: as it
            is) or None, target or note) per row.
        gpu: The device's name.
        ranks: MPI ranks used.

    Returns:
        The table, headed by the date, GPU and rank count.
    """
    head = (f"device check {time.strftime('%Y-%m-%d')}, {gpu}, {ranks} MPI ranks\n\n"
            "| what | measured | baseline (same run) | ratio | target |\n|---|---|---|---|---|")
    body = [f"| {w} | {m} | {b} | {_ratio(r)} | {t} |" for w, m, b, r, t in rows]
    return "\n".join([head, *body])


def _ratio(r) -> str:
    return "-" if r is None else r if isinstance(r, str) else f"{r:.2f}x"


if __name__ == "__main__":
    sys.exit(main())
