"""Dropout whose mask depends on GLOBAL vertex ids, not on the partition.

The keep/drop decision for element ``(v, c)`` is a hash of (seed, call, layer, v, c) (SplitMix64),
so the same seed drops the same elements at every rank count and the distributed model trains
exactly like the single-process one."""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

__all__ = ["keep_mask", "vertex_dropout"]

_M64 = (1 << 64) - 1


def _splitmix64_py(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


@njit(inline="always")
def _kept(index, key, threshold):
    x = np.uint64(index) ^ key
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)) >= threshold


@njit(cache=True)
def _keep(gids, ncols, key, threshold, out):
    for r in range(gids.shape[0]):
        base = np.uint64(gids[r]) * np.uint64(ncols)
        for c in range(ncols):
            out[r, c] = _kept(base + np.uint64(c), key, threshold)


@njit(cache=True)
def _apply(gids, key, threshold, scale, x, out):
    """out = x * keep * scale in one pass (forward and, with x = grad, backward). Serial on
    purpose: a Numba thread pool next to torch's slows both (see hpcpar.kernels.spmm)."""
    ncols = x.shape[1]
    for r in range(gids.shape[0]):
        base = np.uint64(gids[r]) * np.uint64(ncols)
        for c in range(ncols):
            out[r, c] = x[r, c] * scale if _kept(base + np.uint64(c), key, threshold) else 0


def _key(seed: int, call: int, layer: int) -> np.uint64:
    return np.uint64(_splitmix64_py(_splitmix64_py(_splitmix64_py(seed) ^ call) ^ layer))


def _threshold(p: float) -> np.uint64:
    return np.uint64(int(p * (1 << 53)))


def keep_mask(global_ids: np.ndarray, ncols: int, p: float, seed: int, call: int,
              layer: int) -> torch.Tensor:
    """The dropout mask of rows of vertices ``global_ids``, a pure function of its arguments:
    bool ``(len(global_ids), ncols)``, True where the element is kept (probability ``1 - p``),
    the same at every rank count and partition. ``call`` counts forward calls; ``layer`` names
    the dropout stream."""
    out = np.empty((global_ids.shape[0], ncols), dtype=np.bool_)
    _keep(np.ascontiguousarray(global_ids, np.int64), ncols, _key(seed, call, layer),
          _threshold(p), out)
    return torch.from_numpy(out)


class _Dropout(torch.autograd.Function):
    """Fused CPU dropout; the backward recomputes the mask from the hash (nothing saved)."""

    @staticmethod
    def forward(ctx, x, gids, key, threshold, scale):
        ctx.args = (gids, key, threshold, scale)
        return _fused(x, *ctx.args)

    @staticmethod
    def backward(ctx, g):
        return _fused(g, *ctx.args), None, None, None, None


def _fused(x, gids, key, threshold, scale):
    x = x.contiguous()
    out = torch.empty_like(x)
    xn = x.detach().numpy()
    _apply(gids, key, threshold, xn.dtype.type(scale), xn, out.numpy())
    return out


def vertex_dropout(x: torch.Tensor, p: float, global_ids: np.ndarray, seed: int, call: int,
                   layer: int, training: bool = True) -> torch.Tensor:
    """Inverted dropout of the rows ``x`` of vertices ``global_ids``, masks as
    :func:`keep_mask`: dropped elements zeroed (probability ``p``), the rest scaled by ``1 / (1 -
    p)``; identity when not ``training``."""
    if not training or p == 0.0:
        return x
    if p >= 1.0:
        return torch.zeros_like(x)
    gids = np.ascontiguousarray(global_ids, np.int64)
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return _Dropout.apply(x, gids, _key(seed, call, layer), _threshold(p), 1.0 / (1.0 - p))
    mask = keep_mask(gids, x.shape[1], p, seed, call, layer).to(x.device)
    return x * mask.to(x.dtype) * (1.0 / (1.0 - p))
