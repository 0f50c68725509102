"""Job specs: one TOML file describes a distributed training run.

``load_job(path, overrides=["train.lr=0.01"])`` parses, applies ``--set`` overrides, validates
every key (unknown key with a did-you-mean, wrong type, out-of-range value, missing required
key) and returns a :class:`JobSpec` with defaults filled in. Every problem raises
:class:`JobSpecError`, whose message is one line naming the file, ``[section] key`` and what was
expected. The kind-specific keys of ``[model]`` and ``[data]`` come from the workload registered
for ``[model] kind`` (``hpcpar.run.workloads.base``). This module does not import torch.
"""

from __future__ import annotations

import difflib
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcpar.errors import HpcparError
from hpcpar.parallel.grid import AXES, resolve_shape
from hpcpar.run.workloads.base import REQUIRED, Param

TIME_RE = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$")


class JobSpecError(HpcparError, ValueError):
    """A job file (or ``--set`` override) that does not fit the schema."""


def _p(t, default=REQUIRED, **kw) -> Param:
    return Param(t, default, **kw)


# Fixed sections; [model] and [data] add the workload's keys.
SCHEMA: dict[str, dict[str, Param]] = {
    "job": {
        "name": _p(str, "job", help="run name; run dirs default to runs/<name>-<timestamp>"),
        "description": _p(str, "", help="free text"),
    },
    "grid": {a: _p(int, -1 if a == "data" else 1, min=-1,
                   help="ranks along this axis (-1: inferred from the rank count)")
             for a in AXES},
    "model": {"kind": _p(str, help="cosmoflow, unet3d, gcn, sage, ...")},
    "data": {},
    "train": {
        "steps": _p(int, None, min=1, help="optimizer steps (give steps or epochs)"),
        "epochs": _p(int, None, min=1, help="passes over the training data"),
        "global_batch": _p(int, 1, min=1, help="samples per step over all data-parallel ranks"),
        "optimizer": _p(str, "adam", choices=("sgd", "adam", "adamw")),
        "lr": _p(float, 1e-3, min=0.0, help="peak learning rate"),
        "momentum": _p(float, 0.9, min=0.0, max=1.0, help="sgd only"),
        "weight_decay": _p(float, 0.0, min=0.0),
        "beta1": _p(float, 0.9, min=0.0, max=1.0, help="adam/adamw"),
        "beta2": _p(float, 0.999, min=0.0, max=1.0, help="adam/adamw"),
        "lr_schedule": _p(str, "constant", choices=("constant", "cosine", "step", "warmup"),
                          help="after warmup_steps of linear warmup ('warmup' = constant)"),
        "warmup_steps": _p(int, 0, min=0),
        "lr_step_every": _p(int, 1000, min=1, help="step schedule: decay period in steps"),
        "lr_gamma": _p(float, 0.1, min=0.0, max=1.0, help="step schedule: decay factor"),
        "min_lr": _p(float, 0.0, min=0.0, help="cosine schedule floor"),
        "seed": _p(int, 0, min=0),
        "precision": _p(str, "fp32", choices=("fp32", "bf16"), help="bf16 = autocast"),
        "channels_last": _p(bool, False, help="volume models: channels_last_3d inputs"),
        "val_every": _p(int, 0, min=0, help="validate every N steps (0: only at the end)"),
        "log_every": _p(int, 10, min=1, help="rank-0 log line every N steps"),
    },
    "ddp": {
        "bucket_cap_mb": _p(float, 25.0, min=0.0),
        "first_bucket_mb": _p(float, 1.0, min=0.0),
        "hierarchical": _p((str, bool), "auto", choices=("auto", True, False)),
        "compression": _p(str, "none", choices=("none", "fp16", "bf16")),
    },
    "checkpoint": {
        "every": _p(int, 0, min=0, help="checkpoint every N steps (0: only at end/signal)"),
        "keep": _p(int, 3, min=1, help="keep the newest K checkpoints"),
        "at_end": _p(bool, True, help="checkpoint after the last step"),
    },
    "resources": {
        "nodes": _p(int, 1, min=1),
        "tasks_per_node": _p(int, None, min=1, help="default: ranks / nodes"),
        "gpus_per_node": _p(int, 0, min=0),
        "cpus_per_task": _p(int, 1, min=1),
        "time": _p(str, None, help="Slurm time limit, e.g. 01:30:00"),
        "partition": _p(str, None),
        "account": _p(str, None),
        "qos": _p(str, None),
        "constraint": _p(str, None),
    },
    "output": {
        "dir": _p(str, None, help="run directory (else runs/<name>-<timestamp>)"),
    },
}

TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
              list: "a list", dict: "a table"}


class Section:
    """Attribute access to one validated section; ``params`` holds the kind-specific keys."""

    def __init__(self, name: str, values: dict, params: dict | None = None):
        self._name = name
        self.__dict__.update(values)
        self.params = dict(params or {})

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if not k.startswith("_") and k != "params"}
        out.update(self.params)
        return out

    def as_kwargs(self) -> dict:
        """[ddp] as DistributedDataParallel keyword arguments."""
        d = self.as_dict()
        if d.get("compression") == "none":
            d["compression"] = None
        return d

    def __repr__(self) -> str:
        return f"[{self._name}] {self.as_dict()}"


@dataclass
class JobSpec:
    """A validated job: sections as attributes (``job.train.lr``, ``job.model.params``)."""

    source: str
    sections: dict[str, Section] = field(default_factory=dict)

    def __getattr__(self, name):
        sections = self.__dict__.get("sections", {})
        if name in sections:
            return sections[name]
        raise AttributeError(name)

    @property
    def name(self) -> str:
        return self.sections["job"].name

    @property
    def grid_shape(self) -> tuple[int, int, int, int]:
        g = self.sections["grid"]
        return tuple(getattr(g, a) for a in AXES)  # type: ignore[return-value]

    def to_dict(self) -> dict:
        return {name: s.as_dict() for name, s in self.sections.items()}

    def to_json(self) -> str:
        return json.dumps({"source": self.source, "job": self.to_dict()}, indent=1)

    def check_ranks(self, n: int) -> tuple[int, int, int, int]:
        """Resolve the grid against ``n`` ranks; global batch must split over data ranks."""
        try:
            shape = resolve_shape(self.grid_shape, n)
        except HpcparError as exc:
            raise JobSpecError(f"{self.source}: [grid] {exc}") from None
        from hpcpar.run.workloads.base import get_workload

        batch = self.train.global_batch
        if getattr(get_workload(self.model.kind), "splits_global_batch", True) and batch % shape[0]:
            raise JobSpecError(f"{self.source}: [train] global_batch: {batch} does not split over "
                               f"{shape[0]} data-parallel ranks (grid {'x'.join(map(str, shape))})")
        return shape

    def fixed_ranks(self) -> int | None:
        """Rank count implied by the job alone (grid without -1, else [resources]), or None."""
        shape = self.grid_shape
        if -1 not in shape:
            n = 1
            for s in shape:
                n *= s
            return n
        r = self.resources
        if r.tasks_per_node:
            return r.nodes * r.tasks_per_node
        return None


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


