"""Validate ``hpcpar plan``: run a job at several rank counts and grids, print predicted vs
measured median step time (the planner's calibrated local machine file vs real runs).

    python benchmarks/plan.py [--job jobs/demo-cosmoflow.toml] [--ranks 1,2,4] [--steps 15]
                              [--machine local] [--calibrate] [--repeat 3]

Measured = median over steps (after warm-up) of the max over ranks of t_step, from the run's
records, the fastest of ``--repeat`` runs made round robin (this 2-core VM's speed drifts by
15% over minutes; the calibration keeps its best windows too). Prints the ratio
predicted/measured per configuration and how many are within +-25%.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def grids_for(n: int) -> list[str]:
    """Pure data parallel and the spatial splits of the x (and y) axis."""
    out = [f"{n}x1x1x1"]
    if n >= 2:
        out.append(f"{n // 2}x2x1x1")
    if n >= 4:
        out.append(f"{n // 4}x2x2x1")
    return out


def measured_step(run_dir: str) -> float:
    from hpcpar.analysis import load, scaling_table

    runs, steps = load([run_dir])
    table = scaling_table(runs, steps)
    return float(table["t_step_median"].iloc[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default=os.path.join(ROOT, "jobs", "demo-cosmoflow.toml"))
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--machine", default="local")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs per configuration, round robin; measured = the fastest")
    ap.add_argument("--calibrate", action="store_true", help="measure this machine first")
    args = ap.parse_args()
    from hpcpar.cli.plan import workload_from_job
    from hpcpar.parallel.grid import parse_spec
    from hpcpar.plan.machine import load_machine, machines_dir
    from hpcpar.plan.planner import predict

    machine_path = args.machine
    if args.calibrate or (args.machine == "local"
                          and not (machines_dir() / "local.toml").exists()):
        subprocess.run([sys.executable, "-m", "hpcpar.cli", "plan", "--calibrate"], check=True)
    machine = load_machine(machine_path)
    sets = ["--set", f"train.steps={args.steps}", "--set", "checkpoint.every=100000",
            "--set", "train.val_every=100000"]
    work = workload_from_job(args.job, [s for s in sets if s != "--set"])
    rows = []
    configs = [(n, g) for n in [int(r) for r in args.ranks.split(",")] for g in grids_for(n)]
    measured: dict = {}
    with tempfile.TemporaryDirectory(prefix="hpcpar-planbench-") as tmp:
        for rep in range(args.repeat):  # round robin: a slow spell of the host hits all alike
            for n, g in configs:
                run_dir = os.path.join(tmp, f"{g}-{rep}")
                r = subprocess.run([sys.executable, "-m", "hpcpar.cli", "run", args.job,
                                    "-n", str(n), "--grid", g, "--run-dir", run_dir,
                                    "--no-resume", *sets], capture_output=True, text=True)
                if r.returncode:
                    print(f"{g}: run failed: {r.stderr.strip()[-300:]}")
                    continue
                measured.setdefault((n, g), []).append(measured_step(run_dir))
    for (n, g), times in measured.items():
        grid = parse_spec(g)
        pred = predict(work, grid, machine)
        meas = min(times)
        rows.append((n, g, pred.t_step, meas))
        print(f"ranks {n}  grid {g:<9} predicted {pred.t_step * 1e3:8.1f} ms  measured "
              f"{meas * 1e3:8.1f} ms  ratio {pred.t_step / meas:5.2f}  "
              f"(compute {pred.t_compute * 1e3:.1f}, halo {pred.t_halo * 1e3:.1f}, "
              f"allreduce {pred.t_allreduce_exposed * 1e3:.1f} ms; runs "
              f"{', '.join(f'{t * 1e3:.0f}' for t in times)} ms)", flush=True)
    within = sum(1 for *_, p, m in rows if abs(p / m - 1) <= 0.25)
    print(f"{within}/{len(rows)} runs within +-25% of the prediction "
          f"(machine {machine.name}, {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
