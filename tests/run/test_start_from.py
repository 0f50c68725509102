"""Start from anything: ``hpcpar run --from CHECKPOINT`` resumes from a chosen (older, or
another run's) checkpoint, and is one line when the checkpoint is missing, damaged or of an
incompatible job; ``[train] init_from`` starts a new run from a torch-saved ``state_dict`` of
the plain model (split and tensor-parallel layers take their piece), a wrong key set is one
line unless ``init_strict = false``. Real ``hpcpar run`` subprocesses, real files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.cli_run import micro_job_toml

CLI = [sys.executable, "-m", "hpcpar.cli"]
JOB = micro_job_toml("sf")


def _hpcpar(*args):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def _error_line(r) -> str:
    """The run failed with exit code 2 and one error line, no traceback."""
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("hpcpar: error: "), r.stderr
    return errors[0]


def _model(run: Path, step: int | str) -> dict:
    name = step if isinstance(step, str) else f"step-{step:06d}"
    return torch.load(run / "checkpoints" / name / "model.pt", weights_only=True)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A finished 4-step run (train.seed = 1) with a checkpoint at every step."""
    root = tmp_path_factory.mktemp("from")
    (root / "j.toml").write_text(JOB)
    r = _hpcpar("run", root / "j.toml", "-n", "1", "--run-dir", root / "a",
                "--set", "train.seed=1")
    assert r.returncode == 0, r.stderr
    return root


def test_from_an_older_checkpoint_resumes_from_it(base, tmp_path):
    run = tmp_path / "a"
    shutil.copytree(base / "a", run)
    r = _hpcpar("run", base / "j.toml", "-n", "1", "--run-dir", run, "--set", "train.seed=1",
                "--from", run / "checkpoints" / "step-000002")
    assert r.returncode == 0, r.stderr
    assert "step-000002 at step 2" in r.stderr, r.stderr
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "step-000003.superseded" in ckpts and "step-000004.superseded" in ckpts
    # the same steps again from there: the uninterrupted run's weights, bit for bit
    assert _equal(_model(run, 4), _model(run, "step-000004.superseded"))

    # another run directory, another seed: its weights come from the chosen checkpoint
    other = tmp_path / "b"
    r = _hpcpar("run", base / "j.toml", "-n", "1", "--run-dir", other,
                "--from", base / "a" / "checkpoints" / "step-000002")
    assert r.returncode == 0, r.stderr
    assert _equal(_model(other, 4), _model(base / "a", 4))
    assert not (other / "checkpoints" / "step-000001").exists()


def test_a_checkpoint_that_cannot_resume_is_one_line(base, tmp_path):
    good = base / "a" / "checkpoints" / "step-000002"
    damaged = tmp_path / "step-000002"
    shutil.copytree(good, damaged)
    model = damaged / "model.pt"
    model.write_bytes(model.read_bytes()[:-5] + b"oops!")
    (tmp_path / "unet.toml").write_text(
        JOB.replace('"cosmoflow"', '"unet3d"').replace("n_conv_blocks = 1\n", "depth = 1\n")
        .replace("dense = [8]\n", "").replace("channels = 1", "channels = 2"))
    (tmp_path / "wide.toml").write_text(JOB.replace("dense = [8]", "dense = [16]"))
    cases = [(base / "j.toml", tmp_path / "nothing", "no such checkpoint directory"),
             (base / "j.toml", damaged, "model.pt is corrupt"),
             (tmp_path / "unet.toml", good, "kind 'cosmoflow'"),
             (tmp_path / "wide.toml", good, "does not fit this model")]
    for i, (job_file, path, words) in enumerate(cases):
        r = _hpcpar("run", job_file, "-n", "1", "--run-dir", tmp_path / f"r{i}", "--from", path)
        assert words in _error_line(r), r.stderr


def _plain_weights(path: Path, drop: str | None = None, extra: str | None = None) -> dict:
    """A state_dict of the job's plain model, as a user saves it, with fresh random values."""
    from hpcpar.models.cosmoflow import CosmoFlow

    torch.manual_seed(123)
    sd = CosmoFlow(input_size=8, in_channels=1, n_conv_blocks=1, base_filters=2,
                   dense=(8,)).state_dict()
    if drop:
        del sd[drop]
    if extra:
        sd[extra] = torch.zeros(3)
    torch.save(sd, path)
    return sd


def test_init_from_a_state_dict_starts_the_run(base, tmp_path):
    """lr = 0 keeps the weights: the run's last checkpoint is the file, read on 2 ranks that
    split the volume and the tensor-parallel head (each rank loads its piece)."""
    weights = _plain_weights(tmp_path / "w.pt")
    r = _hpcpar("run", base / "j.toml", "-n", "2", "--grid", "1x2x1x1", "--run-dir",
                tmp_path / "r", "--set", f"train.init_from='{tmp_path / 'w.pt'}'",
                "--set", "train.lr=0", "--set", "train.steps=2",
                "--set", "model.tensor_parallel=true", "--set", "model.tp_min_features=2")
    assert r.returncode == 0, r.stderr
    assert _equal(_model(tmp_path / "r", 2), weights)


def test_init_from_wrong_keys_is_one_line_unless_not_strict(base, tmp_path):
    _plain_weights(tmp_path / "w.pt", drop="head.1.bias", extra="head.9.weight")
    common = ["run", base / "j.toml", "-n", "1", "--set",
              f"train.init_from='{tmp_path / 'w.pt'}'"]
    line = _error_line(_hpcpar(*common, "--run-dir", tmp_path / "strict"))
    assert "missing 1 key (head.1.bias), unexpected 1 key (head.9.weight)" in line, line
    r = _hpcpar(*common, "--run-dir", tmp_path / "loose", "--set", "train.init_strict=false")
    assert r.returncode == 0, r.stderr
    assert "warning: [train] init_from" in r.stderr and "missing 1 key" in r.stderr
    torch.save({"weight": print}, tmp_path / "code.pt")      # pickled code: refused
    line = _error_line(_hpcpar("run", base / "j.toml", "-n", "1", "--run-dir", tmp_path / "c",
                               "--set", f"train.init_from='{tmp_path / 'code.pt'}'"))
    assert "not a plain state_dict" in line, line
