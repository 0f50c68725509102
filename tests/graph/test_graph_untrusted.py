"""Graph inputs are data, never code or trusted numbers: a PyG ``.pt`` is unpickled with
``weights_only=True`` (``--trust-pickle`` for the rest), and labels, index arrays, CSR offsets,
damaged ``.npz`` files and a graph without training vertices are one-line errors. Real files,
real ``hpcpar`` subprocesses."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest

from hpcpar.errors import DataError
from hpcpar.graph.format import GraphFile, write_graph

CLI = [sys.executable, "-m", "hpcpar.cli"]


def _hpcpar(args, cwd):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def _one_line_error(r) -> str:
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcpar: error: "), r.stderr
    return lines[0]


class _Evil:
    """Pickles as a call to ``open(marker, "w")``: loading the file would create it."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_pyg_import_runs_no_code_from_the_file(tmp_path):
    import torch

    marker = tmp_path / "MARKER"
    torch.save(_Evil(marker), tmp_path / "evil.pt")
    line = _one_line_error(_hpcpar(["data", "graph", "import", "evil.pt", "g.h5"], tmp_path))
    assert not marker.exists(), "graph import ran code from the .pt file"
    assert "evil.pt: refused to unpickle" in line and "--trust-pickle" in line
    assert not (tmp_path / "g.h5").exists()
    line = _one_line_error(_hpcpar(["data", "graph", "partition", "evil.pt", "parts", "--parts",
                                    "2"], tmp_path))       # mapped, not imported: same rule
    assert not marker.exists(), "graph partition ran code from the .pt file"
    assert "evil.pt: refused to unpickle" in line and not (tmp_path / "parts").exists()


def test_pyg_graph_classes_load_and_the_rest_needs_trust(tmp_path):
    import torch

    data_cls = pytest.importorskip("torch_geometric.data").Data
    edges = torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]])
    torch.save(data_cls(edge_index=edges, x=torch.eye(3), y=torch.tensor([0, 1, 0]),
                        train_mask=torch.tensor([True, True, False])), tmp_path / "ok.pt")
    torch.save(data_cls(edge_index=edges, x=torch.eye(3), y=np.array([0, 1, 0])),
               tmp_path / "numpy.pt")
    r = _hpcpar(["data", "graph", "import", "ok.pt", "ok.h5"], tmp_path)
    assert r.returncode == 0 and "3 nodes, 4 edges" in r.stdout, r.stderr
    line = _one_line_error(_hpcpar(["data", "graph", "import", "numpy.pt", "n.h5"], tmp_path))
    assert "refused to unpickle numpy" in line and "--trust-pickle" in line
    r = _hpcpar(["data", "graph", "import", "numpy.pt", "n.h5", "--trust-pickle"], tmp_path)
    assert r.returncode == 0 and (tmp_path / "n.h5").is_file(), r.stderr


def _npz(path, **changes):
    """A 5-vertex Planetoid-style .npz (a path graph, one-hot CSR features, two classes)."""
    n, e = 5, np.array([[0, 1, 1, 2, 2, 3, 3, 4], [1, 0, 2, 1, 3, 2, 4, 3]])
    base = dict(edge_index=e, x_indptr=np.array([0, 1, 2, 3, 3, 3]),
                x_indices=np.array([0, 1, 2]), x_data=np.ones(3, np.float32),
                x_shape=np.array([n, 3]), y=np.array([0, 1, 0, 1, 0]),
                train_idx=np.array([0, 1]), val_idx=np.array([2]), test_idx=np.array([3, 4]))
    np.savez(path, **{**base, **changes})
    return path


