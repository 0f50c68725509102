"""Dataset format, writer, CLI and every bad-input message (serial; no MPI, no torch)."""

import io
import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from hpcpar.data._hyperslab import ShardFiles, read_samples, touched_chunk_bytes
from hpcpar.data._schedule import EpochSchedule, local_box
from hpcpar.data.format import (
    FORMAT_VERSION,
    check_shard,
    read_manifest,
    sha256_file,
    verify_dataset,
)
from hpcpar.data.synthetic import CosmoflowSource, cosmoflow_sample
from hpcpar.data.writer import H5Source, SerialComm, shard_counts, write_dataset
from hpcpar.errors import DataError


def make_input(path, n=7, shape=(2, 9, 7, 5), k=3, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *shape)).astype(np.float32)
    y = rng.standard_normal((n, k)).astype(np.float32)
    with h5py.File(path, "w") as f:
        f["vol"], f["tgt"] = x, y
    return x, y


def reshard(tmp_path, spp=3, chunk=3, name="ds"):
    inp = str(tmp_path / "in.h5")
    x, y = make_input(inp)
    out = str(tmp_path / name)
    src = H5Source(inp, "vol", "tgt")
    write_dataset(out, src, shard_counts(len(src), samples_per_shard=spp), comm=SerialComm(),
                  chunk=chunk, progress=False)
    src.close()
    return out, x, y


# ---- format and writer -----------------------------------------------------------------------
def test_reshard_roundtrip_manifest_and_attrs(tmp_path):
    out, x, y = reshard(tmp_path)
    m = read_manifest(out)
    assert m.format_version == FORMAT_VERSION == 1 and m.num_samples == 7
    assert [(s.file, s.start, s.count) for s in m.shards] == [
        ("shard-00000.h5", 0, 3), ("shard-00001.h5", 3, 3), ("shard-00002.h5", 6, 1)]
    assert m.x.shape == (2, 9, 7, 5) and m.x.dtype == "float32" and m.x.chunks == (1, 2, 3, 3, 3)
    assert m.y.shape == (3,)
    for s in m.shards:
        p = os.path.join(out, s.file)
        assert sha256_file(p) == s.sha256 and os.path.getsize(p) == s.bytes
        with h5py.File(p) as f:
            assert f.attrs["format_version"] == 1
            assert (f.attrs["sample_start"], f.attrs["sample_stop"]) == (s.start, s.stop)
            np.testing.assert_array_equal(f["x"][:], x[s.start:s.stop])
            np.testing.assert_array_equal(f["y"][:], y[s.start:s.stop])
    assert verify_dataset(out) == []
    assert sorted(os.listdir(tmp_path)) == ["ds", "in.h5"]  # no temporary left


def test_failed_write_leaves_nothing(tmp_path):
    class Failing(CosmoflowSource):
        def read(self, start, stop):
            if start >= 4:
                raise RuntimeError("disk on fire")
            return super().read(start, stop)

    with pytest.raises(RuntimeError, match="disk on fire"):
        write_dataset(str(tmp_path / "ds"), Failing(8, 4, 1), [2, 2, 2, 2], comm=SerialComm(),
                      progress=False)
    assert os.listdir(tmp_path) == []
    # an existing dataset survives a failed --force rewrite untouched
    out, _, _ = reshard(tmp_path)
    before = read_manifest(out).to_json()
    with pytest.raises(RuntimeError):
        write_dataset(out, Failing(8, 4, 1), [4, 4], comm=SerialComm(), force=True,
                      progress=False)
    assert read_manifest(out).to_json() == before
    assert sorted(os.listdir(tmp_path)) == ["ds", "in.h5"]


def test_cosmoflow_deterministic_and_learnable_spread():
    x, y = cosmoflow_sample(3, 5, 16, 4)
    x2, y2 = cosmoflow_sample(3, 5, 16, 4)
    assert x.shape == (4, 16, 16, 16) and x.dtype == np.float32 and y.shape == (4,)
    np.testing.assert_array_equal(x, x2)
    assert np.all(np.abs(y) <= 1)
    # later channels (more growth) fluctuate more; amplitude shows in the spread
    stds = x.std(axis=(1, 2, 3))
    assert np.all(np.diff(stds) > 0)
    lo, hi = (cosmoflow_sample(0, i, 16, 1) for i in range(2))
    assert not np.array_equal(lo[0], hi[0])


