"""A user's own PyG model through ``hpcpar run``: ``[model] kind = "mygnn.py:Net"`` names a
plain module with a multi-head ``GATConv``, a custom ``MessagePassing`` and ``F.dropout`` (no
hpcpar import, nothing to override); 2 ranks give the 1-rank loss history (recorded: the
global loss on every rank) and accuracies."""

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("torch_geometric")

MODEL = '''\
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GATConv, MessagePassing


class MeanMix(MessagePassing):
    def __init__(self, channels):
        super().__init__(aggr="mean")
        self.lin = nn.Linear(channels, channels)

    def forward(self, x, edge_index):
        return self.propagate(edge_index, x=self.lin(x)) + x

    def message(self, x_j):
        return torch.tanh(x_j)


class Net(nn.Module):
    def __init__(self, in_channels, out_channels, hidden=8, heads=2):
        super().__init__()
        self.gat = GATConv(in_channels, hidden, heads=heads)
        self.mix = MeanMix(hidden * heads)
        self.out = nn.Linear(hidden * heads, out_channels)

    def forward(self, x, edge_index):
        x = F.dropout(x, p=0.3, training=self.training)
        x = F.elu(self.gat(x, edge_index))
        return self.out(self.mix(x, edge_index))
'''

JOB = '''\
[grid]
data = 1
x = -1

[model]
kind = "mygnn.py:Net"
args = { hidden = 8, heads = 2 }

[data]
path = "g.h5"
make = "synthetic"
nodes = 300
features = 16
classes = 4
communities = 4

[train]
steps = 5
lr = 0.01
'''


@pytest.mark.timeout(300)
def test_user_pyg_model_one_and_two_ranks(tmp_path):
    (tmp_path / "mygnn.py").write_text(MODEL)
    (tmp_path / "job.toml").write_text(JOB)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = {}
    for n in (1, 2):
        p = subprocess.run([sys.executable, "-m", "hpcpar.cli", "run", "job.toml", "-n", str(n),
                            "--run-dir", f"r{n}"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=240)
        assert p.returncode == 0, p.stderr
        steps = pd.read_parquet(tmp_path / f"r{n}" / "steps.parquet")
        assert (steps.groupby("step")["loss"].nunique() == 1).all()   # global on every rank
        runs[n] = (steps[steps["rank"] == 0]["loss"].to_numpy(),
                   json.loads((tmp_path / f"r{n}" / "metrics.json").read_text()))
    assert len(runs[1][0]) == 5
    np.testing.assert_allclose(runs[2][0], runs[1][0], rtol=1e-5)
    for key in ("train_acc", "val_acc", "test_acc", "val_loss"):
        assert runs[2][1][key] == pytest.approx(runs[1][1][key], rel=1e-5), key
