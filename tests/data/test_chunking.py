"""Default chunking and the direct chunk reads: every spatial grid reads the same values as
numpy slicing, whichever grid the data was chunked for, and counts whole chunks; the CLI's
``--grid`` hint; the reader end to end on the default chunks under MPI."""

import json
import os

import h5py
import numpy as np
import pytest

from hpcpar.data import _hyperslab
from hpcpar.data._hyperslab import ShardFiles, chunk_plan, read_samples, touched_chunk_bytes
from hpcpar.data._schedule import local_box
from hpcpar.data.format import PerRankChunks, read_manifest, x_chunks
from hpcpar.data.writer import SerialComm, shard_counts, write_dataset
from hpcpar.errors import DataError
from hpcpar.testing import mpi_case, shared_tmpdir

# W = 1024 float32: 4 KiB rows, so the default chunks' pieces are long enough to go direct
N, SHAPE, K = 5, (2, 9, 10, 1024), 3
GRIDS = [(1, 1, 1), (2, 1, 1), (3, 1, 1), (1, 2, 1), (2, 2, 1), (4, 3, 1), (9, 10, 1),
         (1, 1, 2), (2, 1, 2), (1, 3, 4)]


class ArraySource:
    """The writer's source protocol over arrays in memory."""

    def __init__(self, x, y):
        self.x, self.y = x, y
        self.x_shape, self.y_shape = x.shape[1:], y.shape[1:]
        self.x_dtype, self.y_dtype = x.dtype, y.dtype
        self.target_names, self.attrs = None, {"generator": "test"}

    def read(self, start, stop):
        return self.x[start:stop], self.y[start:stop]


def arrays(seed=5):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((N, *SHAPE)).astype(np.float32),
            rng.standard_normal((N, K)).astype(np.float32))


def write(out, x, y, chunk=None, comm=None):
    return write_dataset(str(out), ArraySource(x, y), shard_counts(N, samples_per_shard=2),
                         comm=comm or SerialComm(), chunk=chunk, progress=False)


def boxes(grid):
    for coords in np.ndindex(*grid):
        yield local_box(SHAPE[1:], grid, coords)


def test_auto_chunks_span_w_and_stay_bounded():
    assert x_chunks((4, 128, 128, 128)) == (1, 4, 32, 64, 128)
    assert x_chunks((4, 512, 512, 512)) == (1, 4, 32, 64, 512)  # H edge halved to 16 MiB
    assert x_chunks(SHAPE) == (1, 2, 3, 5, 1024)
    c = x_chunks((4, 64, 64, 1 << 20))  # a long W: D and H edges shrink to keep 16 MiB
    assert c[4] == 1 << 20 and 4 * c[2] * c[3] * c[4] <= 1 << 22 and c[2] * c[3] == 1


@pytest.mark.parametrize("chunk", [None, PerRankChunks((2, 1, 1)), PerRankChunks((1, 2, 2)),
                                   (3, 0, 512), 4])
def test_every_grid_reads_any_chunking(tmp_path, monkeypatch, chunk):
    """Whatever grid the data was chunked for, every rank box of every grid reads exactly
    numpy's slice and counts the whole chunks it touches; boxes that keep whole chunks along
    W read straight into place, others through the staging copy."""
    monkeypatch.setattr(_hyperslab, "IOV_PER_READ", 3)  # many preadv calls per run of chunks
    x, y = arrays()
    m = write(tmp_path / "ds", x, y, chunk)
    c = m.x.chunks
    files = ShardFiles([str(tmp_path / "ds" / s.file) for s in m.shards])
    items = [m.locate(i) for i in range(N)]
    files.get(0), files.get(1), files.get(2)
    files.pending_bytes = 0
    for grid in GRIDS:
        for box in boxes(grid):
            shape = tuple(b - a for a, b in box)
            ox, oy = np.empty((N, SHAPE[0], *shape), np.float32), np.empty((N, K), np.float32)
            counted = read_samples(files, items, box, ox, oy)
            sel = (slice(None), slice(None), *(slice(a, b) for a, b in box))
            np.testing.assert_array_equal(ox, x[sel])
            np.testing.assert_array_equal(oy, y)
            assert counted == N * touched_chunk_bytes(box, c, 4)
            (_, _), (_, _), (w0, w1) = box
            whole_w = w0 % c[4] == 0 and (w1 - w0) % c[4] == 0
            if chunk is None:  # default chunks: direct exactly when W is not split
                assert chunk_plan(box, c, 4).direct == whole_w == (grid[2] == 1)
            elif not whole_w:
                assert not chunk_plan(box, c, 4).direct
    files.close()