def test_chunks_and_bytes_counted_match_hdf5_reads(tmp_path):
    out, x, y = reshard(tmp_path, spp=7, chunk=4)
    m = read_manifest(out)
    c = m.x.chunks
    assert c == (1, 2, 3, 4, 3)  # 9, 7, 5 split into even chunks of about 4
    reads = []

    class Counting(io.FileIO):
        def readinto(self, b):
            r = super().readinto(b)
            reads.append(r)
            return r

    def opener(path, **kw):
        return h5py.File(Counting(path, "rb"), "r", **kw)

    # a chunk cache of one chunk: no sample reuses another's chunks (as in an epoch)
    files = ShardFiles([os.path.join(out, s.file) for s in m.shards], opener=opener,
                       rdcc_nbytes=int(np.prod(c)) * 4)
    warm = np.empty((2, 2, 9, 7, 5), np.float32), np.empty((2, 3), np.float32)
    whole = 2 * 2 * 9 * 8 * 6 * 4  # 3 x 2 x 2 chunks of 2 x 3 x 4 x 3 per sample, 2 samples
    y_all = 7 * 3 * 4  # y is read whole when a shard opens
    assert read_samples(files, [(0, 1), (0, 5)], ((0, 9), (0, 7), (0, 5)), *warm) == \
        whole + y_all  # and the metadata is cached now
    for box in [((0, 9), (0, 7), (0, 5)), ((3, 6), (2, 5), (1, 4)), ((8, 9), (6, 7), (4, 5))]:
        shape = tuple(b - a for a, b in box)
        ox, oy = np.empty((2, 2, *shape), np.float32), np.empty((2, 3), np.float32)
        reads.clear()
        counted = read_samples(files, [(0, 1), (0, 5)], box, ox, oy)
        sel = (slice(None), *(slice(a, b) for a, b in box))
        np.testing.assert_array_equal(ox, x[[1, 5]][(slice(None), *sel)])
        np.testing.assert_array_equal(oy, y[[1, 5]])
        share = ox.nbytes
        edges = [-(-b // e) * e - a // e * e for (a, b), e in zip(box, c[2:])]
        rounded = 2 * 2 * np.prod(edges) * 4
        assert share <= counted == rounded
        assert share <= sum(reads) <= counted, reads  # HDF5 fetched whole chunks, no more
    assert touched_chunk_bytes(((3, 6), (2, 5), (1, 4)), (1, 2, 4, 4, 4), 4) == 4 * 2 * 64 * 4
    assert touched_chunk_bytes(((3, 6), (2, 5), (1, 4)), c, 4) == 1 * 2 * 2 * 2 * 36 * 4
    files.close()


def test_chunk_options():
    from hpcpar.data.format import PerRankChunks, parse_chunk, x_chunks

    assert parse_chunk("auto") is None and parse_chunk("16") == 16
    assert parse_chunk("16,0,0") == (16, 0, 0)
    assert parse_chunk("grid:1x2x1x1") == parse_chunk("grid:2x1x1") == PerRankChunks((2, 1, 1))
    assert x_chunks((4, 64, 64, 64), None) == (1, 4, 16, 32, 64)  # H halved, W whole
    assert x_chunks((4, 64, 64, 64), (16, 0, 0)) == (1, 4, 16, 64, 64)
    assert x_chunks((4, 64, 64, 64), PerRankChunks((2, 1, 1))) == (1, 4, 32, 64, 64)
    assert x_chunks((2, 9, 31, 5), PerRankChunks((2, 3, 1))) == (1, 2, 5, 11, 5)
    for bad, what in [("grid:2x0x1", "grid:XxYxZ"), ("grid:2x1", "grid:XxYxZ"),
                      ("a,b", "EDGE, D,H,W"), ("1,2", "EDGE, D,H,W")]:
        with pytest.raises(DataError, match=f"--chunk: expected {what}.*got '{bad}'"):
            parse_chunk(bad)


def test_direct_chunk_reads_match_numpy_and_fill_unwritten(tmp_path):
    """The preadv fast path (chunk offsets from one walk of the chunk index) against numpy
    slicing, for aligned, unaligned, direct and staged boxes; a never-written sample reads as
    HDF5's fill value."""
    path = str(tmp_path / "x.h5")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 2, 8, 12, 10)).astype(np.float32)
    with h5py.File(path, "w") as f:
        d = f.create_dataset("x", shape=x.shape, dtype="f4", chunks=(1, 2, 4, 12, 5),
                             fillvalue=-1.5)
        for i in (0, 1, 3):  # sample 2 never written
            d[i] = x[i]
        f["y"] = np.arange(12, dtype=np.float32).reshape(4, 3)
    x[2] = -1.5
    files = ShardFiles([path])
    assert files.get(0).fd is not None  # the fast path, not read_direct
    for box in [((0, 8), (0, 12), (0, 10)), ((4, 8), (0, 12), (0, 10)),
                ((0, 4), (0, 12), (5, 10)), ((1, 7), (3, 11), (2, 9))]:
        shape = tuple(b - a for a, b in box)
        ox, oy = np.empty((4, 2, *shape), np.float32), np.empty((4, 3), np.float32)
        read_samples(files, [(0, i) for i in range(4)], box, ox, oy)
        sel = (slice(None), slice(None), *(slice(a, b) for a, b in box))
        np.testing.assert_array_equal(ox, x[sel])
    files.close()


