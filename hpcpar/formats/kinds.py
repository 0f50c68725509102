"""Model kinds as a job file names them: the registry of ``[model] kind`` -> workload factory
(built in, registered, an installed package's entry point, or ``package.module:Callable`` /
``file.py:Callable``) and :class:`Param`, how a kind declares the job keys it accepts.

An import path that names a plain model (an ``nn.Module`` subclass, or a function that is not
a workload factory ``(job, grid, device)``) gets the built-in workload for users' own models
(:data:`MODEL_WORKLOAD`): the user's file holds only the model.

It lives with the job format, below the runtime, because validating a job file needs the keys a
kind declares but none of the training loop: the registry stores factories and reads their
``*_params`` attributes; what a workload *does* is :mod:`hpcpar.run.workloads.base`.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from hpcpar.errors import ConfigError

__all__ = ["REQUIRED", "SEED_MAX", "ENTRY_POINT_GROUP", "Param", "load_object", "register_workload",
           "known_kinds", "get_workload"]

REQUIRED = object()

#: the largest seed a job accepts: NumPy's legacy generator (``np.random.seed``) takes 32 bits
SEED_MAX = 2**32 - 1
@dataclass(frozen=True)
class Param:
    """One job key: accepted type (or tuple of types), default (``REQUIRED`` if it must be
    given), inclusive ``min``/``max`` for numbers, ``choices`` when a closed set, and ``help``,
    one line for the documentation and error messages.

    ``path``: a file or directory, whose leading ``~`` is expanded once, where the job is
    parsed, so every reader (pyarrow expands it itself) sees the same path. ``compare``: runs
    that differ in this key are not like for like (a scaling report gives them rows of their
    own); False for what a scaling sweep varies with the rank count (the grid, the resources,
    the global batch) and for what changes nothing measured (a description, how often to log).
    """

    type: type | tuple = float
    default: Any = REQUIRED
    min: float | None = None
    max: float | None = None
    choices: tuple | None = None
    help: str = ""
    path: bool = False
    compare: bool = True

    @property
    def required(self) -> bool:
        """True when the key has no default."""
        return self.default is REQUIRED


# -- registry ---------------------------------------------------------------------------------
_REGISTRY: dict[str, Callable[..., Any]] = {}

# kinds whose module registers them on import (so a job file can name them without the
# user importing anything); a module registering a kind listed here must live at that path.
_BUILTIN = {
    "cosmoflow": "hpcpar.run.workloads.volume",
    "unet3d": "hpcpar.run.workloads.volume",
    "gcn": "hpcpar.run.workloads.graph",
    "sage": "hpcpar.run.workloads.graph",
    "gat": "hpcpar.run.workloads.graph",
}

#: ``module:function(kind, model) -> workload factory``: the built-in workload a plain model
#: named by ``[model] kind`` trains with (imported by name: this module stays below the runtime)
MODEL_WORKLOAD = "hpcpar.run.workloads.usermodel:model_workload"


def register_workload(kind: str, factory: Callable[..., Any] | None = None) -> Any:
    """Register a model kind for ``[model] kind`` in job files; returns ``factory``, or without
    one, a decorator that registers what it decorates.

    ``factory(job, grid, device) -> Workload`` is normally the Workload subclass itself; its
    ``model_params``/``data_params`` are read for job validation (a factory function may carry
    them as attributes too).
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
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_kinds() -> list[str]:
    """Every registered, built-in and installed (entry point) kind, sorted."""
    return sorted(set(_REGISTRY) | set(_BUILTIN) | set(_entry_points()))


def _check_factory(kind: str, factory: Any, origin: str) -> Callable[..., Any]:
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
    return os.path.realpath(entry or ".") == os.path.realpath(os.getcwd())


def _installed_module(kind: str, module: str, origin: str) -> None:
    """Refuse a module an untrusted kind names unless it is installed: found on ``sys.path``
    without the working directory (a module there is whatever that folder holds)."""
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


def _import_path(kind: str, installed_only: bool = False) -> Callable[..., Any]:
    """``"package.module:Attr"`` (``Attr`` may be dotted) or ``"file.py:Attr"``: import the
    module (also from the working directory, like ``python -m``, unless ``installed_only``) and
    return the attribute (a plain model: its built-in workload)."""
    if _is_file_kind(kind) and installed_only:
        raise ConfigError(f"[model] kind {kind!r}: a file path is never imported for a run "
                          f"directory's kind (plan with the job file that names it)")
    mod, attr = _import_module(kind, "[model] kind", installed_only)
    obj = _attribute(kind, mod, attr, "[model] kind")
    if _is_plain_model(obj):
        return _model_workload(kind, obj)
    return _check_factory(kind, obj, attr)


def load_object(text: str, field: str) -> Any:
    """The object an import path ``"package.module:Attr"`` or ``"file.py:Attr"`` names (a
    user's loss for ``[train] loss``); ``field`` names the job key in messages."""
    mod, attr = _import_module(text, field)
    return _attribute(text, mod, attr, field)


