"""A resume runs the settings it reports (issue 67, items 1-3), through real ``hpcpar run``
processes: after ``--from`` another run's checkpoint or ``--new-settings`` the job's lr,
betas, weight decay, momentum and schedule are in force (the checkpoint's optimizer state is
loaded, its settings are not), and the step records' ``lr`` column says so; a checkpoint that
leaves nothing to train is one line; a resume on replaced data is refused unless
``--new-settings``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from hpcpar.launch.submit import run_dir_state
from tests.support.cli_run import micro_job_toml, tree_hashes

CLI = [sys.executable, "-m", "hpcpar.cli"]
JOB = micro_job_toml("rs", train="lr = 0.004", checkpoint="every = 1\nkeep = 10")

#: the step of each segment in which the STOPPER stops (default 2; 0: never)
STOP = "RESUME_SETTINGS_STOP_AT"
#: CosmoFlow whose rank 0 asks itself to stop (SIGUSR1) during the 2nd step of each segment:
#: the run checkpoints after it and exits 3, a preempted run to resume
STOPPER = f'''
import os
import signal

from hpcpar.run.workloads.volume import CosmoFlowWorkload


class StopAfterTwo(CosmoFlowWorkload):
    def forward_loss(self, model, batch):
        self.calls = getattr(self, "calls", 0) + 1
        if str(self.calls) == os.environ.get("{STOP}", "2") and self.grid.rank == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        return super().forward_loss(model, batch)
'''


def _hpcpar(*args, cwd=None, stop: int | None = None):
    env = dict(os.environ, **({STOP: str(stop)} if stop is not None else {}))
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


def _ok(r, code: int = 0):
    assert r.returncode == code and "Traceback" not in r.stderr, r.stderr
    return r


def _error_line(r) -> str:
    """The run failed with exit code 2 and one error line, no traceback."""
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("hpcpar: error: "), r.stderr
    return errors[0]


def _ckpt(run: Path, step: int, name: str) -> dict:
    return torch.load(run / "checkpoints" / f"step-{step:06d}" / name, weights_only=True)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _steps(run: Path) -> pd.DataFrame:
    return pd.read_parquet(run / "steps.parquet").sort_values("step").reset_index(drop=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A finished 4-step Adam run at lr 0.004 with a checkpoint at every step."""
    root = tmp_path_factory.mktemp("settings")
    (root / "j.toml").write_text(JOB)
    _ok(_hpcpar("run", root / "j.toml", "-n", "1", "--run-dir", root / "a"))
    return root


def test_an_lr_changed_on_resume_is_the_lr_the_steps_use(base, tmp_path):
    """Resumed from step 2 at lr 0.002: steps 3-4 equal, bit for bit, a run whose schedule
    halves the lr at step 2 (lr 0.004 x 0.5, exact); the old run (0.004 throughout) differs."""
    a = base / "a"
    b, c = tmp_path / "b", tmp_path / "c"
    r = _ok(_hpcpar("run", base / "j.toml", "-n", "1", "--run-dir", b, "--set", "train.lr=0.002",
                    "--from", a / "checkpoints" / "step-000002"))
    assert "step-000002 at step 2" in r.stderr, r.stderr
    _ok(_hpcpar("run", base / "j.toml", "-n", "1", "--run-dir", c, "--set",
                "train.lr_schedule='step'", "--set", "train.lr_step_every=2", "--set",
                "train.lr_gamma=0.5"))
    assert _equal(_ckpt(b, 4, "model.pt"), _ckpt(c, 4, "model.pt"))
    assert not _equal(_ckpt(b, 4, "model.pt"), _ckpt(a, 4, "model.pt"))
    sb, sc, sa = _steps(b), _steps(c), _steps(a)
    assert sb["lr"].tolist() == [0.002, 0.002] and sa["lr"].tolist() == [0.004] * 4
    assert sc["lr"].tolist() == [0.004, 0.004, 0.002, 0.002]
    assert sb["loss"].tolist() == sc["loss"].tolist()[2:]      # the same steps, the same losses
    assert sb["loss"].iloc[1] != sa["loss"].iloc[3]            # step 4 after the first at 0.002


