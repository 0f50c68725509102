"""Input transforms: ``data shard`` records none unless asked, the CosmoFlow generator records
log1p, older manifests keep what their runs applied, ``[data] transform = "auto"`` follows the
manifest, and the transform a run applied lands in meta.json: a user's zero-mean volumes train
without CosmoFlow's log1p (which made their loss NaN)."""

import json
import math
import subprocess
import sys

import h5py
import numpy as np
import pytest

from hpcpar.data import CosmoflowSource, read_manifest, shard_counts, write_dataset
from hpcpar.errors import DataError
from hpcpar.run.workloads.volume import VolumeWorkload


def _user_file(path, n=8, size=8):
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["x"] = rng.normal(size=(n, 1, size, size, size)).astype(np.float32)
        f["y"] = rng.normal(size=(n, 2)).astype(np.float32)


def _hpcpar(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hpcpar.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_shard_records_no_transform_unless_asked(tmp_path):
    _user_file(tmp_path / "mine.h5")
    for flag, want in (((), "none"), (("--transform", "log1p"), "log1p")):
        out = tmp_path / f"ds-{want}"
        p = _hpcpar("data", "shard", "mine.h5", out.name, "--samples-per-shard", 4, "--quiet",
                    *flag, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        assert read_manifest(out).transform == want
        assert json.loads((out / "manifest.json").read_text())["transform"] == want
        assert f"transform      {want}" in _hpcpar("data", "info", out.name, cwd=tmp_path).stdout
        with h5py.File(tmp_path / "mine.h5") as a, h5py.File(out / "shard-00000.h5") as b:
            np.testing.assert_array_equal(a["x"][:4], b["x"][:])     # values copied as they are
    m = write_dataset(str(tmp_path / "cosmo"), CosmoflowSource(4, 8, 1, 0), shard_counts(4, 1),
                      progress=False)
    assert m.transform == "log1p" == read_manifest(tmp_path / "cosmo").transform


def test_older_manifests_and_auto(tmp_path):
    m = write_dataset(str(tmp_path / "cosmo"), CosmoflowSource(4, 8, 1, 0), shard_counts(4, 1),
                      progress=False)
    path = tmp_path / "cosmo" / "manifest.json"
    doc = json.loads(path.read_text())
    del doc["transform"]                                  # written before the field existed
    path.write_text(json.dumps(doc))
    assert read_manifest(tmp_path / "cosmo").transform == "log1p"
    doc["source"] = {"file": "theirs.h5"}
    path.write_text(json.dumps(doc))
    assert read_manifest(tmp_path / "cosmo").transform == "none"
    doc["transform"] = "sqrt"
    path.write_text(json.dumps(doc))
    with pytest.raises(DataError, match="field 'transform' is 'sqrt'"):
        read_manifest(tmp_path / "cosmo")
    resolve = VolumeWorkload.resolve_transform
    assert resolve({"transform": "auto"}, m) == "log1p"
    m.transform = "none"
    assert resolve({"transform": "auto"}, m) == "none"
    assert resolve({"transform": "log1p"}, m) == "log1p"
    assert resolve({"transform": "auto"}, None) == "log1p"       # in-memory CosmoFlow data


def test_user_volumes_train_without_log1p(tmp_path):
    _user_file(tmp_path / "mine.h5")
    assert _hpcpar("data", "shard", "mine.h5", "ds", "--samples-per-shard", 4, "--quiet",
                   cwd=tmp_path).returncode == 0
    (tmp_path / "job.toml").write_text(
        '[model]\nkind = "cosmoflow"\nn_conv_blocks = 1\nbase_filters = 2\ndense = [4]\n'
        '[data]\npath = "ds"\n[train]\nsteps = 2\nglobal_batch = 2\n')
    p = _hpcpar("run", "job.toml", "-n", 1, "--run-dir", "run", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["transform"] == "none" and meta["job"]["data"]["transform"] == "auto"
    assert math.isfinite(json.loads((tmp_path / "run" / "metrics.json").read_text())
                         ["final_train_loss"])
