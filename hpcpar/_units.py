"""Memory sizes as users write them (``1.5GiB``, ``800M``, ``2GB``): one parser for every
option and tool that takes one."""

from __future__ import annotations

import re

from hpcpar.errors import ConfigError

__all__ = ["parse_bytes"]

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30,
          "gib": 2**30, "t": 2**40, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "tb": 10**12}


def parse_bytes(text: str, what: str = "size") -> int:
    """Bytes from ``"1.5GiB"``, ``"800M"``, ``"2GB"`` (K/M/G alone are binary, like Slurm's
    ``--mem``).

    Args:
        text: The size.
        what: The option or field, for the message.

    Returns:
        Bytes.

    Raises:
        ConfigError: Not a positive size (a ``ValueError`` too).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{what}: {text!r} is not a memory size (e.g. 1.5GiB, 800MiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
