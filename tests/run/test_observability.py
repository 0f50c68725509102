"""Observability: a Callback sees every step, validation and the end on every rank;
``[output] tensorboard = true`` writes rank 0's losses, phases, throughput, memory and
validation metrics as TensorBoard scalars; ``[profile] steps`` writes one Chrome trace per rank
with the halo exchange as a named range; the job keys are validated with a fix to suggest."""

import json

import pytest

from hpcpar.errors import ConfigError
from hpcpar.formats.jobspec import build_job
from hpcpar.testing import mpi_case, shared_tmpdir

pytest.importorskip("tensorboard")


def job(**sections):
    raw = {"grid": {"data": 1, "x": 2},
           "model": {"kind": "cosmoflow", "n_conv_blocks": 2, "base_filters": 4, "dense": [8]},
           "data": {"source": "synthetic", "size": 8, "channels": 1, "samples": 8,
                    "val_samples": 2},
           "train": {"steps": 4, "global_batch": 2, "val_every": 2, "log_every": 1},
           "checkpoint": {"at_end": False}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return build_job(raw)


@mpi_case(nprocs=2, timeout=300)
def test_callbacks_tensorboard_and_profile_window(comm):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hpcpar.run.callbacks import Callback
    from hpcpar.run.trainer import train

    class Calls(Callback):
        def __init__(self):
            self.calls = []

        def on_train_start(self, trainer):
            self.calls.append(("start", trainer.step))

        def on_step_end(self, trainer, row, mean_loss):
            self.calls.append(("step", trainer.step, row["step"], mean_loss))

        def on_validation(self, trainer, metrics):
            self.calls.append(("val", trainer.step, sorted(metrics)))

        def on_train_end(self, trainer, metrics):
            self.calls.append(("end", trainer.step, "final_train_loss" in metrics))

    rank = comm.Get_rank()
    with shared_tmpdir(comm, prefix="hpcpar-obs-") as tmp:
        cb = Calls()
        result = train(job(output={"tensorboard": True}, profile={"steps": "2-3"}), tmp / "r",
                       comm=comm, callbacks=[cb])
        steps = [c for c in cb.calls if c[0] == "step"]
        assert [c[1:3] for c in steps] == [(1, 0), (2, 1), (3, 2), (4, 3)]
        history = dict(result.metrics["train_loss_history"])
        assert all(abs(c[3] - history[c[1]]) < 1e-6 for c in steps)       # the mean over ranks
        assert cb.calls[0] == ("start", 0) and cb.calls[-1] == ("end", 4, True)
        assert [c for c in cb.calls if c[0] == "val"] == [("val", s, ["val_loss", "val_mae"])
                                                          for s in (2, 4)]

        events = tmp / "r" / "tensorboard"
        comm.Barrier()
        if rank == 0:
            acc = EventAccumulator(str(events))
            acc.Reload()
            tags = set(acc.Tags()["scalars"])
            assert {"train/loss", "train/lr", "time/t_step", "time/t_halo", "memory/peak_bytes",
                    "throughput/samples_per_s", "val/loss", "val/mae"} <= tags
            loss = acc.Scalars("train/loss")
            assert [(e.step, round(e.value, 5)) for e in loss] == \
                [(s, round(v, 5)) for s, v in sorted(history.items())]
            assert [e.step for e in acc.Scalars("val/loss")] == [2, 4]
            assert len(list(events.iterdir())) == 1                          # rank 0 only
        for r in range(2):
            trace = json.loads((tmp / "r" / "profile" / f"rank-{r:05d}.json").read_text())
            names = {e.get("name") for e in trace["traceEvents"]}
            assert {"hpcpar.halo_exchange", "hpcpar.halo_exchange.backward", "hpcpar.allreduce",
                    "hpcpar.allreduce.launch"} <= names, r


def test_job_keys(tmp_path, monkeypatch):
    from hpcpar.run.callbacks import TensorBoardCallback, job_callbacks

    (tmp_path / "my_tracker.py").write_text(
        "from hpcpar.run.callbacks import Callback\n"
        "class Tracker(Callback):\n    def __init__(self, job):\n        self.job = job\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    j = job(output={"tensorboard": True, "callbacks": ["my_tracker:Tracker"]})
    cbs = job_callbacks(j)
    assert [type(c).__name__ for c in cbs] == ["TensorBoardCallback", "Tracker"]
    assert isinstance(cbs[0], TensorBoardCallback) and cbs[1].job is j
    with pytest.raises(ConfigError, match="has no 'Trackr'"):
        job_callbacks(job(output={"callbacks": ["my_tracker:Trackr"]}))
    with pytest.raises(ConfigError, match=r"\[profile\] steps: '5-2' is not a step window"):
        job(profile={"steps": "5-2"})
    with pytest.raises(ConfigError, match=r"starts after the last step \(4\); use e.g. --set "
                                          r"profile.steps=\"1-4\""):
        job(profile={"steps": "9-10"})
    assert job().profile.steps is None and job().output.tensorboard is False