@pytest.mark.parametrize("changes, expected", [
    ({"y": np.array([0, 1, -1, 1, 0])}, "label -1 is outside the class ids"),
    ({"x_indptr": np.array([3, 3, 3, 2, 1, 0])}, "indptr must rise from 0 to 3"),
    ({"x_indices": np.array([0, 1, 7])}, "a column id is outside 0..2"),
    ({"train_idx": np.array([0, 99])}, "train_idx holds a vertex outside 0..4"),
    ("truncated", "not a readable .npz (truncated or damaged"),
])
def test_bad_npz_is_one_line(tmp_path, changes, expected):
    src = _npz(tmp_path / "g.npz", **({} if changes == "truncated" else changes))
    if changes == "truncated":
        src.write_bytes(src.read_bytes()[:300])
    line = _one_line_error(_hpcpar(["data", "graph", "import", src, "g.h5"], tmp_path))
    assert expected in line
    assert not (tmp_path / "g.h5").exists()


def test_graph_file_labels_and_features_are_checked_on_read(tmp_path):
    path = tmp_path / "g.h5"
    masks = {m: np.ones(3, bool) for m in ("train", "val", "test")}
    write_graph(path, 3, np.eye(3, dtype=np.float32), np.array([0, 1, 1]), masks,
                edge_index=np.array([[0, 1], [1, 2]]))
    with h5py.File(path, "r+") as f:
        f["labels"][1] = 5                                  # num_classes is 2
    with pytest.raises(DataError, match=r"/labels: label 5 is outside the class ids 0..1"):
        GraphFile(path)
    write_graph(path, 3, (np.array([0, 1, 2, 2]), np.array([0, 1]), np.ones(2), (3, 2)),
                np.array([0, 1, 1]), masks, edge_index=np.array([[0, 1], [1, 2]]))
    with h5py.File(path, "r+") as f:
        f["features/indptr"][...] = np.array([2, 1, 0, 0])  # reversed offsets
    with GraphFile(path) as gf, pytest.raises(DataError, match="/features rows 0..2: indptr"):
        gf.read_rows(0, 3)


def test_no_training_vertex_is_an_error_not_a_zero_loss(tmp_path):
    assert _hpcpar(["data", "graph", "import", _npz(tmp_path / "g.npz",
                                                       train_idx=np.array([], np.int64)),
                    "g.h5"], tmp_path).returncode == 0
    (tmp_path / "j.toml").write_text('[grid]\ndata = 1\nx = -1\n[model]\nkind = "gcn"\n'
                                     '[data]\npath = "g.h5"\npartition = "block"\n'
                                     '[train]\nepochs = 2\n')
    r = _hpcpar(["run", "j.toml", "-n", "1", "--run-dir", "r"], tmp_path)
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(errors) == 1 and errors[0].startswith("hpcpar: error: g.h5: no training vertex "
                                                     "(/masks/train is all false)"), r.stderr


def test_labels_must_be_integer_class_ids_in_a_sane_range(tmp_path):
    """Issue 67: a fraction is refused (it was truncated to another class), and so is a label
    of 1e9 (it made num_classes 1e9+1: a 32 GB model)."""
    np.save(tmp_path / "x.npy", np.eye(3, dtype=np.float32))
    (tmp_path / "e.txt").write_text("0 1\n1 2\n")
    for labels, expected in ((np.array([0.0, 1.5, 1.0]), "label 1.5 of vertex 1 is not an "
                              "integer class id"),
                             (np.array([0, 1e9, 1]), "label 1000000000 of vertex 1 is outside "
                              "the class ids 0..1048575 (or -1: unlabeled)"),
                             (np.array([0, np.nan, 1]), "label nan of vertex 1 is not an "
                              "integer class id")):
        np.save(tmp_path / "y.npy", labels)
        for cmd in (["import", "e.txt", "g.h5"], ["partition", "e.txt", "p", "--parts", "2"]):
            line = _one_line_error(_hpcpar(["data", "graph", *cmd, "--features", "x.npy",
                                            "--labels", "y.npy"], tmp_path))
            assert line == f"hpcpar: error: y.npy: {expected}", line
            assert not (tmp_path / "g.h5").exists() and not (tmp_path / "p").exists()
    src = _npz(tmp_path / "big.npz", y=np.array([0, 1, 0, 1, 10**9]))
    line = _one_line_error(_hpcpar(["data", "graph", "import", src, "g.h5"], tmp_path))
    assert "big.npz: y: label 1000000000 of vertex 4 is outside the class ids" in line


