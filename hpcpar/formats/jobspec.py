"""Job specs: one TOML file describes a distributed training run.

``load_job(path, overrides=["train.lr=0.01"])`` parses, applies ``--set`` overrides, validates
every key (unknown key with a did-you-mean, wrong type, out-of-range value, missing required
key) and returns a :class:`JobSpec` with defaults filled in. Every problem raises
:class:`ConfigError`, whose message is one line naming the file, ``[section] key`` and what was
expected. The kind-specific keys of ``[model]`` and ``[data]`` come from the workload registered
for ``[model] kind`` (``hpcpar.run.workloads.base``). This module does not import torch.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import os
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import NoneType, UnionType
from typing import Any, dataclass_transform, get_args, get_origin, get_type_hints

from hpcpar.errors import ConfigError, HpcparError
from hpcpar.formats.kinds import REQUIRED, SEED_MAX, Param, get_workload
from hpcpar.parallel.grid import AXES, resolve_shape

__all__ = ["TIME_RE", "SCHEMA", "Section", "JobSpec", "parse_override", "load_job", "build_job",
           "load_resolved", "profile_window"]

TIME_RE = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$")
#: A job name is one path component (run directories are runs/<name>-<time>, never elsewhere):
#: no '/' or NUL, not hidden, not an option
NAME_RE = re.compile(r"^[^/\0.\-][^/\0]{0,199}$")


#: keys renamed: section -> {old name: new name}; a job giving the old name is still read
#: (with a note saying so), the job as run (job.json) holds the new one
RENAMED: dict[str, dict[str, str]] = {
    "checkpoint": {"async": "background"},   # a Python keyword: no job.checkpoint.async
}


def key(default: Any = REQUIRED, **kw: Any) -> Any:
    """A job key, a field of its :class:`Section`: the :class:`Param` arguments but the type,
    which the field's annotation gives (``int | None``: an int, None only as the default)."""
    return field(metadata={"default": default, **kw})


def _param_type(hint: Any) -> type | tuple:
    parts = get_args(hint) if isinstance(hint, UnionType) else (hint,)
    types = tuple(get_origin(t) or t for t in parts if t is not NoneType)
    return types[0] if len(types) == 1 else types


@dataclass_transform(frozen_default=True)
@dataclass(frozen=True, repr=False)
class Section:
    """One validated section of a job, frozen: a run reads its job, never writes it.

    Each subclass is a frozen dataclass (``TrainSection`` is ``[train]``, a field of
    :class:`JobSpec`) declaring the section's keys as typed fields made by :func:`key`, from
    which :data:`SCHEMA` follows. ``params`` holds the keys the workload of ``[model] kind``
    adds (its ``model_params``, ``data_params``, ``train_params``).
    """

    params: dict[str, Any] = field(default_factory=dict, kw_only=True)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        dataclass(frozen=True, repr=False)(cls)

    @classmethod
    def schema(cls) -> dict[str, Param]:
        """Key -> :class:`Param`, in field order."""
        hints = get_type_hints(cls)
        return {f.name: Param(_param_type(hints[f.name]), **f.metadata)
                for f in fields(cls) if f.metadata}

    def as_dict(self) -> dict:
        """Every key of the section, the kind-specific ones included."""
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.metadata},
                **self.params}

    def __repr__(self) -> str:
        return f"[{type(self).__name__.removesuffix('Section').lower()}] {self.as_dict()}"


class JobSection(Section):
    name: str = key("job", help="run name; run dirs default to runs/<name>")
    description: str = key("", help="free text", compare=False)


_AXIS = "ranks along this axis (-1: inferred from the rank count)"


class GridSection(Section):  # the axes of hpcpar.parallel.grid.AXES
    data: int = key(-1, min=-1, compare=False, help=_AXIS)
    x: int = key(1, min=-1, compare=False, help=_AXIS)
    y: int = key(1, min=-1, compare=False, help=_AXIS)
    z: int = key(1, min=-1, compare=False, help=_AXIS)


