"""Checks shared by the spatial functional ops (``hpcpar.nn.padding``, ``hpcpar.nn.resample``), and
the accumulation dtype of the ops that reduce over the whole volume.

A functional op receives this rank's piece and the global spatial shape ``gshape``. Its
arguments are validated by torch itself, on a ``meta`` tensor of the GLOBAL shape: the same
accepted combinations, the same errors (as one-line ``LayerError``), and torch's own output
shape, with no data touched. The piece is checked against the partition rule of ``gshape``,
so a wrong ``gshape`` fails with a clear line instead of a mismatched message size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hpcpar.errors import LayerError
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.halo_buffers import input_layout, memory_format
from hpcpar.parallel.halo_plan import AXIS_NAMES
from hpcpar.parallel.partition import box

__all__ = ["check_piece", "torch_output_shape", "same_format", "acc_dtype"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """What sums over a volume accumulate in: float64 stays, everything else (half types
    included) sums in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_piece(op: str, x: torch.Tensor, grid: ProcessGrid, gshape: Sequence[int]) -> None:
    """Raise ``LayerError`` (naming ``op``) unless ``x`` is this rank's ``(N, C, d, h, w)``
    piece of ``gshape``: 5D, with the partition rule's extents."""
    if x.dim() != 5:
        raise LayerError(f"{op}: expected this rank's (N, C, d, h, w) piece, got shape "
                         f"{tuple(x.shape)}")
    if len(gshape) != 3:
        raise LayerError(f"{op}: gshape {tuple(gshape)} must be the 3 global spatial lengths")
    for a, (start, stop) in enumerate(box(gshape, grid.spatial_shape, grid.spatial_coords)):
        if x.shape[2 + a] != stop - start:
            raise LayerError(f"{op}: this rank holds {x.shape[2 + a]} items on axis "
                             f"{AXIS_NAMES[a]}, but the partition rule gives {stop - start} for "
                             f"the global shape {tuple(gshape)} over grid {grid.spec()}")


#: Output shapes of calls torch accepted, by (op, key, shape, dtype): a layer calls the same
#: op with the same arguments every step (the meta call costs ~50 us).
_ACCEPTED: dict = {}


def torch_output_shape(op: str, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                       gshape: Sequence[int], key: str) -> tuple[int, ...]:
    """Run ``fn`` (the single-process call, e.g. ``lambda t: F.pad(t, pad, mode)``) on a ``meta``
    tensor of the global shape (batch, channels and dtype of the piece ``x``): torch's checks and
    the global output shape ``(N, C, D', H', W')``. A refusal is a one-line LayerError naming
    ``op``; accepted calls are remembered by ``key`` (the arguments' repr)."""
    shape = (*x.shape[:2], *gshape)
    memo = (op, key, shape, x.dtype)
    out = _ACCEPTED.get(memo)
    if out is not None:
        return out
    try:
        out = tuple(fn(torch.empty(shape, dtype=x.dtype, device="meta")).shape)
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LayerError(f"{op} on the global volume {shape}: {first}") from None
    if len(_ACCEPTED) >= 1024:
        _ACCEPTED.clear()
    _ACCEPTED[memo] = out
    return out


def same_format(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``y`` in ``like``'s memory format (channels-last or contiguous)."""
    return y.contiguous(memory_format=memory_format(input_layout(like)))
