"""``[train] accumulate`` and ``[train] clip_grad_norm`` against their single-process
definitions, on grids 1x2x1x1 (2 ranks) and 2x2x1x1 (4 ranks), real MPI: K micro-batches per
optimizer step equal one plain-torch step on the K-times batch, and clipping equals
``torch.nn.utils.clip_grad_norm_`` on the plain model (replicated parameters counted once,
tensor-parallel shards by their piece). Plain SGD: unlike Adam it does not hide a wrong
gradient scale (a missing 1/K, a sync per micro-batch, a norm counted twice)."""

import itertools
from pathlib import Path

import torch
import torch.nn.functional as F

from hpcpar.formats.jobspec import build_job
from hpcpar.testing import mpi_case, shared_tmpdir

STEPS = 3
# fp32 sums in another order (spatial partial gradients, data-parallel means, the norm's
# pieces) over 3 SGD steps: a few ulps of the O(0.1) weights. A wrong scale (factor 2 or
# sqrt(2)) moves the weights by about the whole update, checked to be 1000x larger below.
RTOL, ATOL = 1e-4, 1e-6


def job(grid, accumulate, clip, tensor_parallel):
    return build_job({
        "job": {"name": "controls"}, "grid": dict(zip(("data", "x", "y", "z"), grid)),
        "model": {"kind": "cosmoflow", "n_conv_blocks": 2, "base_filters": 4, "dense": [16],
                  "tensor_parallel": tensor_parallel, "tp_min_features": 4},
        "data": {"source": "synthetic", "size": 16, "channels": 2, "samples": 32},
        "train": {"steps": STEPS, "global_batch": 4, "optimizer": "sgd", "lr": 0.05,
                  "momentum": 0.9, "accumulate": accumulate, "clip_grad_norm": clip,
                  "log_every": 1, "check_replicas_every": 1},
        "checkpoint": {"every": 0}})


def plain_run(the_job, clip, steps=STEPS):
    """The single-process definition: each step, one forward/backward of the plain model on
    the concatenated ``accumulate`` global batches (the stream of epochs, in order), then
    torch's clip_grad_norm_ and the optimizer. Returns (initial, final) state dicts and the
    first step's gradient norm."""
    from mpi4py import MPI

    from hpcpar.parallel.grid import ProcessGrid
    from hpcpar.run._optim import build_optimizer
    from hpcpar.run.workloads.base import get_workload

    raw = the_job.to_dict()
    raw["grid"] = {"data": 1, "x": 1, "y": 1, "z": 1}
    raw["model"]["tensor_parallel"] = False
    one = build_job(raw)
    ws = get_workload("cosmoflow")(one, ProcessGrid(1, 1, 1, 1, comm=MPI.COMM_SELF),
                                   torch.device("cpu"))
    model = ws.reference_model()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = build_optimizer(one.train, ws.param_groups(model))
    stream = itertools.chain.from_iterable(ws.batches(e) for e in itertools.count())
    first_norm = None
    for _ in range(steps):
        xs, ys = zip(*(next(stream) for _ in range(one.train.accumulate)))
        loss = F.mse_loss(model(torch.cat(xs).log1p()), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))
        first_norm = float(norm) if first_norm is None else first_norm
        opt.step()
    ws.close()
    return start, model.state_dict(), first_norm


def final_model(run_dir):
    from hpcpar.run.checkpoint.store import list_checkpoints

    return torch.load(list_checkpoints(Path(run_dir) / "checkpoints")[0] / "model.pt",
                      weights_only=True)


def max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@mpi_case(nprocs=(2, 4), timeout=400)
def test_accumulate_and_clip_equal_the_single_process_definitions(comm):
    from hpcpar.run.trainer import train

    rank = comm.Get_rank()
    grid = (comm.Get_size() // 2, 2, 1, 1)
    with shared_tmpdir(comm, prefix="hpcpar-controls-") as tmp:
        for accumulate, tp in ((3, False), (2, True)):
            # clip at half the first step's norm: clipping acts, at least on that step
            _, _, norm = plain_run(job(grid, accumulate, 0.0, tp), 0.0, steps=1)
            clip = comm.bcast(round(0.5 * norm, 6))
            for limit in (0.0, clip):
                the_job = job(grid, accumulate, limit, tp)
                run = tmp / f"k{accumulate}-tp{int(tp)}-clip{int(bool(limit))}"
                result = train(the_job, run, comm=comm)
                assert result.step == STEPS
                if rank == 0:
                    start, want, _ = plain_run(the_job, limit)
                    got = final_model(run)
                    assert got.keys() == want.keys()
                    # the check can fail: the update is far above the tolerance
                    assert max_diff(want, start) > 1000 * ATOL
                    for k in want:
                        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL,
                                                   msg=f"{run.name}: {k}")
            if rank == 0:   # clipping changed the result (else the clipped check proves nothing)
                assert max_diff(final_model(run), final_model(run.with_name(
                    run.name.replace("clip1", "clip0")))) > 1000 * ATOL
        comm.Barrier()
