"""Which models a slab tiling along D (:mod:`hpcpar.run.slabs`) is exact for: every op the
model applies to the volume must read, along D, only a window the margin covers.

The margin is summed from the leaf layers whose window is known (convolutions, pools,
transposed convolutions, up-sampling modules). Anything else that reaches along D would make
the tiled output silently differ from the whole volume's at the slabs' seams: statistics of
the sample (group, instance and layer norms; a batch norm in training mode), a reduction or a
global pool over D (squeeze-and-excitation blocks), a stencil called as a function outside
such a layer (``F.conv3d(x, w)``, ``F.interpolate``: its window is not known to the margin),
an op along D (``softmax``/``cumsum``/``flip``/``roll`` over dim 2, ``cat`` along D), or a view
that moves D (attention over flattened voxels). :class:`SlabGuard` watches the meta-device
probe of :func:`~hpcpar.run.slabs.model_reach` (a torch function mode) and refuses tiling in
one line naming the op and the user's line; the untiled forward stays exact for any model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from hpcpar.errors import ConfigError
from hpcpar.nn import optable
from hpcpar.nn.split import user_frame
from hpcpar.nn.view_maps import by_name

__all__ = ["SlabGuard", "known_window"]

_D = 2   # the volume's D axis in (N, C, D, H, W)
#: ops of the local class that still take a dim: local along D only when that dim is not D
_ALONG_DIM = {"softmax", "log_softmax", "softmin", "cumsum", "cumprod", "cummax", "cummin",
              "logcumsumexp", "flip", "roll", "rot90", "glu", "normalize", "argsort", "sort",
              "topk", "kthvalue", "diff", "cat", "concat", "concatenate", "stack", "chunk",
              "split", "tensor_split", "unbind", "narrow", "select", "index_select", "gather",
              "scatter", "take_along_dim", "unfold", "movedim", "moveaxis", "swapaxes",
              "transpose", "swapdims"}
_TWO_DIMS = ("transpose", "swapaxes", "swapdims", "movedim", "moveaxis")


def known_window(module: Any) -> bool:
    """Whether the margin counts ``module``'s window along D (:func:`slabs._layer_reach`);
    not a circular padding (it reads the far end of the volume, which a slab does not hold)."""
    if getattr(module, "padding_mode", "zeros") == "circular":
        return False
    return isinstance(module, (torch.nn.modules.conv._ConvNd, torch.nn.Upsample)) or (
        hasattr(module, "kernel_size") and hasattr(module, "stride"))


class SlabGuard(TorchFunctionMode):
    """A torch function mode over the probe: refuses (``ConfigError``) the first op that
    reaches along D outside a layer with a known window. Leaf layers push themselves on
    :attr:`layers` (forward pre-hooks) so their own calls (``nn.Conv3d`` -> ``F.conv3d``)
    are judged as the layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: list[Any] = []

    def hooks(self, model: Any) -> list:
        """Forward pre-hooks and hooks on every leaf module of ``model``: remove them after."""
        def enter(module, _args) -> None:
            self.layers.append(module)

        def leave(*_) -> None:   # returns None: a forward hook's value replaces the output
            self.layers.pop()

        out = []
        for m in model.modules():
            if not list(m.children()):
                out.append(m.register_forward_pre_hook(enter))
                out.append(m.register_forward_hook(leave, always_call=True))
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        flat = [b for a in args for b in (a if isinstance(a, (list, tuple)) else (a,))]
        volumes = [a for a in flat if isinstance(a, torch.Tensor) and a.dim() == 5]
        inside = bool(self.layers) and known_window(self.layers[-1])
        if volumes and not inside:
            why = self._reaches_along_d(func, args, kwargs, volumes[0], result)
            if why:
                name = getattr(func, "__name__", str(func))
                raise ConfigError(f"--max-slab: {name} at {user_frame()} {why}: a slab would "
                                  "not see what the whole volume does, so this model cannot be "
                                  "tiled exactly; drop --max-slab (the untiled forward is exact)")
        return result

    def _reaches_along_d(self, func, args, kwargs, x, result) -> str | None:
        """Why ``func`` reads along D beyond one voxel's column (None: it does not)."""
        name = getattr(func, "__name__", "").strip("_")
        kind, b = optable.kind_of(func), by_name(func, args, kwargs) or {}
        if kind == "norm":
            if name == "batch_norm" and not b.get("training"):
                return None    # running statistics: a per-channel affine map
            return "computes statistics over the whole sample"
        if kind == "stencil":
            if name == "pad":
                pad = b.get("pad", ())
                if b.get("mode") == "circular":
                    return "wraps around the volume (circular padding)"
                if len(pad) < 6 or not any(pad[4:6]):
                    return None
            return "reads a window along D that the slab margin does not count (call it " \
                   "through its nn layer: nn.Conv3d, nn.MaxPool3d, nn.Upsample)"
        if kind == "reduction":
            dims = _dims(b, name)
            return None if dims is not None and _D not in dims else "reduces over D"
        if name in _ALONG_DIM:
            dims = _dims(b, name)
            return None if dims is not None and _D not in dims else (
                "moves D" if name in _TWO_DIMS else "works along D")
        if name == "setitem":   # a write at positions along D: a slab's are not the volume's
            index = args[1] if len(args) > 1 else None
            index = index if isinstance(index, tuple) else (index,)
            along = index[_D] if len(index) > _D and Ellipsis not in index else slice(None)
            return None if along == slice(None) else "writes at positions along D"
        if kind in ("local", "metadata", "dropout") or optable.reads_values(func) is False:
            return None
        if kind is None and optable._aten_pointwise(name):
            return None
        if isinstance(result, torch.Tensor) and result.dim() == 5 and \
                result.shape[_D] == x.shape[_D] and kind == "shape":
            return None   # a view or index that keeps D where it is
        return "is not known to keep D's voxels apart"


def _dims(b: dict, name: str) -> set[int] | None:
    """The volume dims an op with dim arguments works on (``b``: its arguments by torch's
    signature), as non-negative indices (None: all of them, or not found)."""
    keys = ("dim0", "dim1", "axis0", "axis1", "source", "destination") if name in _TWO_DIMS \
        else ("dim", "dims", "dimension")
    found = [d for k in keys if b.get(k) not in (None, [], ()) for d in
             (b[k] if isinstance(b[k], (tuple, list)) else (b[k],))]
    if not found and name in ("softmax", "log_softmax", "softmin") and "dim" in b:
        found = [1]   # torch's implicit dim of a 5D input: the channels
    try:
        return {int(d) % 5 for d in found} if found else None
    except TypeError:
        return None
