"""``hpcpar data shard OUT --images ... --labels/--targets ...``: users' own volume files (npy,
npz, h5, NIfTI and TIFF where installed) become a sharded data set with a label volume ``y``
of x's spatial shape (or per-sample targets), pairs matched by stem; a missing partner,
different sizes and bad targets are one line, exit 2; ``--size``/``--pad`` crop and pad."""

import json

import h5py
import numpy as np
import pytest

from hpcpar.data.format import read_manifest

RNG = np.random.default_rng(3)


def _pairs(tmp_path, shapes, ext="npy", save=np.save):
    (tmp_path / "img").mkdir()
    (tmp_path / "lab").mkdir()
    xs, ys = [], []
    for i, shape in enumerate(shapes):
        x = RNG.standard_normal(shape).astype(np.float32)
        y = (x > 0).astype(np.uint8)
        save(tmp_path / "img" / f"case{i}.{ext}", x)
        save(tmp_path / "lab" / f"case{i}.{ext}", y)
        xs.append(x)
        ys.append(y)
    return xs, ys


def _stored(out):
    m = read_manifest(out)
    xs, ys = [], []
    for s in m.shards:
        with h5py.File(out / s.file) as f:
            xs.append(f["x"][()])
            ys.append(f["y"][()])
    return m, np.concatenate(xs), np.concatenate(ys)


def _shard(run_cli, tmp_path, *extra, images="img/*", labels="img/../lab"):
    args = ["data", "shard", str(tmp_path / "out"), "--images", str(tmp_path / images),
            "--samples-per-shard", "2", "--quiet", *extra]
    if labels is not None:
        args += ["--labels", str(tmp_path / labels)]
    return run_cli(args)


def test_npy_pairs_become_x_and_a_label_volume(run_cli, tmp_path):
    xs, ys = _pairs(tmp_path, [(6, 5, 4)] * 3)
    code, out, err = _shard(run_cli, tmp_path)
    assert code == 0, err
    m, x, y = _stored(tmp_path / "out")
    assert m.voxel_targets and m.x.shape == (1, 6, 5, 4) and m.y.shape == (6, 5, 4)
    assert m.y.chunks is not None and len(m.shards) == 2
    np.testing.assert_array_equal(x[:, 0], np.stack(xs))
    np.testing.assert_array_equal(y, np.stack(ys))
    assert all(s.sha256 for s in m.shards)                # checksums as `data shard` records


def test_missing_partner_sizes_and_targets_are_one_line(run_cli, tmp_path):
    _pairs(tmp_path, [(6, 5, 4), (6, 5, 4), (8, 5, 4)])
    code, _, err = _shard(run_cli, tmp_path)
    assert code == 2 and err.count("\n") == 1
    assert "volumes of different sizes (6x5x4, 8x5x4); choose one with --size" in err
    (tmp_path / "lab" / "case1.npy").unlink()
    code, _, err = _shard(run_cli, tmp_path, "--size", "6x5x4")
    assert code == 2 and err.count("\n") == 1
    assert "img/case1.npy: no label file with stem 'case1' among --labels" in err
    (tmp_path / "targets.csv").write_text("name,mass\ncase0,1.5\ncase2,2\n")
    code, _, err = _shard(run_cli, tmp_path, "--size", "6x5x4", "--targets",
                          str(tmp_path / "targets.csv"), labels=None)
    assert code == 2 and "no row for image stem 'case1'" in err
    assert not (tmp_path / "out").exists()


def test_size_crops_and_pads(run_cli, tmp_path):
    xs, ys = _pairs(tmp_path, [(6, 5, 4), (8, 5, 2)])
    code, _, err = _shard(run_cli, tmp_path, "--size", "6x5x4")
    assert code == 2 and "img/case1.npy: volume 8x5x2 is smaller than --size 6x5x4 (add " \
                         "--pad" in err
    code, _, err = _shard(run_cli, tmp_path, "--size", "6x5x4", "--pad")
    assert code == 0, err
    _, x, y = _stored(tmp_path / "out")
    np.testing.assert_array_equal(x[0, 0], xs[0])
    np.testing.assert_array_equal(x[1, 0, :, :, 1:3], xs[1][1:7])     # centre crop of D
    assert (x[1, 0, :, :, [0, 3]] == 0).all() and (y[1, :, :, [0, 3]] == 0).all()   # padded W
    np.testing.assert_array_equal(y[1, :, :, 1:3], ys[1][1:7])