def test_the_jobs_optimizer_settings_are_in_force_after_a_resume(base, tmp_path):
    """beta1 and weight decay (Adam, --from another run), momentum (SGD, --new-settings in
    the run's own directory): the optimizer the resumed steps ran is the job's."""
    r = tmp_path / "r"
    _ok(_hpcpar("run", base / "j.toml", "-n", "1", "--run-dir", r, "--set", "train.beta1=0.5",
                "--set", "train.weight_decay=0.25", "--from",
                base / "a" / "checkpoints" / "step-000002"))
    (group,) = _ckpt(r, 4, "trainer.pt")["optimizer"]["param_groups"]
    assert tuple(group["betas"]) == (0.5, 0.999) and group["weight_decay"] == 0.25, group
    assert group["lr"] == 0.004 and group["initial_lr"] == 0.004, group
    assert not _equal(_ckpt(r, 4, "model.pt"), _ckpt(base / "a", 4, "model.pt"))

    sgd = ["run", base / "j.toml", "-n", "1", "--run-dir", tmp_path / "s", "--set",
           "train.optimizer='sgd'", "--set", "train.momentum=0.9", "--set", "train.lr=0.0625"]
    _ok(_hpcpar(*sgd, "--set", "train.steps=2"))
    r = _ok(_hpcpar(*sgd[:-2], "--set", "train.momentum=0.25", "--set", "train.lr=0.015625",
                    "--new-settings"))
    assert "train.lr 0.0625 -> 0.015625, train.momentum 0.9 -> 0.25" in r.stderr, r.stderr
    (group,) = _ckpt(tmp_path / "s", 4, "trainer.pt")["optimizer"]["param_groups"]
    assert group["momentum"] == 0.25 and group["lr"] == 0.015625, group
    assert _steps(tmp_path / "s")["lr"].tolist() == [0.0625, 0.0625, 0.015625, 0.015625]


def test_a_cosine_schedule_extended_on_resume_keeps_training(tmp_path):
    """Cosine over 4 steps ends at lr 0; extended to 8 with --new-settings, steps 5-8 run at
    the lr of cosine over 8 steps (not the old schedule's 0) and change the weights."""
    (tmp_path / "j.toml").write_text(JOB.replace("lr = 0.004", "lr = 0.004\n"
                                                 "lr_schedule = \"cosine\""))
    run = tmp_path / "cos"
    _ok(_hpcpar("run", tmp_path / "j.toml", "-n", "1", "--run-dir", run))
    _ok(_hpcpar("run", tmp_path / "j.toml", "-n", "1", "--run-dir", run, "--set",
                "train.steps=8", "--new-settings"))
    assert not _equal(_ckpt(run, 8, "model.pt"), _ckpt(run, 4, "model.pt"))
    lr = _steps(run)["lr"].tolist()
    assert len(lr) == 8 and all(v > 0 for v in lr[4:]), lr
    assert lr[4] == pytest.approx(0.004 * 0.5, rel=1e-12), lr    # cosine over 8, at step 4


def test_a_checkpoint_with_nothing_left_to_train_is_one_line(base, tmp_path):
    """--from a checkpoint at or past the job's last step, or --new-settings lowering the
    steps below the run's checkpoint: refused, the directories unchanged; with [train]
    epochs (the step count known to the ranks only) the ranks refuse alike."""
    step4 = base / "a" / "checkpoints" / "step-000004"
    job = base / "j.toml"
    line = _error_line(_hpcpar("run", job, "-n", "1", "--run-dir", tmp_path / "p",
                               "--set", "train.steps=2", "--from", step4))
    assert "checkpoint of step 4, past the job's last step 2" in line, line
    line = _error_line(_hpcpar("run", job, "-n", "1", "--run-dir", tmp_path / "q",
                               "--from", step4))
    assert "checkpoint of step 4, at the job's last step 4" in line, line
    assert not (tmp_path / "p").exists() and not (tmp_path / "q").exists()

    run = tmp_path / "a"
    shutil.copytree(base / "a", run)
    before = tree_hashes(run)
    line = _error_line(_hpcpar("run", job, "-n", "1", "--run-dir", run, "--set",
                               "train.steps=2", "--new-settings"))
    assert "step-000004: checkpoint of step 4, past the job's last step 2" in line, line
    assert tree_hashes(run) == before

    (tmp_path / "e.toml").write_text(JOB.replace("steps = 4", "epochs = 1"))   # 4 steps
    line = _error_line(_hpcpar("run", tmp_path / "e.toml", "-n", "1", "--run-dir",
                               tmp_path / "e", "--from", step4))
    assert "at the job's last step 4 ([train] epochs = 1): nothing to train" in line, line
    assert not (tmp_path / "e" / "metrics.json").exists()


