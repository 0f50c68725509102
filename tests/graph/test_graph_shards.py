"""The sharded graph format, its partitioners (METIS, streaming LDG) and the distributed build.

Exactness: ``DistGraph.from_shards`` (each rank reads its part) trains bit-identically to
today's build (``from_global``) of the same renumbered graph with the same owners, on 2 and 4
ranks; and the parts hold exactly the source graph's rows, relabelled.
"""

import os

import h5py
import numpy as np
import pytest
import torch

from hpcpar.errors import DataError
from hpcpar.testing import mpi_case, shared_tmpdir


def _graph(n=600, deg=6.0, seed=3, directed=False):
    from hpcpar.graph.generate import power_law_community_graph

    return power_law_community_graph(n, deg, communities=6, features=5, classes=3, seed=seed,
                                     directed=directed)


def _write(path, g):
    from hpcpar.graph.format import write_graph

    n = g["x"].shape[0]
    write_graph(path, n, g["x"], g["y"], g["masks"], csr=(g["indptr"], g["indices"]),
                directed=g["directed"], num_classes=g["num_classes"])


def _assemble(out):
    """The whole renumbered graph back from the parts: (edge_index, x, y, masks, orig, m)."""
    from hpcpar.graph._csr import csr_to_edges
    from hpcpar.graph.shards import read_graph_manifest, read_part

    m = read_graph_manifest(out)
    parts = [read_part(out, m, p) for p in range(m["parts"])]
    ip = np.concatenate([[0], np.cumsum(np.concatenate([np.diff(p["indptr"]) for p in parts]))])
    idx = np.concatenate([p["indices"] for p in parts])
    cat = {k: np.concatenate([p[k] for p in parts]) for k in parts[0] if k not in
           ("indptr", "indices")}
    masks = {k: cat[k] for k in ("train", "val", "test")}
    return csr_to_edges(ip, idx), cat["x"], cat["y"], masks, cat["original_ids"], m


def _same_parts(got_dir, got, want_dir, want) -> None:
    """Two partitionings wrote the same graph, relabelling and edge cut."""
    for a, b in zip(_assemble(got_dir)[:5], _assemble(want_dir)[:5]):
        if isinstance(b, dict):
            assert all(np.array_equal(a[k], b[k]) for k in b)
        else:
            assert np.array_equal(a, b)
    assert got["partition"]["edge_cut"] == want["partition"]["edge_cut"]


def _check_same_graph(g, out):
    """Every vertex's row, features, label and masks are the source's, relabelled."""
    e, x, y, masks, orig, m = _assemble(out)
    n = g["x"].shape[0]
    new = np.empty(n, np.int64)
    new[orig] = np.arange(n)
    assert np.array_equal(np.sort(orig), np.arange(n))
    dst = np.repeat(np.arange(n), np.diff(g["indptr"]))
    want = np.sort(new[dst] * n + new[g["indices"]])
    assert np.array_equal(np.sort(e[1] * n + e[0]), want)
    assert np.array_equal(x, g["x"][orig]) and np.array_equal(y, g["y"][orig])
    for k in masks:
        assert np.array_equal(masks[k], g["masks"][k][orig])
    offs = np.asarray(m["offsets"])
    for p in range(m["parts"]):          # inside a part, source order is kept
        assert np.all(np.diff(orig[offs[p]:offs[p + 1]]) > 0)
    return m


@pytest.mark.parametrize("method", ["metis", "stream"])
@pytest.mark.parametrize("directed", [False, True])
def test_parts_hold_the_source_graph(tmp_path, method, directed):
    from hpcpar.graph.shards import verify_graph_shards
    from hpcpar.graph.stream_partition import partition_graph

    g = _graph(directed=directed)
    _write(tmp_path / "g.h5", g)
    m = partition_graph(str(tmp_path / "g.h5"), str(tmp_path / "out"), 3, method, block=97)
    assert m["partition"]["method"] == method and m["directed"] == directed
    assert verify_graph_shards(tmp_path / "out") == []
    _check_same_graph(g, tmp_path / "out")
    owner = np.searchsorted(m["offsets"], np.arange(600), side="right") - 1
    e, *_ = _assemble(tmp_path / "out")
    assert m["partition"]["edge_cut"] == int(np.count_nonzero(owner[e[0]] != owner[e[1]]))


