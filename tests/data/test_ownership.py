"""Issue 35, data side: ``data make --force`` replaces only a dataset hpcpar made, never a
user's folder, the working directory or home; every path a dataset manifest names stays inside
the dataset (verify, reading, staging); ``verify`` refuses a shard without its checksum and
datasets whose data live outside the checksummed shard. Real CLI processes, real HDF5 files."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from hpcpar.data.format import MANIFEST, read_manifest, sha256_file
from hpcpar.data.staging import stage_shards
from hpcpar.data.writer import SerialComm
from hpcpar.errors import DataError


def hpcpar(*args, cwd, env=None):
    """(exit code, stdout, stderr) of the ``hpcpar`` CLI run as its own process."""
    p = subprocess.run([sys.executable, "-m", "hpcpar.cli", *map(str, args)], cwd=cwd,
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, **(env or {})))
    return p.returncode, p.stdout, p.stderr


def make(out, *extra, cwd, env=None):
    return hpcpar("data", "make", "cosmoflow", out, "--samples", "4", "--size", "4",
                  "--channels", "1", "--shards", "2", "--quiet", *extra, cwd=cwd, env=env)


def one_error(err: str) -> str:
    """The single stderr line of a user error (no traceback, nothing else)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("hpcpar: error: "), err
    return lines[0]


def snapshot(root) -> dict:
    """{relative path: sha256} of every file and folder below ``root``."""
    root = Path(root)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "dir" for p in sorted(root.rglob("*"))}


def user_folder(path: Path) -> Path:
    (path / "sub").mkdir(parents=True)
    (path / "important.txt").write_text("years of work\n")
    (path / "sub" / "notes.md").write_text("more\n")
    return path


@pytest.fixture
def dataset(tmp_path):
    rc, _, err = make("ds", cwd=tmp_path)
    assert rc == 0, err
    return tmp_path / "ds"


def edit_manifest(ds: Path, change) -> None:
    doc = json.loads((ds / MANIFEST).read_text())
    change(doc)
    (ds / MANIFEST).write_text(json.dumps(doc))


def test_force_refuses_a_folder_that_is_not_a_dataset(tmp_path):
    victim = user_folder(tmp_path / "victim")
    before = snapshot(victim)
    rc, _, err = make(victim, "--force", cwd=tmp_path)
    assert rc == 2
    assert "victim: not an hpcpar dataset" in one_error(err) and "--force" in err
    assert snapshot(victim) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim"]  # no partial left


def test_force_refuses_the_working_directory_its_parents_and_home(tmp_path, dataset):
    work = user_folder(tmp_path / "work")
    home = tmp_path / "home"
    shutil.copytree(dataset, home)  # even a real dataset is not replaced when it is home
    before = snapshot(tmp_path)
    for target, what in ((".", "the working directory"), (tmp_path, "the working directory"),
                         (home, "the home directory")):
        rc, _, err = make(target, "--force", cwd=work, env={"HOME": str(home)})
        assert rc == 2 and f"is {what} or contains it" in one_error(err), (target, err)
        assert snapshot(tmp_path) == before


def test_force_replaces_a_dataset_but_not_files_put_into_it(tmp_path, dataset):
    old = read_manifest(dataset)
    rc, _, err = make(dataset, "--force", "--seed", "1", cwd=tmp_path)
    assert rc == 0, err
    assert read_manifest(dataset).shards[0].sha256 != old.shards[0].sha256  # replaced
    (dataset / "analysis.ipynb").write_text("{}")
    before = snapshot(dataset)
    rc, _, err = make(dataset, "--force", cwd=tmp_path)
    assert rc == 2
    assert "holds 'analysis.ipynb' besides the dataset's own files" in one_error(err)
    assert snapshot(dataset) == before


def test_empty_data_path_is_refused_when_the_job_is_validated(tmp_path):
    user_folder(tmp_path)
    (tmp_path / "job.toml").write_text(
        '[model]\nkind = "cosmoflow"\nn_conv_blocks = 2\nbase_filters = 4\ndense = [16]\n'
        '[data]\nsource = "hdf5"\npath = ""\ngenerate = true\nsize = 16\n'
        '[train]\nsteps = 2\nglobal_batch = 4\n')
    before = snapshot(tmp_path)
    rc, _, err = hpcpar("run", "job.toml", "--dry-run", cwd=tmp_path)
    assert rc == 2
    assert one_error(err) == ("hpcpar: error: job.toml: [data] path: empty; give the dataset "
                              "directory (or a .h5 file)")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("where", ["escape", "absolute"])
