"""A user's own model in one file: ``[model] kind = "net.py:UNet"`` names a plain ``nn.Module``
(no hpcpar import in the file), ``hpcpar data shard --images --labels`` makes the data set from
``.npy`` volumes, and ``hpcpar run`` trains it with a loss and metrics by name and every
augmentation on; 2 ranks (1x2x1x1) give the 1-rank loss history and metrics, and the global
Dice is the single-process Dice of the trained model's predictions; a run stopped after step 2
and resumed on the other grid draws the same augmentation and gives the same step 3."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from hpcpar.errors import ConfigError
from hpcpar.formats import kinds
from hpcpar.formats.jobspec import build_job

NET = '''\
import torch
import torch.nn.functional as F
from torch import nn


def block(cin, cout):
    return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1), nn.GroupNorm(2, cout), nn.ReLU())


class UNet(nn.Module):
    def __init__(self, in_channels=1, classes=2, width=4):
        super().__init__()
        self.down = block(in_channels, width)
        self.mid = block(width, 2 * width)
        self.up = block(3 * width, width)
        self.head = nn.Conv3d(width, classes, 1)

    def forward(self, x):
        a = self.down(x)
        b = self.mid(F.max_pool3d(a, 2))
        b = F.interpolate(b, scale_factor=2, mode="trilinear", align_corners=False)
        return self.head(self.up(torch.cat([a, b], 1)))


def small_unet(width=4):
    return UNet(width=width)
'''

JOB = '''\
[grid]
data = 1
x = -1

[model]
kind = "net.py:UNet"
args = { in_channels = 1, classes = 2, width = 4 }

[data]
path = "train"
val_path = "val"
flip = true
rot90 = true
intensity_scale = 0.1
noise_std = 0.05

[train]
steps = 3
global_batch = 2
lr = 0.01
loss = "dice+ce"
metrics = ["dice", "accuracy"]
'''


def _volumes(folder, n, seed):
    rng = np.random.default_rng(seed)
    for sub in ("scans", "masks"):
        (folder / sub).mkdir(parents=True)
    for i in range(n):
        x = rng.normal(size=(16, 16, 16)).astype(np.float32)
        np.save(folder / "scans" / f"case{i}.npy", x)
        np.save(folder / "masks" / f"case{i}.npy", (x > 0.3).astype(np.uint8))


def _hpcpar(args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "hpcpar.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _dice(pred, labels):
    inter = np.sum((pred == 1) & (labels == 1))
    return 2 * inter / (np.sum(pred == 1) + np.sum(labels == 1))


@pytest.mark.timeout(600)
def test_user_unet_file_sharded_npy_one_and_two_ranks(tmp_path):
    (tmp_path / "net.py").write_text(NET)
    (tmp_path / "job.toml").write_text(JOB)
    assert len(JOB.splitlines()) <= 25 and "hpcpar" not in NET
    _volumes(tmp_path / "t", 4, 0)
    _volumes(tmp_path / "v", 2, 1)
    for out, src in (("train", "t"), ("val", "v")):
        p = _hpcpar(["data", "shard", out, "--images", f"{src}/scans/*.npy", "--labels",
                     f"{src}/masks", "--samples-per-shard", "3"], tmp_path)
        assert p.returncode == 0, p.stderr
    runs = {}
    for n, grid in ((1, "1x1x1x1"), (2, "1x2x1x1")):
        p = _hpcpar(["run", "job.toml", "-n", str(n), "--grid", grid, "--run-dir", f"r{n}"],
                    tmp_path)
        assert p.returncode == 0, p.stderr
        steps = pd.read_parquet(tmp_path / f"r{n}" / "steps.parquet")
        assert (steps.groupby("step")["loss"].nunique() == 1).all()   # global on every rank
        runs[n] = (steps[steps["rank"] == 0]["loss"].to_numpy(),
                   json.loads((tmp_path / f"r{n}" / "metrics.json").read_text()))
    np.testing.assert_allclose(runs[2][0], runs[1][0], rtol=1e-5)
    assert len(runs[1][0]) == 3
    # stopped after step 2 and resumed on the other grid: step 3 as in the uninterrupted run
    for n, grid, steps in ((2, "1x2x1x1", 2), (1, "1x1x1x1", 3)):
        p = _hpcpar(["run", "job.toml", "-n", str(n), "--grid", grid, "--run-dir", "rr",
                     "--set", f"train.steps={steps}", "--new-settings"], tmp_path)
        assert p.returncode == 0, p.stderr
    assert "resumed from step-000002 (step 2)" in p.stderr
    resumed = pd.read_parquet(tmp_path / "rr" / "steps.parquet")
    assert resumed[resumed["step"] == 2]["loss"].iloc[-1] == pytest.approx(runs[1][0][2],
                                                                          rel=1e-5)
    for key in ("val_loss", "val_dice", "val_accuracy"):
        assert runs[2][1][key] == pytest.approx(runs[1][1][key], rel=1e-5), key

    # the global Dice is the single-process Dice of the trained model on the validation set
    spec = importlib.util.spec_from_file_location("user_net", tmp_path / "net.py")
    net = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(net)
    model = net.UNet(in_channels=1, classes=2, width=4)
    ckpt = sorted((tmp_path / "r2" / "checkpoints").iterdir())[-1]
    model.load_state_dict(torch.load(ckpt / "model.pt", weights_only=True))
    model.eval()
    xs = np.stack([np.load(tmp_path / "v" / "scans" / f"case{i}.npy") for i in range(2)])
    ys = np.stack([np.load(tmp_path / "v" / "masks" / f"case{i}.npy") for i in range(2)])
    with torch.no_grad():
        pred = model(torch.from_numpy(xs[:, None])).argmax(1).numpy()
    for n in (1, 2):
        assert runs[n][1]["val_dice"] == pytest.approx(_dice(pred, ys), rel=1e-6)
        assert runs[n][1]["val_accuracy"] == pytest.approx(np.mean(pred == ys), rel=1e-6)


def _raw(kind, **train):
    return {"grid": {"data": 1, "x": 1}, "model": {"kind": kind},
            "data": {"path": "train"}, "train": {"steps": 1, **train}}


@pytest.fixture()
def model_file(tmp_path, monkeypatch):
    for module in set(kinds._BUILTIN.values()):   # the built-ins register in the real
        importlib.import_module(module)          # registry, not in this test's copy
    monkeypatch.setattr(kinds, "_REGISTRY", dict(kinds._REGISTRY))
    # "net:UNet" imports the module `net` by name: an earlier test's net.py (its folder left
    # on sys.path, its module in sys.modules) must not answer for this one
    monkeypatch.setattr(sys, "path", [p for p in sys.path
                                      if not os.path.isfile(os.path.join(p or ".", "net.py"))])
    monkeypatch.delitem(sys.modules, "net", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.py").write_text(NET + "\n\ndef workload(job, grid, device):\n    pass\n")


def test_model_kinds_resolve_to_the_builtin_workload(model_file):
    from hpcpar.run.workloads.usermodel import ModelWorkload

    for kind in ("net.py:UNet", "net.py:small_unet", "net:UNet"):
        job = build_job(_raw(kind))
        assert issubclass(kinds.get_workload(kind), ModelWorkload), kind
        assert job.train.params["loss"] == "ce" and job.model.params["args"] == {}
    # a (job, grid, device) factory stays a workload factory, not a model
    assert kinds.get_workload("net.py:workload").__name__ == "workload"
    job = build_job(_raw("net.py:UNet", loss="dice", metrics=["dice"], ignore_index=255))
    assert job.train.params["ignore_index"] == 255


@pytest.mark.parametrize("kind, train, message", [
    ("nope.py:UNet", {}, r"\[model\] kind 'nope.py:UNet': file 'nope.py' not found"),
    ("net.py:UNte", {}, r"has no attribute 'UNte' \(did you mean 'UNet'"),
    ("net.py:UNet", {"loss": "dcie"}, r"\[train\] loss: 'dcie' is not one of ce, dice"),
    ("net.py:UNet", {"metrics": ["iou"]}, r"\[train\] metrics: 'iou' is not one of"),
    ("net.py:UNet", {"loss": "mse", "class_weights": [1, 2]},
     r"\[train\] class_weights: loss 'mse' takes none"),
])
def test_model_kind_errors(model_file, kind, train, message):
    with pytest.raises(ConfigError, match=message):
        build_job(_raw(kind, **train))


def test_file_kind_from_a_run_directory_is_not_imported(model_file):
    with pytest.raises(ConfigError, match="a file path is never imported"):
        kinds.get_workload("other.py:UNet", untrusted="RUN/job.json", trust_kind=True)


def test_metric_sums_are_the_whole_set_values():
    """Metrics summed over batches equal numpy's over the concatenated set (not a mean of
    per-batch values), with ignore_index masking labels out."""
    from hpcpar.run.workloads.objectives import MetricSums

    rng = np.random.default_rng(4)
    outs = [torch.from_numpy(rng.standard_normal((n, 3, 4, 4, 4)).astype(np.float32))
            for n in (1, 3)]
    labels = [torch.from_numpy(rng.integers(0, 4, (n, 4, 4, 4))) for n in (1, 3)]   # 3: ignored
    sums = MetricSums(["dice", "accuracy"], ignore_index=3)
    for o, t in zip(outs, labels):
        sums.update(o, t)
    pred = torch.cat(outs).argmax(1).numpy()
    lab = torch.cat(labels).numpy()
    keep = lab != 3
    dice = [2 * np.sum((pred == c) & (lab == c) & keep)
            / (np.sum((pred == c) & keep) + np.sum((lab == c) & keep)) for c in (1, 2)]
    got = sums.values()
    assert got["dice"] == pytest.approx(np.mean(dice), rel=1e-12)
    assert got["accuracy"] == pytest.approx(np.mean(pred[keep] == lab[keep]), rel=1e-12)
    mae = MetricSums(["mae"])
    for o in outs:
        mae.update(o[:, :1], o[:, 1])
    diff = torch.cat(outs)
    assert mae.values()["mae"] == pytest.approx(float((diff[:, 0] - diff[:, 1]).abs().mean()),
                                                rel=1e-6)