class ModelSection(Section):
    kind: str = key(help="cosmoflow, unet3d, gcn, sage, gat, an installed package's kind "
                         "(entry point group hpcpar.workloads), or 'package.module:Workload'")
    check: bool = key(True, help="spatialized models: compare the first step with the plain "
                                 "model on one rank (hpcpar.nn.check)")
    fuse_halos: int = key(1, min=1, help="spatialized models: up to N stride-1 convolutions in "
                          "a row share one halo exchange, recomputing the overlap "
                          "(hpcpar.nn.fused_halo; 1: off)")


class DataSection(Section):
    """``[data]``: every key is the workload's (``params``)."""


class TrainSection(Section):
    steps: int | None = key(None, min=1, help="optimizer steps (give steps or epochs)")
    epochs: int | None = key(None, min=1, help="passes over the training data")
    global_batch: int = key(1, min=1, compare=False,
                            help="samples per step over all data-parallel ranks")
    optimizer: str = key("adam", choices=("sgd", "adam", "adamw"))
    lr: float = key(1e-3, min=0.0, help="peak learning rate")
    momentum: float = key(0.9, min=0.0, max=1.0, help="sgd only")
    weight_decay: float = key(0.0, min=0.0)
    beta1: float = key(0.9, min=0.0, max=1.0, help="adam/adamw")
    beta2: float = key(0.999, min=0.0, max=1.0, help="adam/adamw")
    lr_schedule: str = key("constant", choices=("constant", "cosine", "step", "warmup"),
                           help="after warmup_steps of linear warmup ('warmup' = constant)")
    warmup_steps: int = key(0, min=0)
    lr_step_every: int = key(1000, min=1, help="step schedule: decay period in steps")
    lr_gamma: float = key(0.1, min=0.0, max=1.0, help="step schedule: decay factor")
    min_lr: float = key(0.0, min=0.0, help="cosine schedule floor")
    seed: int = key(0, min=0, max=SEED_MAX)
    precision: str = key("fp32", choices=("fp32", "bf16", "fp16"),
                         help="bf16/fp16 = autocast; fp16 adds dynamic loss scaling")
    channels_last: bool = key(True, help="volume models: channels_last_3d inputs (oneDNN's "
                              "native order: the demo jobs' steps 1.4-2.6x faster)")
    val_every: int = key(0, min=0, help="validate every N steps (0: only at the end)")
    log_every: int = key(10, min=1, compare=False, help="rank-0 log line every N steps")
    on_nonfinite: str = key("stop", choices=("stop", "skip"), help="non-finite "
                            "loss/gradient: stop the run (exit 4) or skip the step")
    grad_sync: str = key("mpi", choices=("mpi", "nccl"),
                         help="who reduces gradient buckets: MPI, or NCCL (CUDA models)")
    halo_transport: str = key("auto", choices=("auto", "mpi", "nccl", "gloo", "staged"), help=(
        "who moves halo faces and spatial collectives: auto (CUDA: CUDA-aware mpi, else staged; "
        "CPU: mpi), mpi, nccl (CUDA), gloo (CPU), staged (CUDA through host memory); meta.json "
        "records the one used"))
    check_replicas_every: int = key(100, min=0, help="compare every replicated parameter's "
                                    "checksum across ranks every N steps (0: never)")
    accumulate: int = key(1, min=1, help="micro-batches (each of global_batch samples) per "
                          "optimizer step; the gradient sync runs on the last only")
    clip_grad_norm: float = key(0.0, min=0.0, help="clip the global gradient 2-norm (of the "
                                "single-process model) to this value after the sync (0: off)")
    shard_optimizer: bool = key(False, help="split the optimizer state and the reduced "
                                "gradients over the ranks that replicate each parameter "
                                "(ZeRO-1/2 style; exact, checkpoints unchanged)")
    activation_checkpointing: bool | int | str = key(
        False, help="recompute activations in backward: N segments per chain (nn.Sequential), "
        "\"auto\" or false; reuses the forward's halo faces")
    init_from: str | None = key(None, path=True, help="a new run starts from these weights: a "
                                "torch.save'd state_dict of the plain single-process model "
                                "(loaded weights_only)")
    init_strict: bool = key(True, help="init_from: every key must match (false: load the "
                            "matching keys, warn about the others)")