def test_metis_is_todays_partition(tmp_path):
    """Same owners as today's build's METIS (same seed and symmetry), so 'same partition'."""
    from hpcpar.graph.stream_partition import partition_graph
    from hpcpar.graph.vertex_partition import partition_csr

    g = _graph()
    _write(tmp_path / "g.h5", g)
    partition_graph(str(tmp_path / "g.h5"), str(tmp_path / "out"), 4, "metis", seed=2)
    *_, orig, m = _assemble(tmp_path / "out")
    owner = partition_csr(g["indptr"], g["indices"], 4, "metis", 2, symmetric=True)
    assert np.array_equal(owner[orig], np.searchsorted(m["offsets"], np.arange(600),
                                                       side="right") - 1)


def test_streaming_is_balanced_and_beats_a_random_cut(tmp_path):
    from hpcpar.graph.stream_partition import ldg_partition

    g = _graph(4000, 8.0, seed=5)
    n, e = 4000, g["indices"].shape[0]
    ip, idx = g["indptr"], g["indices"]
    owner = ldg_partition(lambda a, b: (ip[a:b + 1] - ip[a], idx[ip[a]:ip[b]]), n, e, 4,
                          block=500)
    load = np.bincount(owner, weights=np.diff(ip) + 1, minlength=4)
    assert load.max() / load.mean() < 1.10
    dst = np.repeat(np.arange(n), np.diff(ip))
    cut = np.count_nonzero(owner[dst] != owner[idx]) / e
    assert cut < 0.5, cut        # a random 4-way split cuts 75 %


def test_auto_follows_the_memory_estimate(tmp_path):
    from hpcpar.graph.stream_partition import metis_memory_estimate, partition_graph

    _write(tmp_path / "g.h5", _graph())
    need = metis_memory_estimate(600, _graph()["indices"].shape[0])
    small = partition_graph(str(tmp_path / "g.h5"), str(tmp_path / "a"), 2, "auto",
                            memory_limit=need)
    big = partition_graph(str(tmp_path / "g.h5"), str(tmp_path / "b"), 2, "auto",
                          memory_limit=4 * need)
    assert (small["partition"]["method"], big["partition"]["method"]) == ("stream", "metis")
    assert small["partition"]["peak_rss_bytes"] > 0


def test_edge_list_and_npz_sources(tmp_path):
    """A text edge list (header, comments, duplicates, several buckets) gives the graph file's
    parts exactly; the bundled Cora .npz partitions."""
    from hpcpar.graph._csr import csr_to_edges
    from hpcpar.graph.format import bundled
    from hpcpar.graph.stream_partition import EdgeListSource, partition_graph

    g = _graph(directed=True)
    e = csr_to_edges(g["indptr"], g["indices"])
    lines = ["src dst"] + [f"{a} {b}" for a, b in e.T] + ["# a comment", f"{e[0, 0]},{e[1, 0]}"]
    (tmp_path / "g.txt").write_text("\n".join(lines) + "\n")
    np.save(tmp_path / "x.npy", g["x"])
    np.save(tmp_path / "y.npy", g["y"])
    src = EdgeListSource(tmp_path / "g.txt", str(tmp_path / "x.npy"), str(tmp_path / "y.npy"),
                         workdir=str(tmp_path), bucket_edges=300)
    assert len(src.pieces) > 2 and src.directed
    ip, idx = src.read_structure()
    assert np.array_equal(ip, g["indptr"]) and np.array_equal(idx, g["indices"])
    assert np.array_equal(src.read_structure_rows(100, 350)[1],
                          g["indices"][g["indptr"][100]:g["indptr"][350]])
    m = partition_graph(str(tmp_path / "g.txt"), str(tmp_path / "out"), 3, "stream",
                        features=str(tmp_path / "x.npy"), labels=str(tmp_path / "y.npy"))
    assert m["num_edges"] == g["indices"].shape[0] and m["directed"]
    c = partition_graph(bundled("cora"), str(tmp_path / "cora"), 2, "metis")
    assert (c["num_nodes"], c["num_edges"], c["directed"]) == (2708, 10556, False)


