"""Split-invariant flips and 90° rotations of whole samples, applied as each rank reads its box.

A sample's view ``T`` (flips of D, H, W after ``k`` quarter turns in the (H, W) plane) is drawn from
``(seed, epoch, sample)`` alone, so every rank agrees on it whatever the grid. ``T`` maps boxes to
boxes (it only permutes and mirrors axes), so the rank owning box ``B`` of the augmented sample
reads the source box ``T⁻¹(B)`` (:func:`source_box`) and applies ``T`` to that block locally
(:func:`apply_view`): the same voxels as flipping the whole sample on one rank, with no
communication. Quarter turns need a square (H, W) plane."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["view_code", "source_box", "apply_view"]

_STREAM = 0xA06  # keeps these draws apart from every other use of the data seed


def view_code(seed: int, epoch: int, sample: int, flip: bool, rot90: bool) -> int:
    """The view of global ``sample`` in ``epoch``: bits 0-2 flip D, H, W; bits 3-4 the quarter
    turns (0 when neither is asked for)."""
    if not (flip or rot90):
        return 0
    rng = np.random.default_rng([_STREAM, seed, epoch, sample])
    bits = rng.integers(0, 2, 3) if flip else np.zeros(3, dtype=np.int64)
    turns = int(rng.integers(0, 4)) if rot90 else 0
    return int(bits[0]) | int(bits[1]) << 1 | int(bits[2]) << 2 | turns << 3


def source_box(box: Sequence[Sequence[int]], gshape: Sequence[int], code: int) -> tuple:
    """The box of the stored sample that view ``code`` maps onto ``box`` of the augmented one
    (both ``((d0, d1), (h0, h1), (w0, w1))`` in global voxels of a ``gshape`` volume)."""
    out = [tuple(int(v) for v in b) for b in box]
    for axis in range(3):          # undo the flips (applied last)
        if code >> axis & 1:
            lo, hi = out[axis]
            out[axis] = (gshape[axis] - hi, gshape[axis] - lo)
    for _ in range(code >> 3):     # undo each quarter turn: out[i, j] = in[j, N-1-i]
        (h0, h1), (w0, w1) = out[1], out[2]
        out[1], out[2] = (w0, w1), (gshape[1] - h1, gshape[1] - h0)
    return tuple(out)


def apply_view(block: np.ndarray, code: int) -> np.ndarray:
    """View ``code`` applied to the block read from :func:`source_box` (the last three axes
    are D, H, W): this rank's block of the augmented sample."""
    block = np.rot90(block, code >> 3, axes=(-2, -1))
    flips = tuple(block.ndim - 3 + a for a in range(3) if code >> a & 1)
    return np.flip(block, flips) if flips else block
