"""Issue 16, job and records side: job validation (`hpcpar run --dry-run`), a dataset that does
not match the job (`hpcpar run`, one rank), and a disk that fills up while records are
written. Each case checks the exit code, the one-line message (no traceback) and that nothing
the user had changed."""

import errno
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpcpar.errors import RunDirError
from hpcpar.formats import records
from hpcpar.formats.jobspec import load_job
from tests.support.faults import can_mount

JOB = """[job]
name = {name}
[grid]
data = 1
x = 1
[model]
kind = "cosmoflow"
n_conv_blocks = {blocks}
base_filters = 2
dense = [4]
[data]
{data}
[train]
steps = {steps}
global_batch = 2
lr = {lr}
log_every = 1000
[checkpoint]
at_end = false
"""


def job_file(where: Path, name='"tiny"', blocks=1, data='path = "ds"', steps=3, lr="1e-3"):
    path = where / "job.toml"
    path.write_text(JOB.format(name=name, blocks=blocks, data=data, steps=steps, lr=lr))
    return path


def snapshot(root) -> dict:
    """{relative path: sha256} of every file below ``root``."""
    root = Path(root)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def one_error(err: str) -> str:
    """The single ``hpcpar: error:`` line of stderr (info lines allowed, no traceback)."""
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("hpcpar: error: ")]
    assert len(errors) == 1, err
    return errors[0]


# -- job validation -------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("nan", "[train] lr: expected a finite number, got nan"),
    ("inf", "[train] lr: expected a finite number, got inf"),
    ("-inf", "[train] lr: expected a finite number, got -inf"),
    ("-0.1", "[train] lr: -0.1 is out of range (must be >= 0.0)"),
], ids=["nan", "inf", "-inf", "negative"])
def test_lr_not_finite_or_negative(run_cli, tmp_path, monkeypatch, text, message):
    monkeypatch.chdir(tmp_path)
    job = job_file(tmp_path, lr=text)
    before = snapshot(tmp_path)
    code, out, err = run_cli(["run", str(job), "--dry-run"])
    assert code == 2 and out == ""
    assert one_error(err) == f"hpcpar: error: {job}: {message}"
    code, _, err = run_cli(["run", str(job), "--dry-run", "--set", "train.lr=0.01",
                            "--set", f"model.dropout={text}"])
    assert code == 2 and "[model] dropout: " in one_error(err)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ['"../../escape"', '"a/b"', '".."', '".hidden"', '"-rf"',
                                  '""'])
def test_job_name_cannot_leave_runs(run_cli, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    job = job_file(tmp_path, name=name)
    before = snapshot(tmp_path)
    code, out, err = run_cli(["run", str(job), "--dry-run"])
    assert code == 2 and out == ""
    line = one_error(err)
    assert line.startswith(f"hpcpar: error: {job}: [job] name: ")
    assert line.endswith("must be one plain name (no '/', not starting with '.' or '-'): the "
                         "default run directory under runs/ is made from it")
    assert snapshot(tmp_path) == before and not (tmp_path.parent / "escape").exists()


def test_default_name_from_file_is_made_safe(tmp_path):
    path = tmp_path / "my job (v2).toml"
    path.write_text(job_file(tmp_path, name='"x"').read_text().replace('name = "x"\n', ""))
    assert load_job(str(path)).name == "my-job-v2-"


# -- the dataset against the job (hpcpar run, 1 rank) ---------------------------------------
@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, cli_main):
    """A directory holding dataset ``ds`` (8 samples of 4 x 8^3) made by the CLI."""
    root = tmp_path_factory.mktemp("data")
    with pytest.raises(SystemExit) as exc:
        cli_main(["data", "make", "cosmoflow", str(root / "ds"), "--samples", "8", "--size", "8",
              "--shards", "2", "--quiet"])
        raise SystemExit(0)
    assert not exc.value.code
    return root


