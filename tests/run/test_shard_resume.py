"""``[train] shard_optimizer``: checkpoints keep the plain single-process format, so a run
resumes sharded from an unsharded checkpoint and back; both end where the unsharded run
does. Real ``hpcpar run`` subprocesses on the tiny job (grid 1x2x1x1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from hpcpar.run.checkpoint.store import list_checkpoints
from tests.support.cli_run import tiny_job_toml

SHARD = ("--set", "train.shard_optimizer=true")


def _run(tmp: Path, run_dir: str, *args) -> str:
    r = subprocess.run([sys.executable, "-m", "hpcpar.cli", "run", tmp / "tiny.toml",
                        "--run-dir", tmp / run_dir, *map(str, args)],
                       capture_output=True, text=True, timeout=300, cwd=tmp,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert ("optimizer state sharded" in r.stderr) == (SHARD[1] in args), r.stderr
    return r.stderr


def _newest(run: Path, name: str) -> dict:
    return torch.load(list_checkpoints(run / "checkpoints")[0] / name, weights_only=True)


def test_resume_sharded_from_unsharded_and_back(tmp_path):
    (tmp_path / "tiny.toml").write_text(tiny_job_toml(steps="4", checkpoint="every = 2"))
    _run(tmp_path, "plain")                                   # the reference, 4 steps
    _run(tmp_path, "half", *SHARD, "--set", "train.steps=2")  # sharded, 2 steps
    # sharded from the plain run's step 2, and plain from the sharded run's step 2
    _run(tmp_path, "to_sharded", *SHARD, "--from", tmp_path / "plain/checkpoints/step-000002")
    _run(tmp_path, "to_plain", "--from", tmp_path / "half/checkpoints/step-000002")
    want_model = _newest(tmp_path / "plain", "model.pt")
    want_opt = _newest(tmp_path / "plain", "trainer.pt")["optimizer"]
    half = _newest(tmp_path / "half", "trainer.pt")["optimizer"]
    assert half["param_groups"] == _plain_groups(tmp_path), "not the plain format"
    for run in ("to_sharded", "to_plain"):
        model = _newest(tmp_path / run, "model.pt")
        assert model.keys() == want_model.keys()
        for k in model:   # a lost or misplaced Adam state moves a weight by ~lr = 3e-3
            torch.testing.assert_close(model[k], want_model[k], rtol=1e-5, atol=1e-6,
                                       msg=f"{run} {k}")
        opt = _newest(tmp_path / run, "trainer.pt")["optimizer"]
        assert opt["state"].keys() == want_opt["state"].keys()
        for i, st in want_opt["state"].items():   # full shapes, as one process saves them
            for key, value in st.items():
                torch.testing.assert_close(opt["state"][i][key], value, rtol=1e-4, atol=1e-7,
                                           msg=f"{run} param {i} {key}")


def _plain_groups(tmp: Path) -> list:
    return torch.load(tmp / "plain/checkpoints/step-000002/trainer.pt",
                      weights_only=True)["optimizer"]["param_groups"]
