"""What a checkpoint every step costs (issue 31, item 2): the demo job with no checkpoints,
with an asynchronous checkpoint after every step and with a synchronous one, in alternating
rounds (the order rotates each round, so a slow spell of the host hits every side alike);
prints per side the median step (with the spread over rounds) and its ratio to no
checkpoints, and the ratio within each round (median and range: the noise beside the
verdict). The target: async every step <= 1.10x; the synchronous ratio beside it.

    python benchmarks/checkpoint_cost.py [--job jobs/demo-cosmoflow.toml] [-n 1,2]
        [--rounds 5] [--steps 15]

Each rank count runs on the grid 1xNx1x1. On this 2-core machine, 1 rank leaves a core to its
writer thread, as a GPU node leaves most of its cores to the writers of its 4-8 ranks; 2 ranks
train on every core, so the writers' CPU time (pickling, hashing: a few ms a checkpoint) is
taken from the step and no background write can hide it. Both are printed.

A run's step = the median over steps 3+ of the slowest rank's ``t_step + t_ckpt`` (its
records): the step's work plus what it blocked on checkpointing (copy to memory, waiting for
the previous write, or the whole write). Runs go through ``hpcpar run`` (benchmarks/job_ab.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from job_ab import run  # noqa: E402 - the sibling benchmark: `hpcpar run` one job, timed

SIDES = {
    "none": ["checkpoint.every=0"],
    "async": ["checkpoint.every=1", "checkpoint.background=true", "checkpoint.keep=2"],
    "sync": ["checkpoint.every=1", "checkpoint.background=false", "checkpoint.keep=2"],
}
LABELS = {"none": "none", "async": "async every step", "sync": "sync every step"}


def step_cost(run_dir: str) -> dict:
    """Medians over steps >= 3 of the slowest rank's ``t_step + t_ckpt`` (``step``) and of
    each part alone (seconds)."""
    from hpcpar.analysis import load
    from hpcpar.analysis.stats import drop_warmup

    runs, steps = load([run_dir])
    steps = drop_warmup(steps, runs, warmup=3).assign(t_ckpt=lambda s: s["t_ckpt"].fillna(0.0))
    slowest = steps.assign(cost=steps["t_step"] + steps["t_ckpt"]).groupby("step").max()
    return {"step": float(slowest["cost"].median()),
            **{k: float(slowest[k].median()) for k in ("t_step", "t_ckpt")}}


def measure(args, ranks: int, grid: str, tmp: str) -> dict[str, list[dict]]:
    """Alternating rounds of every side on one grid: per side, each round's step costs."""
    names = list(SIDES)
    got: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for side in names[r % len(names):] + names[:r % len(names)]:
            run_dir = os.path.join(tmp, f"{ranks}-{side}-{r}")
            if run(args.job, SIDES[side], ranks, grid, args.steps, run_dir):
                got.setdefault(side, []).append({**step_cost(run_dir), "round": r})
                print(f"{ranks} rank(s), round {r} {side}: {got[side][-1]['step'] * 1e3:.1f} ms",
                      flush=True)
    return got


def paired(got: dict[str, list[dict]], side: str) -> str:
    """The side's ratio to no checkpoints within each round (the two ran back to back, so a
    slow spell of the host shows in both): median and range, the run-to-run noise made
    visible beside the ratio of medians."""
    none = {x["round"]: x["step"] for x in got.get("none", [])}
    ratios = [x["step"] / none[x["round"]] for x in got[side] if x["round"] in none]
    if side == "none" or not ratios:
        return ""
    return f"  {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def report(args, ranks: int, grid: str, got: dict[str, list[dict]]) -> bool:
    """Print one grid's table; whether the async target was met."""
    cores = os.cpu_count() or 1
    why = ("a core left for each rank's writer thread, as on a GPU node" if 2 * ranks <= cores
           else "every core trains: the writers' CPU time adds to the step")
    print(f"\n{os.path.basename(args.job)}, {ranks} rank(s) as {grid} on {cores} cores ({why}), "
          f"{args.rounds} rounds of {args.steps} steps")
    print(f"{'checkpoints':<18} {'step ms':>8} {'spread':>13} {'t_step':>7} {'t_ckpt':>7}"
          "  vs none  per round")
    med = {side: {k: statistics.median(x[k] for x in got[side]) for k in ("step", "t_step",
                                                                       "t_ckpt")}
           for side in SIDES if got.get(side)}
    base = med.get("none", {}).get("step")
    for side in SIDES:
        if side not in med:
            print(f"{side:<18} failed")
            continue
        spread = [x["step"] * 1e3 for x in got[side]]
        print(f"{LABELS[side]:<18} {med[side]['step'] * 1e3:>8.1f} {min(spread):>6.1f}-"
              f"{max(spread):<6.1f} {med[side]['t_step'] * 1e3:>7.1f} "
              f"{med[side]['t_ckpt'] * 1e3:>7.1f}  "
              + (f"{med[side]['step'] / base:.2f}x" if base else "-") + paired(got, side))
    ok = bool(base and "async" in med and med["async"]["step"] / base <= 1.10)
    print(f"target async <= 1.10x of none: {'met' if ok else 'NOT met'}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default="jobs/demo-cosmoflow.toml")
    ap.add_argument("-n", "--ranks", default="1,2",
                    help="comma-separated rank counts, each on the grid 1xNx1x1")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()
    complete = True
    with tempfile.TemporaryDirectory(prefix="hpcpar-ckpt-cost-") as tmp:
        results = []
        for ranks in (int(n) for n in args.ranks.split(",")):
            grid = f"1x{ranks}x1x1"
            got = measure(args, ranks, grid, tmp)
            complete &= len(got) == len(SIDES)
            results.append((ranks, grid, got))
    for ranks, grid, got in results:
        report(args, ranks, grid, got)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
