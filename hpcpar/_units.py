"""Memory sizes as users write them (``1.5GiB``, ``800M``, ``2GB``): one parser for every
option and tool that takes one, and one way to show a byte count to a person (``1.25 MiB``,
never ``1.311e+06``)."""

from __future__ import annotations

import math
import re

from hpcpar.errors import ConfigError

__all__ = ["parse_bytes", "format_bytes", "bytes_unit"]

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30,
          "gib": 2**30, "t": 2**40, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "tb": 10**12}


def parse_bytes(text: str, what: str = "size") -> int:
    """Bytes from ``"1.5GiB"``, ``"800M"``, ``"2GB"`` (K/M/G alone are binary, like Slurm's
    ``--mem``); not a positive size raises :class:`ConfigError` (a ``ValueError`` too) naming
    ``what``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{what}: {text!r} is not a memory size (e.g. 1.5GiB, 800MiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def bytes_unit(n: float) -> tuple[str, int]:
    """The binary unit a byte count reads best in: ``(name, bytes per unit)``, the largest
    unit not above ``n`` (``B`` for 0, negatives and NaN), so a plot's axis and its values
    share one unit chosen from the largest value."""
    i = 0
    while n == n and i + 1 < len(_BINARY) and abs(n) >= 2 ** (10 * (i + 1)):
        i += 1
    return _BINARY[i], 2 ** (10 * i)


def format_bytes(n: float) -> str:
    """``n`` bytes for a person: three significant digits in binary units (``512 B``, ``1.25 MiB``,
    ``3.5 GiB``); whole bytes below 1 KiB; NaN: ``-``."""
    if n != n:
        return "-"
    unit, scale = bytes_unit(n)
    if scale == 1:
        return f"{n:.0f} B"
    value = n / scale
    decimals = max(0, 2 - int(math.log10(abs(value))))
    if round(abs(value), decimals) >= 1024 and unit != _BINARY[-1]:  # 1023.9996 KiB: 1 MiB
        unit, value, decimals = _BINARY[_BINARY.index(unit) + 1], value / 1024, 2
    text = f"{value:.{decimals}f}"
    return f"{text.rstrip('0').rstrip('.') if '.' in text else text} {unit}"
