"""Full-size tensors a checkpoint gathers, backed by a file instead of memory.

A split head's weight and its Adam moments divide by the spatial ranks while training, but
the checkpoint keeps the single-process format, so the rank writing ``model.pt`` or
``trainer.pt`` gathers them whole: up to three times the head's full weight on one rank, the
one allocation that does not divide. Gathered into a file-backed mapping (``MAP_SHARED`` on an
unlinked file in the checkpoint directory) those pages are page cache: the kernel writes them
out and drops them under memory pressure instead of killing the rank, and they are read once,
by the checkpoint's own write. A directory that cannot be mapped falls back to memory.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import torch

from hpcpar import _env

__all__ = ["zeros"]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, directory: str | Path | None
          ) -> torch.Tensor:
    """A zero tensor of ``shape``: file-backed in ``directory`` when it is at least
    ``HPCPAR_CHECKPOINT_SPILL`` bytes (smaller ones cost more in page faults than they save),
    else in memory (a CPU tensor). ``directory`` (None: memory) is made if missing; the file is
    unlinked at once, so nothing is left behind even if the process dies.

    """
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    least = _env.get("HPCPAR_CHECKPOINT_SPILL")
    if directory is None or least is None or nbytes < least:
        return torch.zeros(shape, dtype=dtype)
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)   # the first checkpoint's
        fd, path = tempfile.mkstemp(prefix=".spill-", dir=directory)
        os.close(fd)
        try:
            flat = torch.from_file(path, shared=True, size=count, dtype=dtype)
        finally:
            os.unlink(path)
    except (OSError, RuntimeError):   # not mappable there (or full): memory, as before
        return torch.zeros(shape, dtype=dtype)
    return flat.view(shape)
