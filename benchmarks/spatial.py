"""Spatial parallelism benchmark: a conv3d stack, forward + backward, on 1 vs 2 vs 4 ranks.

    mpiexec -n 4 python benchmarks/spatial.py --size 128 --layers 3 --channels-last \
        --grids 1x1x1,2x1x1,2x2x1 --rounds 5 --repeat 3     # the issue's 128^3 x 16 case
    mpiexec -n 2 python benchmarks/spatial.py                 # small default (48^3)

It prints the command that reproduces it; ``--json PATH`` writes every round's times too.

Everything is measured in the same run, in alternating rounds: each round times every
configuration once (the median of --repeat steps after a warm-up). The baseline is the
fastest single-process torch form of the same stack with the same weights: ``padding=1`` or
pre-padded (``F.pad`` + ``padding=0``), each contiguous and channels_last_3d; round 1 times
all four, later rounds the fastest of them again. hpcpar runs SpatialConv3d on each grid
(``--grids``; 1x1x1 is hpcpar's own 1 rank) while the remaining ranks sleep (they do not
spin, so they do not steal the cores). Speedup = baseline / configuration within a round,
reported as the median over rounds with its min-max spread. Every process runs with the same
allocator settings (torch on transparent huge pages, ``THP_MEM_ALLOC_ENABLE=1``, set below
for all). One compute thread per rank (torch and numba), the one-rank-per-core convention: 1
rank vs 2 ranks compares one core with two. Printed:

* the machine's limit of each split grid (``limit 2x1x1``, ``limit 2x2x1``...): as many
  ranks at once, each running a single process on its own piece of the volume (the piece
  hpcpar's rank holds) with no halo and no messages, in every round with both the fastest
  torch form of round 1 (pre-padded, usually) and hpcpar's own 1 rank (a grid of its own),
  the faster of the two taken per round. Busy cores share caches, memory bandwidth and the
  host, so a split cannot beat it; with more ranks than cores the limit runs at the same
  oversubscription. hpcpar's grid is printed as a fraction of it (limit / hpcpar per round:
  median and min-max), next to the issue's target (benchmarks/limits.py);
* with ``--general-path``, each split grid again with the boundary fast path off (``general
  2x2x1``: every convolution through the general halo path, its extended buffer and its
  exchange before the compute), and hpcpar's speed relative to it per round;
* step time, speedup vs the 1-rank baseline and vs the fastest single process of each round
  (hpcpar's own 1 rank included), halo time as a fraction of the step, and the
  part of it spent waiting for the neighbours' messages (their lateness, not our copies);
* pack / unpack / add-unpack GB/s of the halo faces (torch and Numba paths, packing into a
  reused message buffer as the exchange does) vs a numpy contiguous copy of the same bytes,
  and vs a numpy copy that moves as many bytes through the caches as the pack must: it reads
  every cache line the face touches (a z face uses 4 bytes of each 64-byte line) and writes
  the message, so the copy is of (lines + message) / 2 bytes. That is the physical limit of a
  strided face, where no kernel can reach a copy of the face bytes alone;
* peak memory per rank during a step (RSS high-water mark above the pre-step RSS, with glibc
  told to return big blocks at once, plus the halo buffers and message buffers kept across
  steps) vs the 1-rank baseline.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import statistics
import time

from limits import command, fraction, quiet_barrier, spread, verdict, write_json

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")
# torch's CPU allocator on transparent huge pages: a fresh 67 MB tensor then costs 12 ms
# instead of 48 ms of page faults (measured); applies to the baseline and the layers alike
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


#: Blocks from this size up are served by mmap (:func:`_malloc_returns_big_blocks`); smaller
#: ones come from the heap, which reuses freed memory without the RSS seeing it again.
MMAP_BLOCK = 4 << 20


def _malloc_returns_big_blocks():
    """Serve >=4 MiB blocks (activations) by mmap and never raise that threshold, so freed
    tensors leave the RSS at once and the RSS high-water mark measures live tensor memory;
    smaller blocks (halo messages) are reused from the heap as usual."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, MMAP_BLOCK)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, MMAP_BLOCK)  # M_TRIM_THRESHOLD
    except OSError:  # pragma: no cover - not glibc
        pass


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


class PeakMemory:
    """Peak RSS growth (bytes) inside the ``with`` block (Linux: VmHWM reset by clear_refs)."""

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            self.ok = True
        except OSError:
            self.ok = False
        self.base = _rss_kib("VmRSS")
        return self

    def __exit__(self, *exc):
        self.peak = (_rss_kib("VmHWM") - self.base) * 1024 if self.ok else float("nan")


