"""Reference checks: does every point of a scaling table meet what a site expects?

An expectations file (TOML) lists references, as ReFrame does::

    tolerance = 0.05                 # default relative tolerance of every reference

    [[expect]]
    config = "demo-cosmoflow"        # optional: every config when absent
    ranks = [2, 4]                   # optional: an int or a list; every rank count when absent
    min_efficiency = 0.6             # met when E >= min_efficiency * (1 - tolerance)
    max_step_time = 2.5              # met when median T <= max_step_time * (1 + tolerance)
    tolerance = 0.1                  # optional, this reference only

A reference naming a config and rank count that the table lacks is a shortfall too
("no such point"): a gate must not pass because a point did not run.
"""

from __future__ import annotations

import math
import os
import tomllib
from pathlib import Path

import pandas as pd

from hpcpar.errors import ConfigError

__all__ = ["KEYS", "read_expectations", "check_expectations"]

#: Keys of one ``[[expect]]`` entry.
KEYS = ("config", "ranks", "min_efficiency", "max_step_time", "tolerance")


def read_expectations(path: str | os.PathLike) -> list[dict]:
    """Read and validate an expectations file.

    Args:
        path: The TOML file.

    Returns:
        One dict per reference, with ``tolerance`` filled in and ``ranks`` a list or None.

    Raises:
        ConfigError: Unreadable TOML, an unknown key, a reference without a bound, a bad
            value (each names the file and the entry).
    """
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read expectations ({exc})") from None
    unknown = set(doc) - {"tolerance", "expect"}
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)}; expected 'tolerance' "
                          f"and [[expect]] entries")
    default_tol = _number(doc.get("tolerance", 0.0), path, "tolerance")
    entries = doc.get("expect")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: no [[expect]] entries")
    out = []
    for i, e in enumerate(entries, 1):
        where = f"{path}: [[expect]] #{i}"
        if not isinstance(e, dict):
            raise ConfigError(f"{where}: not a table")
        bad = set(e) - set(KEYS)
        if bad:
            raise ConfigError(f"{where}: unknown key(s) {sorted(bad)}; expected {KEYS}")
        if "min_efficiency" not in e and "max_step_time" not in e:
            raise ConfigError(f"{where}: needs min_efficiency and/or max_step_time")
        ranks = e.get("ranks")
        if ranks is not None:
            ranks = [ranks] if isinstance(ranks, int) else ranks
            if not isinstance(ranks, list) or not all(isinstance(r, int) and not
                                                      isinstance(r, bool) and r > 0
                                                      for r in ranks):
                raise ConfigError(f"{where}: ranks must be a positive integer or a list of them")
        ref = {"config": e.get("config"), "ranks": ranks,
               "tolerance": _number(e.get("tolerance", default_tol), where, "tolerance")}
        for key in ("min_efficiency", "max_step_time"):
            if key in e:
                ref[key] = _number(e[key], where, key)
        out.append(ref)
    return out


def _number(value, where, key) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 \
            or not math.isfinite(value):
        raise ConfigError(f"{where}: {key} = {value!r}, expected a number >= 0")
    return float(value)


def check_expectations(table: pd.DataFrame, refs: list[dict]) -> list[str]:
    """Every shortfall of the scaling table against the references, one line each.

    A point meets ``min_efficiency`` e with tolerance t when E >= e (1 - t), and
    ``max_step_time`` m when its median step time T <= m (1 + t). A point without a number
    (no usable steps) falls short.

    Args:
        table: The scaling table.
        refs: From :func:`read_expectations`.

    Returns:
        ``"CONFIG @ P ranks: efficiency 0.52 < 0.60 - 5% (0.570)"``-style lines; empty when
        every point meets every reference.
    """
    lines = []
    for ref in refs:
        sel = table
        if ref["config"] is not None:
            sel = sel[sel["config"] == ref["config"]]
        wanted = ref["ranks"] or sorted(sel["ranks"].unique())
        name = ref["config"] or "any config"
        if not len(sel):
            lines.append(f"{name}: no such config in the report")
            continue
        tol = ref["tolerance"]
        for p in wanted:
            rows = sel[sel["ranks"] == p]
            if not len(rows):
                lines.append(f"{name} @ {p} ranks: no such point in the report")
                continue
            for r in rows.to_dict("records"):
                where = f"{r['config']} @ {p} ranks"
                if "min_efficiency" in ref:
                    bound = ref["min_efficiency"] * (1 - tol)
                    E = r["efficiency"]
                    if not (E >= bound):
                        lines.append(f"{where}: efficiency {E:.3f} < {ref['min_efficiency']:g}"
                                     f" - {tol:.0%} ({bound:.3f})")
                if "max_step_time" in ref:
                    bound = ref["max_step_time"] * (1 + tol)
                    T = r["t_step_median"]
                    if not (T <= bound):
                        lines.append(f"{where}: step time {T:.4g} s > {ref['max_step_time']:g}"
                                     f" s + {tol:.0%} ({bound:.4g} s)")
    return lines
