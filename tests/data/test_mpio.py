"""The parallel-HDF5 paths (``driver="mpio"``) on 2 ranks, under an h5py built against
Debian's MPICH HDF5 (the environment .ci/setup.d/30-parallel-hdf5.sh builds): every rank's
batches equal the serial read bit for bit, for a sharded directory with the default chunks and
for one shared file; the read rates of mpio and of the default POSIX path are printed; and
``hpcpar.predict`` writes one plain HDF5 file collectively (no per-rank parts, no virtual data
set) that equals the one-process forward.

Where that environment is missing the test skips with the reason; under ``CI=true`` it fails,
because CI builds it. This file is also the MPI worker (run as a script by the test)."""

import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N, SHAPE, K = 8, (4, 64, 64, 64), 4  # 4 MiB samples: 2 MiB per rank per sample
GRID, BATCH = "1x2x1x1", 2
VENV = os.environ.get("MPIO_VENV", "/opt/hpcpar-mpio-venv")  # .ci/setup.d/30-parallel-hdf5.sh


def mpio_env() -> tuple[str, str]:
    """(python of the parallel-HDF5 environment, its MPICH's mpiexec), or skip (fail in CI)."""
    python = os.path.join(VENV, "bin", "python")
    mpiexec = shutil.which("mpiexec.mpich")
    problem = None
    if not os.path.exists(python):
        problem = f"{python} not found"
    elif mpiexec is None:
        problem = "mpiexec.mpich not found (Debian package mpich)"
    else:
        probe = subprocess.run([python, "-c", "import h5py, sys; "
                                "sys.exit(0 if h5py.get_config().mpi else 3)"],
                               capture_output=True, text=True, timeout=60)
        if probe.returncode:
            problem = (f"{python}: h5py is not built against MPI "
                       f"({(probe.stderr.strip().splitlines() or ['mpi False'])[-1]})")
    if problem:
        why = f"{problem}; .ci/setup.d/30-parallel-hdf5.sh builds the environment"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"the mpio reader test must run in CI: {why}", pytrace=False)
        pytest.skip(f"no parallel HDF5 here: {why}")
    return python, mpiexec


def write_data(tmp_path):
    """A sharded directory (default chunks) and one shared file of the same samples (chunks
    not aligned with the ranks' boxes)."""
    from hpcpar.data.writer import H5Source, SerialComm, shard_counts, write_dataset

    rng = np.random.default_rng(4)
    x = rng.standard_normal((N, *SHAPE)).astype(np.float32)
    y = rng.standard_normal((N, K)).astype(np.float32)
    shared = str(tmp_path / "shared.h5")
    with h5py.File(shared, "w") as f:
        # 24-voxel chunks straddle the ranks' boundary at 32: a rank reads part of a chunk
        f.create_dataset("x", data=x, chunks=(1, 4, 24, 16, 64))
        f["y"] = y
    src = H5Source(shared)
    directory = str(tmp_path / "ds")
    write_dataset(directory, src, shard_counts(N, samples_per_shard=3), comm=SerialComm(),
                  progress=False)
    src.close()
    return {"sharded": directory, "shared": shared}, x, y


def test_mpio_reads_match_serial(tmp_path, record_property):
    python, mpiexec = mpio_env()
    paths, x, y = write_data(tmp_path)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([mpiexec, "-n", "2", python, os.path.abspath(__file__), str(out),
                           json.dumps(paths)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from hpcpar.data._schedule import local_box

    for rank in range(2):
        for name in paths:
            got = np.load(out / f"{name}.{rank}.npz")
            box = local_box(SHAPE[1:], (2, 1, 1), (rank, 0, 0))
            ids = got["ids"]
            assert sorted(ids.tolist()) == list(range(N))
            sel = (slice(None), slice(None), *(slice(a, b) for a, b in box))
            np.testing.assert_array_equal(got["x"], x[ids][sel])  # bit for bit
            np.testing.assert_array_equal(got["y"], y[ids])
    rates = [json.loads((out / f"{name}.{rank}.json").read_text())
             for name in paths for rank in range(2)]
    assert all(r["mpio_mb_s"] > 0 for r in rates)
    for r in rates:
        line = (f"mpio read ({r['name']}, {r['mpi']}, HDF5 {r['hdf5']}): rank {r['rank']} "
                f"{r['mpio_mb_s']:.0f} MB/s vs the default POSIX path {r['sec2_mb_s']:.0f} MB/s "
                f"(page cache, 2 ranks on {os.cpu_count()} cores)")
        print(line)
        record_property(f"mpio_{r['name']}_rank{r['rank']}", line)


class _Net:
    """The prediction test's model: a 3^3 convolution (its halo crosses the ranks' boundary),
    a ReLU and a 1x1x1 head, seeded."""

    @staticmethod
    def make():
        import torch
        from torch import nn

        torch.manual_seed(3)
        return nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 3, 1))


