"""The hyperslab reader under MPI: contents vs numpy slicing for every grid, sample coverage
per epoch, spatial-group agreement, bytes read, resume, staging, parallel make, errors."""

import itertools
import os

import h5py
import numpy as np
import pytest

from hpcpar.testing import mpi_case, shared_tmpdir

N, SHAPE, K = 10, (2, 9, 7, 5), 3  # 9, 7, 5 split unevenly over 2, 3 and 4 ranks


def factorisations(n):
    for d, x, y in itertools.product(range(1, n + 1), repeat=3):
        if n % (d * x * y) == 0:
            yield (d, x, y, n // (d * x * y))


def make_dataset(comm, tmp, chunk=4):
    """Random x/y written by rank 0, re-sharded by all ranks; returns (dir, x, y)."""
    from hpcpar.data.writer import H5Source, shard_counts, write_dataset

    inp = os.path.join(tmp, "in.h5")
    if comm.rank == 0:
        rng = np.random.default_rng(7)
        with h5py.File(inp, "w") as f:
            f["x"] = rng.standard_normal((N, *SHAPE)).astype(np.float32)
            f["y"] = rng.standard_normal((N, K)).astype(np.float32)
    comm.Barrier()
    src = H5Source(inp)
    x, y = src.read(0, N)
    out = os.path.join(tmp, "ds")
    write_dataset(out, src, shard_counts(N, samples_per_shard=3), comm=comm, chunk=chunk,
                  progress=False)
    src.close()
    return out, x, y


def sample_ids(y_batch, y_all):
    return [int(np.flatnonzero((y_all == row).all(axis=1))[0]) for row in y_batch.numpy()]


def collect(ds, epoch):
    ds.set_epoch(epoch)
    return [(xb.numpy(), yb) for xb, yb in ds]


@mpi_case(nprocs=(1, 4), timeout=240)
def test_every_grid_hyperslabs_coverage_bytes(comm):
    from hpcpar import ProcessGrid
    from hpcpar.data import ShardedVolumeDataset
    from hpcpar.parallel.counters import COUNTERS
    from hpcpar.parallel.partition import part_range

    with shared_tmpdir(comm, prefix="hpcpar-test-data-") as tmp:
        out, x_all, y_all = make_dataset(comm, tmp)
        chunks = (1, 2, 3, 4, 3)  # chunk_edge(9|7|5, 4)
        for case, shape in enumerate(factorisations(comm.size)):
            grid = ProcessGrid(*shape, comm=comm)
            d = shape[0]
            for batch, drop_last in ((4, True), (max(3, d), False)):
                # a few configurations through the prefetch process (each starts an interpreter)
                prefetch = 2 if drop_last and case % 5 == 0 else 0
                ds = ShardedVolumeDataset(out, grid, batch, seed=11, drop_last=drop_last,
                                          prefetch=prefetch)
                box = [part_range(n, p, i) for n, p, i in
                       zip(SHAPE[1:], grid.spatial_shape, grid.spatial_coords)]
                sel = (slice(None), slice(None), *(slice(a, b) for a, b in box))
                edges = [-(-b // e) * e - a // e * e for (a, b), e in zip(box, chunks[2:])]
                share = SHAPE[0] * np.prod([b - a for a, b in box]) * 4
                rounded = SHAPE[0] * np.prod(edges) * 4  # whole chunks touched
                before, nread, orders, shards = COUNTERS.bytes_read, 0, [], set()
                for epoch in (0, 1):
                    steps = []
                    for xb, yb in collect(ds, epoch):
                        ids = sample_ids(yb, y_all)
                        np.testing.assert_array_equal(xb, x_all[ids][sel])
                        steps.append(ids)
                        nread += len(ids)
                        shards |= {i // 3 for i in ids}
                    assert len(steps) == len(ds) == (N // batch if drop_last else -(-N // batch))
                    # the spatial group agrees on every step's samples
                    assert all(s == steps for s in grid.spatial_comm.allgather(steps))
                    # across data groups: each step is one global batch, each sample at most once
                    groups = grid.data_comm.allgather(steps)
                    per_step = [sum((g[s] for g in groups), []) for s in range(len(steps))]
                    assert all(len(b) == batch for b in per_step[:N // batch])
                    seen = sorted(sum(per_step, []))
                    if drop_last:
                        assert len(seen) == len(set(seen)) == (N // batch) * batch
                    else:
                        assert seen == list(range(N))
                    orders.append(per_step)
                assert share <= rounded
                y_bytes = sum(min(3, N - 3 * s) * K * 4 for s in shards)  # y: whole, at open
                assert ds.bytes_read == COUNTERS.bytes_read - before == nread * rounded + y_bytes
                assert orders[0] != orders[1]  # reshuffled per epoch (same on every rank)
                ds.close()
            grid.free()


@mpi_case(nprocs=(1, 4), timeout=180)
def test_resume_replay_and_errors(comm):
    from hpcpar import ProcessGrid
    from hpcpar.data import ShardedVolumeDataset
    from hpcpar.errors import DataError

    with shared_tmpdir(comm, prefix="hpcpar-test-data-") as tmp:
        out, _, y_all = make_dataset(comm, tmp)
        d = min(2, comm.size)
        grid = ProcessGrid(d, comm.size // d, comm=comm)

        def ids(batches):
            return [sample_ids(yb, y_all) for _, yb in batches]

        with ShardedVolumeDataset(out, grid, 2, seed=3, prefetch=2) as ds:
            assert len(ds) == 5
            plain = [ids(ds) for _ in range(3)]  # re-iterating walks through epochs 0, 1, 2
            assert ds.epoch == 3 and plain[0] != plain[1]
            ds.set_epoch(1)
            assert ids(ds) == plain[1]
            ds.set_epoch(0)
            for k, _ in enumerate(ds):  # leave early: the prefetcher drains, the epoch replays
                if k == 1:
                    break
            state = ds.state_dict()
            assert (state["epoch"], state["position"]) == (0, 2)
            assert ids(ds) == plain[0]
        with ShardedVolumeDataset(out, grid, 2, seed=3, prefetch=0) as resumed:
            resumed.load_state_dict(state)
            tail = []
            for epoch in range(state["epoch"], 2):
                resumed.set_epoch(epoch)
                tail += ids(resumed)
            assert tail == plain[0][2:] + plain[1]
            with pytest.raises(DataError) as e:
                resumed.load_state_dict({**state, "seed": 4})
            assert str(e.value) == f"{out}: state_dict field 'seed' is 4, this dataset has 3"

        def error(*args, **kw):
            with pytest.raises(DataError) as e:
                ShardedVolumeDataset(*args, **kw)
            return str(e.value)

        assert error(out, grid, 20) == \
            f"{out}: batch_size 20 is larger than the dataset (10 samples)"
        missing = os.path.join(tmp, "absent")
        assert error(missing, grid, 2) == f"{missing}: dataset directory not found"
        comm.Barrier()
        shard = os.path.join(out, "shard-00002.h5")
        if comm.rank == 0:
            os.rename(shard, shard + ".away")
        comm.Barrier()
        assert error(out, grid, 2) == f"{shard}: shard file not found"  # on every rank
        comm.Barrier()
        if comm.rank == 0:
            os.rename(shard + ".away", shard)
            with h5py.File(shard, "a") as f:
                f.move("x", "volume")
        comm.Barrier()
        assert error(out, grid, 2).startswith(f"{shard}: sha256 mismatch")  # the bytes changed
        assert error(out, grid, 2, verify=False) == f"{shard}: missing dataset 'x'"
        grid.free()


@mpi_case(nprocs=(1, 4), timeout=180)
def test_parallel_make_matches_serial_and_synthetic(comm):
    from hpcpar import ProcessGrid
    from hpcpar.data import ShardedVolumeDataset, SyntheticVolumeDataset
    from hpcpar.data.format import read_manifest
    from hpcpar.data.synthetic import CosmoflowSource
    from hpcpar.data.writer import SerialComm, write_dataset
    from hpcpar.errors import DataError

    with shared_tmpdir(comm, prefix="hpcpar-test-data-") as tmp:
        out = os.path.join(tmp, "cf")
        write_dataset(out, CosmoflowSource(6, 8, 2, seed=4), [2, 2, 2], comm=comm, chunk=4,
                      progress=False)  # 3 shards: with 4 ranks one writes nothing
        if comm.rank == 0:
            ref = os.path.join(tmp, "ref")
            write_dataset(ref, CosmoflowSource(6, 8, 2, seed=4), [2, 2, 2], comm=SerialComm(),
                          chunk=4, progress=False)
            assert read_manifest(ref).to_json()["shards"] == read_manifest(out).to_json()["shards"]
        grid = ProcessGrid(1, *(2, 2, 1) if comm.size == 4 else (1, 1, 1), comm=comm)
        files = ShardedVolumeDataset(out, grid, 3, seed=4, drop_last=False)
        memory = SyntheticVolumeDataset(grid, 3, size=8, channels=2, samples=6, seed=4,
                                        drop_last=False)
        assert len(files) == len(memory) == 2
        for epoch in (0, 1):
            for (xf, yf), (xm, ym) in zip(collect(files, epoch), collect(memory, epoch)):
                np.testing.assert_array_equal(xf, xm)
                assert (yf == ym).all()
        files.close()

        class FailsOnLastRank(CosmoflowSource):
            def read(self, start, stop):
                if comm.rank == comm.size - 1:
                    raise OSError("no space left on device")
                return super().read(start, stop)

        bad = os.path.join(tmp, "bad")
        with pytest.raises((OSError, DataError)) as e:
            write_dataset(bad, FailsOnLastRank(8, 4, 1), [2] * 4, comm=comm, progress=False)
        if comm.rank != comm.size - 1:
            assert str(e.value).startswith(f"writing {bad} failed on rank {comm.size - 1}: ")
        assert "no space left on device" in str(e.value) and "\n" not in str(e.value)
        comm.Barrier()
        assert sorted(os.listdir(tmp)) == sorted(["cf"] + (["ref"] if os.path.exists(
            os.path.join(tmp, "ref")) else []))  # nothing half-written
        grid.free()


@mpi_case(nprocs=(1, 4), timeout=120)
def test_staging_once_per_node(comm):
    from hpcpar import ProcessGrid
    from hpcpar.data import ShardedVolumeDataset

    with shared_tmpdir(comm, prefix="hpcpar-test-data-") as tmp:
        out, x_all, y_all = make_dataset(comm, tmp)
        os.environ["HPCPAR_FAKE_NODES"] = "2"
        try:
            grid = ProcessGrid(-1, comm=comm)  # pure data parallel: 2 nodes of 2 when 4 ranks
        finally:
            del os.environ["HPCPAR_FAKE_NODES"]
        local = os.path.join(tmp, f"node{grid.node_index}")
        ds = ShardedVolumeDataset(out, grid, comm.size, shuffle=False, prefetch=2, stage_to=local)
        assert ds.staged_dir.startswith(local)
        staged = sorted(f for f in os.listdir(ds.staged_dir) if f.endswith(".h5"))
        read = set()
        for xb, yb in ds:
            ids = sample_ids(yb, y_all)
            np.testing.assert_array_equal(xb.numpy(), x_all[ids])
            read |= {f"shard-{i // 3:05d}.h5" for i in ids}
        node_read = set().union(*grid.node_comm.allgather(read))
        assert staged == sorted(node_read)  # this node's shards, no others
        copied = grid.node_comm.allgather(ds.bytes_staged)
        assert copied[0] == sum(os.path.getsize(os.path.join(out, f)) for f in staged)
        assert copied[1:] == [0] * (len(copied) - 1)  # only the node's first rank copies
        ds.close()
        again = ShardedVolumeDataset(out, grid, comm.size, shuffle=False, stage_to=local)
        assert again.bytes_staged == 0  # already on the node
        again.close()
        grid.free()
