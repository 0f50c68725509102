"""Activation memory per rank of a spatially split conv3d stack: 1 vs 2 vs 4 ranks.

    mpiexec -n 4 python benchmarks/memory.py --size 128 --layers 3     # the issue's case
    mpiexec -n 4 python benchmarks/memory.py --size 128 --layers 3 --channels-last
    mpiexec -n 4 python benchmarks/memory.py --size 128 --layers 3 --default-malloc

Activation memory = the RSS high-water mark during one forward + backward above the RSS just
before it (input, weights and the warm-up's one-off buffers excluded), on the step after a
warm-up step. glibc is told to serve blocks of 4 MiB and more by mmap and to keep that
threshold (``--default-malloc``: not told; glibc then raises its mmap threshold to the size
of the last freed block, up to 32 MiB, and blocks under it stay in the heap after they are
freed, so the RSS keeps memory no tensor holds, and memory the heap kept from the warm-up
step is not counted again: the peak above the pre-step RSS can then read below ``saved``; at
128³ every tensor is above 32 MiB and both agree). Baselines measured in the same run: plain
torch (``nn.Conv3d(padding=1)`` on the whole volume, in the chosen memory format) and
hpcpar's layers on one rank. Where the memory goes, per configuration:

* ``saved``: bytes autograd keeps for backward at the end of the forward (distinct storages);
* ``kept``: halo buffers and message buffers held across steps by hpcpar;
* ``peak``: the high-water mark; ``peak - saved`` is the backward's transient (gradients
  next to the rebuilt halo-extended input).

Ranks not in a configuration sleep (they do not spin); one compute thread per rank.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spatial import (  # noqa: E402
    PeakMemory,
    _malloc_returns_big_blocks,
    build_stack,
    kept_bytes,
    polite_wait,
    step,
)

GRIDS = ((1, 1, 1), (2, 1, 1), (2, 2, 1))


def saved_bytes(model, x) -> tuple[int, object]:
    """Forward under a saved-tensors hook: bytes of the distinct storages autograd keeps."""
    import torch

    seen = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
    seen.pop(x.untyped_storage().data_ptr(), None)   # the input is there before the step
    return sum(seen.values()), y


def measure(model, x) -> tuple[float, float, float]:
    """(peak, saved, kept) bytes of one step after a warm-up step."""
    import torch

    from hpcpar.parallel.halo import POOL

    POOL.clear()
    step(model, x)
    kept = kept_bytes(model)
    with PeakMemory() as mem:
        x.grad = None
        model.zero_grad(set_to_none=True)
        saved, y = saved_bytes(model, x)
        y.backward(torch.ones_like(y))
        del y
    POOL.clear()
    return mem.peak, saved, kept


def run_config(comm, dims, args):
    """Measure on the first prod(dims) ranks (None: plain torch on rank 0); max over ranks."""
    import torch

    from hpcpar import ProcessGrid
    from hpcpar.parallel.spatial import local_slices

    r = 1 if dims is None else dims[0] * dims[1] * dims[2]
    member = comm.Get_rank() < r
    sub = comm.Split(0 if member else 1, comm.Get_rank())
    out = None
    if member:
        grid = None if dims is None else ProcessGrid(1, *dims, comm=sub)
        n = args.size
        torch.manual_seed(1)
        x = torch.randn(args.batch, args.channels, n, n, n)
        if grid is not None:
            x = x[local_slices(x.shape, grid)]
        fmt = torch.channels_last_3d if args.channels_last else torch.contiguous_format
        x = x.contiguous(memory_format=fmt).requires_grad_()
        model = build_stack(args.channels, args.layers, grid)
        if args.channels_last:
            model = model.to(memory_format=torch.channels_last_3d)
        sub.Barrier()
        from mpi4py import MPI

        out = tuple(sub.allreduce(v, op=MPI.MAX) for v in measure(model, x))
        if grid is not None:
            grid.free()
    sub.Free()
    polite_wait(comm)
    return comm.bcast(out, root=0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64, help="cube edge (issue: 128)")
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--channels-last", action="store_true",
                        help="input and stack in torch's channels_last_3d (baseline too)")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's dynamic mmap threshold on (see the docstring)")
    args = parser.parse_args(argv)
    if not args.default_malloc:
        _malloc_returns_big_blocks()
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    say = print if comm.Get_rank() == 0 else (lambda *a, **k: None)
    vol = args.batch * args.channels * args.size ** 3 * 4
    say(f"# activation memory per rank: {args.layers} x (Conv3d {args.channels}->"
        f"{args.channels} k3 p1 + ReLU), input {args.batch}x{args.channels}x{args.size}^3 fp32"
        f"{' channels-last' if args.channels_last else ''} ({vol / 2**20:.0f} MiB = 1 vol), "
        f"forward+backward; {size} MPI ranks on {os.cpu_count()} cores, 1 thread each; "
        f"malloc: {'glibc default' if args.default_malloc else 'mmap >= 4 MiB, fixed'}")
    say(f"{'ranks':>5} {'config':>8} {'peak MiB':>9} {'saved':>8} {'kept':>7} {'vol':>5} "
        f"{'/torch':>7} {'/hpcpar1':>8} {'ideal':>6}")
    rows = [(1, "torch", run_config(comm, None, args))]
    for dims in GRIDS:
        r = dims[0] * dims[1] * dims[2]
        if r > size:
            break
        rows.append((r, "x".join(map(str, dims)), run_config(comm, dims, args)))
    torch_peak, one_peak = rows[0][2][0], rows[1][2][0]
    for r, name, (peak, saved, kept) in rows:
        say(f"{r:>5} {name:>8} {peak / 2**20:9.1f} {saved / 2**20:8.1f} {kept / 2**20:7.1f} "
            f"{peak / vol * r:5.2f} {peak / torch_peak:7.2f} {peak / one_peak:8.2f} "
            f"{1 / r:6.2f}")
    say("# vol: peak x ranks / one volume; /torch, /hpcpar1: this peak over the 1-rank peak of "
        "plain torch, of hpcpar's layers")


if __name__ == "__main__":
    main()
