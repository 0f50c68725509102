"""Two settings of the same jobs, side by side: ``hpcpar run`` each job with ``--a`` and with
``--b`` overrides, alternating A, B (B, A every other round) so a slow spell of the host hits
both alike; prints per job the median step of each (with the spread over rounds), the phases
(data, forward, backward, optimizer, the rest) and B's speedup over A.

    python benchmarks/job_ab.py --a train.channels_last=false --b train.channels_last=true \\
        [--jobs jobs/demo-cosmoflow.toml,jobs/demo-unet3d.toml,...] [-n 1] [--grid 1x1x1x1]
        [--rounds 3]

A run's step = the median over steps 3+ of the slowest rank's ``t_step`` (its records).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = ("jobs/demo-cosmoflow.toml", "jobs/demo-unet3d.toml", "jobs/demo-cosmoflow-tp.toml")
PHASES = ("t_data", "t_fwd", "t_bwd", "t_opt")


def phases(run_dir: str) -> dict:
    """Median over steps >= 3 of the slowest rank, per phase (seconds)."""
    from hpcpar.analysis import load
    from hpcpar.analysis.stats import drop_warmup

    runs, steps = load([run_dir])
    slowest = drop_warmup(steps, runs, warmup=3).groupby("step").max()
    out = {k: float(slowest[k].median()) for k in (*PHASES, "t_step")}
    out["rest"] = out["t_step"] - sum(out[k] for k in PHASES)
    return out


def run(job: str, sets: list[str], ranks: int, grid: str | None, steps: int,
        run_dir: str) -> dict | None:
    cmd = [sys.executable, "-m", "hpcpar.cli", "run", job, "-n", str(ranks),
           *(["--grid", grid] if grid else []), "--run-dir",
           run_dir, "--no-resume", "--set", f"train.steps={steps}", "--set",
           "checkpoint.every=0", "--set", "checkpoint.at_end=false", "--set",
           "train.val_every=100000"]
    for s in sets:
        cmd += ["--set", s]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        print(f"{job} {sets}: failed: {r.stderr.strip()[-300:]}", flush=True)
        return None
    return phases(run_dir)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", action="append", default=[], help="KEY=VALUE of setting A")
    ap.add_argument("--b", action="append", default=[], help="KEY=VALUE of setting B")
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("-n", "--ranks", type=int, default=1)
    ap.add_argument("--grid", help="DxXxYxZ (default: 1x1x1x1 on one rank, else the job's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()
    grid = args.grid or ("1x1x1x1" if args.ranks == 1 else None)
    got: dict = {}
    with tempfile.TemporaryDirectory(prefix="hpcpar-ab-") as tmp:
        for r in range(args.rounds):
            for job in args.jobs.split(","):
                order = ("a", "b") if r % 2 == 0 else ("b", "a")
                for side in order:
                    sets = args.a if side == "a" else args.b
                    out = run(job, sets, args.ranks, grid, args.steps,
                              os.path.join(tmp, f"{len(got)}-{side}-{r}"))
                    if out:
                        got.setdefault((job, side), []).append(out)
                        print(f"{os.path.basename(job)} {side}: {out['t_step'] * 1e3:.1f} ms",
                              flush=True)
    print(f"\nA = {' '.join(args.a) or 'defaults'}; B = {' '.join(args.b) or 'defaults'}; "
          f"{args.ranks} rank(s) on {os.cpu_count()} cores, {args.rounds} rounds")
    print(f"{'job':<24} {'side':<4} {'step ms':>8} {'spread':>13}  "
          + " ".join(f"{k[2:]:>6}" for k in PHASES) + f" {'rest':>6}  B speedup")
    for job in args.jobs.split(","):
        med = {}
        for side in ("a", "b"):
            runs = got.get((job, side), [])
            if not runs:
                continue
            steps = [x["t_step"] for x in runs]
            med[side] = statistics.median(steps)
            ph = {k: statistics.median(x[k] for x in runs) * 1e3 for k in (*PHASES, "rest")}
            print(f"{os.path.basename(job):<24} {side:<4} {med[side] * 1e3:>8.1f} "
                  f"{min(steps) * 1e3:>6.1f}-{max(steps) * 1e3:<6.1f} "
                  + " ".join(f"{ph[k]:>6.1f}" for k in (*PHASES, "rest"))
                  + (f"  {med['a'] / med['b']:.2f}x" if side == "b" and "a" in med else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
