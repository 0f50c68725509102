"""examples/train_script.py: a user's own loop (ProcessGrid, spatialize, DDP,
ShardedVolumeDataset, RunRecorder) in at most 40 lines runs on 2 ranks and leaves records that
``hpcpar report`` reads."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

from hpcpar.data import CosmoflowSource, shard_counts, write_dataset
from hpcpar.launch.mpiexec import find_mpiexec

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_script.py"


def test_train_script_records_feed_report(tmp_path):
    assert len(SCRIPT.read_text().splitlines()) <= 40
    data = tmp_path / "c16"
    write_dataset(str(data), CosmoflowSource(samples=8, size=16, channels=4, seed=0),
                  shard_counts(8, shards=2), progress=False)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([find_mpiexec(), "-n", "2", sys.executable, str(SCRIPT), str(data),
                    str(tmp_path / "run")], env=env, check=True, timeout=300)
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["status"] == "ok" and meta["grid_spec"] == "1x2x1x1"
    steps = pd.read_parquet(tmp_path / "run" / meta["steps_file"])
    assert sorted(steps["rank"].unique()) == [0, 1]
    assert list(steps.groupby("rank").size()) == [4, 4]      # 2 epochs x 2 steps
    by_step = steps.pivot(index="step", columns="rank", values="loss")
    assert (by_step[0] == by_step[1]).all()                  # one replica, the same loss
    p = subprocess.run([sys.executable, "-m", "hpcpar.cli", "report", str(tmp_path / "run"),
                        "-o", str(tmp_path / "rep")], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    rows = list(csv.DictReader((tmp_path / "rep" / "scaling.csv").open()))
    assert [(r["config"], r["ranks"], r["grid"]) for r in rows] == [("script", "2", "1x2x1x1")]
