"""Gradient sync across nodes: hierarchical vs flat, and hpcpar's message path vs raw
``MPI_Allreduce``, measured side by side in one run on the virtual cluster.

    python benchmarks/multinode.py --nodes 4 --per-node 2 --link 2gbit [--mb 25,50,100]

As root, this brings up ``hpcpar.testing.cluster`` (NODES virtual nodes, each link shaped with
``tc``), runs itself under ``srun`` on NODES x PER_NODE ranks and tears the cluster down. Under
``srun`` (or ``mpiexec``) it is the measurement: for each gradient size B, a wide MLP whose
gradients total B bytes, and per round, alternating:

(a) raw: one in-place ``MPI_Allreduce`` of B bytes of float32 over all ranks (the limit);
(b) flat: hpcpar DDP sync with ``hierarchical=False`` (one allreduce per bucket over all
    ranks, the message path: the one-node shared-memory window does not apply across nodes);
(c) hierarchical: reduce inside each node (shared memory), allreduce among node leaders over
    the network, broadcast inside the node.

Printed: the slowest rank's median of each, hierarchical/flat speedup (target >= 1.2) and
flat/raw bandwidth (target >= 0.9), with the spread (min-max over rounds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MB = 1 << 20


def measure(args) -> None:
    import torch
    from mpi4py import MPI

    import hpcpar

    sys.path.insert(0, str(HERE))
    from allreduce import sync_vs_raw, wide_mlp

    torch.set_num_threads(1)
    grid = hpcpar.ProcessGrid()
    comm = grid.comm
    if grid.rank == 0:
        print(f"{grid.size} ranks on {grid.num_nodes} nodes ({grid.ranks_per_node} per node), "
              f"{args.rounds} rounds x {args.reps} reps, slowest rank's median", flush=True)
        print(f"{'MB':>6} {'raw ms':>9} {'flat ms':>9} {'hier ms':>9} {'hier/flat':>10} "
              f"{'flat/raw bw':>12}  spread hier/flat (min-max over rounds)", flush=True)
    for mb in args.mb:
        torch.manual_seed(0)
        flat = hpcpar.DDP(wide_mlp(mb * MB), grid, hierarchical=False)
        torch.manual_seed(0)
        hier = hpcpar.DDP(wide_mlp(mb * MB), grid, hierarchical=True)
        nbytes = sum(p.numel() * 4 for p in flat.module.parameters())
        raw_t, flat_t, hier_t = [], [], []
        for _ in range(args.rounds):
            raw, f = sync_vs_raw(flat, flat.module, nbytes, args.reps)
            _, h = sync_vs_raw(hier, hier.module, nbytes, args.reps)
            raw_t.append(raw)
            flat_t.append(f)
            hier_t.append(h)
        ratios = [f / h for f, h in zip(flat_t, hier_t)]
        if grid.rank == 0:
            raw, f, h = (statistics.median(t) for t in (raw_t, flat_t, hier_t))
            print(f"{nbytes / MB:6.1f} {raw * 1e3:9.1f} {f * 1e3:9.1f} {h * 1e3:9.1f} "
                  f"{f / h:10.2f} {raw / f:12.2f}  {min(ratios):.2f}-{max(ratios):.2f}",
                  flush=True)
        del flat, hier
        comm.Barrier()
    if grid.rank == 0:
        print("targets: hier/flat >= 1.2, flat/raw >= 0.9", flush=True)
    MPI.COMM_WORLD.Barrier()


def drive(args) -> int:
    """Bring up the virtual cluster, run :func:`measure` under srun on it, tear it down."""
    from hpcpar.launch.launcher import wheel_srun_export
    from hpcpar.testing.cluster import VirtualCluster

    root = Path(tempfile.mkdtemp(prefix="hpcpar-bench-cluster-"))
    cluster = VirtualCluster(root, nodes=args.nodes, link=args.link).start()
    try:
        print(f"virtual cluster: {args.nodes} nodes, link {args.link or 'unshaped'}"
              + "".join(f"; {n}" for n in cluster.notes), flush=True)
        argv = ["srun", f"--nodes={args.nodes}", f"--ntasks-per-node={args.per_node}",
                "--mpi=pmi2", *wheel_srun_export(os.environ), sys.executable, __file__,
                "--measure",
                "--mb", ",".join(map(str, args.mb)), "--rounds", str(args.rounds),
                "--reps", str(args.reps)]
        print("$ " + " ".join(argv), flush=True)
        return subprocess.run(argv, env={**cluster.env(), "OMP_NUM_THREADS": "1"},
                              timeout=1800).returncode
    finally:
        cluster.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--link", default="2gbit", help="RATE[,DELAY] of every node's link")
    ap.add_argument("--mb", type=lambda s: [float(v) for v in s.split(",")],
                    default=[25.0, 50.0, 100.0], help="gradient sizes in MB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2, help="measurements per round")
    ap.add_argument("--measure", action="store_true", help="(internal) the ranks' part")
    args = ap.parse_args(argv)
    if args.measure or int(os.environ.get("PMI_SIZE", os.environ.get("SLURM_NTASKS", "1"))) > 1:
        measure(args)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
