"""Issue 16, data side: ``hpcpar data make/verify/shard`` never write or pass a dataset that
holds NaN/inf unless asked, reject unusable options with one line, and leave what the user had
untouched. Each case runs the real CLI (in this process) and checks exit code, the one-line
message and the files."""

import hashlib
import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcpar.data.format import check_finite, read_manifest, sha256_file, value_stats
from hpcpar.errors import DataError


def snapshot(root) -> dict:
    """{relative path: sha256} of every file below ``root`` (nothing the user had may change)."""
    root = Path(root)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def one_error(err: str) -> str:
    """The single stderr line of a user error (no traceback, nothing else)."""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hpcpar: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def good(tmp_path_factory, cli_main):
    """A small dataset made by the CLI (2 shards of 3 samples of 4 x 6^3)."""
    out = tmp_path_factory.mktemp("good") / "ds"
    with pytest.raises(SystemExit) as exc:
        cli_main(["data", "make", "cosmoflow", str(out), "--samples", "6", "--size", "6",
              "--shards", "2", "--quiet"])
        raise SystemExit(0)
    assert not exc.value.code
    return out


def make(run_cli, out, *opts):
    return run_cli(["data", "make", "cosmoflow", str(out), "--samples", "4", "--shards", "2",
                    "--quiet", *opts])


def test_make_size_1_is_refused_and_existing_dataset_kept(run_cli, good, tmp_path):
    code, _, err = make(run_cli, tmp_path / "new", "--size", "1")
    assert code == 2
    assert one_error(err) == ("hpcpar: error: --size: must be an integer >= 2 (a 1-voxel field "
                              "has no fluctuation modes), got 1")
    assert not (tmp_path / "new").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary directory left either
    before = snapshot(good)
    code, _, err = make(run_cli, good, "--size", "1", "--force")  # --force must not wipe it
    assert code == 2 and "--size: must be an integer >= 2" in one_error(err)
    assert snapshot(good) == before


@pytest.mark.parametrize("opts, message", [
    (("--size", "4", "--seed", "-1"), "--seed: must be an integer >= 0 (a numpy seed), got -1"),
    (("--size", "4", "--channels", "0"), "--channels: must be an integer >= 1, got 0"),
    (("--size", "0"), "--size: must be an integer >= 2"),
])
def test_make_bad_options_one_line(run_cli, tmp_path, opts, message):
    code, _, err = make(run_cli, tmp_path / "ds", *opts)
    assert code == 2 and message in one_error(err)
    assert not (tmp_path / "ds").exists()


def test_make_records_finite_stats_and_verify_scans(run_cli, good):
    m = read_manifest(str(good))
    assert m.stats["x"]["finite"] and m.stats["x"]["nonfinite"] == 0
    assert m.stats["y"]["finite"] and -1 <= m.stats["y"]["min"] <= m.stats["y"]["max"] <= 1
    assert sorted(m.stats["shards"]) == ["shard-00000.h5", "shard-00001.h5"]
    with h5py.File(good / "shard-00001.h5", "r") as f:
        x = f["x"][...]
    assert m.stats["shards"]["shard-00001.h5"]["x"]["max"] == float(x.max())
    json.loads((good / "manifest.json").read_text(), parse_constant=pytest.fail)  # strict JSON
    code, out, err = run_cli(["data", "verify", str(good)])
    assert code == 0 and out.startswith(f"ok: {good}: 2 shards, 6 samples verified, values finite")


def _poison(src: Path, dst: Path, keep_stats: bool) -> None:
    """Copy of dataset ``src`` with one NaN in sample 4 (shard 1, row 1) and a manifest whose
    sha256/bytes match (as if written by a generator that made NaN: the old --size 1 bug)."""
    import shutil

    shutil.copytree(src, dst)
    with h5py.File(dst / "shard-00001.h5", "r+") as f:
        f["x"][1, 2, 3, 4, 5] = np.nan
    d = json.loads((dst / "manifest.json").read_text())
    d["shards"][1].update(sha256=sha256_file(str(dst / "shard-00001.h5")),
                          bytes=os.path.getsize(dst / "shard-00001.h5"))
    if not keep_stats:
        del d["stats"]  # a dataset written before stats existed
    (dst / "manifest.json").write_text(json.dumps(d))


@pytest.mark.parametrize("keep_stats", [False, True])
def test_verify_catches_nan(run_cli, good, tmp_path, keep_stats):
    ds = tmp_path / "nan"
    _poison(good, ds, keep_stats)
    before = snapshot(ds)
    code, out, err = run_cli(["data", "verify", str(ds)])
    assert code == 2 and out == ""
    assert one_error(err) == (f"hpcpar: error: {ds}/shard-00001.h5: sample 4 (row 1) holds "
                              f"NaN/inf in 'x' (the manifest says the dataset is finite)")
    assert snapshot(ds) == before


def test_verify_reads_manifest_stats(run_cli, good, tmp_path):
    import shutil

    ds = tmp_path / "claims"
    shutil.copytree(good, ds)
    d = json.loads((ds / "manifest.json").read_text())
    d["stats"]["x"]["nonfinite"] = 7  # the writer counted NaN but the flag says finite
    (ds / "manifest.json").write_text(json.dumps(d))
    code, _, err = run_cli(["data", "verify", str(ds), "--no-checksum"])
    assert code == 2
    assert one_error(err) == (f"hpcpar: error: {ds}/manifest.json: field 'stats.x.nonfinite' "
                              f"is 7 (NaN/inf values), but 'stats.x.finite' says finite")


