"""The job file as data for tools: JSON Schema of the job keys and the resolved job as TOML.

``hpcpar schema [--kind KIND]`` prints :func:`json_schema` (editors and CI validate job files
with it); ``hpcpar run JOB --print-config`` prints :func:`job_to_toml` of the fully resolved
job, every default filled in, which ``hpcpar run`` accepts back as a job file. No torch import.
"""

from __future__ import annotations

from typing import Any

import tomlkit

from hpcpar.formats.jobspec import SCHEMA, JobSpec
from hpcpar.formats.kinds import REQUIRED, Param, get_workload, known_kinds

__all__ = ["json_schema", "job_to_toml"]

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
               dict: "object"}


def param_schema(spec: Param) -> dict:
    """One key's JSON Schema: type, enum, bounds, default and description."""
    types = spec.type if isinstance(spec.type, tuple) else (spec.type,)
    out: dict[str, Any] = {}
    if spec.choices is not None:
        out["enum"] = list(spec.choices)
    else:
        names = [_JSON_TYPES[t] for t in types if t in _JSON_TYPES]
        out["type"] = names[0] if len(names) == 1 else names
    if spec.min is not None:
        out["minimum"] = spec.min
    if spec.max is not None:
        out["maximum"] = spec.max
    if spec.default is not REQUIRED and spec.default is not None:
        out["default"] = spec.default
    if spec.help:
        out["description"] = spec.help
    return out


def _section(params: dict[str, Param], closed: bool) -> dict:
    required = [k for k, p in params.items() if p.required]
    out: dict[str, Any] = {"type": "object",
                           "properties": {k: param_schema(p) for k, p in params.items()},
                           "additionalProperties": not closed}
    if required:
        out["required"] = required
    return out


def json_schema(kind: str | None = None) -> dict:
    """The job file's JSON Schema (draft 2020-12) as a JSON-able dict.

    With a ``[model] kind`` (built-in, installed or ``package.module:Workload``; ConfigError
    when it cannot be resolved) its ``[model]``/``[data]``/``[train]`` keys are added and unknown
    keys rejected; without, the fixed sections only, ``[model]`` and ``[data]`` left open.
    """
    sections = {name: dict(params) for name, params in SCHEMA.items()}
    title = "hpcpar job file"
    if kind is not None:
        factory = get_workload(kind)
        for name in ("model", "data", "train"):
            sections[name].update(getattr(factory, f"{name}_params", {}))
        title += f" ([model] kind = {kind!r})"
    props = {name: _section(params, closed=kind is not None or name not in ("model", "data"))
             for name, params in sections.items()}
    kind_schema = props["model"]["properties"]["kind"]
    if kind is not None:
        kind_schema["const"] = kind
    else:
        kind_schema["examples"] = known_kinds()
    return {"$schema": JSON_SCHEMA_DIALECT, "title": title, "type": "object",
            "properties": props, "required": ["model"], "additionalProperties": False}


def _toml_item(value: Any) -> Any:
    """A job value as a tomlkit item: tables inline (a key stays on its line, under its
    section, as users read and diff it), tuples as arrays."""
    if isinstance(value, dict):
        table = tomlkit.inline_table()
        table.update({str(k): _toml_item(v) for k, v in value.items()})
        return table
    if isinstance(value, (list, tuple)):
        return [_toml_item(v) for v in value]
    return value


def job_to_toml(job: JobSpec) -> str:
    """The resolved job as a TOML job file: every section and key, defaults included; keys
    without a value (TOML has no null) are shown commented out.

    ``load_job`` reads it back into the same job. Written with ``tomlkit``, which quotes and
    escapes every string and key the TOML way and, unlike ``tomli-w``, writes comments: the
    header naming the source and the unset keys.
    """
    doc = tomlkit.document()
    doc.add(tomlkit.comment(f"resolved from {job.source} by hpcpar"))
    for name, values in job.to_dict().items():
        section = tomlkit.table()
        for key, value in values.items():
            if value is None:
                section.add(tomlkit.comment(f"{key} = (unset)"))
            else:
                section.add(key, _toml_item(value))
        doc.add(name, section)
    return tomlkit.dumps(doc)
