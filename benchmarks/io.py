"""I/O benchmark: hyperslab reads vs raw reads, reader-fed training vs in-memory, bytes read.

    mpiexec -n 2 python benchmarks/io.py --grid 1x2x1x1 --size 128 --samples 16

1. Hyperslab read throughput: every rank reads its sub-volume of its data group's samples
   with the reader's code; the baseline reads the same bytes of the same files with plain
   ``preadv`` calls into one buffer, one per stretch of touched chunks adjacent in the file
   (so it pays the same seeks, but nothing for placing data), interleaved with the hyperslab
   reads sample by sample so both see the same machine load. Warm (page cache): each sample
   read both ways, alternating which goes first; cold (pages dropped with
   ``posix_fadvise(DONTNEED)``): each pass reads every other sample one way and the rest the
   other, then the roles swap, so neither way reads pages the other just fetched. Throughput
   = the rank's share of a sample / median seconds per sample. Warm reads are CPU work (the
   kernel's copy plus ours), so they are also timed in CPU seconds of the reading thread
   (``warm cpu``): wall times of ranks sharing a core (or a machine other jobs use) include
   waiting for the core. Target >= 0.9x.
2. Training loop (a small local conv net on each rank's block, no communication: an I/O
   test) fed by ``ShardedVolumeDataset(prefetch=2)`` from cold files vs the same loop on
   the same batches already in memory. Target step time <= 1.05x.
3. Bytes read per rank per sample vs the ideal 1/(x*y*z) of a sample (chunk rounding).

1 and 3 run for each chunking (default: ``auto``, what ``hpcpar data make`` chooses without
options, then ``grid``, one chunk per rank block of ``--grid`` as ``--grid`` makes them), 2
for the first unless ``--no-train``. The last line per chunking sums up all ranks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np


def drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_ranges(sh, row, box, nbytes, file_size) -> list[tuple[int, int]]:
    """The file ranges (offset, length) the hyperslab read of (shard, row) fetches: the
    touched chunks, merged where adjacent in the file. Without the fast path (no chunk
    offsets): ``nbytes`` from a place that depends on the row."""
    if sh.fd is None:
        return [((row * nbytes) % max(file_size - nbytes, 1), nbytes)]
    c = sh.chunks
    size = int(np.prod(c)) * sh.dtype.itemsize
    out: list = []
    for off in sorted(o for o in sh.chunk_offsets(row, box) if o is not None):
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + size)
        else:
            out.append((off, size))
    return out


class PairedReads:
    """One rank's two ways of reading a sample: the reader's hyperslab read, and plain
    ``preadv`` calls of the same file ranges into one buffer (files stay open, as the reader
    keeps them)."""

    def __init__(self, files, box, local_shape, nbytes: int):
        from hpcpar.data._hyperslab import touched_chunk_bytes

        self.files, self.box, self.nbytes = files, box, nbytes
        self.out_x = np.empty((1, *local_shape), np.float32)
        self.out_y = np.empty((1, 4), np.float32)
        sh = files.get(0)
        whole = touched_chunk_bytes(box, sh.chunks, sh.dtype.itemsize) if sh.chunks else 0
        self.buf = np.empty(max(nbytes, whole), np.uint8)
        self.fds: dict = {}
        self.ranges: dict = {}

    def seconds(self, item, raw: bool) -> tuple[float, float]:
        """(wall, CPU) seconds of one read."""
        from hpcpar.data._hyperslab import read_samples

        shard, row = item
        if raw:
            if shard not in self.fds:
                self.fds[shard] = os.open(self.files.paths[shard], os.O_RDONLY)
            fd = self.fds[shard]
            if item not in self.ranges:
                self.ranges[item] = [
                    (off, memoryview(self.buf)[pos:pos + n]) for off, n, pos in
                    _placed(raw_ranges(self.files.get(shard), row, self.box, self.nbytes,
                                       os.fstat(fd).st_size))]
            c0, t0 = time.thread_time(), time.perf_counter()
            for off, view in self.ranges[item]:
                os.preadv(fd, [view], off)
        else:
            c0, t0 = time.thread_time(), time.perf_counter()
            read_samples(self.files, [item], self.box, self.out_x, self.out_y)
        return time.perf_counter() - t0, time.thread_time() - c0

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _placed(ranges):
    """(offset, length, position in the buffer) of consecutive ranges."""
    pos = 0
    for off, n in ranges:
        yield off, n, pos
        pos += n


def paired_times(reads: PairedReads, items, mode: str, comm, paths) -> tuple[list, list]:
    """(wall, CPU) seconds per sample (hyperslab, raw) of one pass, interleaved sample by
    sample. Per-sample times, so a busy machine's preemptions show as outliers, not averages."""
    t_h, t_r = [], []
    if mode == "warm":
        for k, item in enumerate(items):
            for raw in ((False, True) if k % 2 else (True, False)):
                (t_r if raw else t_h).append(reads.seconds(item, raw))
        return t_h, t_r
    for parity in (0, 1):
        comm.Barrier()
        drop_cache(paths)
        comm.Barrier()
        for k, item in enumerate(items):
            raw = k % 2 != parity
            (t_r if raw else t_h).append(reads.seconds(item, raw))
    return t_h, t_r