class DdpSection(Section):
    bucket_cap_mb: float = key(25.0, min=0.0)
    first_bucket_mb: float = key(1.0, min=0.0)
    hierarchical: str | bool = key("auto", choices=("auto", True, False))
    compression: str = key("none", choices=("none", "fp16", "bf16"))

    def as_kwargs(self) -> dict:
        """DistributedDataParallel keyword arguments."""
        return {**self.as_dict(), "compression": None if self.compression == "none"
                else self.compression}


class CheckpointSection(Section):
    every: int = key(0, min=0, help="checkpoint every N steps (0: only at end/signal)")
    keep: int = key(3, min=1, help="keep the newest K checkpoints")
    at_end: bool = key(True, help="checkpoint after the last step")
    background: bool = key(True, help="copy the state to memory at the step boundary and write "
                           "it in a background thread (false: training waits for the write)")


class ResourcesSection(Section):
    nodes: int = key(1, compare=False, min=1)
    tasks_per_node: int | None = key(None, compare=False, min=1, help="default: ranks / nodes")
    gpus_per_node: int = key(0, compare=False, min=0)
    cpus_per_task: int = key(1, compare=False, min=1)
    time: str | None = key(None, compare=False, help="Slurm time limit, e.g. 01:30:00")
    partition: str | None = key(None, compare=False)
    account: str | None = key(None, compare=False)
    qos: str | None = key(None, compare=False)
    constraint: str | None = key(None, compare=False)


class OutputSection(Section):
    dir: str | None = key(None, path=True, compare=False, help="run directory (else runs/<name>)")
    tensorboard: bool = key(False, help="TensorBoard event files in RUN/tensorboard (rank 0; "
                            "pip install 'hpcpar[tensorboard]')")
    callbacks: list[str] = key([], help="'package.module:factory' names; factory(job) -> "
                               "hpcpar.run.callbacks.Callback, on every rank")


class ProfileSection(Section):
    steps: str | None = key(None, help="torch.profiler window, e.g. '20-24' (1-based steps): "
                            "one Chrome trace per rank in RUN/profile")
    record_shapes: bool = key(False, help="record operator input shapes")
    memory: bool = key(False, help="profile memory allocations")


#: every integer of a job must fit the int64 the ranks compute with
INT_LIMIT = 2**63 - 1

PROFILE_RE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def profile_window(text: str | None) -> tuple[int, int] | None:
    """``[profile] steps`` (``"20-24"`` or ``"20"``) as a 1-based inclusive ``(first, last)``,
    or None when unset; ConfigError unless ``A-B`` with ``1 <= A <= B``."""
    if text is None:
        return None
    m = PROFILE_RE.match(text)
    if not m or int(m.group(1)) < 1 or int(m.group(2) or m.group(1)) < int(m.group(1)):
        raise ConfigError(f"[profile] steps: {text!r} is not a step window such as '20-24' "
                          f"(1-based, first <= last)")
    return int(m.group(1)), int(m.group(2) or m.group(1))

TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
              list: "a list", dict: "a table"}


