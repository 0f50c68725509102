"""``hpcpar predict RUN_DIR_OR_CHECKPOINT --data PATH --out OUT.h5 -n N``: a trained model over
whole volumes, split over ranks (:mod:`hpcpar.run.predict`).

The output rules are checked here, before any rank starts; the ranks run ``python -m
hpcpar.run.predict`` (in this process for one rank or under MPI already)."""

from __future__ import annotations

import math
import sys

import click

from hpcpar.cli._options import ranks_option
from hpcpar.errors import EXIT_OK

__all__ = ["predict"]


@click.command()
@click.argument("target", metavar="RUN_DIR_OR_CHECKPOINT", required=False)
@click.option("--data", required=True, metavar="PATH",
              help="Inputs: a dataset folder (hpcpar data shard) or an HDF5 file with x "
                   "(N, C, D, H, W).")
@click.option("--out", "-o", required=True, metavar="OUT.h5",
              help="Output HDF5 file: y (N, C', D, H, W), attribute complete = 1 when done.")
@ranks_option(many=False, help="Number of ranks (default: the grid's product, else 1).")
@click.option("--grid", "grid_spec", metavar="DxXxYxZ", default=None,
              help="Process grid (default 1xNx1x1: every volume split along D).")
@click.option("--model", "model_spec", metavar="FILE.py:Class", default=None,
              help="A model class (built without arguments) instead of a run directory.")
@click.option("--weights", metavar="FILE", default=None,
              help="With --model: its state_dict (loaded with weights_only=True).")
@click.option("--max-slab", type=click.IntRange(min=1), default=None, metavar="VOXELS",
              help="Tile each volume into slabs of at most this many voxels along D plus "
                   "the model's receptive-field margin (exact; less memory per rank).")
@click.option("--argmax", is_flag=True, help="Store the class index per voxel (one channel).")
@click.option("--softmax", is_flag=True, help="Softmax over channels per voxel.")
@click.option("--sigmoid", is_flag=True, help="Sigmoid per voxel.")
@click.option("--dtype", type=click.Choice(["float32", "float64", "float16", "uint8"]),
              default="float32",
              help="Stored type; uint8 stores labels or probabilities x 255.")
@click.option("--force", is_flag=True,
              help="Overwrite an existing OUT that is not an unfinished prediction.")
def predict(target, data, out, ranks, grid_spec, model_spec, weights, max_slab, argmax,
            softmax, sigmoid, dtype, force):
    """Predict every sample of --data with a trained model, exactly (equal to the one-process
    whole-volume forward), each rank writing its own piece of OUT. A rerun restarts an unfinished
    OUT; any other existing file needs --force. Exit codes: 0 done, 1 a rank failed (OUT stays
    marked incomplete), 2 user error."""
    from hpcpar.launch.launcher import (  # deferred: keeps --help fast
        default_ranks,
        launch_command,
        mpi_world_size,
        plan_launch,
        run_ranks,
    )
    from hpcpar.launch.mpiexec import rank_env  # deferred: keeps --help fast
    from hpcpar.launch.threads import (  # deferred: keeps --help fast
        thread_env,
        threads_per_rank,
        use_threads,
    )
    from hpcpar.parallel.grid import parse_spec, resolve_shape  # deferred: keeps --help fast
    from hpcpar.run.predict_model import load_model  # deferred: loads torch
    from hpcpar.run.predict_output import check_out  # deferred: loads h5py

    shape = parse_spec(grid_spec) if grid_spec else None
    n = ranks or default_ranks() or (math.prod(shape) if shape and -1 not in shape else 1)
    spec = "x".join(map(str, resolve_shape(shape or (1, n, 1, 1), n)))
    if mpi_world_size() <= 1:
        check_out(out, force)     # one line now, before any rank starts
        load_model(target, model_spec, weights)
    argv = [sys.executable, "-m", "hpcpar.run.predict", *([target] if target else []),
            "--data", data, "--out", out, "--grid", spec, "--dtype", dtype]
    argv += ["--model", model_spec] if model_spec else []
    argv += ["--weights", weights] if weights else []
    argv += ["--max-slab", str(max_slab)] if max_slab else []
    argv += [f"--{f}" for f, on in (("argmax", argmax), ("softmax", softmax),
                                     ("sigmoid", sigmoid), ("force", force)) if on]
    mode = plan_launch(n)
    threads = threads_per_rank(1)    # OMP_NUM_THREADS, else one per rank (as hpcpar run)
    if mode == "direct":
        from hpcpar.run.predict import main  # deferred: loads torch

        use_threads(threads)
        sys.exit(main(argv[3:]))
    rc = run_ranks(launch_command(mode, n, argv), rank_env(thread_env(threads)))
    sys.exit(EXIT_OK if rc == 0 else rc)