#: The row of hpcpar's own 1 rank (also a form of the limits, :func:`bench_limit`).
ONE_RANK = "hpcpar 1x1x1"
GRIDS = ((1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 2, 2))
#: Issue 34: hpcpar's fraction of its limit (the median over rounds) on these grids.
TARGETS = {(2, 1, 1): 0.95, (2, 2, 1): 0.90}


def grid_name(dims) -> str:
    return "x".join(map(str, dims))


class PrePadded:
    """``F.pad`` then ``Conv3d(padding=0)``: the same layer as ``padding=1`` with the zero frame
    made once, in the input's memory format (the fastest single-process form on CPU)."""

    def __new__(cls, conv, memory_format):
        import torch.nn.functional as F
        from torch import nn

        class _Pad(nn.Module):
            def forward(self, x):
                return F.pad(x, (1,) * 6).contiguous(memory_format=memory_format)

        conv.padding = (0, 0, 0)
        return nn.Sequential(_Pad(), conv)


def build_stack(channels, layers, grid=None, seed=0, prepad=None):
    """The layer stack: torch Conv3d (``padding=1``, or pre-padded in ``prepad`` memory
    format) or, with ``grid``, hpcpar's SpatialConv3d; the same weights for a seed."""
    import torch
    from torch import nn

    from hpcpar.nn import SpatialConv3d

    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        if grid is None:
            conv = nn.Conv3d(channels, channels, 3, padding=1)
            mods += [conv if prepad is None else PrePadded(conv, prepad), nn.ReLU()]
        else:
            mods += [SpatialConv3d(channels, channels, 3, padding=1, grid=grid), nn.ReLU()]
    return nn.Sequential(*mods)


def step(model, x) -> None:
    """One forward + backward of the stack (gradients of the previous step dropped)."""
    import torch

    x.grad = None
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.backward(torch.ones_like(y))


def kept_bytes(model) -> int:
    """Halo buffers kept across steps: the pool and the plans' reused message buffers."""
    from hpcpar.parallel.halo_buffers import POOL

    return POOL.nbytes + sum(p.halo.message_nbytes for m in model.modules()
                             for p in getattr(m, "_spatial_plans", {}).values())


def time_steps(model, x, repeat):
    """Median seconds of forward + backward over ``repeat`` steps after one warm-up step, and
    the peak memory growth over all of them (halo buffer pool included)."""
    from hpcpar.parallel.counters import COUNTERS
    from hpcpar.parallel.halo_buffers import POOL

    POOL.clear()
    times, halo, wait = [], [], []
    step(model, x)  # warm-up: plans, oneDNN kernels/scratchpads (~100 MB once), MPI buffers
    pooled = kept_bytes(model)
    with PeakMemory() as mem:
        for _ in range(repeat):
            before = COUNTERS.snapshot()
            t0 = time.perf_counter()
            step(model, x)
            times.append(time.perf_counter() - t0)
            spent = COUNTERS.since(before)
            halo.append(spent["t_halo"])
            wait.append(spent["t_halo_wait"])
    POOL.clear()
    return (statistics.median(times), statistics.median(halo), mem.peak + pooled,
            statistics.median(wait))


def on_first(comm, ranks, args, build):
    """Time a stack on the first ``ranks`` ranks at once while the others wait without
    spinning. ``build(sub)`` (``sub``: the members' communicator) returns the model, this
    rank's input and the grids to free after. Returns (step, halo, peak, halo wait), each the
    largest over the ranks, on every rank."""
    member = comm.Get_rank() < ranks
    sub = comm.Split(0 if member else 1, comm.Get_rank())
    out = None
    if member:
        model, x, grids = build(sub)
        sub.Barrier()
        out = tuple(sub.allreduce(v, op=_max()) for v in time_steps(model, x, args.repeat))
        for grid in grids:
            grid.free()
    sub.Free()
    quiet_barrier(comm)
    return comm.bcast(out, root=0)


def volume(args, fmt, grid=None):
    """The input (the same for every configuration), or the piece of it this rank of
    ``grid`` holds, in memory format ``fmt``, requiring its gradient."""
    import torch

    from hpcpar.parallel.spatial import local_slices

    n = args.size
    torch.manual_seed(1)
    x = torch.randn(args.batch, args.channels, n, n, n)
    x = x if grid is None else x[local_slices(x.shape, grid)]
    return x.contiguous(memory_format=fmt).requires_grad_()