@dataclass(frozen=True)
class JobSpec:
    """A validated job, frozen: sections as typed attributes (``job.train.lr``,
    ``job.model.params``); a field per section, in the order ``job.json`` lists them.

    Made by [load_job][hpcpar.formats.jobspec.load_job] or
    [build_job][hpcpar.formats.jobspec.build_job]. ``source`` is where the job came from (the
    file path), for messages; ``notes`` one line per value the job changed to make a run of it
    work (a ``warmup_steps`` above ``steps`` clamped to it), for the CLI to print.
    """

    source: str
    job: JobSection
    grid: GridSection
    model: ModelSection
    data: DataSection
    train: TrainSection
    ddp: DdpSection
    checkpoint: CheckpointSection
    resources: ResourcesSection
    output: OutputSection
    profile: ProfileSection
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The job's name (``[job] name``, else the file's stem)."""
        return self.job.name

    @property
    def grid_shape(self) -> tuple[int, int, int, int]:
        """``[grid]`` as ``(data, x, y, z)``; one axis may still be -1."""
        g = self.grid
        return g.data, g.x, g.y, g.z

    def to_dict(self) -> dict:
        """Section name -> every key of the section (what ``RUN/job.json`` stores)."""
        return {name: getattr(self, name).as_dict() for name in SECTIONS}

    def to_json(self) -> str:
        """The job and its source as JSON (``RUN/job.json``; see ``load_resolved``)."""
        return json.dumps({"source": self.source, "job": self.to_dict()}, indent=1)

    def check_ranks(self, n: int) -> tuple[int, int, int, int]:
        """The grid ``(data, x, y, z)`` resolved for ``n`` ranks; ConfigError when it does not
        fit ``n`` or the global batch does not split over the data ranks."""
        try:
            shape = resolve_shape(self.grid_shape, n)
        except HpcparError as exc:
            raise ConfigError(f"{self.source}: [grid] {exc}; {grid_fix(self.grid_shape, n)}") \
                from None

        batch = self.train.global_batch
        if getattr(get_workload(self.model.kind), "splits_global_batch", True) and batch % shape[0]:
            fit = -(-batch // shape[0]) * shape[0]
            raise ConfigError(f"{self.source}: [train] global_batch: {batch} does not split over "
                              f"{shape[0]} data-parallel ranks (grid {'x'.join(map(str, shape))})"
                              f"; use --set train.global_batch={fit} (a multiple of "
                              f"{shape[0]}), or another grid")
        return shape

    def fixed_ranks(self) -> int | None:
        """Rank count implied by the job alone (grid without -1, else [resources]), or None."""
        if -1 not in self.grid_shape:
            return math.prod(self.grid_shape)
        r = self.resources
        if r.tasks_per_node:
            return r.nodes * r.tasks_per_node
        return None


#: Section name -> its type: the sections of :class:`JobSpec`, in order
SECTIONS: dict[str, type[Section]] = {n: t for n, t in get_type_hints(JobSpec).items()
                                      if isinstance(t, type) and issubclass(t, Section)}
#: Section name -> key -> :class:`Param`: the fixed keys, as the sections declare them;
#: ``[model]``, ``[data]`` and ``[train]`` add the workload's keys
SCHEMA: dict[str, dict[str, Param]] = {name: t.schema() for name, t in SECTIONS.items()}


def grid_fix(shape: Sequence[int], n: int) -> str:
    """The fix to suggest when grid ``shape`` (data, x, y, z; one axis may be -1) does not fit
    ``n`` ranks: the rank count it needs, and a grid for ``n`` ranks keeping the spatial split
    when it divides ``n``; one clause, e.g. ``"run with -n 4, or fit the grid to 2 ranks:
    --grid 1x2x1x1"``."""
    known = math.prod(s for s in shape if s != -1)
    fixes = []
    if -1 not in shape:
        fixes.append(f"run with -n {known}")
    elif known:
        fixes.append(f"run with -n {known * max(1, -(-n // known))} (a multiple of {known})")
    spatial = [1 if s == -1 else s for s in shape[1:]]
    sp = math.prod(spatial)
    if n % sp == 0:
        grid = "x".join(map(str, (n // sp, *spatial)))
        more = " (or data = -1 in [grid])" if shape[0] != -1 else ""
        fixes.append(f"fit the grid to {n} ranks: --grid {grid}{more}")
    else:
        fixes.append(f"fit the grid to {n} ranks, e.g. --grid {n}x1x1x1 (data parallel only)")
    return ", or ".join(fixes)


# -- parsing ----------------------------------------------------------------------------------
def _did_you_mean(word: str, options) -> str:
    hint = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


def _type_ok(value, types) -> bool:
    types = types if isinstance(types, tuple) else (types,)
    for t in types:
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if t not in (int, float) and isinstance(value, t):
            return True
    return False


def _describe(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(TYPE_NAMES.get(t, t.__name__) for t in types)


def check_value(where: str, key: str, value: Any, spec: Param) -> Any:
    """``value`` normalised (ints accepted as floats...); ConfigError naming ``where`` (file and
    section) and ``key`` for a wrong type, an out-of-range value or one not of the choices."""
    if value is None and spec.default is None:
        return None
    if not _type_ok(value, spec.type):
        raise ConfigError(f"{where} {key}: expected {_describe(spec.type)}, got {value!r}")
    if spec.path and isinstance(value, str):
        value = os.path.expanduser(value)
    if spec.type is float or (isinstance(spec.type, tuple) and float in spec.type
                              and not isinstance(value, str)):
        value = float(value) if not isinstance(value, bool) else value
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where} {key}: expected a finite number, got {value}")
    if spec.choices is not None and value not in spec.choices:
        opts = ", ".join(repr(c) if isinstance(c, str) else str(c).lower() for c in spec.choices)
        hint = _did_you_mean(value, [c for c in spec.choices if isinstance(c, str)]) \
            if isinstance(value, str) else ""
        raise ConfigError(f"{where} {key}: {value!r} is not one of {opts}{hint}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        shown = str(value) if len(str(value)) <= 24 else f"{str(value)[:20]}..."
        if spec.min is not None and value < spec.min:
            raise ConfigError(f"{where} {key}: {shown} is out of range (must be >= {spec.min})")
        if spec.max is not None and value > spec.max:
            raise ConfigError(f"{where} {key}: {shown} is out of range (must be <= {spec.max})")
        if isinstance(value, int) and abs(value) > INT_LIMIT:
            raise ConfigError(f"{where} {key}: {shown} is out of range (must fit a 64-bit "
                              f"integer: at most {INT_LIMIT})")
    return value


def _validate_section(src: str, name: str, raw: dict, schema: dict[str, Param]) -> dict:
    where = f"{src}: [{name}]"
    out = {}
    for key, value in raw.items():
        if key not in schema:
            raise ConfigError(f"{where} unknown key {key!r}{_did_you_mean(key, schema)}")
        out[key] = check_value(where, key, value, schema[key])
    for key, spec in schema.items():
        if key not in out:
            if spec.required:
                raise ConfigError(f"{where} {key}: required key is missing")
            out[key] = spec.default
    return {k: out[k] for k in schema}   # schema order, whatever the file's


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split a ``--set`` override ``"SECTION.KEY=VALUE"`` into ``(section, key, value)``, e.g.
    ``("train", "lr", 0.01)``: the value is read as a TOML literal when it is one (numbers,
    booleans, quoted strings, arrays), else as a bare string; ConfigError on another form."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. train.lr=0.01")
    path, value = text.split("=", 1)
    path = path.strip()
    if path.count(".") != 1 or not all(path.split(".")):
        raise ConfigError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. train.lr=0.01")
    section, key = path.split(".")
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value.strip()
    except RecursionError:
        raise ConfigError(f"--set {path}: the value nests too deeply") from None
    except ValueError:        # an integer of thousands of digits
        raise ConfigError(f"--set {path}: the value is out of range (too many digits)") \
            from None
    return section, key, parsed


def _coerce_override(value, spec: Param | None):
    """Make a ``--set`` value fit the key's type where the text allows (e.g. '5' for a str)."""
    if spec is None:
        return value
    types = spec.type if isinstance(spec.type, tuple) else (spec.type,)
    if _type_ok(value, types):
        return value
    if str in types and isinstance(value, (int, float, bool)):
        return str(value).lower() if isinstance(value, bool) else str(value)
    return value


def _read_toml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{path}: job file not found")
    if p.is_dir():
        raise ConfigError(f"{path}: is a directory, expected a job .toml file")
    try:
        return tomllib.loads(p.read_text())
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid TOML: arrays or tables nest too deeply") from None
    except ValueError:        # an integer of thousands of digits
        raise ConfigError(f"{path}: invalid TOML: a number with too many digits") from None


def load_job(path: str | os.PathLike, overrides: Sequence[str] = (),
             name: str | None = None) -> JobSpec:
    """Read, override and validate a TOML job file (keys: ``docs/guides/jobs.md``).

    ``overrides`` are ``"section.key=value"`` strings (``--set``) applied before validation (the
    value parsed as TOML, else taken as a string); ``name`` is the job name when ``[job] name``
    is not set (None: the file's stem). Raises ConfigError, one line naming the file and the
    field, for an unreadable file, invalid TOML, an unknown section or key (with a "did you
    mean"), a value of the wrong type or out of range, or an unknown model kind.

    Example:
        ```python
        job = load_job("jobs/demo-cosmoflow.toml", ["train.steps=10"])
        ```
    """
    raw = _read_toml(path)
    return build_job(raw, overrides, source=str(path), default_name=name or Path(path).stem)


def build_job(raw: dict, overrides: Sequence[str] = (), source: str = "<job>",
              default_name: str = "job", untrusted: bool = False,
              trust_kind: bool = False) -> JobSpec:
    """Validate an already parsed job mapping, section -> key -> value (``load_job`` without
    the file; ``source`` names it in messages).

    ``untrusted``: the mapping was read from a run directory, not given by the user, so its
    ``[model] kind`` may import no code unless ``trust_kind`` (load a non-built-in kind from an
    installed package; see :func:`hpcpar.run.workloads.base.get_workload`). Raises ConfigError
    for an unknown section or key, a bad value, or an unknown model kind.
    """
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for text in overrides:
        section, key, value = parse_override(text)
        if section not in SCHEMA:
            raise ConfigError(f"--set {text!r}: unknown section [{section}]"
                              f"{_did_you_mean(section, SCHEMA)}")
        raw.setdefault(section, {})[key] = value
    for name, value in raw.items():
        if name not in SCHEMA:
            raise ConfigError(f"{source}: unknown section [{name}]{_did_you_mean(name, SCHEMA)}")
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {name!r} must be a [{name}] table, got {value!r}")
    renamed = _read_old_names(raw, source)
    raw.setdefault("job", {}).setdefault("name", safe_name(default_name))
    model_raw = raw.get("model", {})
    if "kind" not in model_raw:
        raise ConfigError(f"{source}: [model] kind: required key is missing")
    kind = model_raw["kind"]
    if not isinstance(kind, str):
        raise ConfigError(f"{source}: [model] kind: expected a string, got {kind!r}")
    try:
        factory = get_workload(kind, source if untrusted else None, trust_kind)
    except HpcparError as exc:
        raise ConfigError(f"{source}: {exc}" if not untrusted else str(exc)) from None
    schemas = {name: dict(s) for name, s in SCHEMA.items()}
    schemas["model"].update(getattr(factory, "model_params", {}))
    schemas["data"].update(getattr(factory, "data_params", {}))
    schemas["train"].update(getattr(factory, "train_params", {}))
    # --set values are text: coerce them to the declared type where that is unambiguous
    for text in overrides:
        section, key, _ = parse_override(text)
        if key in raw[section]:
            raw[section][key] = _coerce_override(raw[section][key], schemas[section].get(key))
    sections: dict[str, Any] = {}
    for name, schema in schemas.items():
        values = _validate_section(source, name, raw.get(name, {}), schema)
        sections[name] = SECTIONS[name](**{k: values.pop(k) for k in SCHEMA[name]},
                                        params=values)
    job = _cross_checks(JobSpec(source=source, **sections, notes=renamed))
    check = getattr(factory, "check_job", None)
    if check is not None:
        try:
            check(job)
        except HpcparError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    return job


def uncompared_keys() -> tuple[str, ...]:
    """The job keys in which like-for-like runs may differ (:class:`Param` ``compare`` False),
    in schema order: ``"section."`` for a section none of whose keys compare, else
    ``"section.key"``."""
    out: list[str] = []
    for name, params in SCHEMA.items():
        off = [f"{name}.{k}" for k, p in params.items() if not p.compare]
        out += [f"{name}."] if params and len(off) == len(params) else off
    return tuple(out)


def _read_old_names(raw: dict, source: str) -> list[str]:
    """Move each key given by its old name (:data:`RENAMED`) to its new one, in place; one
    deprecation note per key moved."""
    notes = []
    for section, names in RENAMED.items():
        values = raw.get(section, {})
        for old, new in names.items():
            if old not in values:
                continue
            if new in values:
                raise ConfigError(f"{source}: [{section}] {old} and {new}: give only {new} "
                                  f"({old} is its old name)")
            values[new] = values.pop(old)
            notes.append(f"{source}: [{section}] {old} is deprecated: it is now called {new} "
                         f"(read as {new} = {str(values[new]).lower()})")
    return notes


def safe_name(text: str) -> str:
    """A job name made from free text (the job file's stem): characters outside ``NAME_RE``
    replaced by ``-`` (``"job"`` if empty)."""
    name = re.sub(r"[^A-Za-z0-9_.+=@-]+", "-", str(text)).lstrip(".-")[:200]
    return name or "job"


def _cross_checks(job: JobSpec) -> JobSpec:
    """``job`` checked across keys; a new job where a value is clamped (with a note)."""
    src, t = job.source, job.train
    if not NAME_RE.match(job.name):
        raise ConfigError(f"{src}: [job] name: {job.name!r} must be one plain name (no '/', "
                          f"not starting with '.' or '-'): the default run directory under "
                          f"runs/ is made from it")
    if (t.steps is None) == (t.epochs is None):
        raise ConfigError(f"{src}: [train] give exactly one of steps or epochs")
    if t.warmup_steps and t.steps is not None and t.warmup_steps > t.steps:
        # a smoke run (--set train.steps=2) of a job with a longer warm-up: the warm-up
        # covers the whole run, as it would have; the job as run (job.json) says so
        job.notes.append(f"{src}: [train] warmup_steps {t.warmup_steps} > steps {t.steps}: "
                         f"clamped to {t.steps}")
        job = replace(job, train=replace(t, warmup_steps=t.steps))
    ckpt = t.activation_checkpointing
    if not (ckpt is False or ckpt == "auto" or (type(ckpt) is int and ckpt >= 1)):
        raise ConfigError(f"{src}: [train] activation_checkpointing: expected false, \"auto\" "
                          f"or a number of segments per chain >= 1, got "
                          f"{str(ckpt).lower() if isinstance(ckpt, bool) else repr(ckpt)}")
    for axis, v in zip(AXES, job.grid_shape):
        if v == 0:
            raise ConfigError(f"{src}: [grid] {axis}: 0 is out of range (must be >= 1, or -1)")
    if job.grid_shape.count(-1) > 1:
        raise ConfigError(f"{src}: [grid] at most one axis may be -1")
    try:
        window = profile_window(job.profile.steps)
    except HpcparError as exc:
        raise ConfigError(f"{src}: {exc}") from None
    if window and t.steps is not None and window[0] > t.steps:
        raise ConfigError(f"{src}: [profile] steps: {job.profile.steps!r} starts after the last "
                          f"step ({t.steps}); use e.g. --set profile.steps="
                          f"\"{max(1, t.steps - 4)}-{t.steps}\"")
    if not all(isinstance(c, str) for c in job.output.callbacks):
        raise ConfigError(f"{src}: [output] callbacks: expected a list of "
                          f"'package.module:factory' strings")
    if job.output.tensorboard:
        try:
            check_tensorboard()
        except HpcparError as exc:
            raise ConfigError(f"{src}: {exc}") from None
    r = job.resources
    if r.time is not None and not TIME_RE.match(r.time):
        raise ConfigError(f"{src}: [resources] time: {r.time!r} is not a Slurm time such as "
                          f"01:30:00 or 1-00:00:00")
    return job


def check_tensorboard() -> None:
    """ConfigError unless the ``tensorboard`` package is installed (the launcher checks it)."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("[output] tensorboard = true needs the tensorboard package: "
                          "pip install 'hpcpar[tensorboard]'")


def load_resolved(path: str | os.PathLike, untrusted: bool = False,
                  trust_kind: bool = False) -> JobSpec:
    """Reload the ``RUN/job.json`` written by ``hpcpar run`` (validated again); ``untrusted``
    when read by a tool other than the run that wrote it (``plan --fit-on``), with
    ``trust_kind`` as in :func:`build_job`."""
    doc = json.loads(Path(path).read_text())
    if untrusted:
        return build_job(doc["job"], (), source=str(path), untrusted=True,
                         trust_kind=trust_kind)
    return build_job(doc["job"], (), source=doc.get("source", str(path)))
