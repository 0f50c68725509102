"""fp16 with dynamic loss scaling against fp32 on the demo job (issue 29): the final training
loss of ``[train] precision = "fp16"`` must be within 2% of fp32's. Two full demo runs (CosmoFlow
32^3 x 4, grid 2x2x1x1, Adam): minutes on CPU, where torch's fp16 conv3d backward is slow, so
this is a benchmark, not a test.

    mpiexec -n 4 python benchmarks/fp16_loss.py [--steps 60]

Prints the two losses, their relative difference and the overflow steps; exit code 1 when the
difference is above 2%.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from mpi4py import MPI

from hpcpar.formats.jobspec import load_job
from hpcpar.run.trainer import train

DEMO = Path(__file__).resolve().parents[1] / "jobs" / "demo-cosmoflow.toml"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="[train] steps (default: the job's)")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    tmp = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcpar-fp16-") if comm.rank == 0 else None))
    losses, overflows = {}, {}
    for precision in ("fp32", "fp16"):
        sets = [f"train.precision={precision}", f"data.path={tmp / 'data'}",
                "checkpoint.every=0", "checkpoint.at_end=false"]
        if args.steps:
            sets.append(f"train.steps={args.steps}")
        result = train(load_job(DEMO, sets), tmp / precision, comm=comm)
        losses[precision] = result.metrics["final_train_loss"]
        overflows[precision] = result.overflow_steps
    comm.Barrier()
    rel = abs(losses["fp16"] - losses["fp32"]) / abs(losses["fp32"])
    if comm.rank == 0:
        shutil.rmtree(tmp)
        print(f"final train loss: fp32 {losses['fp32']:.5f}, fp16 {losses['fp16']:.5f} "
              f"(relative difference {rel:.2%}, target <= 2%); overflow steps: fp16 "
              f"{overflows['fp16']}, fp32 {overflows['fp32']}")
    return 0 if rel <= 0.02 and overflows["fp32"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
