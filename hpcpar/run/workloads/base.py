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
:class:`hpcpar.errors.ConfigError` for cross-field problems. Keep the workload module
importable without torch at import time (import torch inside methods): job validation runs in
the launcher process.

Your own kind, without editing hpcpar (``docs/guides/custom-workloads.md``): name it in the job
as an import path, ``[model] kind = "my_pkg.my_module:MyWorkload"`` (any importable callable
``(job, grid, device) -> Workload``; the working directory is searched too, like
``python -m``), or give it a name from an installed package's entry point in the
``hpcpar.workloads`` group (``[project.entry-points."hpcpar.workloads"] mykind =
"my_pkg.my_module:MyWorkload"``). The kind string is stored in ``RUN/job.json`` as written,
so the ranks, resumed runs, sweeps, submitted jobs and reports all resolve it the same way.
A kind read back from a run directory by a tool that only reads it (``report --plan``,
``plan --fit-on``) is *untrusted*: only built-in kinds and kinds this process already loaded
resolve; any other needs ``--trust-kind`` and a module installed outside the working directory
(:func:`get_workload`'s ``untrusted``), so opening someone's run directory runs none of its code.

Checkpoints store ``hpcpar.run.checkpoint.full_state_dict(model)``: the unpartitioned
single-process ``state_dict`` (modules exposing ``full_state_dict()`` / ``load_full_state_dict()``
are asked for theirs, e.g. tensor-parallel layers). ``reference_model()`` optionally returns the
plain single-process twin so tests can ``load_state_dict`` a checkpoint into it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpcpar.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from hpcpar.parallel.grid import ProcessGrid
    from hpcpar.run.jobspec import JobSpec

__all__ = ["REQUIRED", "SEED_MAX", "MAX_POOLINGS", "ENTRY_POINT_GROUP", "Param", "StepResult",
           "Workload", "register_workload", "known_kinds", "get_workload"]

REQUIRED = object()

#: the largest seed a job accepts: NumPy's legacy generator (``np.random.seed``) takes 32 bits
SEED_MAX = 2**32 - 1
#: the most poolings a volume model may have: an edge of 2**20 voxels is beyond any sample
MAX_POOLINGS = 20


@dataclass(frozen=True)
class Param:
    """One kind-specific job key: type(s), default (``REQUIRED`` if none), range, choices.

    Attributes:
        type: Accepted Python type, or a tuple of them.
        default: The default value; ``REQUIRED`` when the key must be given.
        min: Smallest accepted value (numbers).
        max: Largest accepted value (numbers).
        choices: The accepted values, when they are a closed set.
        help: One line for the documentation and error messages.
    """

    type: type | tuple = float
    default: Any = REQUIRED
    min: float | None = None
    max: float | None = None
    choices: tuple | None = None
    help: str = ""

    @property
    def required(self) -> bool:
        """True when the key has no default."""
        return self.default is REQUIRED


@dataclass
class StepResult:
    """What ``forward_loss`` returns: the loss to backpropagate and the samples it covered.

    Attributes:
        loss: The loss tensor the loop calls ``backward()`` on.
        samples: Samples this rank's data-parallel replica processed this step.
        loss_value: What is logged and recorded; ``loss.item()`` when None.
        extra: Further per-step values for the log.
    """

    loss: Any
    samples: int
    loss_value: float | None = None
    extra: dict = field(default_factory=dict)


class Workload:
    """Base class of a model kind; the module docstring states the full contract.

    Every method is called on every rank in the same order.

    Args:
        job: The validated job; ``job.model.params`` and ``job.data.params`` hold this
            kind's keys.
        grid: The process grid.
        device: Where the model and batches live.

    Attributes:
        kind: The ``[model] kind`` name.
        model_params: The ``[model]`` keys this kind accepts.
        data_params: The ``[data]`` keys this kind accepts.
        train_params: Extra ``[train]`` keys this kind accepts.
        splits_global_batch: Whether ``[train] global_batch`` is split over data ranks.
    """

    kind: str = ""
    model_params: dict[str, Param] = {}
    data_params: dict[str, Param] = {}
    train_params: dict[str, Param] = {}   # extra [train] keys this kind understands
    splits_global_batch: bool = True      # [train] global_batch must divide over data ranks

    def __init__(self, job: JobSpec, grid: ProcessGrid, device: torch.device):
        self.job = job
        self.grid = grid
        self.device = device

    # -- model -------------------------------------------------------------------------------
    def build_model(self) -> torch.nn.Module:
        """The distributed model on ``self.device``, identical initial weights on every rank."""
        raise NotImplementedError

    def reference_model(self) -> torch.nn.Module | None:
        """The plain single-process twin (same state_dict keys), or None."""
        return None

    def param_groups(self, model: torch.nn.Module) -> list[dict]:
        """What the optimizer gets (default: every trainable parameter in one group).

        Args:
            model: The model ``build_model`` returned.

        Returns:
            Optimizer parameter groups; the loop adds lr and optimizer options.
        """
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module trained: by default ``DistributedDataParallel`` with the job's ``[ddp]``.

        Args:
            model: The model ``build_model`` returned.

        Returns:
            The wrapped model whose backward synchronises gradients.
        """
        from hpcpar.sync.ddp import DistributedDataParallel

        opts = self.job.ddp.as_kwargs() if hasattr(self.job, "ddp") else {}
        train = getattr(self.job, "train", None)
        if getattr(train, "grad_sync", None):
            opts.setdefault("grad_sync", train.grad_sync)
        return DistributedDataParallel(model, self.grid, **opts)

    # -- data --------------------------------------------------------------------------------
    def steps_per_epoch(self) -> int:
        """Steps in one epoch, the same on every rank."""
        raise NotImplementedError

    def batches(self, epoch: int) -> Iterable[Any]:
        """This rank's batches of one epoch (continuing mid-epoch after ``load_state_dict``).

        Args:
            epoch: The epoch index.

        Returns:
            An iterable of ``steps_per_epoch()`` batches.
        """
        raise NotImplementedError

    def state_dict(self) -> dict:
        """This rank's data position (epoch, index, shuffle state) for checkpoints."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore a data position saved by ``state_dict``.

        Args:
            state: What ``state_dict`` returned on this rank.
        """

    # -- loss and metrics ----------------------------------------------------------------------
    def forward_loss(self, model: torch.nn.Module, batch: Any) -> StepResult:
        """Forward one batch and return the loss to backpropagate.

        Args:
            model: The wrapped model.
            batch: One item of ``batches``.

        Returns:
            The loss (after the gradient sync, gradients must equal the single-process
            ones: for the default DDP, the mean over this rank's samples) and the samples.
        """
        raise NotImplementedError

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Validation metrics, the same dict on every rank (collective; eval mode, no grad).

        Args:
            model: The wrapped model.

        Returns:
            Metric name -> value, e.g. ``{"val_loss": ..., "val_acc": ...}``.
        """
        return {}

    def final_metrics(self, model: torch.nn.Module) -> dict[str, float]:
        """Metrics at the end of training (collective; default ``evaluate``).

        Args:
            model: The wrapped model.

        Returns:
            Metric name -> value; written to ``RUN/metrics.json``.
        """
        return self.evaluate(model)

    def run_meta(self) -> dict:
        """Facts decided at run time (e.g. the input transform the dataset asked for),
        recorded in ``RUN/meta.json``; JSON-able."""
        return {}

    def close(self) -> None:
        """Stop prefetchers and close files."""


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


def register_workload(kind: str, factory: Callable[..., Workload] | None = None) -> Any:
    """Register a model kind for ``[model] kind`` in job files; usable as a decorator.

    Args:
        kind: The kind's name.
        factory: ``factory(job, grid, device) -> Workload``, normally the Workload subclass
            itself; its ``model_params``/``data_params`` are read for job validation (a
            factory function may carry them as attributes too). None: return a decorator.

    Returns:
        ``factory``, or a decorator that registers what it decorates.
    """

    def deco(f):
        _REGISTRY[kind] = f
        return f

    return deco(factory) if factory is not None else deco


#: The entry-point group through which an installed package adds kinds by name
#: (``[project.entry-points."hpcpar.workloads"]`` in its pyproject.toml).
ENTRY_POINT_GROUP = "hpcpar.workloads"


def _entry_points() -> dict:
    """Name -> entry point of the ``hpcpar.workloads`` group of every installed package."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_kinds() -> list[str]:
    """Every registered, built-in and installed (entry point) kind, sorted."""
    return sorted(set(_REGISTRY) | set(_BUILTIN) | set(_entry_points()))


def _check_factory(kind: str, factory: Any, origin: str) -> Callable[..., Workload]:
    if not callable(factory):
        raise ConfigError(f"[model] kind {kind!r}: {origin} is {type(factory).__name__}, not a "
                          f"Workload subclass or factory")
    for attr in ("model_params", "data_params", "train_params"):
        params = getattr(factory, attr, {})
        if not isinstance(params, dict) or not all(isinstance(v, Param)
                                                   for v in params.values()):
            raise ConfigError(f"[model] kind {kind!r}: {origin}.{attr} must be a dict of "
                              f"hpcpar.run.workloads.base.Param")
    return factory


def _is_cwd(entry: str) -> bool:
    import os

    return os.path.realpath(entry or ".") == os.path.realpath(os.getcwd())


def _installed_module(kind: str, module: str, origin: str) -> None:
    """Refuse a module an untrusted kind names unless it is installed: found on ``sys.path``
    without the working directory (a module there is whatever that folder holds)."""
    import importlib.util
    import sys

    saved = sys.path[:]
    sys.path[:] = [p for p in saved if not _is_cwd(p)]
    try:
        spec = importlib.util.find_spec(module.split(".")[0])   # a top level runs no code
    finally:
        sys.path[:] = saved
    if spec is None:
        raise ConfigError(f"{origin}: [model] kind {kind!r}: module {module.split('.')[0]!r} "
                          f"is not installed (a module in the working directory or the run "
                          f"directory is never imported for a run directory's kind)")


def _import_path(kind: str, installed_only: bool = False) -> Callable[..., Workload]:
    """``"package.module:Attr"`` (``Attr`` may be dotted): import the module (also from the
    working directory, like ``python -m``, unless ``installed_only``) and return the
    attribute."""
    import importlib
    import os
    import sys

    module, _, attr = kind.partition(":")
    names = module.split(".") + attr.split(".")
    if not module or not attr or not all(p.isidentifier() for p in names):
        raise ConfigError(f"[model] kind {kind!r}: expected a kind name or "
                          f"'package.module:Callable'")
    if installed_only:
        saved = sys.path[:]
        sys.path[:] = [p for p in saved if not _is_cwd(p)]
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if not (exc.name and module.startswith(exc.name)):
                raise
            raise ConfigError(f"[model] kind {kind!r}: no installed module {exc.name!r}") \
                from None
        finally:
            sys.path[:] = saved
        return _attribute(kind, mod, attr)
    cwd = os.getcwd()
    for attempt in (0, 1):
        try:
            mod = importlib.import_module(module)
            break
        except ModuleNotFoundError as exc:
            if not (exc.name and module.startswith(exc.name)):
                raise          # the user's module imports something missing: show it
            if attempt or cwd in sys.path:
                raise ConfigError(f"[model] kind {kind!r}: cannot import module {exc.name!r} "
                                  f"(install the package, add its folder to PYTHONPATH, or run "
                                  f"from the folder that holds it)") from None
            sys.path.append(cwd)   # a module next to the job, as `python -m` would find it
    return _attribute(kind, mod, attr)


def _attribute(kind: str, mod: Any, attr: str) -> Callable[..., Workload]:
    """The (dotted) attribute ``attr`` of the imported module of ``kind``."""
    module = mod.__name__
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            hint = difflib.get_close_matches(part, names, n=1)
            more = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(f"[model] kind {kind!r}: module {module!r} has no attribute "
                              f"{attr!r}{more}")
        obj = getattr(obj, part)
    return _check_factory(kind, obj, attr)


def _from_entry_point(kind: str, ep: Any) -> Callable[..., Workload]:
    try:
        factory = ep.load()
    except Exception as exc:  # noqa: BLE001 - a broken plugin: name it, keep the cause
        dist = getattr(getattr(ep, "dist", None), "name", None) or "an installed package"
        raise ConfigError(f"[model] kind {kind!r}: the entry point {ep.value!r} of {dist} "
                          f"(group {ENTRY_POINT_GROUP!r}) failed to load: "
                          f"{type(exc).__name__}: {exc}") from None
    return _check_factory(kind, factory, ep.value)


def get_workload(kind: str, untrusted: str | None = None,
                 trust_kind: bool = False) -> Callable[..., Workload]:
    """The factory of a kind: registered, built-in, an installed package's entry point in the
    ``hpcpar.workloads`` group, or an import path ``"package.module:Callable"``.

    Args:
        kind: The ``[model] kind`` value.
        untrusted: Where the kind was read from when that is not the user's own job (a run
            directory's ``job.json``): then only built-in and already loaded kinds resolve,
            unless ``trust_kind``.
        trust_kind: With ``untrusted``: also load the kind from an installed package (never
            from the working directory).

    Returns:
        The factory (normally the Workload subclass); ``model_params``/``data_params``/
        ``train_params`` on it declare the kind's job keys.

    Raises:
        ConfigError: An unknown kind (with a "did you mean"), a module or attribute that
            cannot be imported, a broken entry point, a built-in kind whose module is
            missing from this build, or an untrusted kind that would import code.
    """
    if untrusted is not None and kind not in _REGISTRY and kind not in _BUILTIN:
        if not trust_kind:
            raise ConfigError(f"{untrusted}: [model] kind {kind!r} is not built in, and hpcpar "
                              f"imports no code a run directory names: pass --trust-kind to "
                              f"load it from an installed package (never the working "
                              f"directory), or plan with the job file that names it")
        if ":" in kind:
            _installed_module(kind, kind.partition(":")[0], untrusted)
            _REGISTRY[kind] = _import_path(kind, installed_only=True)
    if kind in _REGISTRY:
        return _REGISTRY[kind]
    if kind in _BUILTIN:
        import importlib

        try:
            importlib.import_module(_BUILTIN[kind])
        except ModuleNotFoundError as exc:
            if exc.name and _BUILTIN[kind].startswith(exc.name):
                raise ConfigError(f"[model] kind {kind!r} is not available in this build "
                                  f"({_BUILTIN[kind]} is missing)") from None
            raise
    elif ":" in kind:
        _REGISTRY[kind] = _import_path(kind)
    else:
        eps = _entry_points()
        if kind in eps:
            _REGISTRY[kind] = _from_entry_point(kind, eps[kind])
    if kind not in _REGISTRY:
        hint = difflib.get_close_matches(kind, known_kinds(), n=1)
        more = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(f"[model] kind: unknown kind {kind!r}{more}; known: "
                          f"{', '.join(known_kinds())}, or 'package.module:Workload' for your "
                          f"own")
    return _REGISTRY[kind]