@pytest.mark.parametrize("compressed", [False, True])
def test_an_npz_streams_into_the_same_parts_as_its_import(tmp_path, compressed):
    """An ``.npz`` read in blocks out of the archive (stored or compressed, several buckets
    and edge blocks) gives the same parts, bit for bit, as the graph file import_npz writes
    of it whole; a damaged or incomplete archive is one line."""
    from hpcpar.errors import DataError
    from hpcpar.graph.format import bundled, import_npz
    from hpcpar.graph.stream_partition import NpzSource, partition_graph

    with np.load(bundled("cora")) as z:
        fields = {k: z[k] for k in z.files}
    src = tmp_path / "cora.npz"
    (np.savez_compressed if compressed else np.savez)(src, **fields)
    import_npz(src, tmp_path / "cora.h5")
    work = tmp_path / "work"
    work.mkdir()
    npz = NpzSource(str(src), str(work), bucket_edges=1000, block=777)
    assert len(npz.pieces) > 5 and not npz.directed and npz.num_edges == 10556
    whole = partition_graph(str(tmp_path / "cora.h5"), str(tmp_path / "a"), 3, "stream")
    streamed = partition_graph(str(src), str(tmp_path / "b"), 3, "stream")
    _same_parts(tmp_path / "b", streamed, tmp_path / "a", whole)
    del fields["y"]
    np.savez(tmp_path / "noy.npz", **fields)
    with pytest.raises(DataError, match=r"noy.npz: missing field\(s\) y \(expected"):
        NpzSource(str(tmp_path / "noy.npz"), str(work))
    (tmp_path / "cut.npz").write_bytes(src.read_bytes()[:5000])
    with pytest.raises(DataError, match="cut.npz: not a readable .npz"):
        NpzSource(str(tmp_path / "cut.npz"), str(work))


def _mapped_kib(path) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.mark.parametrize("legacy", [False, True])
def test_a_pyg_file_streams_into_the_same_parts_as_its_import(tmp_path, legacy):
    """A PyG ``Data`` saved with torch.save, mapped and read in blocks (several buckets and
    edge blocks; float64 features, repeated edges, no masks) gives the same parts, bit for
    bit, as the graph file import_graph writes of it whole, and the pages it read are given
    back; a legacy (non-zip) file is imported whole; a Data without x is one line."""
    pytest.importorskip("torch_geometric")
    from torch_geometric.data import Data

    from hpcpar.graph._csr import csr_to_edges
    from hpcpar.graph.interop import import_graph
    from hpcpar.graph.stream_partition import (
        PygSource,
        _drop_pages,
        open_source,
        partition_graph,
    )

    g = _graph(n=3000, directed=True)
    e = torch.from_numpy(csr_to_edges(g["indptr"], g["indices"]))
    data = Data(x=torch.from_numpy(g["x"]).double(), y=torch.from_numpy(g["y"]),
                edge_index=torch.cat([e, e[:, :5]], 1))
    src = tmp_path / "g.pt"
    torch.save(data, src, _use_new_zipfile_serialization=not legacy)
    with pytest.warns(UserWarning, match="5 repeated edge"):
        import_graph(src, tmp_path / "g.h5", seed=4)
    work = tmp_path / "work"
    work.mkdir()
    if legacy:
        with pytest.warns(UserWarning, match="5 repeated edge"):   # imported whole
            assert not isinstance(open_source(str(src), str(work)), PygSource)
    else:
        with pytest.warns(UserWarning, match="5 repeated edge"):
            pyg = PygSource(str(src), str(work), seed=4, bucket_edges=2000, block=777)
        assert len(pyg.pieces) > 5 and pyg.directed and pyg.num_edges == e.shape[1]
        rows = pyg.read_rows(1000, 1500)
        np.testing.assert_array_equal(rows["x"], g["x"][1000:1500])
        # 6.4 MB of edges read in 512 kB blocks: the file's mapping keeps little resident
        big = tmp_path / "big.pt"
        edges = torch.randint(0, 1000, (2, 400000), generator=torch.Generator().manual_seed(0))
        torch.save(Data(x=torch.zeros(1000, 1), edge_index=edges), big)
        with pytest.warns(UserWarning, match="repeated edge"):
            held = PygSource(str(big), str(work), block=1 << 16)
        assert held.num_edges > 300000 and _mapped_kib(big) < 600, _mapped_kib(big)
        # only the file's own pages are given back: memory built in this process is kept
        assert held._spans
        mine = torch.arange(1 << 20)
        _drop_pages(mine, held._spans)
        assert torch.equal(mine, torch.arange(1 << 20))
    whole = partition_graph(str(tmp_path / "g.h5"), str(tmp_path / "a"), 3, "stream")
    with pytest.warns(UserWarning, match="5 repeated edge"):
        streamed = partition_graph(str(src), str(tmp_path / "b"), 3, "stream", seed=4)
    _same_parts(tmp_path / "b", streamed, tmp_path / "a", whole)
    torch.save(Data(edge_index=e), tmp_path / "nox.pt")
    with pytest.raises(DataError, match="nox.pt: no 'x'"):
        open_source(str(tmp_path / "nox.pt"), str(work))


