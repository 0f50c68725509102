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

``--limit SIZE``: under a real per-rank memory limit (a cgroup per process or rank,
:mod:`hpcpar.testing.memlimit`; needs root), with ``--model FILE.py:Class`` (default: this
file's :class:`LimitNet`, random weights with seed 0) instead of the demo:

* the largest cubic edge (a multiple of ``--step``, at most ``--max-edge``) that ``whole`` and
  ``monai`` (one process each) and ``hpcpar predict`` (``--ranks`` ranks, slabs of
  ``--max-slab``) complete, each process or rank under the limit (a table);
* ``hpcpar predict`` on ``--check-ranks`` (4) ranks, each under the limit, on a volume whose
  input is at least ``--ratio`` (4) times the limit, compared with the whole-volume forward
  run in one process without a limit (in the channels-last memory format, which needs about
  three volumes of memory), chunk by chunk along D (max |diff| <= 1e-5, float32); exits 1
  when it does not hold.

Peak RSS counts the shared libraries' pages, which the cgroup charges once: a rank's RSS may
exceed the limit it ran under.

    python benchmarks/predict.py --limit 448MiB --ranks 4 --step 32   # ~15 min, 2 cores
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch
from largest_sample import completed, largest, spatial_grid

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-5      # float32: hpcpar against the one-process whole-volume forward


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


class LimitNet(torch.nn.Module):
    """The memory-limit mode's model: two 3^3 convolutions (one channel, ReLU between), so
    the halo and the slab margin matter, and small enough that a volume several times a
    rank's memory limit runs in minutes on two cores, and its unlimited one-process
    reference needs only three volumes of memory."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Conv3d(1, 1, 3, padding=1), torch.nn.ReLU(),
                                       torch.nn.Conv3d(1, 1, 3, padding=1))

    def forward(self, x):
        return self.net(x)


def one(method: str, run: str | None, data: str, out: str | None, roi: int, overlap: float,
        threads: int, model_spec: str | None = None, weights: str | None = None) -> dict:
    """(In a fresh process) ``whole``, ``monai`` or ``reference``: the output to ``out`` (npy;
    None: kept in memory only), the wall time of the inference and the peak memory.

    ``reference`` is ``whole`` in the channels-last memory format: the same forward to
    rounding, in about three volumes of memory where oneDNN's blocked copies of a one-channel
    volume take about ten (the unlimited check's reference, on a shared machine)."""
    from hpcpar.run.predict_model import load_model

    torch.set_num_threads(threads)
    model, channels = load_model(run, model_spec, weights)
    start = time.perf_counter()
    with h5py.File(data, "r") as f:
        x = torch.from_numpy(f["x"][:, :channels])
    if method == "reference":
        model = model.to(memory_format=torch.channels_last_3d)
        x = x.to(memory_format=torch.channels_last_3d)
    with torch.inference_mode():
        if method != "monai":
            y = model(x)
        else:
            from monai.inferers import sliding_window_inference

            y = sliding_window_inference(x, (roi,) * 3, 1, model, overlap=overlap)
    if out:
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


# -- under a real per-rank memory limit (--limit) ------------------------------------------
def write_volume(path: Path, edge: int, planes: int = 16) -> None:
    """A random (1, 1, edge^3) float32 volume (seed 0), written ``planes`` D-planes at a time
    so that making it never needs it whole in memory."""
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", (1, 1, edge, edge, edge), np.float32)
        for d in range(0, edge, planes):
            n = min(planes, edge - d)
            x[0, 0, d:d + n] = rng.standard_normal((n, edge, edge), np.float32)


class Limited:
    """One method at one edge, every process or rank under ``a.limit`` bytes; volumes cached
    by edge under ``work``."""

    def __init__(self, a, work: Path, weights: Path):
        from hpcpar.testing.memlimit import mpiexec_wrapper

        self.a, self.work, self.weights = a, work, weights
        self.wrapper = mpiexec_wrapper(work / "mpiexec-limited", a.limit_bytes)
        self.volumes: dict[int, Path] = {}

    def volume(self, edge: int) -> Path:
        if edge not in self.volumes:
            for old in list(self.volumes):     # one volume on disk at a time
                self.volumes.pop(old).unlink()
            self.volumes[edge] = self.work / f"volume-{edge}.h5"
            write_volume(self.volumes[edge], edge)
        return self.volumes[edge]

    def command(self, method: str, ranks: int, data: Path, out: Path) -> tuple[list, dict]:
        """The command that runs ``method`` under the limit, and its environment."""
        limited = [sys.executable, "-m", "hpcpar.testing.memlimit", "--limit",
                   str(self.a.limit_bytes), "--"]
        env = dict(os.environ, OMP_NUM_THREADS="1", HPCPAR_MPIEXEC=str(self.wrapper))
        if method != "hpcpar":
            return limited + [sys.executable, __file__, "--one", method, "--data", str(data),
                              "--model", self.a.model, "--weights", str(self.weights),
                              "--roi", str(self.a.roi), "--overlap", str(self.a.overlap),
                              "--threads", "1"], env
        cmd = [sys.executable, "-m", "hpcpar.cli", "predict", "--model", self.a.model,
               "--weights", str(self.weights), "--data", str(data), "--out", str(out),
               "-n", str(ranks), "--grid", spatial_grid(ranks), "--max-slab",
               str(self.a.max_slab), "--force"]
        return (limited + cmd if ranks == 1 else cmd), env   # 1 rank runs in the CLI process

    def fits(self, config: tuple, edge: int) -> bool:
        """Whether ``config`` (method, ranks, _) completes at ``edge`` under the limit."""
        method, ranks, _ = config
        out = self.work / "out"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        cmd, env = self.command(method, ranks, self.volume(edge), out / "y.h5")
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        shutil.rmtree(out, ignore_errors=True)
        print(f"  {method:<7} {ranks} rank(s) edge {edge:>5}: "
              f"{'fits' if done.returncode == 0 else f'exit {done.returncode}'}", flush=True)
        return completed(done, f"{method} at edge {edge}")


def max_diff_chunked(reference: Path, out: Path, planes: int = 16) -> float:
    """max |hpcpar's ``y`` - the reference (npy)|, read ``planes`` D-planes at a time from each."""
    ref = np.load(reference, mmap_mode="r")
    worst = 0.0
    with h5py.File(out, "r") as f:
        y = f["y"]
        if y.shape != ref.shape:
            sys.exit(f"{out}: y is {y.shape}, the reference {ref.shape}")
        for d in range(0, ref.shape[2], planes):
            a = y[:, :, d:d + planes].astype(np.float64)
            worst = max(worst, float(np.abs(a - ref[:, :, d:d + planes]).max()))
    return worst


def limit_mode(a, work: Path) -> int:
    """Largest edge per method under the limit, then the check on a volume >= ratio x limit."""
    from hpcpar.testing.memlimit import available, parse_size

    why = available()
    if why:
        print(f"predict --limit: {why}", file=sys.stderr)
        return 2
    a.limit_bytes = parse_size(a.limit)
    a.model = a.model or f"{Path(__file__).resolve()}:LimitNet"
    from hpcpar.run.predict_model import model_class

    torch.manual_seed(0)
    weights = work / "weights.pt"
    torch.save(model_class(a.model)().state_dict(), weights)
    trial = Limited(a, work, weights)
    print(f"# {' '.join(sys.argv)}\n# model {a.model}, {a.limit} ({a.limit_bytes / 2**20:.0f} "
          f"MiB) per process / rank, 1 torch thread each, hpcpar --max-slab {a.max_slab}, "
          f"MONAI roi {a.roi}^3 overlap {a.overlap}", flush=True)
    rows = []
    if not a.no_search:
        for config in (("whole", 1, ""), ("monai", 1, ""), ("hpcpar", a.ranks, "")):
            edge = largest(trial, config, rows[-1][2] if rows else None, a.step, a.max_edge)
            rows.append((config[0], config[1], edge))
        print(f"\n| method | ranks | largest edge under {a.limit} each | input MiB "
              "| input / limit |\n| --- | --- | --- | --- | --- |")
        for method, ranks, edge in rows:
            shown = "-" if edge is None else (f">= {edge} (the --max-edge)"
                                             if edge + a.step > a.max_edge else str(edge))
            mib = (edge or 0) ** 3 * 4 / 2**20
            print(f"| {method} | {ranks} | {shown} | {mib:.0f} | "
                  f"{(edge or 0) ** 3 * 4 / a.limit_bytes:.2f} |")
        print("(whole, monai: the plain model as a user runs it, NCDHW: oneDNN's convolutions "
              "of a one-channel volume hold about ten volumes)")
    # the check: the smallest edge (a multiple of 8) whose input is >= ratio x the limit
    edge = 8 * math.ceil((a.ratio * a.limit_bytes / 4) ** (1 / 3) / 8)
    data, out = trial.volume(edge), work / "check.h5"
    cmd, env = trial.command("hpcpar", a.check_ranks, data, out)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        print(f"hpcpar predict on {a.check_ranks} ranks at edge {edge} under {a.limit} each: "
              f"exit {done.returncode}\n{done.stderr[-2000:]}")
        return 1
    with h5py.File(out, "r") as f:
        record = json.loads(f.attrs["hpcpar_predict"])
    reference = work / "whole.npy"
    whole = subprocess.run([sys.executable, __file__, "--one", "reference", "--data", str(data),
                            "--out", str(reference), "--model", a.model, "--weights",
                            str(weights), "--threads", "1"], capture_output=True, text=True)
    if whole.returncode:
        sys.exit(f"the unlimited whole-volume forward failed:\n{whole.stderr[-2000:]}")
    ref = json.loads(whole.stdout.strip().splitlines()[-1])
    diff = max_diff_chunked(reference, out)
    ok = diff <= TOLERANCE
    ratio = edge ** 3 * 4 / a.limit_bytes
    print(f"\nvolume {edge}^3 float32 = {edge ** 3 * 4 / 2**20:.0f} MiB on {a.check_ranks} "
          f"ranks ({spatial_grid(a.check_ranks)}, --max-slab {a.max_slab}), "
          f"{a.limit} each: {record['wall_s']:.1f} s, peak RSS "
          f"{record['peak_rss_bytes_max'] / 2**20:.0f} MiB per rank; the reference (one "
          f"process, no limit, channels-last): {ref['wall_s']:.1f} s, peak RSS "
          f"{ref['peak_rss'] / 2**20:.0f} MiB")
    print(f"volume bytes / limit: {ratio:.2f}x; max|diff| vs the unlimited one-process "
          f"forward: {diff:.3g} ({'<=' if ok else '>'} {TOLERANCE:g}): {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


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
    lim = ap.add_argument_group("under a real per-rank memory limit")
    lim.add_argument("--limit", help="e.g. 512MiB: measure under this limit per process/rank")
    lim.add_argument("--model", help="FILE.py:Class (default: this file's LimitNet)")
    lim.add_argument("--step", type=int, default=32, help="edges are multiples of this")
    lim.add_argument("--max-edge", type=int, default=512)
    lim.add_argument("--max-slab", type=int, default=16, help="hpcpar predict --max-slab")
    lim.add_argument("--check-ranks", type=int, default=4)
    lim.add_argument("--ratio", type=float, default=4.0,
                     help="the check's volume: at least this many times the limit")
    lim.add_argument("--no-search", action="store_true", help="only the check")
    ap.add_argument("--one", choices=("whole", "monai", "reference"), help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--weights", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.run, a.data, a.out, a.roi, a.overlap, a.threads,
                             a.model, a.weights)))
        return
    work = Path(a.work or tempfile.mkdtemp(prefix="hpcpar-bench-predict-"))
    work.mkdir(parents=True, exist_ok=True)
    if a.limit:
        try:
            sys.exit(limit_mode(a, work))
        finally:
            if not a.work:      # its volumes are several times the limit
                shutil.rmtree(work, ignore_errors=True)
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