def small_net(channels: int, targets: int):
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv3d(channels, 16, 3, padding=1), nn.ReLU(), nn.MaxPool3d(2),
        nn.Conv3d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten(),
        nn.Linear(16, targets))


def train_steps(batches, net, opt) -> list[float]:
    import torch

    times = []
    t0 = time.perf_counter()
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grid", default="1x1x1x1", help="data x X x Y x Z (one may be -1)")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--channels", type=int, default=4)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--batch", type=int, default=0, help="global batch (default: 2 x data)")
    ap.add_argument("--chunk", action="append",
                    help="chunking as `data make --chunk` (repeatable; default: auto (what "
                    "`data make` chooses) and grid (one chunk per rank block of --grid))")
    ap.add_argument("--no-train", action="store_true", help="skip the training-loop part")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the dataset (default: tmp)")
    args = ap.parse_args()

    import torch
    from mpi4py import MPI

    from hpcpar import ProcessGrid
    from hpcpar.data.format import parse_chunk, read_manifest
    from hpcpar.data.synthetic import CosmoflowSource
    from hpcpar.data.writer import shard_counts, write_dataset

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    grid = ProcessGrid.parse(args.grid, comm=comm)
    root = comm.bcast(tempfile.mkdtemp(prefix="hpcpar-io-", dir=args.dir)
                      if comm.rank == 0 else None)
    batch = args.batch or 2 * grid.data
    chunkings = [f"grid:{grid.spec()}" if c == "grid" else c for c in args.chunk or
                 ["auto", "grid"]]
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"benchmarks/io.py: grid {grid.spec()} ({comm.size} ranks on {os.cpu_count()} cores), "
        f"{args.samples} samples {args.channels}x{args.size}^3 float32, batch {batch}, "
        f"{args.repeats} passes")
    for k, chunking in enumerate(chunkings):
        out = os.path.join(root, f"ds{k}")
        shards = min(args.samples, max(comm.size, 4))
        write_dataset(out, CosmoflowSource(args.samples, args.size, args.channels, seed=0),
                      shard_counts(args.samples, shards=shards), comm=comm,
                      chunk=parse_chunk(chunking), progress=False)
        m = read_manifest(out)
        paths = [os.path.join(out, s.file) for s in m.shards]
        hyper, per_sample, ideal, local_shape = bench_reads(grid, out, m, paths, batch, args)
        train = None
        if k == 0 and not args.no_train:
            train = bench_training(grid, out, m, paths, batch, args)
        rows = comm.gather((grid.rank, hyper, per_sample, ideal, train), root=0)
        say(f"-- --chunk {chunking}: chunks {tuple(m.x.chunks)}, local block {local_shape}")
        ratios: dict = {"cold": [], "warm": [], "warm cpu": []}
        for r, res_r, ps, ideal_r, tr in rows or ():
            for mode in ratios:
                ratios[mode].append(res_r[mode][0] / res_r[mode][1])
            say(f"rank {r}: hyperslab/raw read  " + "   ".join(
                f"{mode} {res_r[mode][0]:6.0f} / {res_r[mode][1]:6.0f} MB/s = "
                f"{res_r[mode][0] / res_r[mode][1]:.2f}x" for mode in ratios))
            say(f"rank {r}: bytes read per sample {ps:.0f} = {ps / ideal_r:.3f}x the ideal "
                f"1/{grid.spatial_size} of a sample ({ideal_r:.0f})")
            if tr:
                say(f"rank {r}: step time reader(prefetch=2, cold) {tr[0] * 1e3:.1f} ms vs "
                    f"in-memory {tr[1] * 1e3:.1f} ms = {tr[0] / tr[1]:.3f}x")
        if rows:
            say(f"summary --chunk {chunking} grid {grid.spec()}: hyperslab/raw over ranks "
                + "   ".join(f"{mode} median {statistics.median(v):.2f}x (min {min(v):.2f}x, "
                             f"max {max(v):.2f}x)" for mode, v in ratios.items()))
    if comm.rank == 0:
        shutil.rmtree(root, ignore_errors=True)


