"""Hooks into the training loop for trackers: :class:`Callback`, and TensorBoard built on it.

A callback sees the loop from every rank (``trainer.rank``; most trackers write from rank 0
only). Give them to :func:`hpcpar.run.trainer.train` (``callbacks=[...]``) or name them in the
job, ``[output] callbacks = ["my_pkg.tracking:make_callback"]`` (an importable callable
``factory(job) -> Callback``, resolved on every rank); ``[output] tensorboard = true`` adds
:class:`TensorBoardCallback`. A callback must not communicate: it runs between the loop's
collectives, and a rank that blocks in one stalls them all.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from hpcpar.errors import ConfigError
from hpcpar.formats.jobspec import check_tensorboard

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from hpcpar.formats.jobspec import JobSpec

__all__ = ["Callback", "TensorBoardCallback", "job_callbacks", "check_tensorboard"]

#: Step-record columns written as TensorBoard scalars under ``time/`` (seconds).
STEP_SCALARS = ("t_step", "t_data", "t_fwd", "t_bwd", "t_halo", "t_allreduce_exposed", "t_opt")


class Callback:
    """Override what you need; every hook is called on every rank, in loop order."""

    def on_train_start(self, trainer: Any) -> None:
        """After set-up (and resume), before the first step of this segment. ``trainer`` is the
        :class:`hpcpar.run.trainer.Trainer` (``.job``, ``.rank``, ``.grid``, ``.run_dir``,
        ``.step``, ``.total``, ``.model``), in every hook."""

    def on_step_end(self, trainer: Any, row: dict, mean_loss: float) -> None:
        """After each optimizer step (``trainer.step`` already counts it): ``row`` is this
        rank's step record (``hpcpar.formats.records.COLUMNS``: ``t_step``, ``samples``,
        ``peak_mem``, ...), ``mean_loss`` the step's loss averaged over all ranks (NaN for a
        skipped step)."""

    def on_validation(self, trainer: Any, metrics: dict) -> None:
        """After a validation (every ``[train] val_every`` steps) and the final metrics;
        ``metrics`` (name -> value) are the same on every rank."""

    def on_train_end(self, trainer: Any, metrics: dict) -> None:
        """At the end of this segment (finished, stopped by a signal or diverged); ``metrics``
        are the final metrics when finished, else ``{}``."""


class TensorBoardCallback(Callback):
    """Event files in ``RUN/tensorboard`` from rank 0: ``train/loss`` (mean over ranks),
    ``train/lr``, ``time/<phase>`` per step, ``throughput/samples_per_s`` (whole job),
    ``memory/peak_bytes`` and ``val/<metric>``; ``tensorboard --logdir RUN/tensorboard``
    (``log_dir`` None)."""

    def __init__(self, log_dir: str | None = None):
        self.log_dir = log_dir
        self.writer: SummaryWriter | None = None

    def on_train_start(self, trainer: Any) -> None:
        if trainer.rank != 0:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.log_dir or str(trainer.run_dir / "tensorboard"),
                                    purge_step=trainer.step + 1 if trainer.step else None)

    def on_step_end(self, trainer: Any, row: dict, mean_loss: float) -> None:
        if self.writer is None:
            return
        step, w = trainer.step, self.writer
        if mean_loss == mean_loss:
            w.add_scalar("train/loss", mean_loss, step)
        w.add_scalar("train/lr", trainer.scheduler.get_last_lr()[0], step)
        for key in STEP_SCALARS:
            if row.get(key) is not None:
                w.add_scalar(f"time/{key}", row[key], step)
        replicas = trainer.grid.shape[0]
        w.add_scalar("throughput/samples_per_s",
                     row["samples"] * replicas / max(row["t_step"], 1e-12), step)
        if row.get("peak_mem") is not None:
            w.add_scalar("memory/peak_bytes", row["peak_mem"], step)

    def on_validation(self, trainer: Any, metrics: dict) -> None:
        if self.writer is not None:
            for key, value in metrics.items():
                name = key[4:] if key.startswith("val_") else key
                self.writer.add_scalar(f"val/{name}", value, trainer.step)

    def on_train_end(self, trainer: Any, metrics: dict) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None


def _factory(path: str) -> Any:
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ConfigError(f"[output] callbacks: {path!r}: expected 'package.module:factory'")
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"[output] callbacks: {path!r}: cannot import {exc.name!r}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"[output] callbacks: {path!r}: {module!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def job_callbacks(job: JobSpec) -> list[Callback]:
    """The callbacks a job asks for: TensorBoard, then ``factory(job)`` of each of ``[output]
    callbacks`` in order; ConfigError for one that cannot be imported, or tensorboard missing."""
    out: list[Callback] = []
    if job.output.tensorboard:
        check_tensorboard()
        out.append(TensorBoardCallback())
    for path in job.output.callbacks:
        out.append(_factory(path)(job))
    return out
