"""The training loop in-process on 2 ranks: loss falls; 2 data ranks == 1 rank with the same
global batch; a stop signal on ONE rank stops all after the same step, checkpoints, and the
resumed run is bit-identical to an uninterrupted one; a corrupt newest checkpoint falls back
to the previous one; the checkpoint loads into the plain torch model; channels-last training
matches; U-Net runs. And the GCN demo job through the loop (serial)."""

import os
import signal
import time
from pathlib import Path

import numpy as np
import torch

from hpcpar.formats.jobspec import build_job
from hpcpar.run.workloads.base import register_workload
from hpcpar.run.workloads.volume import CosmoFlowWorkload
from hpcpar.testing import mpi_case, shared_tmpdir


@register_workload("cosmoflow-sigtest")
class SignalAtCall(CosmoFlowWorkload):
    """CosmoFlow that sends itself SIGUSR1 during its 3rd forward, on the last rank only."""

    def forward_loss(self, model, batch):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3 and self.grid.rank == self.grid.size - 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return super().forward_loss(model, batch)


def job(grid, steps=8, kind="cosmoflow", **sections):
    raw = {"job": {"name": "t"}, "grid": dict(zip(("data", "x", "y", "z"), grid)),
           "model": {"kind": kind, "n_conv_blocks": 2, "base_filters": 4, "dense": [16]},
           "data": {"source": "synthetic", "size": 16, "channels": 2, "samples": 32,
                    "val_samples": 4},
           "train": {"steps": steps, "global_batch": 4, "lr": 0.003, "log_every": 1},
           "checkpoint": {"every": 0, "keep": 3}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return build_job(raw)


def final_model(run_dir):
    from hpcpar.run.checkpoint.store import list_checkpoints

    newest = list_checkpoints(Path(run_dir) / "checkpoints")[0]
    return torch.load(newest / "model.pt", weights_only=True)


def idle_wait(comm):
    """Barrier that sleeps instead of busy-polling (the other rank trains alone meanwhile)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.02)


@mpi_case(nprocs=2, timeout=400)
def test_loop_equivalence_signal_resume_fallback(comm):
    from mpi4py import MPI

    from hpcpar.run.trainer import train

    rank = comm.Get_rank()
    with shared_tmpdir(comm, prefix="hpcpar-train-") as tmp:
        # -- 2 data ranks vs 1 rank, same global batch; the loss falls ------------------------
        d2 = train(job((2, 1, 1, 1), steps=10), tmp / "d2", comm=comm)
        losses = [loss for _, loss in d2.metrics["train_loss_history"]]
        assert min(losses[-3:]) < 0.85 * losses[0], losses
        assert {"val_loss", "val_mae", "final_train_loss"} <= set(d2.metrics)
        if rank == 0:
            d1 = train(job((1, 1, 1, 1), steps=10), tmp / "d1", comm=MPI.COMM_SELF)
            a, b = final_model(tmp / "d2"), final_model(tmp / "d1")
            assert a.keys() == b.keys()
            for k in a:
                torch.testing.assert_close(a[k], b[k], rtol=2e-5, atol=2e-6, msg=k)
            assert abs(d1.metrics["final_train_loss"] - d2.metrics["final_train_loss"]) < 1e-5
            # the full state dict loads into the plain single-process model
            from hpcpar.models.cosmoflow import CosmoFlow

            CosmoFlow(input_size=16, in_channels=2, n_conv_blocks=2, base_filters=4,
                      dense=(16,)).load_state_dict(a)
        idle_wait(comm)

        # -- SIGUSR1 on the last rank only: both stop after step 3, checkpoint, resume ---------
        spatial = (1, 2, 1, 1)
        ref = train(job(spatial), tmp / "ref", comm=comm)
        assert ref.step == 8 and not ref.stopped
        cut = train(job(spatial, kind="cosmoflow-sigtest"), tmp / "cut", comm=comm)
        assert cut.stopped and cut.step == 3
        assert (tmp / "cut" / "checkpoints" / "step-000003" / "manifest.json").exists()
        done = train(job(spatial), tmp / "cut", comm=comm)
        assert done.step == 8 and not done.stopped
        a, b = final_model(tmp / "ref"), final_model(tmp / "cut")
        assert all(torch.equal(a[k], b[k]) for k in a), "resume is not bit-identical"
        assert done.metrics["final_train_loss"] == ref.metrics["final_train_loss"]

        # -- train.channels_last (the default): the same training in torch's default order -------
        assert job(spatial).train.channels_last
        cl = train(job(spatial, train={"channels_last": False}), tmp / "cl", comm=comm)
        a, b = final_model(tmp / "ref"), final_model(tmp / "cl")
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=2e-5, atol=2e-6, msg=k)
        assert abs(cl.metrics["final_train_loss"] - ref.metrics["final_train_loss"]) < 1e-5

        # -- corrupt newest checkpoint -> previous one, with a warning ---------------------------
        comm.Barrier()
        if rank == 0:
            newest = tmp / "cut" / "checkpoints" / "step-000008" / "model.pt"
            newest.write_bytes(newest.read_bytes()[:-7] + b"garbage")
        comm.Barrier()
        more = job(spatial, steps=10)
        back = train(more, tmp / "cut", comm=comm)              # 3 -> 10
        ahead = train(more, tmp / "ref", comm=comm)             # 8 -> 10
        assert back.step == ahead.step == 10
        a, b = final_model(tmp / "ref"), final_model(tmp / "cut")
        assert all(torch.equal(a[k], b[k]) for k in a)
        if rank == 0:
            log = (tmp / "cut" / "logs" / "rank-00000.log").read_text()
            assert "skipping corrupt checkpoint" in log and "resumed from" in log
            assert "step-000003 at step 3" in log


@mpi_case(nprocs=2, timeout=300)
def test_unet_on_two_spatial_ranks_trains_like_one(comm):
    """U-Net (spatial, batch norm over the global batch) on 2 spatial ranks: the same losses,
    validation and final weights as on 1 rank. Running statistics updated from each rank's
    own voxels fail it (the validation loss moves by 3.5e-4); a forward or a gradient that
    differs on the first step stops the run earlier (the spatialize check)."""
    from mpi4py import MPI

    from hpcpar.run.trainer import train

    with shared_tmpdir(comm, prefix="hpcpar-unet-") as tmp:
        u2 = train(_unet_job((1, 2, 1, 1)), tmp / "u2", comm=comm)
        assert u2.step == 2
        if comm.Get_rank() == 0:
            assert (tmp / "u2" / "metrics.json").exists() and (tmp / "u2" / "meta.json").exists()
            u1 = train(_unet_job((1, 1, 1, 1)), tmp / "u1", comm=MPI.COMM_SELF)
            for key in ("train_loss_history", "final_train_loss", "val_loss", "val_accuracy"):
                np.testing.assert_allclose(u2.metrics[key], u1.metrics[key], rtol=2e-5,
                                           err_msg=key)
            a, b = final_model(tmp / "u2"), final_model(tmp / "u1")
            assert a.keys() == b.keys()
            for k in a:
                torch.testing.assert_close(a[k], b[k], rtol=2e-5, atol=2e-6, msg=k)
        idle_wait(comm)


def _unet_job(grid):
    return build_job({
        "job": {"name": "u"}, "grid": dict(zip(("data", "x", "y", "z"), grid)),
        "model": {"kind": "unet3d", "base_filters": 2, "depth": 1},
        "data": {"source": "synthetic", "size": 8, "channels": 2, "samples": 8,
                 "val_samples": 4},
        "train": {"steps": 2, "global_batch": 4, "log_every": 1},
        "checkpoint": {"every": 0}})


def test_demo_job_through_the_training_loop(tmp_path, monkeypatch):
    """jobs/demo-gcn-cora.toml (20 epochs): the bundled Cora is imported on first use and the
    model learns from the edges: test accuracy 0.685 (seeded), where chance is 1/7 and the
    same model with propagate() returning its input (a GCN that ignores edges) reaches 0.524."""
    import json
    import os

    from mpi4py import MPI

    from hpcpar.formats.jobspec import load_job
    from hpcpar.run.trainer import train

    monkeypatch.chdir(tmp_path)
    job = load_job(os.path.join(os.path.dirname(__file__), "..", "..", "jobs",
                                "demo-gcn-cora.toml"),
                   ["train.epochs=20", "train.val_every=0"])
    train(job, tmp_path / "run", comm=MPI.COMM_SELF)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert {"val_acc", "test_acc", "train_acc"} <= set(metrics)
    assert metrics["test_acc"] > 0.62 and metrics["val_acc"] > 0.62, metrics
    assert (tmp_path / "data" / "cora.h5").exists()