def test_a_resume_on_replaced_data_is_refused(tmp_path):
    """meta.json records the dataset's manifest checksum; a dataset replaced between
    segments is refused in one line (nothing changed), and --new-settings continues on it."""
    for name, seed in (("ds", 1), ("other", 2)):
        _ok(_hpcpar("data", "make", "cosmoflow", tmp_path / name, "--samples", "8", "--size",
                    "8", "--channels", "1", "--shards", "2", "--seed", seed, "--quiet"))
    (tmp_path / "stopper.py").write_text(STOPPER)
    (tmp_path / "d.toml").write_text(
        JOB.replace('"cosmoflow"', '"stopper:StopAfterTwo"')
        .replace('source = "synthetic"', 'source = "hdf5"\npath = "ds"')
        .replace("samples = 8\n", ""))
    args = ["run", "d.toml", "-n", "1", "--run-dir", "r"]
    _ok(_hpcpar(*args, cwd=tmp_path), code=3)
    meta = json.loads((tmp_path / "r" / "meta.json").read_text())
    manifest = (tmp_path / "ds" / "manifest.json").read_bytes()
    assert meta["data"] == {"path": {"path": "ds", "checksum": "sha256:"
                                     + hashlib.sha256(manifest).hexdigest()}}
    shutil.rmtree(tmp_path / "ds")
    shutil.copytree(tmp_path / "other", tmp_path / "ds")
    before = tree_hashes(tmp_path / "r")
    line = _error_line(_hpcpar(*args, cwd=tmp_path))
    assert line.startswith("hpcpar: error: [data] path: 'ds' holds other data than the run in "
                           "r trained on"), line
    assert tree_hashes(tmp_path / "r") == before
    _ok(_hpcpar(*args, "--new-settings", cwd=tmp_path))
    meta = json.loads((tmp_path / "r" / "meta.json").read_text())
    assert meta["data"]["path"]["checksum"] == "sha256:" + hashlib.sha256(
        (tmp_path / "other" / "manifest.json").read_bytes()).hexdigest()


@pytest.mark.parametrize("how", ["new-settings", "from"])
def test_a_stopped_segment_with_new_settings_leaves_no_old_result(tmp_path, how):
    """A finished 4-step run continued to 6 steps (--new-settings, or --from its own step 2)
    and stopped (SIGUSR1): its metrics.json, of the old settings, does not stay as the run's
    result (the run is not "finished"); it is kept as job-<time>.metrics.json beside the old
    settings' job-<time>.json, hpcpar's own (--fresh moves it). The plain resume finishes
    with a metrics.json of its own."""
    (tmp_path / "stopper.py").write_text(STOPPER)
    (tmp_path / "j.toml").write_text(JOB.replace('"cosmoflow"', '"stopper:StopAfterTwo"'))
    run = tmp_path / "r"
    args = ["run", "j.toml", "-n", "1", "--run-dir", "r"]
    _ok(_hpcpar(*args, cwd=tmp_path, stop=0))
    old = json.loads((run / "metrics.json").read_text())
    assert old["steps"] == 4 and run_dir_state(run) == "finished"

    more = [*args, "--new-settings", "--set", "train.steps=6"]
    more += ["--from", run / "checkpoints" / "step-000002"] if how == "from" else []
    _ok(_hpcpar(*more, cwd=tmp_path, stop=1), code=3)
    assert json.loads((run / "meta.json").read_text())["status"] == "preempted"
    assert json.loads((run / "job.json").read_text())["job"]["train"]["steps"] == 6
    assert not (run / "metrics.json").exists()
    assert run_dir_state(run) != "finished", run_dir_state(run)
    (kept,) = run.glob("job-*.metrics.json")
    assert json.loads(kept.read_text()) == old
    settings = json.loads(kept.with_name(kept.name.replace(".metrics", "")).read_text())
    assert settings["job"]["train"]["steps"] == 4

    r = _ok(_hpcpar(*args, "--set", "train.steps=6", cwd=tmp_path, stop=0))
    assert "previous result" not in r.stderr, r.stderr
    assert json.loads((run / "metrics.json").read_text())["steps"] == 6
    assert json.loads(kept.read_text()) == old
    _ok(_hpcpar(*args, "--fresh", cwd=tmp_path, stop=0))
    (previous,) = run.glob("previous-*")
    assert (previous / kept.name).is_file() and not list(run.glob("job-*"))