def test_targets_csv_npz_and_h5(run_cli, tmp_path):
    xs, _ = _pairs(tmp_path, [(2, 4, 4, 4)] * 3, "npz", lambda p, a: np.savez(p, volume=a))
    (tmp_path / "t.csv").write_text("stem,a,b\n" + "".join(f"case{i},{i},{-i}\n"
                                                           for i in (2, 0, 1)))
    code, _, err = _shard(run_cli, tmp_path, "--targets", str(tmp_path / "t.csv"), labels=None)
    assert code == 0, err
    m, x, y = _stored(tmp_path / "out")
    assert not m.voxel_targets and m.y.names == ["a", "b"] and m.x.shape == (2, 4, 4, 4)
    np.testing.assert_array_equal(x, np.stack(xs))
    np.testing.assert_array_equal(y, [[0, 0], [1, -1], [2, -2]])
    img = tmp_path / "h5img"
    img.mkdir()
    for i, a in enumerate(xs):
        with h5py.File(img / f"case{i}.h5", "w") as f:
            f["group/vol"] = a
    code, _, err = _shard(run_cli, tmp_path, "--targets", str(tmp_path / "t.csv"), "--force",
                          images="h5img", labels=None)
    assert code == 0, err
    np.testing.assert_array_equal(_stored(tmp_path / "out")[1], np.stack(xs))


def test_nifti_pairs(run_cli, tmp_path):
    nib = pytest.importorskip("nibabel")

    def save(path, a):
        nib.save(nib.Nifti1Image(a, np.eye(4)), str(path))

    xs, ys = _pairs(tmp_path, [(5, 6, 4)] * 2, "nii.gz", save)
    code, _, err = _shard(run_cli, tmp_path)
    assert code == 0, err
    m, x, y = _stored(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["y"]["shape"] == [5, 6, 4]
    np.testing.assert_array_equal(x[:, 0], np.stack(xs))
    np.testing.assert_array_equal(y, np.stack(ys))


def test_tiff_stacks(run_cli, tmp_path):
    tifffile = pytest.importorskip("tifffile")
    xs, ys = _pairs(tmp_path, [(4, 6, 5)] * 2, "tif",
                    lambda p, a: tifffile.imwrite(p, a, photometric="minisblack"))
    code, _, err = _shard(run_cli, tmp_path)
    assert code == 0, err
    _, x, y = _stored(tmp_path / "out")
    np.testing.assert_array_equal(x[:, 0], np.stack(xs))
    np.testing.assert_array_equal(y, np.stack(ys))


def test_progress_bar_in_a_log_when_asked(run_cli, tmp_path, monkeypatch):
    """A bar is for a terminal; a log or a pipe gets the closing line only, or the bar too
    with HPCPAR_PROGRESS=1 (a Slurm job's log, a supervisor watching the pipe)."""
    _pairs(tmp_path, [(6, 5, 4)] * 3)
    args = ["data", "shard", str(tmp_path / "out"), "--images", str(tmp_path / "img"),
            "--labels", str(tmp_path / "lab"), "--samples-per-shard", "2", "--force"]
    monkeypatch.delenv("HPCPAR_PROGRESS", raising=False)
    code, out, err = run_cli(args)
    assert code == 0 and "writing out" not in err and out.startswith("wrote "), (out, err)
    monkeypatch.setenv("HPCPAR_PROGRESS", "1")
    code, out, err = run_cli(args)
    assert code == 0 and out.startswith("wrote "), err
    assert "writing out: 100%" in err and "3/3" in err, err
