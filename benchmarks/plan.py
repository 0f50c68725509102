"""Validate ``hpcpar plan`` out of sample: run jobs at several rank counts and grids, print
predicted vs measured step time.

    python benchmarks/plan.py [--jobs jobs/demo-unet3d.toml,jobs/demo-gcn-cora.toml,...]
                              [--ranks 1,2,4] [--steps 15] [--machine local] [--calibrate]
                              [--repeat 3]

The machine file comes from ``hpcpar plan --calibrate`` alone: microbenchmarks (ping-pong,
conv / GEMM / SpMM / dropout rates, memory-bound layer costs, contention, oversubscription),
no training job. Nothing is fitted to the runs measured here, so every row is out of sample.

Measured = per run, the median over steps (after warm-up) of the max over ranks of t_step
(the run's records); the table shows the median of ``--repeat`` runs made round robin (this
2-core VM's speed drifts by 15% over minutes), their spread, and the ratio to the fastest run
too (the calibration keeps its best windows). Prints the ratio
predicted/measured per configuration and how many are within +-25%, per job and in all.
Full-graph jobs (gcn, sage) run one step per epoch on data = 1 grids. Each run records the
host's 1-minute load average (the higher of before and after): work of others on the host,
which the bench lock does not stop, inflates a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEFAULT_JOBS = ("jobs/demo-unet3d.toml", "jobs/demo-gcn-cora.toml",
                "jobs/demo-cosmoflow-tp.toml")


def grids_for(n: int, kind: str = "volume", every: bool = False) -> list[str]:
    """One grid per rank count: a graph splits x; a tensor-parallel job splits x, then x and
    y (its dense head over both); a volume job splits x, then adds data groups. ``every``:
    pure data parallel and the spatial splits of x (and y)."""
    if kind == "graph":
        return [f"1x{n}x1x1"]
    if every:
        return [f"{n}x1x1x1"] + ([f"{n // 2}x2x1x1"] if n >= 2 else []) + \
            ([f"{n // 4}x2x2x1"] if n >= 4 else [])
    if n == 1:
        return ["1x1x1x1"]
    if kind == "tp" and n >= 4:
        return [f"{n // 4}x2x2x1"]
    return [f"{n // 2}x2x1x1"]


def measured_step(run_dir: str) -> float:
    from hpcpar.analysis import load, scaling_table

    runs, steps = load([run_dir])
    table = scaling_table(runs, steps)
    return float(table["t_step_median"].iloc[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", default=",".join(os.path.join(ROOT, j) for j in DEFAULT_JOBS))
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--machine", default="local")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs per configuration, round robin; measured = their median")
    ap.add_argument("--every-grid", action="store_true",
                    help="volume jobs: data parallel and x (x and y) splits at each count")
    ap.add_argument("--results", help="JSON-lines file: append each measured run, and build "
                                      "the table from every run in it (so the measurements "
                                      "can be split over several short locked sessions)")
    ap.add_argument("--fit-on", metavar="JOB",
                    help="also scale every prediction at N ranks by measured/predicted of "
                         "JOB's runs at N ranks (from --results; e.g. jobs/demo-cosmoflow.toml, "
                         "never a validated job): the issue's 'calibrate on the demo job only'")
    ap.add_argument("--calibrate", action="store_true", help="measure this machine first")
    args = ap.parse_args()
    from hpcpar.parallel.grid import parse_spec
    from hpcpar.plan.job import workload_from_job
    from hpcpar.plan.machine import load_machine, machines_dir
    from hpcpar.plan.planner import predict

    if args.calibrate or (args.machine == "local"
                          and not (machines_dir() / "local.toml").exists()):
        cmd = [sys.executable, "-m", "hpcpar.cli", "plan", "--calibrate"]
        if args.machine != "local":
            cmd += ["-o", args.machine]
        subprocess.run(cmd, check=True)
    machine = load_machine(args.machine)
    ranks = [int(r) for r in args.ranks.split(",")]
    configs, works = [], {}
    for job in args.jobs.split(","):
        work = workload_from_job(job)
        kind = "graph" if work.graph is not None else \
            "tp" if work.tp_params else "volume"
        sets = ["--set", f"train.{'epochs' if kind == 'graph' else 'steps'}={args.steps}",
                "--set", "checkpoint.every=0", "--set", "checkpoint.at_end=false",
                "--set", "train.val_every=100000"]
        works[work.name] = work
        configs += [(job, work.name, n, g, sets) for n in ranks
                    for g in grids_for(n, kind, args.every_grid)]
    measured: dict = {}
    with tempfile.TemporaryDirectory(prefix="hpcpar-planbench-") as tmp:
        for rep in range(args.repeat):  # round robin: a slow spell of the host hits all alike
            for i, (job, name, n, g, sets) in enumerate(configs):
                run_dir = os.path.join(tmp, f"{i}-{g}-{rep}")
                load = os.getloadavg()[0]   # other work on the host inflates a measurement
                r = subprocess.run([sys.executable, "-m", "hpcpar.cli", "run", job,
                                    "-n", str(n), "--grid", g, "--run-dir", run_dir,
                                    "--no-resume", *sets], capture_output=True, text=True)
                if r.returncode:
                    print(f"{job} {g}: run failed: {r.stderr.strip()[-300:]}")
                    continue
                t = measured_step(run_dir)
                load = max(load, os.getloadavg()[0])
                measured.setdefault((name, n, g), []).append((t, load))
                print(f"measured {name} {g}: {t * 1e3:.1f} ms (load average {load:.1f})",
                      flush=True)
                if args.results:
                    with open(args.results, "a") as fh:
                        fh.write(json.dumps({"job": name, "ranks": n, "grid": g, "t_step": t,
                                             "load": load, "cores": os.cpu_count()}) + "\n")
    if args.results:   # every run recorded so far for these jobs
        measured = {}
        with open(args.results) as fh:
            for line in fh:
                r = json.loads(line)
                if r["job"] in works:
                    measured.setdefault((r["job"], r["ranks"], r["grid"]), []).append(
                        (r["t_step"], r.get("load", float("nan"))))
    scale = {}
    if args.fit_on:
        fit = workload_from_job(args.fit_on)
        if fit.name in works:
            raise SystemExit(f"--fit-on {fit.name}: a validated job; fitting on it would not "
                             "be out of sample")
        from hpcpar.plan import fit as fitting

        with open(args.results) as fh:
            runs = [json.loads(line) for line in fh]
        table = fitting.ratios([(fit, parse_spec(r["grid"]), r["t_step"]) for r in runs
                                if r["job"] == fit.name], machine)
        scale = {n: fitting.scale(table, n) for n in ranks}   # what hpcpar plan --fit-on does
        print(f"fitted on {fit.name}: measured/predicted per rank count "
              f"{ {n: round(v, 2) for n, v in sorted(scale.items())} }")
    rows = []
    print(f"{'job':<20} {'ranks':>5} {'grid':<9} {'runs':>4} {'load':>5} {'median ms':>10} "
          f"{'spread':>13} {'predicted ms':>13} {'ratio':>6} {'ratio to fastest':>16}  "
          "breakdown (ms)")
    for (name, n, g), runs in sorted(measured.items()):
        pred = predict(works[name], parse_spec(g), machine)
        times = [t for t, _ in runs]
        meas = statistics.median(times)
        load = statistics.median(x for _, x in runs)
        rows.append((name, pred.t_step, meas, min(times), pred.t_step * scale.get(n, 1.0),
                     n, g))
        print(f"{name:<20} {n:>5} {g:<9} {len(times):>4} {load:>5.1f} {meas * 1e3:>10.1f} "
              f"{min(times) * 1e3:>6.1f}-{max(times) * 1e3:<6.1f} {pred.t_step * 1e3:>13.1f} "
              f"{pred.t_step / meas:>6.2f} {pred.t_step / min(times):>16.2f}  "
              f"compute {pred.t_compute * 1e3:.1f}, halo "
              f"{pred.t_halo * 1e3:.1f}, tp {pred.t_tp * 1e3:.1f}, allreduce "
              f"{pred.t_allreduce_exposed * 1e3:.1f}", flush=True)
    def within(rs, col, pcol=1):
        return sum(1 for r in rs if abs(r[pcol] / r[col] - 1) <= 0.25)

    if scale:
        for name, _, meas, _, fitted, n, g in rows:
            print(f"fitted {name:<20} {n:>2} {g:<9} predicted {fitted * 1e3:7.1f} ms, "
                  f"ratio {fitted / meas:.2f}")
        print(f"fitted on the demo job: {within(rows, 2, 4)}/{len(rows)} within +-25% of the "
              "median")

    for name in dict.fromkeys(r[0] for r in rows):
        mine = [r for r in rows if r[0] == name]
        print(f"{name}: {within(mine, 2)}/{len(mine)} within +-25% of the median, "
              f"{within(mine, 3)}/{len(mine)} of the fastest run")
    print(f"{within(rows, 2)}/{len(rows)} configurations within +-25% of the median "
          f"({within(rows, 3)}/{len(rows)} of the fastest run; machine {machine.name}; up to "
          f"{max(ranks)} ranks on {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