def test_bad_input_is_one_line(tmp_path, run_cli):
    from types import SimpleNamespace

    from hpcpar.graph.shards import verify_graph_shards

    cli = run_cli

    def run_cli(args):
        code, out, err = cli(args)
        return SimpleNamespace(code=code, out=out, err=err)

    _write(tmp_path / "g.h5", _graph())
    r = run_cli(["data", "graph", "partition", str(tmp_path / "nope.h5"), str(tmp_path / "o"),
                 "--parts", "2"])
    assert r.code == 2 and "nope.h5: no such file" in r.err and "Traceback" not in r.err
    r = run_cli(["data", "graph", "partition", str(tmp_path / "g.h5"), str(tmp_path / "o"),
                 "--parts", "601"])
    assert r.code == 2 and "--parts 601: expected 1..600" in r.err
    r = run_cli(["data", "graph", "partition", str(tmp_path / "g.h5"), str(tmp_path / "o"),
                 "--parts", "2", "--method", "stream"])
    assert r.code == 0 and "edge cut" in r.out and "peak memory" in r.out
    r = run_cli(["data", "verify", str(tmp_path / "o")])
    assert r.code == 0 and "sharded graph, 2 parts" in r.out
    r = run_cli(["data", "graph", "partition", str(tmp_path / "g.h5"), str(tmp_path / "o"),
                 "--parts", "2"])
    assert r.code == 2 and "pass --force" in r.err
    with h5py.File(tmp_path / "o" / "part-00001.h5", "a") as f:   # same size, other bytes
        f["features"][0, 0] += 1
    r = run_cli(["data", "verify", str(tmp_path / "o")])
    assert r.code == 2 and "part-00001.h5: sha256 mismatch" in r.err
    assert len(r.err.strip().splitlines()) == 1
    os.remove(tmp_path / "o" / "part-00000.h5")
    assert "part-00000.h5: shard file not found" in verify_graph_shards(tmp_path / "o")[0]


# ---- the distributed build ------------------------------------------------------------------
def _train(graph, conv, epochs=4):
    """Losses, final logits and parameters of a few Adam epochs (dropout on)."""
    from hpcpar.graph.metrics import masked_loss
    from hpcpar.models import GCN
    from hpcpar.parallel.comm import sum_grads_

    torch.manual_seed(0)
    model = GCN(graph.num_features, 8, graph.num_classes, dropout=0.5, conv=conv, seed=4)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses = []
    for _ in range(epochs):
        model.train()
        opt.zero_grad()
        loss = masked_loss(model(graph.x, graph), graph)
        loss.backward()
        sum_grads_(model.parameters(), graph.comm)
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    with torch.no_grad():
        out = model(graph.x, graph)
    return losses, out, [p.detach().clone() for p in model.parameters()]