# ---- schedule -------------------------------------------------------------------------------
def test_schedule_drop_last_rule_and_messages():
    s = EpochSchedule(10, 4, 3, 1, shuffle=True, seed=0, drop_last=True, name="ds")
    assert s.steps == 2 and s.max_local == 2
    s2 = EpochSchedule(10, 4, 1, 0, shuffle=True, seed=0, drop_last=False, name="ds")
    assert s2.steps == 3 and sorted(np.concatenate(s2.local_steps(5))) == list(range(10))
    with pytest.raises(DataError) as e:
        EpochSchedule(12, 20, 1, 0, shuffle=True, seed=0, drop_last=True, name="DIR")
    assert str(e.value) == "DIR: batch_size 20 is larger than the dataset (12 samples)"
    with pytest.raises(DataError) as e:
        EpochSchedule(12, 2, 4, 0, shuffle=True, seed=0, drop_last=True, name="DIR")
    assert str(e.value) == ("DIR: batch_size 2 is smaller than the 4 data-parallel groups "
                            "(each needs a sample per step)")
    assert local_box((9, 7, 5), (2, 3, 1), (1, 2, 0)) == ((5, 9), (5, 7), (0, 5))
    with pytest.raises(DataError) as e:
        local_box((9, 7, 5), (1, 1, 6), (0, 0, 0))
    assert str(e.value) == ("grid axis z has 6 ranks but the volume is only 5 long on that "
                            "axis (shape (9, 7, 5))")