def bench_ranks(comm, dims, args, general=False):
    """hpcpar's spatial stack on the grid ``dims`` (the first prod(dims) ranks); with
    ``general``, every convolution on the general halo path (the boundary path off)."""
    from hpcpar import ProcessGrid
    from hpcpar.nn import _boundary_conv

    def build(sub):
        grid = ProcessGrid(1, *dims, comm=sub)
        model = build_stack(args.channels, args.layers, grid)
        return model, volume(args, _fmt(args), grid), [grid]

    _boundary_conv.ENABLED = not general
    try:
        return on_first(comm, math.prod(dims), args, build)
    finally:
        _boundary_conv.ENABLED = True


def _fmt(args):
    import torch

    return torch.channels_last_3d if args.channels_last else torch.contiguous_format


def _max():
    from mpi4py import MPI

    return MPI.MAX


#: The single-process torch forms of the same stack, each timed in every round: the fastest
#: one that round is the baseline (never a slow form chosen to flatter the ratio).
BASELINES = (("torch p1", False, False), ("torch p1 cl", False, True),
             ("torch pad", True, False), ("torch pad cl", True, True))


def torch_form(args, form):
    """The stack of the BASELINES ``form`` and its memory format."""
    import torch

    _, prepad, cl = next(b for b in BASELINES if b[0] == form)
    fmt = torch.channels_last_3d if cl else torch.contiguous_format
    return build_stack(args.channels, args.layers, prepad=fmt if prepad else None), fmt


def bench_baseline(comm, args, form):
    """The torch ``form`` on the whole volume, rank 0 only."""
    def build(sub):
        model, fmt = torch_form(args, form)
        return model, volume(args, fmt), []

    return on_first(comm, 1, args, build)


def bench_limit(comm, dims, args, form):
    """The machine's limit of the grid ``dims``: each of its ranks runs the single-process
    ``form`` (a BASELINES name, or ONE_RANK: hpcpar's 1-rank path on a grid of this rank
    alone) on the piece of the volume it holds in that grid, with no halo and no messages, all
    at once (so at the same oversubscription as hpcpar's grid)."""
    from mpi4py import MPI

    from hpcpar import ProcessGrid

    def build(sub):
        split = ProcessGrid(1, *dims, comm=sub)  # only where this rank's piece lies
        if form == ONE_RANK:
            grid = ProcessGrid(1, 1, 1, 1, comm=MPI.COMM_SELF)
            return (build_stack(args.channels, args.layers, grid),
                    volume(args, _fmt(args), split), [split, grid])
        model, fmt = torch_form(args, form)
        return model, volume(args, fmt, split), [split]

    return on_first(comm, math.prod(dims), args, build)