def test_unlabeled_vertices_outside_every_mask_are_accepted(tmp_path):
    """Issue 67: -1 marks a vertex without a label (some public citation graphs have them);
    it is refused only on a vertex in a mask."""
    src = _npz(tmp_path / "g.npz", y=np.array([0, 1, 0, -1, 1]),
               test_idx=np.array([4]))                      # vertex 3 in no mask
    r = _hpcpar(["data", "graph", "import", src, "g.h5"], tmp_path)
    assert r.returncode == 0 and "2 classes" in r.stdout, r.stderr
    with GraphFile(tmp_path / "g.h5") as gf:
        assert gf.num_classes == 2 and gf.read_rows(0, 5)["y"].tolist() == [0, 1, 0, -1, 1]
    r = _hpcpar(["data", "graph", "partition", src, "p", "--parts", "2"], tmp_path)
    assert r.returncode == 0, r.stderr
    src = _npz(tmp_path / "m.npz", y=np.array([0, 1, 0, -1, 1]))     # vertex 3 in test
    line = _one_line_error(_hpcpar(["data", "graph", "import", src, "m.h5"], tmp_path))
    assert line.endswith("m.npz: y: label -1 is outside the class ids 0..1 (vertex 3 is in "
                         "the test mask; -1 marks an unlabeled vertex, allowed only outside "
                         "every mask)"), line


def test_graph_out_is_replaced_only_with_force_and_only_when_hpcpar_made_it(tmp_path):
    """Issue 67: ``graph make``/``graph import`` replaced an existing OUT without --force."""
    (tmp_path / "mine.h5").write_bytes(b"my own data\n")
    for cmd in (["make", "mine.h5", "--nodes", "50"], ["import", "cora", "mine.h5"]):
        line = _one_line_error(_hpcpar(["data", "graph", *cmd], tmp_path))
        assert line == "hpcpar: error: mine.h5: already exists (use --force to replace it)"
        line = _one_line_error(_hpcpar(["data", "graph", *cmd, "--force"], tmp_path))
        assert line == ("hpcpar: error: mine.h5: not an hpcpar graph file; --force replaces only "
                        "a graph file hpcpar made: remove it yourself or choose another OUT")
        assert (tmp_path / "mine.h5").read_bytes() == b"my own data\n"
    r = _hpcpar(["data", "graph", "make", "g.h5", "--nodes", "50"], tmp_path)
    assert r.returncode == 0, r.stderr
    _one_line_error(_hpcpar(["data", "graph", "make", "g.h5", "--nodes", "60"], tmp_path))
    r = _hpcpar(["data", "graph", "make", "g.h5", "--nodes", "60", "--force"], tmp_path)
    assert r.returncode == 0, r.stderr
    with GraphFile(tmp_path / "g.h5") as gf:
        assert gf.num_nodes == 60
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.h5", "mine.h5"]   # no temp left


@pytest.mark.parametrize("args, expected", [
    (["--nodes", "100000000000"], "make graph: --nodes 100000000000 --avg-degree 10 --features "
                                  "32 needs about "),
    (["--nodes", "1000", "--avg-degree", "1e9"], "make graph: --avg-degree must be positive and "
                                                 "below --nodes (1000: a vertex has at most 999 "
                                                 "neighbours), got 1000000000.0"),
])
def test_graph_make_sizes_are_range_checked(tmp_path, args, expected):
    """Issue 67: a NumPy MemoryError traceback before."""
    line = _one_line_error(_hpcpar(["data", "graph", "make", "g.h5", *args], tmp_path))
    assert line.startswith(f"hpcpar: error: {expected}"), line
    assert not (tmp_path / "g.h5").exists()