# ---- bad input: one exact line each ---------------------------------------------------------
def test_bad_dataset_messages(tmp_path):
    out, _, _ = reshard(tmp_path)
    m = read_manifest(out)
    p1 = os.path.join(out, "shard-00001.h5")

    def msg(fn, *a, **kw):
        with pytest.raises(DataError) as e:
            fn(*a, **kw)
        return str(e.value)

    missing = str(tmp_path / "nope")
    assert msg(read_manifest, missing) == f"{missing}: dataset directory not found"
    os.rename(p1, p1 + ".bak")
    assert msg(check_shard, out, m, 1) == f"{p1}: shard file not found"
    with open(p1, "w") as fh:
        fh.write("hello, not hdf5" * 100)
    assert msg(check_shard, out, m, 1) == f"{p1}: not an HDF5 file"
    os.replace(p1 + ".bak", p1)
    good = open(p1, "rb").read()
    with open(p1, "wb") as fh:
        fh.write(good[:3000])
    assert msg(check_shard, out, m, 1) == (f"{p1}: truncated file (3000 bytes, manifest says "
                                           f"{len(good)})")
    flipped = bytearray(good)
    flipped[-100] ^= 0xFF
    with open(p1, "wb") as fh:
        fh.write(flipped)
    got = sha256_file(p1)
    want = m.shards[1].sha256
    assert msg(check_shard, out, m, 1, checksum=True) == (
        f"{p1}: sha256 mismatch (file {got[:12]}..., manifest {want[:12]}...)")
    assert verify_dataset(out) == [f"{p1}: sha256 mismatch (file {got[:12]}..., manifest "
                                   f"{want[:12]}...)"]
    with open(p1, "wb") as fh:
        fh.write(good)
    with h5py.File(p1, "a") as f:
        f.move("y", "targets")
    assert msg(check_shard, out, m, 1) == f"{p1}: missing dataset 'y'"
    with h5py.File(p1, "a") as f:
        f.move("targets", "y")
    m.x.shape = (2, 9, 7, 6)
    assert msg(check_shard, out, m, 1) == (f"{p1}: dataset 'x' has shape (3, 2, 9, 7, 5), "
                                           "manifest says (3, 2, 9, 7, 6)")
    m.x.shape, m.y.dtype = (2, 9, 7, 5), "float64"
    assert msg(check_shard, out, m, 1) == (f"{p1}: dataset 'y' has dtype float32, manifest "
                                           "says float64")
    manifest = os.path.join(out, "manifest.json")
    d = json.load(open(manifest))
    d["format_version"] = 99
    json.dump(d, open(manifest, "w"))
    assert msg(read_manifest, out) == (f"{manifest}: field 'format_version' is 99, this "
                                       "hpcpar reads version 1")


def test_shard_input_messages(tmp_path):
    inp = str(tmp_path / "in.h5")
    make_input(inp)
    with pytest.raises(DataError) as e:
        H5Source(inp, "volume", "tgt")
    assert str(e.value) == f"{inp}: missing dataset 'volume'"
    with h5py.File(inp, "a") as f:
        f["short"] = np.zeros((5, 3), np.float32)
    with pytest.raises(DataError) as e:
        H5Source(inp, "vol", "short")
    assert str(e.value) == f"{inp}: dataset 'vol' has 7 samples but 'short' has 5"
    with pytest.raises(DataError) as e:
        shard_counts(7, samples_per_shard=0)
    assert str(e.value) == "--samples-per-shard: must be positive, got 0"


# ---- CLI --------------------------------------------------------------------------------------
def test_cli_make_info_verify_shard(tmp_path, run_cli):
    out = str(tmp_path / "cf")
    code, o, err = run_cli(["data", "make", "cosmoflow", out, "--samples", "5", "--size", "8",
                            "--channels", "2", "--shards", "2", "--seed", "3", "--quiet"])
    assert code == 0, err
    assert f"wrote {out}: 5 samples in 2 shards" in o
    x0, y0 = cosmoflow_sample(3, 4, 8, 2)
    with h5py.File(os.path.join(out, "shard-00001.h5")) as f:
        np.testing.assert_array_equal(f["x"][1], x0)
        np.testing.assert_array_equal(f["y"][1], y0)
    code, o, _ = run_cli(["data", "info", out])
    assert "hpcpar-volume-shards v1" in o and "5 in 2 shards" in o and "slope" in o
    code, o, _ = run_cli(["data", "verify", out])
    assert o.strip() == f"ok: {out}: 2 shards, 5 samples verified, values finite"
    code, _, err = run_cli(["data", "make", "cosmoflow", out, "--samples", "5", "--size", "8",
                            "--shards", "1", "--quiet"])
    assert code == 2 and err.strip() == (f"hpcpar: error: {out}: already exists (use --force "
                                          "to replace it)")
    p = os.path.join(out, "shard-00000.h5")
    os.remove(p)
    code, _, err = run_cli(["data", "verify", out])
    assert code == 2 and err.strip() == f"hpcpar: error: {p}: shard file not found"
    code, _, err = run_cli(["data", "info", str(tmp_path / "none")])
    assert err.strip() == f"hpcpar: error: {tmp_path / 'none'}: dataset directory not found"
    inp = str(tmp_path / "in.h5")
    x, _ = make_input(inp)
    code, o, err = run_cli(["data", "shard", inp, str(tmp_path / "rs"), "--x-key", "vol",
                            "--y-key", "tgt", "--samples-per-shard", "4", "--quiet"])
    assert "7 samples in 2 shards" in o
    assert verify_dataset(str(tmp_path / "rs")) == []
    code, _, err = run_cli(["data", "shard", inp, str(tmp_path / "rs2"), "--x-key", "x",
                            "--samples-per-shard", "4"])
    assert err.strip() == f"hpcpar: error: {inp}: missing dataset 'x'"
    assert not os.path.exists(tmp_path / "rs2")


