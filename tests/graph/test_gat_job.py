"""``[model] kind = "gat"`` trains through ``hpcpar run`` (jobs/demo-gat-cora.toml, a few
epochs): the loss falls, and 1 and 2 ranks train alike (dropout masks follow global vertex
ids, GAT's attention is exact on the local view; float32, rtol 1e-4 on the loss history)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcpar.launch.mpiexec import rank_env

pytest.importorskip("torch_geometric")

JOB = Path(__file__).resolve().parents[2] / "jobs" / "demo-gat-cora.toml"
EPOCHS = 8


def _run(tmp_path, ranks):
    run_dir = tmp_path / f"r{ranks}"
    proc = subprocess.run([sys.executable, "-m", "hpcpar.cli", "run", str(JOB), "-n", str(ranks),
                           "--run-dir", str(run_dir), "--set", f"train.epochs={EPOCHS}",
                           "--set", "train.val_every=0", "--set", "train.log_every=1"],
                          cwd=tmp_path, env=rank_env({"OMP_NUM_THREADS": "1"}),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((run_dir / "metrics.json").read_text())


def test_gat_job_trains_through_hpcpar_run(tmp_path):
    one, two = _run(tmp_path, 1), _run(tmp_path, 2)
    losses = [loss for _, loss in two["train_loss_history"]]
    assert len(losses) == EPOCHS
    assert losses[-1] < 0.97 * losses[0], losses
    assert 0 < two["test_acc"] <= 1 and "val_acc" in two
    assert [loss for _, loss in one["train_loss_history"]] == pytest.approx(losses, rel=1e-4)
    assert os.path.exists(tmp_path / "data" / "cora.h5")  # [data] make = "cora" on first use