def hpcpar_run(cwd, *args, private_mounts=None, timeout=120):
    """(exit code, stderr) of ``hpcpar run`` in a fresh process. ``private_mounts``: a shell
    line run instead, in a private mount namespace (``unshare -m``: its mounts are invisible
    outside and vanish with it), that runs ``$HPCPAR`` itself."""
    cmd = [sys.executable, "-m", "hpcpar.cli", "run", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if private_mounts:
        env["HPCPAR"] = subprocess.list2cmdline(cmd)
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", private_mounts]
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stderr


@pytest.mark.parametrize("data, message", [
    ('path = "ds"\nsize = 16', "ds/manifest.json ([data] path): field 'x.shape' is 4x8x8x8 "
     "(volume 8x8x8), but the job's [data] size = 16 (16^3)"),
    ('path = "ds"\nchannels = 2', "ds/manifest.json ([data] path): field 'x.shape' is 4x8x8x8 "
     "(4 channels), but the job's [data] channels = 2"),
    ('path = "ds"\nn_conv_blocks_too_deep = true', "ds/manifest.json ([data] path): field "
     "'x.shape' is 4x8x8x8: [model] n_conv_blocks: 4 pooling blocks need a volume of at least "
     "16"),
    ('path = "ds"\nval_samples = 2', "[data] val_samples = 2: the validation set 'ds-val' "
     "([data] path + '-val', made by generate = true) is missing: set generate = true, or give "
     "[data] val_path instead"),
    ('path = "ds"\nval_path = "val/ds"', "[data] val_path: 'val/ds': dataset not found "
     "(working directory {cwd})"),
    ('path = "nope"', "[data] path: 'nope': dataset not found (working directory {cwd})"),
], ids=["size", "channels", "model-too-deep", "val-samples-no-dir", "val-path", "path"])
def test_dataset_does_not_match_job(data_dir, tmp_path, data, message):
    work = tmp_path / "w"
    shutil.copytree(data_dir, work)
    deep = "n_conv_blocks_too_deep = true" in data
    job = job_file(work, blocks=4 if deep else 1,
                   data=data.replace("\nn_conv_blocks_too_deep = true", ""))
    before = snapshot(work)
    code, err = hpcpar_run(work, str(job), "-n", "1", "--run-dir", "rd")
    assert code == 2
    assert one_error(err) == f"hpcpar: error: [rank 0] {message.format(cwd=work)}"
    after = snapshot(work)
    assert {k: v for k, v in after.items() if not k.startswith("rd/")} == before


# -- a full disk while records are written ---------------------------------------------------
def test_records_write_failure_leaves_whole_lines(tmp_path, monkeypatch):
    """A short write followed by ENOSPC: one RunDirError naming the file, no chained
    exception, the file cut back to its last complete line; later steps append cleanly."""
    rec = records.RunRecorder(tmp_path, None, {"job_name": "full"})
    rec.step(step=0, t_step=1.0)
    good = rec.path.read_bytes()
    real, calls = os.write, []

    def full_disk(fd, data):
        if fd != rec._fd:
            return real(fd, data)
        calls.append(len(data))
        if len(calls) == 1:
            return real(fd, bytes(data[:7]))  # a short write: part of the line is on disk
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(RunDirError) as exc:
        rec.step(step=1, t_step=1.0)
    monkeypatch.undo()
    assert str(exc.value) == (f"{rec.path}: cannot write step records (No space left on "
                              f"device); the records up to the last complete step are kept")
    assert exc.value.__suppress_context__ and exc.value.__cause__ is None
    assert len(calls) == 2 and rec.path.read_bytes() == good
    rec.step(step=1, t_step=2.0)  # space freed: the run could go on
    rec.close()
    df = records.read_rank_file(rec.path, notes := [])
    assert list(df["step"]) == [0, 1] and list(df["t_step"]) == [1.0, 2.0] and notes == []




@pytest.mark.skipif(not can_mount(), reason="needs root and mount namespaces (unshare -m)")
def test_full_disk_during_a_run(tmp_path):
    """`hpcpar run` whose records directory is a 4 KiB tmpfs (in a private mount namespace,
    gone with the process): the run stops with one line naming the file, exit 2, and the
    records it kept end with a complete line."""
    (tmp_path / "rd" / "records").mkdir(parents=True)
    job = job_file(tmp_path, data='source = "synthetic"\nsize = 4\nsamples = 4', steps=400)
    job.write_text(job.read_text().replace("global_batch = 2", "global_batch = 1"))
    code, err = hpcpar_run(
        tmp_path, private_mounts="mount -t tmpfs -o size=4k hpcpar-full rd/records && $HPCPAR "
        f"{job} -n 1 --run-dir rd; rc=$?; cp rd/records/rank-00000.csv kept.csv; exit $rc")
    assert f" {tmp_path}/" not in Path("/proc/mounts").read_text()  # nothing leaked out
    assert code == 2
    assert one_error(err) == ("hpcpar: error: [rank 0] rd/records/rank-00000.csv: cannot write "
                              "step records (No space left on device); the records up to the "
                              "last complete step are kept")
    kept = (tmp_path / "kept.csv").read_bytes()
    assert kept.endswith(b"\n") and len(kept) > 3000
    df = records.read_rank_file(tmp_path / "kept.csv", notes := [])
    assert notes == [] and list(df["step"]) == list(range(len(df))) and len(df) > 10
