"""``[train] init_from``: a new run starts from plain single-process weights.

The file is a torch ``state_dict`` of the plain model (``torch.save(model.state_dict(), f)``),
read with ``weights_only=True``: tensors and plain containers only, never pickled code. It is
matched against the distributed model's full (unpartitioned) state dict, the one checkpoints
store, so split and tensor-parallel layers take their piece when it is loaded
(:func:`hpcpar.run.checkpoint.capture.load_full_state_dict`). Strict by default
(``[train] init_strict``): missing or unexpected keys are one error line; not strict, the
matching keys load, the others are one warning line. A shape mismatch is always an error.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from hpcpar.errors import ConfigError

__all__ = ["read_state_dict", "fit_state_dict", "describe_keys"]

_SHOWN = 3


def read_state_dict(path: str | os.PathLike) -> dict:
    """The torch-saved state dict ``[train] init_from``, read safely (a torch-DDP ``module.``
    prefix on every key is dropped); ConfigError naming the file when it is missing,
    unreadable, refused by ``weights_only`` or not a mapping of names to tensors."""
    import torch

    where = f"[train] init_from {os.fspath(path)!r}"
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: no such file")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"{where}: not a plain state_dict (weights_only refused it: "
                          f"{first})") from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"{where}: not a torch file ({type(exc).__name__}: {first})") from None
    if not isinstance(sd, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise ConfigError(f"{where}: expected a state_dict (names -> tensors), got a "
                          f"{type(sd).__name__}: save it with torch.save(model.state_dict())")
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


def describe_keys(missing: list[str], unexpected: list[str]) -> str:
    """``missing 2 keys (a, b), unexpected 1 key (c)``: the first few names of each."""
    def part(what, keys):
        names = ", ".join(keys[:_SHOWN]) + (", ..." if len(keys) > _SHOWN else "")
        return f"{what} {len(keys)} key{'s' if len(keys) != 1 else ''} ({names})"

    return ", ".join(part(w, k) for w, k in (("missing", missing), ("unexpected", unexpected))
                     if k)


def fit_state_dict(given: dict, expected: dict[str, Any], strict: bool,
                   where: str) -> tuple[dict, list[str], list[str]]:
    """(full state dict to load, missing keys, unexpected keys) of the file's ``given`` against
    the model's full state dict ``expected`` (whose values fill missing keys); ConfigError
    when a shape differs, or (``strict``) keys are missing or unexpected."""
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    for k, v in given.items():
        want = expected.get(k)
        if want is not None and tuple(v.shape) != tuple(want.shape):
            raise ConfigError(f"[train] init_from {where!r}: {k} has shape {tuple(v.shape)}, "
                              f"the model's is {tuple(want.shape)}")
    if strict and (missing or unexpected):
        raise ConfigError(f"[train] init_from {where!r}: the keys do not match the model: "
                          f"{describe_keys(missing, unexpected)} (set [train] init_strict = "
                          f"false to load the matching keys only)")
    merged = {k: (given[k].to(v.dtype) if k in given and hasattr(v, "dtype") else v)
              for k, v in expected.items()}
    return merged, missing, unexpected
