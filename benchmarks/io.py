"""I/O benchmark: hyperslab reads vs raw reads, reader-fed training vs in-memory, bytes read.

    mpiexec -n 2 python benchmarks/io.py --grid 1x2x1x1 --size 128 --samples 16

1. Hyperslab read throughput: every rank reads its sub-volume of every sample with the
   reader's code; the baseline reads the same number of bytes with one plain ``preadv`` per
   sample from the same files, in the same run. Both cold (pages dropped with
   ``posix_fadvise(DONTNEED)``) and warm (page cache); throughput = the rank's share of a
   sample / median seconds per sample. Target >= 0.9x.
2. Training loop (a small local conv net on each rank's block, no communication: an I/O
   test) fed by ``ShardedVolumeDataset(prefetch=2)`` from cold files vs the same loop on
   the same batches already in memory. Target step time <= 1.05x.
3. Bytes read per rank per sample vs the ideal 1/(x*y*z) of a sample (chunk rounding).

1 and 3 run for each chunking (default: ``grid:`` one chunk per rank block, then ``auto``
cubic chunks), 2 for the first.
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


def raw_offset(sh, row, box, size, nbytes) -> int:
    """Where the raw read of (shard, row) starts: at this rank's first chunk of the sample, so
    each rank reads its own part of the file, as the hyperslab read does (ranks reading the
    same bytes would share the page cache and halve the raw read's disk traffic)."""
    if sh.fd is not None:
        first = sh.chunk_offsets(row, box)[0]
        if first is not None:
            return min(first, size - nbytes)
    return (row * nbytes) % max(size - nbytes, 1)


def read_times(files, items, box, local_shape, nbytes: int, raw: bool) -> list[float]:
    """Seconds per sample: this rank's hyperslab through the reader's code (files stay open,
    as the reader keeps them), or the same byte count with one plain ``preadv`` (``raw``).
    Per-sample times, so a busy machine's preemptions show as outliers, not averages."""
    from hpcpar.data._hyperslab import read_samples

    out_x = np.empty((1, *local_shape), np.float32)
    out_y = np.empty((1, 4), np.float32)
    buf = np.empty(nbytes, np.uint8)
    fds = {}
    times = []
    for shard, row in items:
        if raw:
            path = files.paths[shard]
            fd = fds.setdefault(shard, os.open(path, os.O_RDONLY))
            offset = raw_offset(files.get(shard), row, box, os.fstat(fd).st_size, nbytes)
            t0 = time.perf_counter()
            os.preadv(fd, [buf], offset)
        else:
            t0 = time.perf_counter()
            read_samples(files, [(shard, row)], box, out_x, out_y)
        times.append(time.perf_counter() - t0)
    for fd in fds.values():
        os.close(fd)
    return times


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
                    help="chunking as `data make --chunk` (repeatable; default: grid (one chunk "
                    "per rank block of --grid) and auto (cubic))")
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
                 ["grid", "auto"]]
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"benchmarks/io.py: grid {grid.spec()} ({comm.size} ranks), {args.samples} samples "
        f"{args.channels}x{args.size}^3 float32, batch {batch}")
    for k, chunking in enumerate(chunkings):
        out = os.path.join(root, f"ds{k}")
        shards = min(args.samples, max(comm.size, 4))
        write_dataset(out, CosmoflowSource(args.samples, args.size, args.channels, seed=0),
                      shard_counts(args.samples, shards=shards), comm=comm,
                      chunk=parse_chunk(chunking), progress=False)
        m = read_manifest(out)
        paths = [os.path.join(out, s.file) for s in m.shards]
        hyper, per_sample, ideal, local_shape = bench_reads(grid, out, m, paths, batch, args)
        train = bench_training(grid, out, m, paths, batch, args) if k == 0 else None
        rows = comm.gather((grid.rank, hyper, per_sample, ideal, train), root=0)
        say(f"-- --chunk {chunking}: chunks {tuple(m.x.chunks)}, local block {local_shape}")
        for r, res_r, ps, ideal_r, tr in rows or ():
            (hc, rc), (hw, rw) = res_r["cold"], res_r["warm"]
            say(f"rank {r}: hyperslab/raw read  cold {hc:8.0f} / {rc:8.0f} MB/s = "
                f"{hc / rc:.2f}x   warm {hw:8.0f} / {rw:8.0f} MB/s = {hw / rw:.2f}x")
            say(f"rank {r}: bytes read per sample {ps:.0f} = {ps / ideal_r:.3f}x the ideal "
                f"1/{grid.spatial_size} of a sample ({ideal_r:.0f})")
            if tr:
                say(f"rank {r}: step time reader(prefetch=2, cold) {tr[0] * 1e3:.1f} ms vs "
                    f"in-memory {tr[1] * 1e3:.1f} ms = {tr[0] / tr[1]:.3f}x")
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
    items = [m.locate(i) for i in range(m.num_samples)]
    files = ShardFiles(paths, rdcc_nbytes=cache_bytes(m.x.chunks, 4), rdcc_w0=1.0)
    read_times(files, items, box, local_shape, share, False)  # metadata into HDF5's cache
    res = {}
    for mode in ("cold", "warm"):
        t_h, t_r = [], []
        for _ in range(args.repeats):
            for raw, acc in ((False, t_h), (True, t_r)):
                if mode == "cold":
                    comm.Barrier()
                    drop_cache(paths)
                else:
                    read_times(files, items, box, local_shape, share, raw)
                comm.Barrier()
                acc += read_times(files, items, box, local_shape, share, raw)
        res[mode] = (share / statistics.median(t_h) / 1e6, share / statistics.median(t_r) / 1e6)
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