def test_predict_writes_one_file_with_mpio(tmp_path):
    import torch

    python, mpiexec = mpio_env()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 2, 13, 9, 6)).astype(np.float32)   # odd sizes: uneven halves
    src = tmp_path / "vol.h5"
    with h5py.File(src, "w") as f:
        f["x"] = x
    out = tmp_path / "pred.h5"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([mpiexec, "-n", "2", python, os.path.abspath(__file__), "predict",
                           str(src), str(out)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not os.path.exists(f"{out}.parts"), "mpio must write one file, not per-rank parts"
    with h5py.File(out, "r") as f:
        assert not f["y"].is_virtual
        assert int(f.attrs["complete"]) == 1
        got = f["y"][...]
    with torch.no_grad():
        want = _Net.make()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def predict_worker(src: str, out: str) -> None:
    """Both ranks predict ``src`` on a 1x2x1x1 grid (h5py with MPI: the mpio writer)."""
    import h5py

    import hpcpar

    assert h5py.get_config().mpi, "h5py is not built against MPI"
    hpcpar.predict(_Net.make(), src, out, "1x2x1x1")


def worker(out: str, paths: dict) -> None:
    """Each rank reads every path with driver="mpio", then with the default driver (warm:
    both after one untimed epoch), and saves its batches and its read rates in ``out``."""
    import time

    import h5py
    from mpi4py import MPI

    from hpcpar import ProcessGrid
    from hpcpar.data import ShardedVolumeDataset

    assert h5py.get_config().mpi, "h5py is not built against MPI"
    comm = MPI.COMM_WORLD
    grid = ProcessGrid.parse(GRID, comm=comm)
    for name, path in paths.items():
        rate = {}
        for driver in ("mpio", None):
            with ShardedVolumeDataset(path, grid, BATCH, shuffle=False, prefetch=0,
                                      driver=driver) as ds:
                for _ in ds:  # untimed: opens files, fills the page cache
                    pass
                comm.Barrier()
                before, t0 = ds.bytes_read, time.perf_counter()
                xs, ys = [], []
                for xb, yb in ds:
                    xs.append(xb.numpy())
                    ys.append(yb.numpy())
                seconds = time.perf_counter() - t0
                rate[driver] = (ds.bytes_read - before) / seconds / 1e6
                if driver == "mpio":
                    xa, ya = np.concatenate(xs), np.concatenate(ys)
                    ids = np.array([i for step in ds.schedule.local_steps(0) for i in step])
                    np.savez(os.path.join(out, f"{name}.{grid.rank}.npz"), x=xa, y=ya,
                             ids=ids)
        with open(os.path.join(out, f"{name}.{grid.rank}.json"), "w") as fh:
            json.dump({"name": name, "rank": grid.rank, "mpio_mb_s": rate["mpio"],
                       "sec2_mb_s": rate[None], "hdf5": h5py.version.hdf5_version,
                       "mpi": " ".join(MPI.Get_library_version().split()[:3])}, fh)
    grid.free()


if __name__ == "__main__":
    if sys.argv[1] == "predict":
        predict_worker(*sys.argv[2:4])
    else:
        worker(sys.argv[1], json.loads(sys.argv[2]))