@mpi_case(nprocs=(2, 4), timeout=300)
def test_distributed_build_is_bit_identical(comm):
    from hpcpar.graph import DistGraph
    from hpcpar.graph.shards import RangeOwner
    from hpcpar.graph.stream_partition import partition_graph

    size, rank = comm.Get_size(), comm.Get_rank()
    with shared_tmpdir(comm, prefix="hpcpar-graph-shards-") as tmp:
        for directed, method in ((False, "metis"), (True, "stream")):
            g = _graph(557, directed=directed)  # uneven part sizes
            out = os.path.join(tmp, f"{method}-{directed}")
            if rank == 0:
                _write(os.path.join(tmp, "g.h5"), g)
                partition_graph(os.path.join(tmp, "g.h5"), out, size, method, force=True)
            comm.Barrier()
            e, x, y, masks, orig, m = _assemble(out)
            new = DistGraph.from_shards(out, comm, row_normalize=True)
            owner = RangeOwner(m["offsets"])[np.arange(557)]
            old = DistGraph.from_global(e, 557, x, comm, y=y, masks=masks, owner=owner,
                                        row_normalize=True, directed=directed,
                                        original_ids=orig)  # so its dropout masks are new's
            assert new.num_owned == m["offsets"][rank + 1] - m["offsets"][rank]
            assert np.array_equal(new.global_ids, old.global_ids)
            assert np.array_equal(new.halo_ids, old.halo_ids)
            assert np.array_equal(orig[new.global_ids], new.original_ids)
            assert np.array_equal(old.original_ids, new.original_ids)
            for conv in ("gcn", "sage"):
                a, b = _train(new, conv), _train(old, conv)
                assert a[0] == b[0], (conv, a[0], b[0])
                assert torch.equal(a[1], b[1])
                assert all(torch.equal(p, q) for p, q in zip(a[2], b[2]))
            if method == "metis":  # today's build of the ORIGINAL graph, METIS, same partition:
                ref = DistGraph.from_hdf5(os.path.join(tmp, "g.h5"), comm, row_normalize=True)
                assert np.array_equal(np.sort(orig[new.global_ids]), ref.global_ids)
                mine = new.operator("gcn")(new.exchange(new.x))
                theirs = ref.gather(ref.operator("gcn")(ref.exchange(ref.x)))
                torch.testing.assert_close(mine, theirs[torch.from_numpy(new.original_ids)],
                                           rtol=1e-6, atol=1e-7)   # only summation order differs


@mpi_case(nprocs=(2,), timeout=120)
def test_wrong_part_count_is_one_line_on_every_rank(comm):
    from hpcpar.graph import DistGraph
    from hpcpar.graph.stream_partition import partition_graph

    with shared_tmpdir(comm, prefix="hpcpar-graph-shards-") as tmp:
        out = os.path.join(tmp, "out")
        if comm.Get_rank() == 0:
            _write(os.path.join(tmp, "g.h5"), _graph())
            partition_graph(os.path.join(tmp, "g.h5"), out, 3, "stream")
        comm.Barrier()
        with pytest.raises(DataError, match="partitioned into 3 parts, but the graph is split "
                                            "over 2 ranks"):
            DistGraph.from_shards(out, comm)
        with pytest.raises(DataError, match="sharded graph directory not found"):
            DistGraph.from_shards(os.path.join(tmp, "missing"), comm)


def _run_job(tmp_path, ranks, path, name):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from hpcpar.launch.mpiexec import rank_env

    job = Path(__file__).resolve().parents[2] / "jobs" / "demo-gcn-cora.toml"
    run_dir = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "hpcpar.cli", "run", str(job), "-n", str(ranks),
                           "--run-dir", str(run_dir), "--set", f"data.path={path}",
                           "--set", "data.make=", "--set", "train.epochs=30",
                           "--set", "train.val_every=0", "--set", "train.log_every=1"],
                          cwd=tmp_path, env=rank_env({"OMP_NUM_THREADS": "1"}),
                          capture_output=True, text=True, timeout=300)
    metrics = run_dir / "metrics.json"
    return proc, json.loads(metrics.read_text()) if metrics.exists() else None


def test_a_job_trains_on_a_sharded_graph(tmp_path):
    """``[data] path`` = a sharded Cora (2 METIS parts): trains through ``hpcpar run`` on 2
    ranks like the graph file does, dropout 0.5 included (the same partition in another
    numbering: the masks hash the source graph's ids, so only the sums' order differs); on 1
    rank it stops with one line."""
    from hpcpar.graph.format import bundled, import_npz
    from hpcpar.graph.stream_partition import partition_graph

    import_npz(bundled("cora"), tmp_path / "cora.h5")
    partition_graph(str(tmp_path / "cora.h5"), str(tmp_path / "cora-2"), 2, "metis")
    proc, sharded = _run_job(tmp_path, 2, tmp_path / "cora-2", "sharded")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc, plain = _run_job(tmp_path, 2, tmp_path / "cora.h5", "plain")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    a = np.array([loss for _, loss in sharded["train_loss_history"]])
    b = np.array([loss for _, loss in plain["train_loss_history"]])
    assert len(a) == 30 and a[-1] < 0.9 * a[0]
    np.testing.assert_allclose(a, b, rtol=1e-5)
    assert sharded["test_acc"] == plain["test_acc"]
    proc, _ = _run_job(tmp_path, 1, tmp_path / "cora-2", "wrong")
    assert proc.returncode == 2 and "partitioned into 2 parts, but the graph is split over " \
        "1 ranks" in proc.stderr and "Traceback" not in proc.stderr