def test_h5dump_reads_shards(tmp_path):
    import shutil

    if not shutil.which("h5dump"):
        pytest.skip("h5dump not installed (apt-get install hdf5-tools)")
    out, _, _ = reshard(tmp_path)
    text = subprocess.run(["h5dump", "-H", os.path.join(out, "shard-00000.h5")],
                          capture_output=True, text=True, check=True).stdout
    assert 'DATASET "x"' in text and "( 3, 2, 9, 7, 5 )" in text and "sample_start" in text


# ---- prefetch process lifetime ----------------------------------------------------------------
ORPHAN_SCRIPT = """
import os, signal, sys
from hpcpar.data.format import read_manifest
from hpcpar.data._prefetch import Prefetcher, SlotLayout
out = sys.argv[1]
m = read_manifest(out)
lay = SlotLayout(2, 2, (2, 9, 7, 5), 'float32', (3,), 'float32')
pf = Prefetcher([os.path.join(out, s.file) for s in m.shards], 'x', 'y',
                [(0, 9), (0, 7), (0, 5)], lay, {})
pf.submit(0, [(0, 1), (1, 0)])
slot, n, nbytes = pf.result()
x, y = pf.views(slot)
print(pf._proc.pid, n, float(x[1, 0, 0, 0, 0]), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_prefetch_child_dies_with_parent_and_reads_right(tmp_path):
    out, x, _ = reshard(tmp_path)
    r = subprocess.run([sys.executable, "-c", ORPHAN_SCRIPT, out], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    pid, n, value = r.stdout.split()
    assert int(n) == 2 and float(value) == pytest.approx(float(x[3, 0, 0, 0, 0]))
    for _ in range(100):
        if not os.path.exists(f"/proc/{pid}") or "Z" in _proc_state(pid):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"prefetch process {pid} outlived its parent")


STOP_SIGNAL_SCRIPT = """
import os, signal, sys, threading
from hpcpar.data.format import read_manifest
from hpcpar.data._prefetch import Prefetcher, SlotLayout
out = sys.argv[1]
m = read_manifest(out)
lay = SlotLayout(2, 2, (2, 9, 7, 5), 'float32', (3,), 'float32')
signal.signal(signal.SIGUSR1, lambda *a: None)   # the trainer catches its stop signals
pf = Prefetcher([os.path.join(out, s.file) for s in m.shards], 'x', 'y',
                [(0, 9), (0, 7), (0, 5)], lay, {})
pf.submit(0, [(0, 1)])
pf.result()
os.killpg(0, signal.SIGUSR1)    # srun signals every process of the step, the child too
pf.submit(0, [(1, 0)])
print("after USR1:", pf.result()[1], flush=True)
pf.submit(0, [(0, 0)])
pf.submit(1, [(1, 1)])
os.kill(pf._proc.pid, signal.SIGKILL)  # a child gone with requests outstanding
threading.Timer(20, lambda: os._exit(9)).start()
pf.drain()
print("drained", pf.outstanding, flush=True)
os._exit(0)
"""


def test_prefetch_child_survives_stop_signals_and_drain_never_waits_for_a_dead_one(tmp_path):
    """The trainer's stop signals reach every process of a Slurm step: the prefetch child
    ignores them (the parent checkpoints, then closes it); and a child that died with
    requests outstanding must not keep the parent's clean-up waiting (it spun forever, and
    the requeue of a preempted job never came)."""
    out, _, _ = reshard(tmp_path)
    r = subprocess.run([sys.executable, "-c", STOP_SIGNAL_SCRIPT, out], capture_output=True,
                       text=True, timeout=60, start_new_session=True)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.split() == ["after", "USR1:", "1", "drained", "0"], r.stdout


def _proc_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2]
    except OSError:
        return "Z"
