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

from hpcpar.errors import ConfigError

COMPRESSIONS = {None: None, "none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def wire_dtype_for(compression) -> torch.dtype | None:
    """The 16-bit dtype for ``compression`` (None: gradients travel in their own dtype)."""
    key = compression.lower() if isinstance(compression, str) else compression
    if key not in COMPRESSIONS:
        raise ConfigError(f"DistributedDataParallel: compression={compression!r}, "
                          "expected None, 'fp16' or 'bf16'")
    return COMPRESSIONS[key]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums run in the gradient dtype, but never below float32."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def fold(rows, groups, out: torch.Tensor, scratch=None) -> torch.Tensor:
    """``out = sum(rows)`` in the canonical order: within each group left to right, then the
    group partials left to right. ``rows[i]`` are equal-length 1-D tensors (any float dtype,
    summed in ``out.dtype``); ``groups`` lists row indices covering every row once.
    ``scratch()`` returns a temporary like ``out``.

    ``out`` may BE one of the rows (this rank's own chunk, so it need not be copied) when the
    order is a plain left fold (one group, or groups of one row each); otherwise it must not
    alias any row.
    """
    acc = out.dtype

    def row(i):
        r = rows[i]
        return r if r.dtype == acc else r.to(acc)

    def temp():
        return scratch() if scratch is not None else torch.empty_like(out)

    if len(groups) == 1 or all(len(g) == 1 for g in groups):
        return _left_fold(row, [i for g in groups for i in g], out, rows, temp)
    _left_fold(row, groups[0], out, rows, temp)
    for g in groups[1:]:
        out.add_(row(g[0]) if len(g) == 1 else _left_fold(row, g, temp(), rows, temp))
    return out


def _left_fold(row, order, dest, rows, temp):
    """((r0 + r1) + r2) + ... into ``dest``, which may be one of the rows."""
    alias = next((k for k, i in enumerate(order) if rows[i] is dest), None)
    if len(order) == 1:
        return dest if alias == 0 else dest.copy_(row(order[0]))
    into = dest if alias is None or alias <= 1 else temp()  # dest is read before written
    torch.add(row(order[0]), row(order[1]), out=into)
    for k in range(2, len(order)):
        if k == alias:
            torch.add(into, row(order[k]), out=dest)
            into = dest
        else:
            into.add_(row(order[k]))
    return dest