def check_value(where: str, key: str, value, spec: Param):
    """Validate one value against its Param; returns the normalised value."""
    if value is None and spec.default is None:
        return None
    if not _type_ok(value, spec.type):
        raise JobSpecError(f"{where} {key}: expected {_describe(spec.type)}, got {value!r}")
    if spec.type is float or (isinstance(spec.type, tuple) and float in spec.type
                              and not isinstance(value, str)):
        value = float(value) if not isinstance(value, bool) else value
    if spec.choices is not None and value not in spec.choices:
        opts = ", ".join(repr(c) if isinstance(c, str) else str(c).lower() for c in spec.choices)
        hint = _did_you_mean(value, [c for c in spec.choices if isinstance(c, str)]) \
            if isinstance(value, str) else ""
        raise JobSpecError(f"{where} {key}: {value!r} is not one of {opts}{hint}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if spec.min is not None and value < spec.min:
            raise JobSpecError(f"{where} {key}: {value} is out of range (must be >= {spec.min})")
        if spec.max is not None and value > spec.max:
            raise JobSpecError(f"{where} {key}: {value} is out of range (must be <= {spec.max})")
    return value


def _validate_section(src: str, name: str, raw: dict, schema: dict[str, Param]) -> dict:
    where = f"{src}: [{name}]"
    out = {}
    for key, value in raw.items():
        if key not in schema:
            raise JobSpecError(f"{where} unknown key {key!r}{_did_you_mean(key, schema)}")
        out[key] = check_value(where, key, value, schema[key])
    for key, spec in schema.items():
        if key not in out:
            if spec.required:
                raise JobSpecError(f"{where} {key}: required key is missing")
            out[key] = spec.default
    return out


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"train.lr=0.01"`` -> ("train", "lr", 0.01); the value is read as a TOML literal when
    it is one (numbers, booleans, quoted strings), else as a bare string."""
    if "=" not in text:
        raise JobSpecError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. train.lr=0.01")
    path, value = text.split("=", 1)
    path = path.strip()
    if path.count(".") != 1 or not all(path.split(".")):
        raise JobSpecError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. train.lr=0.01")
    section, key = path.split(".")
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value.strip()
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


def _read_toml(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        raise JobSpecError(f"{path}: job file not found")
    if p.is_dir():
        raise JobSpecError(f"{path}: is a directory, expected a job .toml file")
    try:
        return tomllib.loads(p.read_text())
    except UnicodeDecodeError:
        raise JobSpecError(f"{path}: not a text file") from None
    except tomllib.TOMLDecodeError as exc:
        raise JobSpecError(f"{path}: invalid TOML: {str(exc).splitlines()[0]}") from None


def load_job(path: str, overrides: list[str] | tuple = (), name: str | None = None) -> JobSpec:
    """Read, override and validate a job file."""
    raw = _read_toml(path)
    return build_job(raw, overrides, source=str(path), default_name=name or Path(path).stem)


def build_job(raw: dict, overrides=(), source: str = "<job>", default_name: str = "job") -> JobSpec:
    """Validate an already parsed job mapping (``load_job`` without the file)."""
    from hpcpar.run.workloads.base import get_workload

    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for text in overrides:
        section, key, value = parse_override(text)
        if section not in SCHEMA:
            raise JobSpecError(f"--set {text!r}: unknown section [{section}]"
                               f"{_did_you_mean(section, SCHEMA)}")
        raw.setdefault(section, {})[key] = value
    for name, value in raw.items():
        if name not in SCHEMA:
            raise JobSpecError(f"{source}: unknown section [{name}]{_did_you_mean(name, SCHEMA)}")
        if not isinstance(value, dict):
            raise JobSpecError(f"{source}: {name!r} must be a [{name}] table, got {value!r}")
    raw.setdefault("job", {}).setdefault("name", default_name)
    model_raw = raw.get("model", {})
    if "kind" not in model_raw:
        raise JobSpecError(f"{source}: [model] kind: required key is missing")
    kind = model_raw["kind"]
    if not isinstance(kind, str):
        raise JobSpecError(f"{source}: [model] kind: expected a string, got {kind!r}")
    try:
        factory = get_workload(kind)
    except HpcparError as exc:
        raise JobSpecError(f"{source}: {exc}") from None
    schemas = {name: dict(s) for name, s in SCHEMA.items()}
    schemas["model"].update(getattr(factory, "model_params", {}))
    schemas["data"].update(getattr(factory, "data_params", {}))
    schemas["train"].update(getattr(factory, "train_params", {}))
    # --set values are text: coerce them to the declared type where that is unambiguous
    for text in overrides:
        section, key, _ = parse_override(text)
        if key in raw[section]:
            raw[section][key] = _coerce_override(raw[section][key], schemas[section].get(key))
    sections = {}
    for name, schema in schemas.items():
        values = _validate_section(source, name, raw.get(name, {}), schema)
        base = {k: v for k, v in values.items() if k in SCHEMA[name]}
        extra = {k: v for k, v in values.items() if k not in SCHEMA[name]}
        sections[name] = Section(name, base, extra)
    job = JobSpec(source=source, sections=sections)
    _cross_checks(job)
    check = getattr(factory, "check_job", None)
    if check is not None:
        try:
            check(job)
        except HpcparError as exc:
            raise JobSpecError(f"{source}: {exc}") from None
    return job


def _cross_checks(job: JobSpec) -> None:
    src, t = job.source, job.train
    if (t.steps is None) == (t.epochs is None):
        raise JobSpecError(f"{src}: [train] give exactly one of steps or epochs")
    if t.warmup_steps and t.steps is not None and t.warmup_steps > t.steps:
        raise JobSpecError(f"{src}: [train] warmup_steps: {t.warmup_steps} is out of range "
                           f"(must be <= steps = {t.steps})")
    for axis in AXES:
        v = getattr(job.grid, axis)
        if v == 0:
            raise JobSpecError(f"{src}: [grid] {axis}: 0 is out of range (must be >= 1, or -1)")
    if sum(1 for a in AXES if getattr(job.grid, a) == -1) > 1:
        raise JobSpecError(f"{src}: [grid] at most one axis may be -1")
    r = job.resources
    if r.time is not None and not TIME_RE.match(r.time):
        raise JobSpecError(f"{src}: [resources] time: {r.time!r} is not a Slurm time such as "
                           f"01:30:00 or 1-00:00:00")


def load_resolved(path: str) -> JobSpec:
    """Reload the ``RUN/job.json`` written by ``hpcpar run`` (already validated)."""
    doc = json.loads(Path(path).read_text())
    return build_job(doc["job"], (), source=doc.get("source", str(path)))
