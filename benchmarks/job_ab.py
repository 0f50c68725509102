"""Two settings of the same jobs, side by side: ``hpcpar run`` each job with ``--a`` and with
``--b`` overrides, alternating A, B (B, A every other round) so a slow spell of the host hits
both alike; prints per job the median step of each (with the spread over rounds), the phases
(data, forward, backward, optimizer, the rest) and B's speedup over A.

    python benchmarks/job_ab.py --a train.channels_last=false --b train.channels_last=true \\
        [--jobs jobs/demo-cosmoflow.toml,jobs/demo-unet3d.toml,...] [-n 1] [--grid 1x1x1x1]
        [--rounds 3]
    python benchmarks/job_ab.py --a-rev HEAD~1 --jobs jobs/demo-unet3d.toml -n 2  # two commits

``--a-rev`` / ``--b-rev`` run that side on another commit of hpcpar (checked out in a
temporary git worktree, put first on ``PYTHONPATH`` for every rank); the jobs and the data
are the same files for both sides. ``--a-env`` / ``--b-env KEY=VALUE`` give that side's
ranks an environment variable (e.g. the allocator's ``MALLOC_CONF``: every rank inherits it).
The peak column is the largest rank's ``peak_mem``, median over rounds.

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
    out["peak"] = float(steps["peak_mem"].max())
    out["rest"] = out["t_step"] - sum(out[k] for k in PHASES)
    return out


def worktree(rev: str, tmp: str) -> str:
    """A detached checkout of ``rev`` under ``tmp`` (pruned when ``tmp`` is gone)."""
    path = os.path.join(tmp, f"rev-{rev.replace('/', '_')}")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", path, rev],
                   check=True)
    return path


def run(job: str, sets: list[str], ranks: int, grid: str | None, steps: int,
        run_dir: str, src: str | None = None, env_sets: tuple[str, ...] = ()) -> dict | None:
    cmd = [sys.executable, "-m", "hpcpar.cli", "run", job, "-n", str(ranks),
           *(["--grid", grid] if grid else []), "--run-dir",
           run_dir, "--no-resume", "--set", f"train.steps={steps}", "--set",
           "checkpoint.every=0", "--set", "checkpoint.at_end=false", "--set",
           "train.val_every=100000"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, **dict(e.split("=", 1) for e in env_sets))
    if src:  # this side's hpcpar before the installed one, in every rank (mpiexec passes
        # env); PYTHONSAFEPATH keeps `python -m` from putting this tree's hpcpar (cwd) first
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (src, env.get("PYTHONPATH"))))
        env["PYTHONSAFEPATH"] = "1"
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
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
    ap.add_argument("--a-rev", help="git revision of hpcpar for side A (default: this tree)")
    ap.add_argument("--b-rev", help="git revision of hpcpar for side B (default: this tree)")
    ap.add_argument("--a-env", action="append", default=[], help="KEY=VALUE for A's ranks")
    ap.add_argument("--b-env", action="append", default=[], help="KEY=VALUE for B's ranks")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()
    grid = args.grid or ("1x1x1x1" if args.ranks == 1 else None)
    got: dict = {}
    try:
        with tempfile.TemporaryDirectory(prefix="hpcpar-ab-") as tmp:
            src = {side: worktree(rev, tmp) if rev else None
                   for side, rev in (("a", args.a_rev), ("b", args.b_rev))}
            for r in range(args.rounds):
                for i, job in enumerate(args.jobs.split(",")):
                    for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
                        out = run(job, args.a if side == "a" else args.b, args.ranks, grid,
                                  args.steps, os.path.join(tmp, f"{i}-{side}-{r}"), src[side],
                                  tuple(args.a_env if side == "a" else args.b_env))
                        if out:
                            got.setdefault((job, side), []).append(out)
                            print(f"{os.path.basename(job)} {side}: "
                                  f"{out['t_step'] * 1e3:.1f} ms", flush=True)
    finally:  # the checkouts went with the temporary directory; forget them in git too
        subprocess.run(["git", "-C", ROOT, "worktree", "prune"], check=False)
    a, b = (" ".join(sets + envs + ([f"rev {rev}"] if rev else [])) or "defaults"
            for sets, envs, rev in ((args.a, args.a_env, args.a_rev),
                                    (args.b, args.b_env, args.b_rev)))
    print(f"\nA = {a}; B = {b}; "
          f"{args.ranks} rank(s) on {os.cpu_count()} cores, {args.rounds} rounds")
    print(f"{'job':<24} {'side':<4} {'step ms':>8} {'spread':>13}  "
          + " ".join(f"{k[2:]:>6}" for k in PHASES) + f" {'rest':>6} {'peak MiB':>8}  B speedup")
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
                  + f" {statistics.median(x['peak'] for x in runs) / 2**20:>8.0f}"
                  + (f"  {med['a'] / med['b']:.2f}x" if side == "b" and "a" in med else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
