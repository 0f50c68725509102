"""How a model kind plugs into the training loop and ``hpcpar run``.

The loop (``hpcpar.run.trainer``) knows nothing about volumes or graphs. A *workload* owns the
model, its data and its loss; the loop owns the steps, timings, optimizer, lr schedule, precision,
checkpoints, signals, records and logs. ``[model] kind`` in a job file picks the workload::

    from hpcpar.run.workloads.base import Workload, Param, StepResult, register_workload

    @register_workload("gcn")
    class GCNWorkload(Workload):
        model_params = {"hidden": Param(int, 16, min=1), "dropout": Param(float, 0.5, min=0, max=1)}
        data_params = {"path": Param(str), "normalize": Param(bool, True)}

        def build_model(self):            # distributed model on self.device, not yet synced
            ...
        def steps_per_epoch(self):        # full-graph training: one step per epoch
            return 1
        def batches(self, epoch):         # this rank's batches of one epoch
            yield self.graph
        def forward_loss(self, model, batch):
            out = model(batch.x)
            return StepResult(loss=..., samples=n_owned_train)
        def evaluate(self, model):        # collective; same dict on every rank
            return {"val_acc": ..., "val_loss": ...}

Lifecycle, per rank (every call is made on every rank in the same order; methods marked
*collective* may communicate):

1. ``W(job, grid, device)``: ``job`` (:class:`hpcpar.formats.jobspec.JobSpec`) holds this
   kind's keys in ``job.model.params`` / ``job.data.params``, validated, defaults filled.
2. ``build_model()`` -> ``nn.Module`` on ``self.device``; every rank must build identical
   initial replicated parameters (seed with ``job.train.seed`` before creating layers).
3. ``param_groups(model)`` -> what the optimizer gets (default: all trainable parameters in one
   group; override e.g. for weight decay on the first layer only); the loop adds lr/options.
4. ``wrap(model)`` -> the module trained (default: ``hpcpar.DistributedDataParallel`` over the
   grid with the job's ``[ddp]`` options). Override when the gradient convention differs.
5. Per epoch: ``batches(epoch)`` -> iterator over this rank's batches (``steps_per_epoch()`` of
   them, the same count on every rank). After ``load_state_dict`` the first call continues the
   saved epoch mid-way (mid-epoch resume must be bit-identical to not stopping).
6. Per step: ``forward_loss(model, batch)`` -> :class:`StepResult`; the loop calls
   ``result.loss.backward()``, so the *convention* is: after ``wrap``'s gradient sync,
   gradients equal the single-process gradients. For the default DDP (sum over spatial ranks,
   average over data ranks) return the mean loss over this rank's local samples. ``samples``
   counts this replica's samples (the loop divides by the spatial size itself).
7. ``evaluate(model)`` (collective) -> ``{"val_loss": .., "val_acc": ..}``, the same dict on
   every rank, every ``[train] val_every`` steps, in eval mode under ``torch.no_grad``;
   ``final_metrics(model)`` (collective, default ``evaluate``) at the end, e.g. adding
   ``test_acc``. Metric names land in ``RUN/metrics.json`` as given.
8. ``state_dict()`` / ``load_state_dict(d)``: data position (epoch, index, shuffle state) for
   checkpoints; per rank, picklable with plain types/tensors only (``weights_only=True``).
9. ``run_meta()``: facts decided at run time, JSON-able, recorded in ``RUN/meta.json``.
10. ``close()``: stop prefetchers, close files.

Read when validating a job (before any rank starts, without MPI): ``model_params`` /
``data_params`` / ``train_params`` (dicts of :class:`Param`: the ``[model]`` / ``[data]`` /
extra ``[train]`` keys; unknown keys are errors), ``splits_global_batch`` (False when ``[train]
global_batch`` is not split over data ranks, e.g. full-graph training) and an optional
``check_job(job)`` staticmethod raising :class:`hpcpar.errors.ConfigError` for cross-field
problems. Import torch inside methods, not at module import: validation runs in the launcher.

Your own kind, without editing hpcpar (``docs/guides/custom-workloads.md``): name it in the job
as an import path, ``[model] kind = "my_pkg.my_module:MyWorkload"`` (any importable callable
``(job, grid, device) -> Workload``; the working directory is searched too, like ``python -m``),
or by an installed package's entry point in the ``hpcpar.workloads`` group
(``[project.entry-points."hpcpar.workloads"] mykind = "my_pkg.my_module:MyWorkload"``). The kind
string is stored in ``RUN/job.json`` as written, so the ranks, resumed runs, sweeps, submitted
jobs and reports all resolve it the same way. A kind read back from a run directory by a tool
that only reads it (``report --plan``, ``plan --fit-on``) is *untrusted*: only built-in kinds
and kinds this process already loaded resolve; any other needs ``--trust-kind`` and a module
installed outside the working directory (:func:`get_workload`'s ``untrusted``), so opening
someone's run directory runs none of its code.

Checkpoints store ``hpcpar.run.checkpoint.capture.full_state_dict(model)``: the unpartitioned
single-process ``state_dict`` (modules exposing ``full_state_dict()`` / ``load_full_state_dict()``
are asked for theirs, e.g. tensor-parallel layers). ``reference_model()`` optionally returns the
plain single-process twin (same keys) so tests can ``load_state_dict`` a checkpoint into it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpcpar.formats.kinds import (  # re-exported: a kind's module imports them from here
    ENTRY_POINT_GROUP,
    REQUIRED,
    SEED_MAX,
    Param,
    get_workload,
    known_kinds,
    register_workload,
)

if TYPE_CHECKING:
    import torch

    from hpcpar.formats.jobspec import JobSpec
    from hpcpar.parallel.grid import ProcessGrid

__all__ = ["REQUIRED", "SEED_MAX", "MAX_POOLINGS", "ENTRY_POINT_GROUP", "Param", "StepResult",
           "Workload", "register_workload", "known_kinds", "get_workload"]

#: the most poolings a volume model may have: an edge of 2**20 voxels is beyond any sample
MAX_POOLINGS = 20


@dataclass
class StepResult:
    """What ``forward_loss`` returns: the ``loss`` tensor the loop calls ``backward()`` on, the
    ``samples`` this rank's data-parallel replica processed this step, the ``loss_value`` (a
    float) logged and recorded (``loss.item()`` when None), and ``extra`` values for the log."""

    loss: Any
    samples: int
    loss_value: float | None = None
    extra: dict = field(default_factory=dict)


class Workload:
    """Base class of a model kind (``kind``: its ``[model] kind`` name); the module docstring
    states the full contract. Every method is called on every rank in the same order."""

    kind: str = ""
    model_params: dict[str, Param] = {}   # the [model] keys this kind accepts
    data_params: dict[str, Param] = {}    # the [data] keys
    train_params: dict[str, Param] = {}   # extra [train] keys
    splits_global_batch: bool = True      # [train] global_batch must divide over data ranks

    def __init__(self, job: JobSpec, grid: ProcessGrid, device: torch.device):
        self.job, self.grid, self.device = job, grid, device

    # -- model -------------------------------------------------------------------------------
    def build_model(self) -> torch.nn.Module:
        """The distributed model on ``self.device``, identical initial weights on every rank."""
        raise NotImplementedError

    def reference_model(self) -> torch.nn.Module | None:
        """The plain single-process twin (same state_dict keys), or None."""
        return None

    def param_groups(self, model: torch.nn.Module) -> list[dict]:
        """Optimizer parameter groups (default: every trainable parameter in one group); the
        loop adds lr and optimizer options."""
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module trained, whose backward synchronises gradients: by default
        ``DistributedDataParallel`` with the job's ``[ddp]``."""
        from hpcpar.sync.ddp import DistributedDataParallel  # deferred: loads torch, numpy

        opts = {**self.job.ddp.as_kwargs(), "grad_sync": self.job.train.grad_sync}
        return DistributedDataParallel(model, self.grid, **opts)

    # -- data --------------------------------------------------------------------------------
    def steps_per_epoch(self) -> int:
        """Steps in one epoch, the same on every rank."""
        raise NotImplementedError

    def batches(self, epoch: int) -> Iterable[Any]:
        """This rank's ``steps_per_epoch()`` batches of one epoch (continuing mid-epoch after
        ``load_state_dict``)."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """This rank's data position (epoch, index, shuffle state) for checkpoints."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore the data position ``state_dict`` returned on this rank."""

    # -- loss and metrics ----------------------------------------------------------------------
    def forward_loss(self, model: torch.nn.Module, batch: Any) -> StepResult:
        """Forward one batch of ``batches`` through the wrapped model: the loss (after the
        gradient sync, gradients must equal the single-process ones: for the default DDP, the
        mean over this rank's samples) and the samples."""
        raise NotImplementedError

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Validation metrics of the wrapped model, e.g. ``{"val_loss": ..., "val_acc": ...}``,
        the same dict on every rank (collective; eval mode, no grad)."""
        return {}

    def final_metrics(self, model: torch.nn.Module) -> dict[str, float]:
        """Metrics at the end of training, written to ``RUN/metrics.json`` (collective;
        default ``evaluate``)."""
        return self.evaluate(model)

    def run_meta(self) -> dict:
        """Facts decided at run time (e.g. the input transform the dataset asked for),
        recorded in ``RUN/meta.json``; JSON-able."""
        return {}

    def close(self) -> None:
        """Stop prefetchers and close files."""
