"""How a model kind plugs into the training loop and ``hpcpar run``.

The loop (``hpcpar.run.trainer``) knows nothing about volumes or graphs. A *workload* owns the model,
its data and its loss; the loop owns the steps, timings, optimizer, lr schedule, precision,
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

1. ``W(job, grid, device)`` — ``job`` is a :class:`hpcpar.run.jobspec.JobSpec` (``job.model.params``
   and ``job.data.params`` hold this kind's keys, already validated against ``model_params`` /
   ``data_params``, defaults filled; ``job.train.seed``, ``job.train.global_batch`` ...).
2. ``build_model()`` -> ``nn.Module`` on ``self.device``; every rank must build identical
   initial replicated parameters (seed with ``job.train.seed`` before creating layers).
3. ``param_groups(model)`` -> what the optimizer gets (default: all parameters in one group;
   override e.g. for weight decay on the first layer only). The loop adds lr/optimizer options.
4. ``wrap(model)`` -> the module trained (default: ``hpcpar.DistributedDataParallel`` over the
   grid with the job's ``[ddp]`` options). Override when the gradient convention differs.
5. Per epoch: ``batches(epoch)`` -> iterator over this rank's batches (``steps_per_epoch()`` of
   them, the same count on every rank). After ``load_state_dict`` the first call continues the
   saved epoch mid-way (mid-epoch resume must be bit-identical to not stopping).
6. Per step: ``forward_loss(model, batch)`` -> :class:`StepResult`. The loop calls
   ``result.loss.backward()``, so the *convention* is: after ``wrap``'s gradient sync, gradients
   equal the single-process gradients. For the default DDP (sum over spatial ranks, average
   over data ranks) return the mean loss over this rank's local samples. ``samples`` is the
   number of samples this rank's data-parallel replica processed this step (the loop divides
   throughput bookkeeping by the spatial size itself). ``loss_value`` (optional float) is what
   is logged/recorded; default ``result.loss.item()``.
7. ``evaluate(model)`` (collective) -> ``{"val_loss": .., "val_acc": ..}``, called every
   ``[train] val_every`` steps with the model in eval mode under ``torch.no_grad``;
   ``final_metrics(model)`` (collective, default ``evaluate``) at the end, e.g. adding
   ``test_acc``. Metric names land in ``RUN/metrics.json`` as given.
8. ``state_dict()`` / ``load_state_dict(d)`` — data position (epoch, index, shuffle state) for
   checkpoints; per rank, picklable with plain types/tensors only (``weights_only=True``).
9. ``close()`` — stop prefetchers, close files.

Class attributes read when validating a job (before any rank starts, without MPI):
``model_params`` / ``data_params`` / ``train_params`` (dicts of :class:`Param`: the keys this
kind accepts in ``[model]`` / ``[data]`` / extra ``[train]`` keys; unknown keys are errors),
``splits_global_batch`` (False when ``[train] global_batch`` is not split over data ranks, e.g.
full-graph training) and an optional ``check_job(job)`` staticmethod raising
``HpcparError`` for cross-field problems. Keep the workload module importable without torch at
import time (import torch inside methods): job validation runs in the launcher process.

Checkpoints store ``hpcpar.run.checkpoint.full_state_dict(model)``: the unpartitioned
single-process ``state_dict`` (modules exposing ``full_state_dict()`` / ``load_full_state_dict()``
are asked for theirs, e.g. tensor-parallel layers). ``reference_model()`` optionally returns the
plain single-process twin so tests can ``load_state_dict`` a checkpoint into it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from hpcpar.errors import HpcparError

REQUIRED = object()


class WorkloadError(HpcparError, ValueError):
    """Unknown model kind or a workload-level configuration problem."""


@dataclass(frozen=True)
class Param:
    """One kind-specific job key: type(s), default (``REQUIRED`` if none), range, choices."""

    type: type | tuple = float
    default: Any = REQUIRED
    min: float | None = None
    max: float | None = None
    choices: tuple | None = None
    help: str = ""

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@dataclass
class StepResult:
    """What ``forward_loss`` returns: the loss to backpropagate and the samples it covered."""

    loss: Any
    samples: int
    loss_value: float | None = None
    extra: dict = field(default_factory=dict)


class Workload:
    """Base class of a model kind; see the module docstring for the contract."""

    kind: str = ""
    model_params: dict[str, Param] = {}
    data_params: dict[str, Param] = {}
    train_params: dict[str, Param] = {}   # extra [train] keys this kind understands
    splits_global_batch: bool = True      # [train] global_batch must divide over data ranks

    def __init__(self, job, grid, device):
        self.job = job
        self.grid = grid
        self.device = device

    # -- model -------------------------------------------------------------------------------
    def build_model(self):
        raise NotImplementedError

    def reference_model(self):
        """The plain single-process twin (same state_dict keys), or None."""
        return None

    def param_groups(self, model) -> list[dict]:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]

    def wrap(self, model):
        from hpcpar.sync.ddp import DistributedDataParallel

        opts = self.job.ddp.as_kwargs() if hasattr(self.job, "ddp") else {}
        return DistributedDataParallel(model, self.grid, **opts)

    # -- data --------------------------------------------------------------------------------
    def steps_per_epoch(self) -> int:
        raise NotImplementedError

    def batches(self, epoch: int) -> Iterable[Any]:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # -- loss and metrics ----------------------------------------------------------------------
    def forward_loss(self, model, batch) -> StepResult:
        raise NotImplementedError

    def evaluate(self, model) -> dict[str, float]:
        return {}

    def final_metrics(self, model) -> dict[str, float]:
        return self.evaluate(model)

    def close(self) -> None:
        pass


# -- registry ---------------------------------------------------------------------------------
_REGISTRY: dict[str, Callable[..., Workload]] = {}

# kinds whose module registers them on import (so a job file can name them without the
# user importing anything); a module registering a kind listed here must live at that path.
_BUILTIN = {
    "cosmoflow": "hpcpar.run.workloads.volume",
    "unet3d": "hpcpar.run.workloads.volume",
    "gcn": "hpcpar.run.workloads.graph",
    "sage": "hpcpar.run.workloads.graph",
}


def register_workload(kind: str, factory: Callable[..., Workload] | None = None):
    """Register ``factory(job, grid, device) -> Workload`` under ``kind``; usable as a decorator.

    ``factory`` is normally the Workload subclass itself; its ``model_params``/``data_params``
    are read for job validation (a factory function may carry them as attributes too).
    """

    def deco(f):
        _REGISTRY[kind] = f
        return f

    return deco(factory) if factory is not None else deco


def known_kinds() -> list[str]:
    return sorted(set(_REGISTRY) | set(_BUILTIN))


def get_workload(kind: str):
    """The registered factory for ``kind`` (importing the built-in module that defines it)."""
    if kind not in _REGISTRY and kind in _BUILTIN:
        import importlib

        try:
            importlib.import_module(_BUILTIN[kind])
        except ModuleNotFoundError as exc:
            if exc.name and _BUILTIN[kind].startswith(exc.name):
                raise WorkloadError(f"[model] kind {kind!r} is not available in this build "
                                    f"({_BUILTIN[kind]} is missing)") from None
            raise
    if kind not in _REGISTRY:
        hint = difflib.get_close_matches(kind, known_kinds(), n=1)
        more = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise WorkloadError(f"[model] kind: unknown kind {kind!r}{more}; known: "
                            f"{', '.join(known_kinds())}")
    return _REGISTRY[kind]