def _import_module(kind: str, field: str, installed_only: bool = False) -> tuple[Any, str]:
    """The imported module of an import path and the attribute it names."""
    if _is_file_kind(kind):
        module, _, attr = kind.rpartition(":")
        return _import_file(kind, module, field), attr
    module, _, attr = kind.partition(":")
    names = module.split(".") + attr.split(".")
    if not module or not attr or not all(p.isidentifier() for p in names):
        raise ConfigError(f"{field} {kind!r}: expected a kind name or "
                          f"'package.module:Callable'")
    if installed_only:
        saved = sys.path[:]
        sys.path[:] = [p for p in saved if not _is_cwd(p)]
        try:
            return importlib.import_module(module), attr
        except ModuleNotFoundError as exc:
            if not (exc.name and module.startswith(exc.name)):
                raise
            raise ConfigError(f"{field} {kind!r}: no installed module {exc.name!r}") \
                from None
        finally:
            sys.path[:] = saved
    cwd = os.getcwd()
    for attempt in (0, 1):
        try:
            return importlib.import_module(module), attr
        except ModuleNotFoundError as exc:
            if not (exc.name and module.startswith(exc.name)):
                raise          # the user's module imports something missing: show it
            if attempt or cwd in sys.path:
                raise ConfigError(f"{field} {kind!r}: cannot import module {exc.name!r} "
                                  f"(install the package, add its folder to PYTHONPATH, or run "
                                  f"from the folder that holds it)") from None
            sys.path.append(cwd)   # a module next to the job, as `python -m` would find it
    raise AssertionError("unreachable")


def _is_file_kind(kind: str) -> bool:
    """``"net.py:UNet"`` or ``"models/net.py:UNet"``: a Python file, not a module name."""
    return kind.rpartition(":")[0].endswith(".py")


def _import_file(kind: str, path: str, field: str) -> Any:
    """The module of a ``file.py:Callable`` kind, loaded from ``path`` (relative to the working
    directory, where ``hpcpar run`` and its ranks start) under a name made from its absolute
    path, so two files called ``net.py`` do not collide and every rank loads it once."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise ConfigError(f"{field} {kind!r}: file {path!r} not found (working directory "
                          f"{os.getcwd()})")
    name = "hpcpar_user_" + "".join(c if c.isalnum() else "_" for c in full)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    folder = os.path.dirname(full)
    added = folder not in sys.path
    if added:   # the model file may import its neighbours, as `python net.py` would
        sys.path.append(folder)
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def _is_plain_model(obj: Any) -> bool:
    """An ``nn.Module`` subclass, or a function that is not a workload factory (whose first
    parameters are ``job, grid, device``) nor carries a kind's ``*_params``."""
    torch = sys.modules.get("torch")
    if isinstance(obj, type):
        return torch is not None and issubclass(obj, torch.nn.Module)
    if not inspect.isfunction(obj) or any(hasattr(obj, f"{n}_params")
                                           for n in ("model", "data", "train")):
        return False
    params = list(inspect.signature(obj).parameters)
    return params[:3] != ["job", "grid", "device"]


def _model_workload(kind: str, model: Any) -> Callable[..., Any]:
    module, _, attr = MODEL_WORKLOAD.partition(":")
    return getattr(importlib.import_module(module), attr)(kind, model)


def _attribute(kind: str, mod: Any, attr: str, field: str) -> Any:
    """The (dotted) attribute ``attr`` of the imported module of ``kind``."""
    module = mod.__name__
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            hint = difflib.get_close_matches(part, names, n=1)
            more = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(f"{field} {kind!r}: module {module!r} has no attribute "
                              f"{attr!r}{more}")
        obj = getattr(obj, part)
    return obj


def _from_entry_point(kind: str, ep: Any) -> Callable[..., Any]:
    try:
        factory = ep.load()
    except Exception as exc:  # noqa: BLE001 - a broken plugin: name it, keep the cause
        dist = getattr(getattr(ep, "dist", None), "name", None) or "an installed package"
        raise ConfigError(f"[model] kind {kind!r}: the entry point {ep.value!r} of {dist} "
                          f"(group {ENTRY_POINT_GROUP!r}) failed to load: "
                          f"{type(exc).__name__}: {exc}") from None
    return _check_factory(kind, factory, ep.value)


def get_workload(kind: str, untrusted: str | None = None,
                 trust_kind: bool = False) -> Callable[..., Any]:
    """The factory (normally the Workload subclass, whose ``model_params``/``data_params``/
    ``train_params`` declare the kind's job keys) of a ``[model] kind``: registered, built-in,
    an installed package's entry point in the ``hpcpar.workloads`` group, or an import path
    ``"package.module:Callable"``.

    ``untrusted`` names where the kind was read when that is not the user's own job (a run
    directory's ``job.json``): then only built-in and already loaded kinds resolve, unless
    ``trust_kind`` (also load it from an installed package, never the working directory).
    Raises ConfigError for an unknown kind (with a "did you mean"), a module or attribute that
    cannot be imported, a broken entry point, a built-in kind whose module is missing from this
    build, or an untrusted kind that would import code.
    """
    if untrusted is not None and kind not in _REGISTRY and kind not in _BUILTIN:
        if not trust_kind:
            raise ConfigError(f"{untrusted}: [model] kind {kind!r} is not built in, and hpcpar "
                              f"imports no code a run directory names: pass --trust-kind to "
                              f"load it from an installed package (never the working "
                              f"directory), or plan with the job file that names it")
        if ":" in kind:
            if not _is_file_kind(kind):
                _installed_module(kind, kind.partition(":")[0], untrusted)
            _REGISTRY[kind] = _import_path(kind, installed_only=True)
    if kind in _REGISTRY:
        return _REGISTRY[kind]
    if kind in _BUILTIN:
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
