"""How gradient numbers travel and how they are summed.

Gradients travel in a *wire* dtype: their own dtype, or 16 bits (``"fp16"``/``"bf16"``) to
halve the bytes. Sums are always accumulated in at least float32, in ONE fixed order that
does not depend on how the reduction is split into messages: first over the ranks of each
node (in rank order), then over the node partial sums (in node order). The flat and the
hierarchical reduction both follow that order, so in full precision they give bitwise
identical results, and every rank receives the same bytes (parameters stay identical).
"""

from __future__ import annotations

import torch

from .errors import HpcparError

COMPRESSIONS = {None: None, "none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class CompressionError(HpcparError, ValueError):
    """An unknown ``compression=`` value."""


def wire_dtype_for(compression) -> torch.dtype | None:
    """The 16-bit dtype for ``compression`` (None: gradients travel in their own dtype)."""
    key = compression.lower() if isinstance(compression, str) else compression
    if key not in COMPRESSIONS:
        raise CompressionError(f"DistributedDataParallel: compression={compression!r}, "
                               "expected None, 'fp16' or 'bf16'")
    return COMPRESSIONS[key]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums run in the gradient dtype, but never below float32."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def fold(rows, groups, out: torch.Tensor, scratch=None) -> torch.Tensor:
    """``out = sum(rows)`` in the canonical order: within each group left to right, then the
    group partials left to right. ``rows[i]`` are equal-length 1-D tensors (any float dtype,
    summed in ``out.dtype``); ``groups`` lists row indices covering every row once; ``out``
    must not alias a row. ``scratch()`` returns a temporary like ``out`` (needed only for a
    second or later group of more than one row)."""
    acc = out.dtype

    def row(i):
        r = rows[i]
        return r if r.dtype == acc else r.to(acc)

    def fold_into(indices, dest):
        if len(indices) == 1:
            return dest.copy_(row(indices[0]))
        torch.add(row(indices[0]), row(indices[1]), out=dest)
        for i in indices[2:]:
            dest.add_(row(i))
        return dest

    fold_into(groups[0], out)
    for g in groups[1:]:
        if len(g) == 1:
            out.add_(row(g[0]))
        else:
            tmp = scratch() if scratch is not None else torch.empty_like(out)
            out.add_(fold_into(g, tmp))
    return out