def test_shard_nan_input_refused_unless_allowed(run_cli, tmp_path):
    inp = tmp_path / "in.h5"
    x = np.ones((5, 1, 4, 4, 4), np.float32)
    x[3, 0, 1, 1, 1] = np.inf
    with h5py.File(inp, "w") as f:
        f["x"], f["y"] = x, np.zeros((5, 2), np.float32)
    before = snapshot(tmp_path)
    code, _, err = run_cli(["data", "shard", str(inp), str(tmp_path / "out"),
                            "--samples-per-shard", "2", "--quiet"])
    assert code == 2
    assert one_error(err) == (f"hpcpar: error: {inp}: sample 3: 'x' holds NaN/inf values (a "
                              f"dataset must be finite to train; --allow-nonfinite keeps them)")
    assert snapshot(tmp_path) == before  # no output, no temporary directory, input unchanged
    code, _, _ = run_cli(["data", "shard", str(inp), str(tmp_path / "out"),
                          "--samples-per-shard", "2", "--quiet", "--allow-nonfinite"])
    assert code == 0
    m = read_manifest(str(tmp_path / "out"))
    assert m.stats["x"]["finite"] is False and m.stats["x"]["nonfinite"] == 1
    assert m.stats["shards"]["shard-00001.h5"]["x"]["nonfinite"] == 1
    code, out, _ = run_cli(["data", "verify", str(tmp_path / "out")])
    assert code == 0 and "NaN/inf present as the manifest records" in out


def test_check_finite_for_the_reader(good, tmp_path):
    """The reader's run-time check: one line naming shard and global sample."""
    m = read_manifest(str(good))
    x = np.zeros((3, 4, 2, 2, 2), np.float32)
    y = np.zeros((3, 4), np.float32)
    items = [(0, 2), (1, 0), (1, 2)]  # samples 2, 3, 5
    check_finite(x, y, items, m, str(good))
    x[2, 1, 0, 0, 0] = np.nan
    with pytest.raises(DataError) as exc:
        check_finite(x, y, items, m, str(good))
    assert str(exc.value) == (f"{good}/shard-00001.h5: sample 5 (row 2) holds NaN/inf in 'x', "
                              f"but the manifest says the dataset is finite (corrupt shard? "
                              f"run `hpcpar data verify`)")
    x[2] = 0
    y[0, 1] = -np.inf
    with pytest.raises(DataError, match=r"shard-00000.h5: sample 2 \(row 2\) holds NaN/inf in 'y'"):
        check_finite(x, y, items, m, str(good))
    m.stats["y"]["finite"] = False  # NaN recorded on purpose: allowed
    check_finite(x, y, items, m, str(good))
    assert value_stats(np.array([1.0, np.nan, -2.0, np.inf])) == {"nonfinite": 2, "min": -2.0,
                                                                  "max": 1.0}


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _poke_nan(path: Path, sample: int) -> None:
    """Write NaN into one sample of a shard in place, as a bad disk or a stray writer would."""
    with h5py.File(path, "r+") as f:
        x = f["x"][sample]
        x.flat[7] = np.nan
        f["x"][sample] = x


def test_reader_refuses_a_corrupt_shard_before_training(good, tmp_path):
    """Overwritten bytes (the file still opens): the sha256 check at open names the shard;
    with verify=False the values check names shard and sample at the first batch."""
    from hpcpar import ProcessGrid
    from hpcpar.data import ShardedVolumeDataset

    ds = _copy(good, tmp_path / "ds")
    shard = ds / "shard-00001.h5"
    _poke_nan(shard, 1)
    before = snapshot(ds)
    grid = ProcessGrid()
    with pytest.raises(DataError, match=r"shard-00001\.h5: sha256 mismatch"):
        ShardedVolumeDataset(ds, grid, 2, shuffle=False, prefetch=0)
    for prefetch in (0, 2):
        data = ShardedVolumeDataset(ds, grid, 2, shuffle=False, prefetch=prefetch,
                                    verify=False)
        with pytest.raises(DataError) as exc:
            for _ in data:
                pass
        data.close()
        assert str(exc.value) == (f"{shard}: sample 4 (row 1) holds NaN/inf in 'x', but the "
                                  "manifest says the dataset is finite (corrupt shard? run "
                                  "`hpcpar data verify`)")
    assert snapshot(ds) == before
    grid.free()


def test_a_large_dataset_is_announced_before_it_is_written(tmp_path, monkeypatch, capsys):
    """Issue 32: above ANNOUNCE_BYTES (1 GB) the size is said on stderr before writing, and
    no progress bar is drawn when stderr is not a terminal (logs, pipes)."""
    from hpcpar.data import writer
    from hpcpar.data.synthetic import CosmoflowSource

    monkeypatch.setattr(writer, "ANNOUNCE_BYTES", 0)
    out = str(tmp_path / "ds")
    writer.write_dataset(out, CosmoflowSource(3, 6, 1, 0), [3], comm=writer.SerialComm())
    err = capsys.readouterr().err
    assert err.startswith(f"hpcpar: writing {out}: 3 samples, about 0.0 GB"), err
    assert "sample/s" not in err and "it/s" not in err, err     # no tqdm bar off a terminal
    monkeypatch.setattr(writer, "ANNOUNCE_BYTES", 1 << 30)
    writer.write_dataset(str(tmp_path / "small"), CosmoflowSource(3, 6, 1, 0), [3],
                         comm=writer.SerialComm())
    assert capsys.readouterr().err == ""
