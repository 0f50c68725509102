"""Activation memory per rank of a spatially split model: plain torch vs hpcpar on 1, 2, 4 ranks.

    mpiexec -n 4 python benchmarks/memory.py --size 128 --layers 3     # a conv3d stack
    mpiexec -n 4 python benchmarks/memory.py --size 128 --layers 3 --channels-last
    mpiexec -n 4 python benchmarks/memory.py --size 128 --layers 3 --default-malloc
    mpiexec -n 4 python benchmarks/memory.py --size 128 --model cosmoflow unet3d --formats both

``--model cosmoflow unet3d`` measures hpcpar's models (``spatialize`` of the plain model, batch
1) against the plain model, per memory format, and prints the targets of issue 29: hpcpar on
1 rank at most 1.05x torch, on P ranks at most 1.1 x torch / P plus the halo's own share
(``halo``: the ghost faces exchanged in the forward, which backward keeps).

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
    step,
)

from hpcpar.testing.oracles import idle_barrier  # noqa: E402

GRIDS = ((1, 1, 1), (2, 1, 1), (2, 2, 1))


MODELS = ("stack", "cosmoflow", "unet3d")


def build_model(name, args, grid):
    """The plain model (``grid`` None) or its hpcpar form, the same weights either way."""
    import torch

    if name == "stack":
        return build_stack(args.channels, args.layers, grid)
    from hpcpar.models import CosmoFlow, UNet3D
    from hpcpar.nn import spatialize

    torch.manual_seed(0)
    model = CosmoFlow(input_size=args.size) if name == "cosmoflow" else UNet3D()
    return model if grid is None else spatialize(model, grid)


def in_channels(name, args) -> int:
    return {"stack": args.channels, "cosmoflow": 4, "unet3d": 1}[name]


def saved_bytes(model, x) -> tuple[int, object]:
    """Forward under a saved-tensors hook: bytes of the distinct storages autograd keeps
    (parameters and the input excluded: they are there before the step)."""
    import torch

    seen = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
    for t in (x, *model.parameters()):
        seen.pop(t.untyped_storage().data_ptr(), None)
    return sum(seen.values()), y


def measure(model, x) -> tuple[float, float, float, float]:
    """(peak, saved, kept, halo) bytes of one step after a warm-up step."""
    import torch

    from hpcpar.parallel.counters import COUNTERS
    from hpcpar.parallel.halo_buffers import POOL

    POOL.clear()
    step(model, x)
    kept = kept_bytes(model)
    with PeakMemory() as mem:
        x.grad = None
        model.zero_grad(set_to_none=True)
        before = COUNTERS.snapshot()
        saved, y = saved_bytes(model, x)
        halo = COUNTERS.since(before)["bytes_halo"]
        y.backward(torch.ones_like(y))
        del y
    POOL.clear()
    return mem.peak, saved, kept, halo


def run_config(comm, dims, args, name="stack", channels_last=False):
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
        x = torch.randn(args.batch, in_channels(name, args), n, n, n)
        if grid is not None:
            x = x[local_slices(x.shape, grid)]
        fmt = torch.channels_last_3d if channels_last else torch.contiguous_format
        x = x.contiguous(memory_format=fmt).requires_grad_()
        model = build_model(name, args, grid)
        if channels_last:
            model = model.to(memory_format=torch.channels_last_3d)
        sub.Barrier()
        from mpi4py import MPI

        out = tuple(sub.allreduce(v, op=MPI.MAX) for v in measure(model, x))
        if grid is not None:
            grid.free()
    sub.Free()
    idle_barrier(comm)
    return comm.bcast(out, root=0)


def table(comm, args, name, channels_last, say):
    """Measure one model in one memory format on torch and every grid that fits; print."""
    size = comm.Get_size()
    n, c = args.size, in_channels(name, args)
    vol = args.batch * c * n ** 3 * 4
    what = (f"{args.layers} x (Conv3d {c}->{c} k3 p1 + ReLU)" if name == "stack" else name)
    say(f"# {what}, input {args.batch}x{c}x{n}^3 fp32 "
        f"{'channels-last' if channels_last else 'contiguous'} ({vol / 2**20:.0f} MiB), "
        f"forward+backward; {size} MPI ranks on {os.cpu_count()} cores, 1 thread each; "
        f"malloc: {'glibc default' if args.default_malloc else 'mmap >= 4 MiB, fixed'}")
    say(f"{'ranks':>5} {'config':>8} {'peak MiB':>9} {'saved':>8} {'kept':>7} {'halo':>6} "
        f"{'/(torch/P)':>10} {'target':>7} {'ok':>3}")
    rows = [(1, "torch", run_config(comm, None, args, name, channels_last))]
    for dims in GRIDS:
        r = dims[0] * dims[1] * dims[2]
        if r > size:
            break
        rows.append((r, "x".join(map(str, dims)),
                     run_config(comm, dims, args, name, channels_last)))
    torch_peak = rows[0][2][0]
    for k, (r, config, (peak, saved, kept, halo)) in enumerate(rows):
        # issue 29: 1 rank <= 1.05 x torch; P ranks <= 1.1 x torch / P + the halo's share
        target = torch_peak * (1.05 if r == 1 else 1.1 / r) + halo
        ok = "-" if k == 0 else ("yes" if peak <= target else "NO")
        say(f"{r:>5} {config:>8} {peak / 2**20:9.1f} {saved / 2**20:8.1f} {kept / 2**20:7.1f} "
            f"{halo / 2**20:6.1f} {peak / torch_peak * r:10.2f} {target / 2**20:7.1f} {ok:>3}")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64, help="cube edge (issue: 128)")
    parser.add_argument("--model", nargs="+", choices=MODELS, default=["stack"],
                        help="what to measure (stack: the conv3d stack below)")
    parser.add_argument("--channels", type=int, default=16, help="stack only")
    parser.add_argument("--layers", type=int, default=3, help="stack only")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--channels-last", action="store_true",
                        help="input and model in torch's channels_last_3d (baseline too)")
    parser.add_argument("--formats", choices=("one", "both"), default="one",
                        help="both: contiguous, then channels-last")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's dynamic mmap threshold on (see the docstring)")
    args = parser.parse_args(argv)
    if not args.default_malloc:
        _malloc_returns_big_blocks()
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    say = print if comm.Get_rank() == 0 else (lambda *a, **k: None)
    formats = (False, True) if args.formats == "both" else (args.channels_last,)
    for name in args.model:
        for channels_last in formats:
            table(comm, args, name, channels_last, say)
    say("# peak: RSS high-water mark above the pre-step RSS (max over ranks); saved: what "
        "autograd keeps at the end of the forward; kept: halo buffers kept across steps; "
        "halo: ghost faces exchanged in the forward; /(torch/P): peak x ranks / torch's peak; "
        "target: 1.05 x torch on 1 rank, 1.1 x torch / P + halo on P")


if __name__ == "__main__":
    main()