@pytest.mark.parametrize("libc", [True, False])
def test_direct_reads_fill_unwritten_chunks_and_skip_strided_outputs(tmp_path, monkeypatch,
                                                                     libc):
    if not libc:  # the Python-buffers fallback of the direct read
        monkeypatch.setattr(_hyperslab, "_libc_preadv", lambda: None)
        monkeypatch.setattr(_hyperslab, "IOV_PER_READ", 5)
    path = str(tmp_path / "x.h5")
    x, y = arrays(8)
    with h5py.File(path, "w") as f:
        d = f.create_dataset("x", shape=x.shape, dtype="f4", chunks=x_chunks(SHAPE),
                             fillvalue=-2.5)
        for i in (0, 2, 4):  # samples 1 and 3 never written
            d[i] = x[i]
        f["y"] = y
    x[[1, 3]] = -2.5
    files = ShardFiles([path])
    box = ((1, 8), (2, 9), (0, 1024))  # not aligned with chunk edges along D and H
    assert chunk_plan(box, x_chunks(SHAPE), 4).direct
    ox, oy = np.empty((N, 2, 7, 7, 1024), np.float32), np.empty((N, K), np.float32)
    read_samples(files, [(0, i) for i in range(N)], box, ox, oy)
    np.testing.assert_array_equal(ox, x[:, :, 1:8, 2:9])
    big = np.zeros((N, 2, 7, 7, 2048), np.float32)  # strided output: the staging copy
    read_samples(files, [(0, i) for i in range(N)], box, big[..., :1024], oy)
    np.testing.assert_array_equal(big[..., :1024], x[:, :, 1:8, 2:9])
    assert not big[..., 1024:].any()
    files.close()


def test_cli_grid_hint_chooses_chunks_and_is_recorded(tmp_path, run_cli):
    out = str(tmp_path / "ds")
    code, _, err = run_cli(["data", "make", "cosmoflow", out, "--samples", "2", "--size", "16",
                            "--shards", "1", "--grid", "1x2x2x1", "--quiet"])
    assert code == 0, err
    m = read_manifest(out)
    assert m.x.chunks == (1, 4, 8, 8, 16) and m.source["chunk_grid"] == "2x2x1"
    code, _, _ = run_cli(["data", "make", "cosmoflow", out + "2", "--samples", "2", "--size",
                          "16", "--shards", "1", "--quiet"])
    assert code == 0 and read_manifest(out + "2").x.chunks == (1, 4, 4, 8, 16)
    assert "chunk_grid" not in read_manifest(out + "2").source
    inp = str(tmp_path / "in.h5")
    with h5py.File(inp, "w") as f:
        f["x"], f["y"] = arrays()
    code, _, err = run_cli(["data", "shard", inp, out + "3", "--samples-per-shard", "2",
                            "--grid", "2x1x1", "--quiet"])
    assert code == 0, err
    with open(os.path.join(out + "3", "manifest.json")) as fh:
        doc = json.load(fh)
    assert doc["x"]["chunks"] == [1, 2, 5, 10, 1024] and doc["source"]["chunk_grid"] == "2x1x1"
    code, _, err = run_cli(["data", "make", "cosmoflow", out + "4", "--size", "16", "--grid",
                            "2x1x1", "--chunk", "8"])
    assert code == 2 and "--grid 2x1x1 and --chunk 8: give one of them" in err
    code, _, err = run_cli(["data", "make", "cosmoflow", out + "4", "--size", "16", "--grid",
                            "2x0x1"])
    assert code == 2 and "--grid: expected DxXxYxZ or XxYxZ" in err
    assert not os.path.exists(out + "4")


def test_grid_hint_errors_name_the_option():
    from hpcpar.data.format import chunk_from_options as _chunking

    assert _chunking("auto", None) is None and _chunking("16", None) == 16
    assert _chunking("auto", "1x2x2x1") == PerRankChunks((2, 2, 1))
    with pytest.raises(DataError, match="--grid: expected"):
        _chunking("auto", "ax2")


@mpi_case(nprocs=(4,), timeout=180)
def test_reader_on_default_chunks_every_grid(comm):
    """ShardedVolumeDataset on default-chunked data, inline and through the prefetch
    process, for grids that read directly (W whole) and one that splits W; bytes read are
    the whole chunks touched."""
    from hpcpar import ProcessGrid
    from hpcpar.data import ShardedVolumeDataset

    with shared_tmpdir(comm, prefix="hpcpar-test-chunking-") as tmp:
        x, y = arrays()
        out = os.path.join(tmp, "ds")
        m = write(out, x, y, comm=comm)
        for shape, prefetch in (((1, 2, 2, 1), 2), ((2, 2, 1, 1), 0), ((1, 4, 1, 1), 0),
                                ((1, 1, 2, 2), 0)):
            grid = ProcessGrid(*shape, comm=comm)
            with ShardedVolumeDataset(out, grid, 2 * shape[0], seed=3, prefetch=prefetch,
                                      drop_last=False) as ds:
                box = ds.box
                sel = (slice(None), slice(None), *(slice(a, b) for a, b in box))
                nread, shards = 0, set()
                for xb, yb in ds:
                    ids = [int(np.flatnonzero((y == r).all(axis=1))[0]) for r in yb.numpy()]
                    np.testing.assert_array_equal(xb.numpy(), x[ids][sel])
                    nread += len(ids)
                    shards |= {m.locate(i)[0] for i in ids}
                y_bytes = sum(m.shards[s].count * K * 4 for s in shards)  # y: whole, at open
                assert ds.bytes_read - y_bytes == nread * touched_chunk_bytes(box, m.x.chunks, 4)
            grid.free()
