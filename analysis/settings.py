"""Like for like: which runs may share a row of the scaling table.

Runs of one config are pooled and compared only when their resolved job settings agree on
everything but what a scaling sweep varies. The settings of a run are its meta.json ``job``
(the job spec as run) flattened to dotted keys, minus :data:`SCALING_KEYS`, the keys the job
schema marks ``compare = False`` (:class:`hpcpar.formats.kinds.Param`): the rank count, the
grid and the resources that follow it, the global batch (the sweep variable of weak scaling;
how the work per step changes with p is checked by the strong/weak detection instead), and
keys that change nothing measured (a description, how often to log). A key given by its old
name (``checkpoint.async``) is compared by its new one. A run may name more sweep variables
in meta ``sweep_vary`` (a list of dotted keys).

The settings hash is ``sha256`` of the sorted ``key=value`` lines (first 12 hex digits).
"""

from __future__ import annotations

import hashlib
import json

import pandas as pd

from hpcpar.errors import ConfigError
from hpcpar.formats.jobspec import RENAMED, uncompared_keys

__all__ = ["SCALING_KEYS", "flatten", "resolved_settings", "settings_hash", "split_unlike"]

#: Dotted keys (or section prefixes ending in ".") in which runs of one row may differ: what a
#: scaling sweep changes with p, and what changes nothing measured (the schema's ``compare``)
SCALING_KEYS = uncompared_keys()


def flatten(obj: object, prefix: str = "") -> dict:
    """Flatten nested dicts to dotted keys: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``.

    Lists stay values.

    Args:
        obj: A dict (possibly nested) or a leaf value.
        prefix: Dotted key prefix of ``obj``, ending in ``"."`` (empty at the top level).

    Returns:
        Dotted key -> leaf value.
    """
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def _scaling(key: str, extra) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k))
               for k in (*SCALING_KEYS, *extra))


def resolved_settings(meta: dict) -> dict:
    """The settings runs are compared by: the flattened ``job`` minus the scaling keys.

    Args:
        meta: A run's meta.json.

    Returns:
        Dotted key -> value (empty when the run recorded no job spec).
    """
    job = meta.get("job")
    extra = meta.get("sweep_vary") or ()
    if not isinstance(job, dict):
        return {}
    flat = flatten(job)
    for section, names in RENAMED.items():
        for old, new in names.items():
            if f"{section}.{old}" in flat:
                flat[f"{section}.{new}"] = flat.pop(f"{section}.{old}")
    return {k: v for k, v in flat.items() if not _scaling(k, extra)}


def settings_hash(settings: dict) -> str:
    """Identify a run's settings: sha256 of the sorted ``key=json(value)`` lines.

    Args:
        settings: Dotted key -> value, as from :func:`resolved_settings`.

    Returns:
        The first 12 hex digits of the digest.
    """
    text = "\n".join(f"{k}={json.dumps(v, sort_keys=True, default=str)}"
                     for k, v in sorted(settings.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _differences(a: dict, b: dict) -> list[str]:
    keys = sorted(set(a) | set(b))
    return [f"{k}={a.get(k, '(unset)')!r} (others {b.get(k, '(unset)')!r})"
            for k in keys if a.get(k, "(unset)") != b.get(k, "(unset)")]


def split_unlike(runs: pd.DataFrame, strict: bool = False) -> pd.DataFrame:
    """Give runs whose settings differ from the rest of their config their own config label.

    In each config the settings shared by the most runs (ties: the one of the smallest rank
    count) are the reference; every other settings hash becomes config
    ``"CONFIG [settings HASH]"`` and its runs get a note naming the differing keys.

    Args:
        runs: The run table (columns ``config``, ``settings_hash``, ``settings``).
        strict: Raise instead of splitting.

    Returns:
        A copy of ``runs`` with ``config`` and ``settings_note`` updated.

    Raises:
        ConfigError: ``strict`` and some config mixes settings (every differing run named).
    """
    runs = runs.copy()
    if "settings_note" not in runs:  # kept when split already (the report splits first)
        runs["settings_note"] = ""
    problems = []
    for config, group in runs.groupby("config", sort=True):
        hashes = group["settings_hash"].fillna("")
        if hashes.nunique() < 2:
            continue
        counts = group.assign(h=hashes).groupby("h").agg(n=("run", "size"), p=("ranks", "min"))
        ref = counts.sort_values(["n", "p"], ascending=[False, True]).index[0]
        ref_settings = group[hashes == ref]["settings"].iloc[0]
        for i in group.index[hashes != ref]:
            diff = _differences(runs.at[i, "settings"], ref_settings)
            shown = "; ".join(diff[:4]) + (f"; ... ({len(diff)} keys)" if len(diff) > 4 else "")
            problems.append(f"{runs.at[i, 'name']} ({config}, {runs.at[i, 'ranks']} ranks): "
                            f"{shown}")
            runs.at[i, "config"] = f"{config} [settings {hashes[i] or 'unknown'}]"
            runs.at[i, "settings_note"] = (f"settings differ from the other runs of "
                                           f"{config!r}: {shown}")
    if strict and problems:
        raise ConfigError("runs with different settings in one config (--strict): "
                          + " | ".join(problems))
    return runs
