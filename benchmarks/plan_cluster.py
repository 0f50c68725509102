"""The planner off the box it was calibrated on: calibrate on the virtual cluster, then predict
the demo job at 1, 2 and 4 nodes and compare with runs that calibration never saw.

    python benchmarks/plan_cluster.py [--nodes 1,2,4] [--per-node 2] [--link 2gbit] [--steps 30]
        [--machine FILE]

As root, this brings up ``hpcpar.testing.cluster`` (4 virtual nodes, links shaped with ``tc``)
and, all through Slurm on it:

1. ``hpcpar plan --calibrate -o MACHINE`` in a 2-node x PER_NODE allocation: intra- and
   inter-node latency and bandwidth (pingpongs), compute rates, contention; the nodes are
   recognised as sharing one host's cores (``host_cores``). No training step is run.
2. ``hpcpar submit jobs/demo-cosmoflow.toml --nodes N --ranks-per-node PER_NODE`` for each
   node count in turn (one job at a time: the virtual nodes share the host's cores): the demo
   (spatial x=2 inside each node, data parallel across nodes), STEPS steps per point.
3. ``hpcpar report --plan MACHINE``: the predicted step time beside the measured median.

Printed: per node count, measured and predicted seconds per step, predicted/measured, and how
many points are within +-25% (the target: all).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "jobs" / "demo-cosmoflow.toml"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="1,2,4", help="node counts of the validation runs")
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--link", default="2gbit", help="RATE[,DELAY] of every node's link")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--machine", type=Path,
                    help="predict with this machine file instead of calibrating on the "
                         "cluster (the smoke stage: tests/launch/test_multinode.py runs the "
                         "calibration there)")
    args = ap.parse_args(argv)
    nodes = [int(n) for n in args.nodes.split(",")]

    from hpcpar.launch.submit import plan_submit, submit
    from hpcpar.testing.cluster import VirtualCluster

    work = Path(tempfile.mkdtemp(prefix="hpcpar-plan-cluster-"))
    cluster = VirtualCluster(work / "cluster", nodes=max(nodes), link=args.link).start()
    try:
        env = cluster.env()
        print(f"virtual cluster: {max(nodes)} nodes, link {args.link}"
              + "".join(f"; {n}" for n in cluster.notes), flush=True)
        machine = args.machine.resolve() if args.machine else _calibrate(cluster, work,
                                                                         args.per_node)
        if machine is None:
            return 1
        sets = [f"data.path={work / 'data'}", f"train.steps={args.steps}", "train.val_every=0",
                "data.val_samples=0", "checkpoint.every=0", "grid.data=-1", "grid.x=2",
                "train.warmup_steps=0", f"resources.tasks_per_node={args.per_node}"]
        out = work / "sweep"
        print(f"$ hpcpar submit {DEMO.name} -o {out} --nodes {args.nodes} --ranks-per-node "
              f"{args.per_node} " + " ".join(f"--set {s}" for s in sets), flush=True)
        # one point at a time: the virtual nodes share this host's cores, so points running
        # side by side would slow each other down
        for n in nodes:
            [rec] = submit(plan_submit(DEMO, out, nodes=[n], ranks_per_node=args.per_node,
                                       sets=sets, python=sys.executable), out, env=env)
            state = cluster.wait(rec["id"], 1800)["JobState"]
            print(f"  job {rec['id']} ({rec['label']}): {state}", flush=True)
        rep = subprocess.run([sys.executable, "-m", "hpcpar.cli", "report", str(out), "-o",
                              str(work / "report"), "--plan", str(machine), "--json"],
                             capture_output=True, text=True, env=env)
        if rep.returncode:
            print(rep.stderr, file=sys.stderr)
            return 1
        import pandas as pd

        pred = pd.read_csv(json.loads(rep.stdout)["files"]["predicted.csv"])
        print(f"\n{'nodes':>5} {'ranks':>5} {'grid':>9} {'measured s':>11} {'predicted s':>12} "
              f"{'pred/meas':>10}")
        within = 0
        for p in pred.to_dict("records"):
            ratio = p["t_step_predicted"] / p["t_step_measured"]
            within += abs(ratio - 1) <= 0.25
            print(f"{p['ranks'] // args.per_node:>5} {p['ranks']:>5} {p['grid']:>9} "
                  f"{p['t_step_measured']:11.4f} {p['t_step_predicted']:12.4f} {ratio:10.2f}")
        how = f"machine file {args.machine}" if args.machine else \
            "calibrated on microbenchmarks only"
        print(f"{within}/{len(pred)} within +-25% ({how}; "
              f"{args.per_node} ranks per node, all nodes sharing this host's "
              f"{os.cpu_count()} cores)")
        return 0
    finally:
        cluster.stop()


def _calibrate(cluster, work: Path, per_node: int) -> Path | None:
    """``hpcpar plan --calibrate`` in a 2-node allocation: the machine file, or None."""
    machine = work / "vcluster.toml"
    cal_log = work / "calibrate.out"
    cmd = f"{sys.executable} -m hpcpar.cli plan --calibrate -o {machine}"
    print(f"$ sbatch --nodes=2 --ntasks-per-node={per_node} --wrap '{cmd}'", flush=True)
    job = cluster.sbatch("--nodes=2", f"--ntasks-per-node={per_node}",
                         f"--output={cal_log}", f"--chdir={work}", "--wrap", cmd)
    info = cluster.wait(job, 900)
    print(cal_log.read_text().strip(), flush=True)
    if info["JobState"] != "COMPLETED":
        print(f"calibration failed: {info['JobState']}", file=sys.stderr)
        return None
    return machine


if __name__ == "__main__":
    sys.exit(main())
