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