def test_manifest_shard_path_must_stay_inside_the_dataset(tmp_path, dataset, where):
    outside = tmp_path / "evil.h5"
    os.rename(dataset / "shard-00000.h5", outside)  # a valid shard, checksum and all
    name = "../evil.h5" if where == "escape" else str(outside)
    edit_manifest(dataset, lambda d: d["shards"][0].update(file=name))
    for cmd in ("verify", "info"):
        rc, out, err = hpcpar("data", cmd, dataset, cwd=tmp_path)
        assert rc == 2 and not out, (cmd, out, err)
        line = one_error(err)
        assert f"{dataset / MANIFEST}: field 'shards[0].file' is {name!r}" in line, line


def test_staging_never_writes_outside_stage_to(tmp_path, dataset):
    m = read_manifest(dataset)
    evil = tmp_path / "evil.h5"
    shutil.copyfile(dataset / "shard-00000.h5", evil)
    m.shards[0].file = "../evil.h5"  # a manifest object a caller built, not read from disk
    node = tmp_path / "node"
    stage = node / "stage"
    with pytest.raises(DataError, match=r"field 'shards\[0\]\.file' is '\.\./evil\.h5'"):
        stage_shards(str(dataset), m, [0, 1], str(stage), SerialComm())
    assert [p for p in node.rglob("*") if p.is_file()] == []


def test_verify_refuses_a_shard_without_its_checksum(tmp_path, dataset):
    edit_manifest(dataset, lambda d: d["shards"][1].update(sha256=""))
    rc, out, err = hpcpar("data", "verify", dataset, cwd=tmp_path)
    assert rc == 2 and "verified" not in out
    assert one_error(err) == (f"hpcpar: error: {dataset / MANIFEST}: field 'shards[1].sha256' "
                              f"is missing: shard-00001.h5 cannot be verified")


@pytest.mark.parametrize("how", ["virtual", "external link"])
def test_verify_refuses_data_that_live_outside_the_shard(tmp_path, dataset, how):
    shard = dataset / "shard-00000.h5"
    data = tmp_path / "elsewhere.h5"
    with h5py.File(shard, "r") as f:
        x, y, attrs = f["x"][()], f["y"][()], dict(f.attrs)
    with h5py.File(data, "w") as f:
        f["x"] = x
    with h5py.File(shard, "w") as f:  # same keys, shapes, dtypes and values: only x moved out
        f.attrs.update(attrs)
        f["y"] = y
        if how == "virtual":
            layout = h5py.VirtualLayout(shape=x.shape, dtype=x.dtype)
            layout[:] = h5py.VirtualSource(str(data), "x", shape=x.shape)
            f.create_virtual_dataset("x", layout)
        else:
            f["x"] = h5py.ExternalLink(str(data), "x")
    size, digest = shard.stat().st_size, sha256_file(str(shard))
    edit_manifest(dataset, lambda d: d["shards"][0].update(bytes=size, sha256=digest))
    rc, out, err = hpcpar("data", "verify", dataset, cwd=tmp_path)
    assert rc == 2 and "verified" not in out
    line = one_error(err)
    assert f"{shard}: dataset 'x' is " in line and "outside the shard file" in line, line


def test_force_checks_the_shards_sub_folders_too(tmp_path, dataset):
    """Issue 67: a shard in a sub-folder made the whole sub-folder hpcpar's, and --force
    deleted a user's file put beside the shard."""
    (dataset / "part").mkdir()
    os.rename(dataset / "shard-00000.h5", dataset / "part" / "shard-00000.h5")
    edit_manifest(dataset, lambda d: d["shards"][0].update(file="part/shard-00000.h5"))
    (dataset / "part" / "notes.md").write_text("mine\n")
    before = snapshot(dataset)
    rc, _, err = make(dataset, "--force", cwd=tmp_path)
    assert rc == 2
    assert one_error(err) == (f"hpcpar: error: {dataset}: holds 'part/notes.md' besides the "
                              f"dataset's own files; --force would delete it: move it out "
                              f"first, or choose another OUT")
    assert snapshot(dataset) == before
    (dataset / "part" / "notes.md").unlink()
    rc, _, err = make(dataset, "--force", cwd=tmp_path)        # nothing of the user's: replaced
    assert rc == 0, err
