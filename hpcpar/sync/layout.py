"""A parameter's elements in its own memory order.

A gradient bucket holds each parameter's gradient as a slice of one flat buffer, and the
optimizer updates the parameter from that gradient. torch's fused and foreach optimizers
walk a parameter and its gradient as raw memory, so the two must share their strides: a
channels-last weight (``[train] channels_last`` puts a volume model's convolution weights in
``channels_last_3d``) with an NCDHW-ordered gradient view is updated wrongly, silently. So a
bucket lays each parameter out in the parameter's own order, and the sharded optimizer cuts
its slices from that same order, and an optimizer state loaded from a checkpoint written in
the other layout is laid out like its parameter.
"""

from __future__ import annotations

import torch

__all__ = ["dense", "flat_in_order", "match_state_layouts", "shaped_like"]


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one span of memory without gaps or overlaps, in any
    order of its dimensions (contiguous, channels-last, any permutation)."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def shaped_like(flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The 1-D slice ``flat`` (``p.numel()`` elements) seen with ``p``'s shape and strides."""
    if dense(p):
        return flat.as_strided(p.shape, p.stride())
    return flat.view(p.shape)


def flat_in_order(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """``t``'s elements as a 1-D tensor in the memory order of ``like`` (default: ``t``).

    A view when ``t`` already has that layout; otherwise a copy laid out like ``like``
    (a checkpoint written by a run in the other memory format)."""
    like = t if like is None else like
    if not dense(like):
        return t.reshape(-1)
    if t.stride() != like.stride() or not dense(t):
        t = torch.empty_like(like).copy_(t)
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def match_state_layouts(optimizer: torch.optim.Optimizer) -> None:
    """Lay every per-element state tensor out like its parameter (a checkpoint written while
    the weights were in the other memory order: torch loads the state with the strides it
    was saved with)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == p.shape and \
                        value.stride() != p.stride() and dense(p):
                    state[key] = torch.empty_like(p, dtype=value.dtype).copy_(value)
