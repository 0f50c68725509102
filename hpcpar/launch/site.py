"""Slurm site profiles: what an expert writes into an sbatch script for one machine.

A profile is a TOML file (``slurm/sites/<name>.toml``; see ``generic.toml`` for every key).
``load_site("perlmutter")`` finds it by name in, in order: the folders of ``HPCPAR_SITE_PATH``
(colon-separated), ``~/.config/hpcpar/sites``, and the profiles shipped with hpcpar; any argument
containing a ``/`` or ending in ``.toml`` is read as a path. Templates
(``slurm/templates/<name>.sbatch``) are found the same way (``HPCPAR_TEMPLATE_PATH``). This module
does not import torch."""

from __future__ import annotations

import difflib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from hpcpar import _env
from hpcpar._resources import data_dirs
from hpcpar.errors import LaunchError

__all__ = ["SCHEMA", "Site", "available", "find_template", "load_site"]


# section -> key -> (type(s), default); every key of a profile must appear here.
SCHEMA: dict[str, dict[str, tuple]] = {
    "site": {"description": (str, ""), "docs": (list, []), "template": (str, "run"),
             "report_template": (str, "report")},
    "node": {"cpus": (int, 0), "threads_per_core": (int, 1), "gpus": (int, 0),
             "tasks_per_node": (int, 0)},
    "sbatch": {"partition": (str, ""), "qos": (str, ""), "constraint": (str, ""),
               "account": (str, ""), "time": (str, "00:30:00"), "request_gpus": (bool, False),
               "exclusive": (bool, False), "options": (list, [])},
    "srun": {"mpi": (str, ""), "cpu_bind": (str, ""), "gpu_options": (list, []),
             "options": (list, [])},
    "setup": {"modules": (list, []), "commands": (list, []), "python": (str, "")},
    "env": {},   # NAME = "value" (literal strings)
    "requeue": {"signal": (str, "USR1"), "grace": (int, 180), "max": (int, 3)},
    "report": {"partition": (str, ""), "qos": (str, ""), "constraint": (str, ""),
               "time": (str, "00:15:00"), "cpus_per_task": (int, 1), "exclusive": (bool, False)},
}


@dataclass
class Site:
    """A validated site profile: ``name`` (its file stem), ``source`` (its file) and one dict per
    :data:`SCHEMA` section with every default filled in; see ``docs/guides/slurm.md``."""

    name: str
    source: str
    site: dict = field(default_factory=dict)
    node: dict = field(default_factory=dict)
    sbatch: dict = field(default_factory=dict)
    srun: dict = field(default_factory=dict)
    setup: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    requeue: dict = field(default_factory=dict)
    report: dict = field(default_factory=dict)


# -- finding files ---------------------------------------------------------------------------
def _search_path(env_var: str, sub: str) -> list[Path]:
    user = [Path(p) for p in _env.get(env_var)]
    return user + [Path.home() / ".config" / "hpcpar" / sub] + [d / sub for d in data_dirs()]


def _find(what: str, name_or_path: str, env_var: str, sub: str, suffix: str) -> Path:
    if "/" in name_or_path or name_or_path.endswith(suffix):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise LaunchError(f"{what} file not found: {name_or_path}")
        return path
    for d in _search_path(env_var, sub):
        cand = d / f"{name_or_path}{suffix}"
        if cand.is_file():
            return cand
    known = available(sub, suffix, env_var)
    hint = difflib.get_close_matches(name_or_path, known, n=1)
    raise LaunchError(f"unknown {what} {name_or_path!r}"
                    + (f" (did you mean {hint[0]!r}?)" if hint else "")
                    + f"; known: {', '.join(known) or 'none'}; or give a path to a {suffix} file")


def available(sub: str = "sites", suffix: str = ".toml",
              env_var: str = "HPCPAR_SITE_PATH") -> list[str]:
    """Names of the profiles (``sub="sites"``) or templates (``"templates"``, with ``suffix`` and
    ``env_var`` to match) found on the search path, sorted."""
    names: set[str] = set()
    for d in _search_path(env_var, sub):
        if d.is_dir():
            names.update(p.name[: -len(suffix)] for p in d.glob(f"*{suffix}"))
    return sorted(names)


def find_template(name_or_path: str) -> Path:
    """The sbatch template named (on ``HPCPAR_TEMPLATE_PATH`` and the bundled ones) or given as a
    path to a ``.sbatch`` file; :class:`LaunchError` with a "did you mean" when not found."""
    return _find("template", name_or_path, "HPCPAR_TEMPLATE_PATH", "templates", ".sbatch")


# -- loading ---------------------------------------------------------------------------------
def _typename(t) -> str:
    return {str: "a string", int: "an integer", bool: "true or false", list: "a list",
            dict: "a table"}.get(t, str(t))


def _check(src: str, section: str, key: str, value, expected) -> None:
    ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
    if not ok:
        raise LaunchError(f"{src}: [{section}] {key}: expected {_typename(expected)}, "
                          f"got {value!r}")
    if expected is int and value < 0:
        raise LaunchError(f"{src}: [{section}] {key}: {value} is out of range (must be >= 0)")
    if expected is list and section != "site" and not all(isinstance(v, str) for v in value):
        raise LaunchError(f"{src}: [{section}] {key}: expected a list of strings, got {value!r}")


def parse_site(raw: dict, name: str, source: str) -> Site:
    """Validate a parsed profile (``source`` names its file in messages) and fill in every default.
    An unknown section or key (with a "did you mean"), a wrong type or a value out of range raises
    :class:`LaunchError`."""
    out = {}
    for section, values in raw.items():
        if section not in SCHEMA:
            hint = difflib.get_close_matches(section, SCHEMA, n=1)
            raise LaunchError(f"{source}: unknown section [{section}]"
                            + (f" (did you mean [{hint[0]}]?)" if hint else ""))
        if not isinstance(values, dict):
            raise LaunchError(f"{source}: {section!r} must be a [{section}] table")
    for section, schema in SCHEMA.items():
        values = dict(raw.get(section, {}))
        if section == "env":
            for key, value in values.items():
                if not key.isidentifier():
                    raise LaunchError(f"{source}: [env] {key!r} is not a variable name")
                _check(source, section, key, value, str)
            out[section] = values
            continue
        for key, value in values.items():
            if key not in schema:
                hint = difflib.get_close_matches(key, schema, n=1)
                raise LaunchError(f"{source}: [{section}] unknown key {key!r}"
                                + (f" (did you mean {hint[0]!r}?)" if hint else ""))
            _check(source, section, key, value, schema[key][0])
        out[section] = {k: values.get(k, list(d) if isinstance(d, list) else d)
                        for k, (_, d) in schema.items()}
    if out["node"]["threads_per_core"] < 1:
        raise LaunchError(f"{source}: [node] threads_per_core: must be >= 1")
    return Site(name=name, source=source, **out)


def load_site(name_or_path: str = "generic") -> Site:
    """Load and validate a site profile, by name on the search path or as a path to a ``.toml``
    file; :class:`LaunchError` when not found, invalid TOML, or invalid fields."""
    path = _find("site", name_or_path, "HPCPAR_SITE_PATH", "sites", ".toml")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise LaunchError(f"{path}: invalid TOML: {str(exc).splitlines()[0]}") from None
    return parse_site(raw, name=path.stem, source=str(path))