def bench_reads(grid, out, m, paths, batch, args):
    """1. hyperslab vs raw, cold and warm (MB/s from the median seconds per sample over all
    passes); 3. bytes read per rank per sample vs the ideal share."""
    from mpi4py import MPI

    from hpcpar.data import ShardedVolumeDataset
    from hpcpar.data._hyperslab import ShardFiles, cache_bytes

    comm = MPI.COMM_WORLD
    ds = ShardedVolumeDataset(out, grid, batch, prefetch=0)
    box, local_shape = ds.box, (args.channels, *ds.local_shape)
    share = int(np.prod(local_shape)) * 4
    # this data group's samples (as training splits them), so no two ranks read the same bytes
    items = [m.locate(i) for i in range(grid.coords[0], m.num_samples, grid.data)]
    files = ShardFiles(paths, rdcc_nbytes=cache_bytes(m.x.chunks, 4), rdcc_w0=1.0)
    reads = PairedReads(files, box, local_shape, share)
    paired_times(reads, items, "warm", comm, paths)  # metadata into caches, buffers touched
    res = {}
    for mode in ("cold", "warm"):
        t_h, t_r = [], []
        for _ in range(args.repeats):
            comm.Barrier()
            h, r = paired_times(reads, items, mode, comm, paths)
            t_h += h
            t_r += r
        for kind, i in ((mode, 0), (f"{mode} cpu", 1)):
            res[kind] = tuple(share / statistics.median(t[i] for t in ts) / 1e6
                              for ts in (t_h, t_r))
    reads.close()
    files.close()
    before = ds.bytes_read
    nread = 0
    for xb, _ in ds:
        nread += len(xb)
    per_sample = (ds.bytes_read - before) / max(nread, 1) - 4 * len(m.y.shape)
    ideal = args.channels * args.size**3 * 4 / grid.spatial_size
    ds.close()
    return res, per_sample, ideal, local_shape


def bench_training(grid, out, m, paths, batch, args):
    """2. the same training loop fed by the reader (prefetch, cold files) and in memory;
    returns the median step times (reader, memory)."""
    import torch
    from mpi4py import MPI

    from hpcpar.data import ShardedVolumeDataset

    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    net = small_net(args.channels, m.y.shape[0])
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    reader = ShardedVolumeDataset(out, grid, batch, prefetch=2)
    memory = [(x.clone(), y.clone()) for x, y in reader]  # also warms up the worker
    train_steps(memory[:2], net, opt)  # warm up torch
    t_mem, t_rd = [], []
    for _ in range(args.repeats):
        reader.set_epoch(0)
        comm.Barrier()
        drop_cache(paths)
        comm.Barrier()
        t_rd += train_steps(reader, net, opt)[1:]
        comm.Barrier()
        t_mem += train_steps(memory, net, opt)[1:]
    reader.close()
    return statistics.median(t_rd), statistics.median(t_mem)


if __name__ == "__main__":
    main()
