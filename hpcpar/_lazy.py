"""Lazy package attributes: heavy submodules (torch, h5py) load on first use, so importing a
package (and ``hpcpar --help``) stays fast."""

from __future__ import annotations

import importlib


def lazy_getattr(package: str, table: dict):
    """A module ``__getattr__`` resolving ``name`` through ``table``: name -> "module" (same
    attribute name) or name -> ("module", "attribute")."""

    def __getattr__(name):
        if name in table:
            target = table[name]
            module, attr = (target, name) if isinstance(target, str) else target
            return getattr(importlib.import_module(module), attr)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
