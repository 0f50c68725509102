"""``hpcpar predict`` beside MONAI's ``sliding_window_inference`` (issue 63, item 3).

The same trained demo UNet3D (``jobs/demo-unet3d.toml``, trained here for ``--train-steps``
steps unless ``--run`` names a run directory) and the same random volume (``--size``^3):

* ``whole``: the plain model's forward on the whole volume in one process: the reference;
* ``monai``: ``sliding_window_inference`` (``--roi``^3 windows, ``--overlap``, constant
  blending) in one process with as many torch threads as hpcpar has ranks (the same cores);
* ``hpcpar``: ``hpcpar predict RUN -n RANKS`` (the volume split along D, one thread a rank).

Each runs in its own process, alternating, ``--reps`` times (the best wall time is kept).
Printed per method: max |difference| against ``whole``, wall time of the inference itself
(model loaded, inputs read, outputs written or kept; no interpreter start), peak resident
memory per rank (``ru_maxrss``), then the ratio line hpcpar / MONAI.

    python benchmarks/predict.py                    # trains the demo briefly, 48^3, 2 ranks
    python benchmarks/predict.py --run runs/demo-unet3d --size 96 --ranks 2 --reps 3

On a shared machine the times are indicative only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _cli(args: list, env: dict | None = None) -> None:
    cmd = [sys.executable, "-m", "hpcpar.cli", *map(str, args)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}")


def train(work: Path, steps: int) -> Path:
    """The demo UNet3D trained for ``steps`` steps on 2 ranks (1x2x1x1)."""
    run = work / "run"
    _cli(["run", ROOT / "jobs" / "demo-unet3d.toml", "-n", 2, "--grid", "1x2x1x1",
          "--run-dir", run, "--set", f"train.steps={steps}", "--set", f"checkpoint.every={steps}"])
    return run


def one(method: str, run: str, data: str, out: str, roi: int, overlap: float,
        threads: int) -> dict:
    """(In a fresh process) ``whole`` or ``monai``: the output to ``out`` (npy), the wall
    time of the inference and the peak memory."""
    import torch

    from hpcpar.run.predict_model import load_model

    torch.set_num_threads(threads)
    model, channels = load_model(run, None, None)
    start = time.perf_counter()
    with h5py.File(data, "r") as f:
        x = torch.from_numpy(f["x"][()][:, :channels])
    with torch.inference_mode():
        if method == "whole":
            y = model(x)
        else:
            from monai.inferers import sliding_window_inference

            y = sliding_window_inference(x, (roi,) * 3, 1, model, overlap=overlap)
    np.save(out, y.numpy())
    return {"wall_s": time.perf_counter() - start,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _spawn(method: str, a, data: Path, work: Path) -> dict:
    out = work / f"{method}.npy"
    cmd = [sys.executable, __file__, "--one", method, "--run", str(a.run), "--data", str(data),
           "--out", str(out), "--roi", str(a.roi), "--overlap", str(a.overlap),
           "--threads", str(a.ranks)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{method} failed:\n{done.stderr[-2000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "y": np.load(out)}


def _hpcpar(a, data: Path, work: Path) -> dict:
    out = work / "hpcpar.h5"
    _cli(["predict", a.run, "--data", data, "--out", out, "-n", a.ranks, "--force"],
         env=dict(os.environ, OMP_NUM_THREADS="1"))
    with h5py.File(out, "r") as f:
        record = json.loads(f.attrs["hpcpar_predict"])
        y = f["y"][()]
    return {"wall_s": record["wall_s"], "peak_rss": record["peak_rss_bytes_max"], "y": y}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=None, help="a trained unet3d run directory")
    ap.add_argument("--train-steps", type=int, default=6)
    ap.add_argument("--size", type=int, default=48)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--roi", type=int, default=32)
    ap.add_argument("--overlap", type=float, default=0.25)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--work", default=None)
    ap.add_argument("--one", choices=("whole", "monai"), help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.run, a.data, a.out, a.roi, a.overlap, a.threads)))
        return
    work = Path(a.work or tempfile.mkdtemp(prefix="hpcpar-bench-predict-"))
    work.mkdir(parents=True, exist_ok=True)
    a.run = a.run or train(work, a.train_steps)
    from hpcpar.run.predict_model import load_model

    channels = load_model(str(a.run), None, None)[1] or 1
    data = work / "volume.h5"
    with h5py.File(data, "w") as f:
        f["x"] = np.random.default_rng(0).standard_normal(
            (1, channels, a.size, a.size, a.size)).astype(np.float32)
    whole = _spawn("whole", a, data, work)
    best: dict = {}
    for _ in range(a.reps):                       # alternating, best of each
        for name, run in (("monai", lambda: _spawn("monai", a, data, work)),
                          ("hpcpar", lambda: _hpcpar(a, data, work))):
            r = run()
            if name not in best or r["wall_s"] < best[name]["wall_s"]:
                best[name] = r
    print(f"volume {a.size}^3 x {channels}, model {a.run}, {a.ranks} ranks / threads, "
          f"MONAI roi {a.roi}^3 overlap {a.overlap}, best of {a.reps}")
    print(f"{'method':<8} {'max|diff| vs whole':>20} {'wall s':>9} {'peak MiB/rank':>14}")
    for name, r in (("whole", whole), *best.items()):
        diff = float(np.abs(r["y"].astype(np.float64) - whole["y"]).max())
        print(f"{name:<8} {diff:>20.3g} {r['wall_s']:>9.3f} {r['peak_rss'] / 2**20:>14.0f}")
    ratio = best["hpcpar"]["wall_s"] / best["monai"]["wall_s"]
    print(f"ratio hpcpar / monai wall time: {ratio:.2f} (issue target <= 0.7)")


if __name__ == "__main__":
    main()