def lines_touched(view) -> int:
    """Bytes of the distinct 64-byte cache lines holding the elements of ``view``."""
    import numpy as np

    idx = np.zeros(1, dtype=np.int64)
    for n, st in zip(view.shape, view.stride()):
        idx = (idx[:, None] + np.arange(n, dtype=np.int64) * st).ravel()
    addr = view.data_ptr() + idx * view.element_size()
    return int(np.unique(addr // 64).size) * 64


def bench_pack(args):
    """GB/s of face pack/unpack/add-unpack on a half volume vs a numpy contiguous copy of the
    same bytes and vs one moving the same cache traffic."""
    import numpy as np
    import torch

    from hpcpar.kernels import halo_pack as K
    from hpcpar.parallel.halo_buffers import CHANNELS_LAST, new_buffer
    from hpcpar.plan.calibrate import best_time

    def copy_time(nbytes):
        src = np.random.rand(nbytes // 4).astype(np.float32)
        dst = np.empty_like(src)
        return best_time(lambda: np.copyto(dst, src), args.repeat * 25)

    n, c = args.size, args.channels
    faces = {"x": (slice(1, 2), slice(1, n + 1), slice(1, n + 1)),
             "y": (slice(1, n // 2 + 1), slice(1, 2), slice(1, n + 1)),
             "z": (slice(1, n // 2 + 1), slice(1, n + 1), slice(1, 2))}
    rows = []
    for label, layout in (("ncdhw", None), ("cl", CHANNELS_LAST)):
        # halo buffer and message buffers as the exchange makes them, in one memory order
        buf = new_buffer((args.batch, c, n // 2 + 2, n + 2, n + 2), torch.float32, "cpu",
                         layout).normal_()
        for name, face in faces.items():
            view = buf[(slice(None), slice(None), *face)]
            nbytes = view.numel() * view.element_size()
            lines = lines_touched(view)
            ref, ref_lines = copy_time(nbytes), copy_time((lines + nbytes) // 2)
            msg = new_buffer(view.shape, view.dtype, view.device, layout)
            for mode, tp, tu, ta in _pack_times(K, view, msg, args.repeat * 25):
                rows.append((name, label, mode, nbytes, lines, nbytes / ref / 1e9,
                             nbytes / tp / 1e9, nbytes / tu / 1e9, nbytes / ta / 1e9,
                             ref_lines / tp))
    os.environ.pop("HPCPAR_HALO_KERNELS", None)
    return rows


def _pack_times(K, view, msg, repeat):
    """(path, pack s, unpack s, add-unpack s) of one face on the torch and Numba paths."""
    from hpcpar.plan.calibrate import best_time

    out = []
    for mode in ("torch", "numba"):
        os.environ["HPCPAR_HALO_KERNELS"] = mode
        out.append((mode, best_time(lambda: K.pack(view, msg), repeat),
                    best_time(lambda: K.unpack(view, msg), repeat),
                    best_time(lambda: K.unpack(view, msg, add=True), repeat)))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=48, help="cube edge (issue: 128)")
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=2, help="timed steps per configuration "
                        "and round (after one warm-up step)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--grids", default=",".join("x".join(map(str, g)) for g in GRIDS),
                        type=lambda t: [tuple(int(v) for v in g.split("x"))
                                        for g in t.split(",")],
                        help="spatial grids XxYxZ of hpcpar (those that fit the ranks run)")
    parser.add_argument("--channels-last", action="store_true",
                        help="run hpcpar's stack on channels_last_3d tensors (the torch "
                        "baselines run in both memory formats)")
    parser.add_argument("--general-path", action="store_true",
                        help="also time each split grid with the boundary fast path off "
                        "(`general XxYxZ`: every convolution through the general halo path)")
    parser.add_argument("--json", metavar="PATH", help="also write the command, the settings "
                        "and every round's times to PATH")
    args = parser.parse_args(argv)
    _malloc_returns_big_blocks()
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    try:
        import numba

        numba.set_num_threads(1)
    except Exception:  # pragma: no cover
        pass
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    say = print if comm.Get_rank() == 0 else (lambda *a, **k: None)
    say(f"# conv3d stack: {args.layers} x (Conv3d {args.channels}->{args.channels} k3 p1 + "
        f"ReLU), input {args.batch}x{args.channels}x{args.size}^3 fp32"
        f"{' channels-last' if args.channels_last else ''}, forward+backward; "
        f"{size} MPI ranks launched on {os.cpu_count()} cores, 1 thread each; "
        f"THP_MEM_ALLOC_ENABLE={os.environ['THP_MEM_ALLOC_ENABLE']}")
    say(f"# command: {command(size)}")
    grids = [d for d in args.grids if math.prod(d) <= size]
    names = [b[0] for b in BASELINES]
    for d in grids:  # each split grid after its limit
        if math.prod(d) > 1:
            names.append(f"limit {grid_name(d)}")
        names.append(f"hpcpar {grid_name(d)}")
        if args.general_path and math.prod(d) > 1:
            names.append(f"general {grid_name(d)}")
    rounds: list[dict] = []
    for r in range(args.rounds):  # every configuration once per round, in turn
        res = {b[0]: bench_baseline(comm, args, b[0]) for b in BASELINES
               if r == 0 or b[0] == rounds[0]["fastest"]}
        res["fastest"] = min((b for b in res if b.startswith("torch")), key=lambda b: res[b][0])
        res["limit forms"] = {}
        torch_best = (rounds[0] if rounds else res)["fastest"]
        for d in grids:
            res[f"hpcpar {grid_name(d)}"] = bench_ranks(comm, d, args)
            if f"general {grid_name(d)}" in names:
                res[f"general {grid_name(d)}"] = bench_ranks(comm, d, args, general=True)
            if math.prod(d) > 1:  # the limit in both fastest forms, the faster one taken
                forms = {f: bench_limit(comm, d, args, f) for f in (torch_best, ONE_RANK)}
                res["limit forms"][grid_name(d)] = {f: v[0] for f, v in forms.items()}
                res[f"limit {grid_name(d)}"] = min(forms.values(), key=lambda v: v[0])
        rounds.append(res)
    best = rounds[0]["fastest"]
    say(f"# {args.rounds} rounds; each: median of {args.repeat} steps after a warm-up. The "
        f"baseline is the fastest single-process torch form of round 1 ({best}), timed again "
        f"in every round; speedup = baseline / config per round: median (min-max)")
    say("# vs 1 proc = the same, against the fastest single process of each round, hpcpar's "
        "1 rank included;\n# limit XxYxZ = as many ranks at once, each running one process "
        "on the piece it holds in that grid, no halo, no messages; per round the faster of "
        f"{best} and hpcpar's 1 rank: the machine's limit for that split")
    say(f"{'config':>16} {'ranks':>5} {'step s':>8} {'speedup':>8} {'spread':>11} "
        f"{'vs 1 proc':>9} {'spread':>11} {'halo %':>7} {'wait %':>7} {'peak MiB':>9} "
        f"{'mem ratio':>9}")
    one = [n for n in names if n.startswith("torch") or n == ONE_RANK]
    if comm.Get_rank() == 0:
        base_peak = rounds[0][best][2]
        for name in names:
            runs = [rd[name] for rd in rounds if name in rd]
            ratios = [rd[best][0] / rd[name][0] for rd in rounds if name in rd]
            vs_one = [min(rd[o][0] for o in one if o in rd) / rd[name][0]
                      for rd in rounds if name in rd]
            step = statistics.median(v[0] for v in runs)
            halo, peak, wait = (statistics.median(v[i] for v in runs) for i in (1, 2, 3))
            ranks = 1 if name.startswith("torch") else math.prod(
                int(v) for v in name.split()[1].split("x"))
            say(f"{name:>16} {ranks:>5} {step:8.3f} {statistics.median(ratios):8.2f} "
                f"{spread(ratios):>11} {statistics.median(vs_one):9.2f} {spread(vs_one):>11} "
                f"{100 * halo / step:7.1f} {100 * wait / step:7.1f} {peak / 2**20:9.1f} "
                f"{peak / base_peak if base_peak else math.nan:9.2f}")  # 0: below the RSS's grain
    for d in (d for d in grids if math.prod(d) > 1):
        g = grid_name(d)
        limit, ours = ([rd[f"{kind} {g}"][0] for rd in rounds] for kind in ("limit", "hpcpar"))
        won = [min(forms, key=forms.get) for forms in (rd["limit forms"][g] for rd in rounds)]
        say(f"# hpcpar {g} runs at {fraction(limit, ours)} of its {math.prod(d)}-slab limit "
            "(limit step / hpcpar step per round; the limit's form: "
            + ", ".join(f"{f} in {won.count(f)}" for f in sorted(set(won)))
            + f" of {len(won)} rounds){verdict(limit, ours, TARGETS.get(d))}")
        if f"general {g}" in names:
            general = [rd[f"general {g}"][0] for rd in rounds]
            say(f"# hpcpar {g} is {fraction(general, ours)} times as fast as with every "
                "convolution on the general halo path (general step / hpcpar step per round)")
    say(f"# {size} ranks on {os.cpu_count()} cores ({size / (os.cpu_count() or 1):g} per "
        "core); a limit runs its ranks at the same oversubscription as its grid")
    if comm.Get_rank() == 0:
        write_json(args.json, {"command": command(size), "args": vars(args), "rounds": rounds})
    if comm.Get_rank() == 0:
        say("\n# halo faces of a half volume (GB/s); ratio = pack / numpy contiguous copy of "
            "the same bytes;\n# limit = numpy copy time of (lines + KiB) / 2, the same cache "
            "traffic, / pack time (lines = KiB of the cache lines the face touches)")
        say(f"{'face':>4} {'layout':>6} {'path':>6} {'KiB':>6} {'lines':>6} {'numpy':>7} "
            f"{'pack':>7} {'unpack':>7} {'add':>7} {'ratio':>6} {'limit':>6}")
        for name, layout, mode, nbytes, lines, ref, p, u, a, lim in bench_pack(args):
            say(f"{name:>4} {layout:>6} {mode:>6} {nbytes / 1024:6.0f} {lines / 1024:6.0f} "
                f"{ref:7.2f} "
                f"{p:7.2f} {u:7.2f} {a:7.2f} {p / ref:6.2f} {lim:6.2f}")
    quiet_barrier(comm)


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:  # one rank failing must end the run, not leave the others waiting
        if isinstance(e, SystemExit) and e.code in (0, 2, None):
            raise  # --help or a bad argument: every rank parsed the same and exits alike
        import traceback

        from mpi4py import MPI

        traceback.print_exc()
        MPI.COMM_WORLD.Abort(1)
