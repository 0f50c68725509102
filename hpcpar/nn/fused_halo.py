"""Fused halos: one exchange for a run of convolutions (``spatialize(..., fuse_halos=k)``).

On small local volumes the exchanges' latency and the ranks' waiting for each other weigh more
than the copies: fused, the first of a run of stride-1, size-keeping convolutions receives the
COMBINED halo of the run once and each later one computes on what its predecessor computed
beyond this rank's voxels (the overlap computed twice instead of exchanged again). Exact voxel
for voxel: the extra voxels are the neighbour's own values, from the same inputs and kernels.
What a run may hold, where it ends and how its length is learned: the spatial guide's *Fused
halos*.

How it runs under :func:`~hpcpar.nn.spatialize`'s dispatch, which it joins as a layout
(:class:`MarginLayout`'s forms, the split volume's form of ``F.conv3d``, ``Layout.own``):

* The first convolution of a run takes the halo of all of its run (``reach`` items per side,
  inner sides only; the global boundary is padded per convolution, as the single-process model
  pads each layer) through one :func:`~hpcpar.parallel.halo.halo_stencil`, and returns its
  output with a :class:`MarginLayout`: the piece plus the part of the reach not used yet.
* A convolution given such a tensor pads only its global sides and convolves with no exchange,
  using up its own halo of the margin; a pointwise op keeps the margin, and so does batch norm
  (statistics of the owned voxels only; in backward a margin voxel's share of the statistics'
  gradient goes to the owners through the sums).
* Anything else first crops the margin away: correct everywhere, its compute then wasted.

What was learned changes only at the start of a forward, so the recomputation of a checkpointed
segment makes the exchanges its forward made. Decisions use only global facts (the layers, the
global shape, the partition), so every rank takes the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
import torch.nn.functional as F

from hpcpar.errors import LayerError
from hpcpar.parallel.halo import halo_stencil
from hpcpar.parallel.halo_buffers import input_layout, memory_format
from hpcpar.parallel.halo_plan import HaloPlan
from hpcpar.parallel.partition import axis_halo, conv_pads, split_sizes, torch_pad

from . import rules
from . import spatial_ops as sops
from ._base import triple
from .conv import ConvOp
from .norm import _GlobalBatchNorm
from .rules import Call, leaves, map_args
from .spatial_ops import CONV_ARGS
from .split import Layout, SplitTensor, adopt

__all__ = ["MarginLayout", "crop", "check_setting"]


def check_setting(value, where: str = "fuse_halos") -> int:
    """``fuse_halos`` as the longest run (1: off); LayerError if not an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayerError(f"{where}: expected the longest run of convolutions sharing one "
                         f"halo exchange, an integer >= 1 (1: off), got {value!r}")
    return value


@dataclass(frozen=True)
class MarginLayout(Layout):
    """A split tensor that holds, beyond this rank's piece, up to ``reach`` (per axis, low and
    high; the same on every rank) items of its neighbours' voxels on each inner side: the unused
    rest of a fused run's halo."""

    reach: tuple[tuple[int, int], ...] = ((0, 0),) * 3
    run: tuple = ()   # (key, convolutions so far, halo used so far per axis)
    forms: ClassVar[dict] = {}

    def no_form(self, rule, call: Call, redo):
        """Any other op (module docstring) runs on the cropped pieces."""
        args, kwargs = map_args(lambda a: crop(a) if isinstance(a, SplitTensor) and
                                type(a._hp) is MarginLayout else a, call.args, call.kwargs)
        return redo(call.func, args, kwargs)

    def own(self, t: SplitTensor, end: bool = False) -> SplitTensor:
        return crop(t, learn=end)

    def margins(self) -> tuple[tuple[int, int], ...]:
        """This rank's own margins: the reach on inner sides, 0 on global ones."""
        grid = self.ctx.grid
        return tuple((r[0] if c > 0 else 0, r[1] if c < p - 1 else 0)
                     for r, p, c in zip(self.reach, grid.spatial_shape, grid.spatial_coords))

    def owned(self) -> Layout:
        return Layout(self.ctx, self.sdims, self.gshape)


# -- the learning -----------------------------------------------------------------------------
def settle_runs(ctx) -> None:
    """At an outermost forward's start: what the last forwards learned takes effect."""
    ctx.fuse_counts[:] = [0, 0]
    if ctx.fuse_seen:
        for key, (convs, used) in ctx.fuse_seen.items():
            old = ctx.fuse_plan.get(key)
            if old is None or convs < old[0]:
                ctx.fuse_plan[key] = (convs, used)
        ctx.fuse_seen.clear()


# -- geometry ---------------------------------------------------------------------------------
def _fusable(b, w) -> tuple[tuple[int, int], ...] | None:
    """Per axis (low, high) padding of a stride-1, size-keeping convolution, else None."""
    k = tuple(w.shape[2:])
    stride, dilation = triple(b["stride"], "stride", "conv3d"), _dilation(b)
    if stride != (1, 1, 1) or len(k) != 3:
        return None
    pads = tuple(conv_pads(b["padding"], a, k[a], dilation[a]) for a in range(3))
    if any(lo + hi != dilation[a] * (k[a] - 1) or lo < 0 or hi < 0
           for a, (lo, hi) in enumerate(pads)):
        return None
    return pads


def _dilation(b) -> tuple[int, int, int]:
    return triple(b["dilation"], "dilation", "conv3d")


def _fits(reach, gshape, grid) -> bool:
    """Every piece on a split axis holds at least the reach (ghosts come from the adjacent rank
    only, and a run's margin never crosses the global boundary)."""
    return all(p == 1 or min(split_sizes(n, p)) >= max(r)
               for r, n, p in zip(reach, gshape, grid.spatial_shape))


def _run_reach(ctx, key, pads, gshape):
    """The reach of the run this convolution starts, or None (not fused)."""
    grid = ctx.grid
    split = [p > 1 for p in grid.spatial_shape]
    planned = ctx.fuse_plan.get(key)
    if planned is not None:
        convs, used = planned
        if convs < 2:
            return None
        reach = tuple(u if s else (0, 0) for u, s in zip(used, split))
        return reach if _fits(reach, gshape, grid) else None
    for convs in range(ctx.fuse_halos, 1, -1):
        reach = tuple((convs * lo, convs * hi) if s else (0, 0)
                      for (lo, hi), s in zip(pads, split))
        if _fits(reach, gshape, grid):
            return reach
    return None


def _plan(ctx, gshape, reach, pads) -> HaloPlan:
    """The run's one exchange: ``reach`` items from each inner neighbour, the first convolution's
    own padding on global sides (cached per geometry)."""
    key = ("fused halo", gshape, reach, pads)
    plan = ctx.twins.get(key)
    if plan is None:
        grid = ctx.grid
        per_axis = []
        for n, parts, r, p in zip(gshape, grid.spatial_shape, reach, pads):
            per_axis.append([axis_halo(n, n, parts, i, _reads(r[0] if i > 0 else p[0],
                                                              r[1] if i < parts - 1 else p[1]))
                             for i in range(parts)])
        plan = ctx.twins[key] = HaloPlan.from_halos(grid, per_axis, "fused halo exchange")
    return plan


def _reads(lo: int, hi: int):
    """``(out_start, out_stop) -> the inputs read``, as :func:`axis_halo` asks."""
    return lambda start, stop: (start - lo, stop + hi)


# -- the ops ---------------------------------------------------------------------------------
def start(call: Call, b, w, bias) -> torch.Tensor | None:
    """The conv3d rule's first look (standard split input): start a run here, or None."""
    ctx = call.ctx
    x = b["input"]
    lay = x._hp
    pads = _fusable(b, w)
    if pads is None or type(lay) is not Layout or not lay.standard or x.dim() != 5 or \
            not any(any(p) for p, n in zip(pads, ctx.grid.spatial_shape) if n > 1) or \
            torch.is_autocast_enabled(x.device.type):
        # a 1x1x1 convolution or nothing split: no halo to share; under autocast (bf16,
        # fp16 jobs) the layers' own casting path runs instead
        return None
    # a run is known by its first convolution: its weight (a Parameter, the same object every
    # step; one computed in forward is new each call, so its runs keep the first guess), the
    # global shape and the geometry
    key = (id(w), tuple(lay.gshape), pads, _dilation(b))
    reach = _run_reach(ctx, key, pads, lay.gshape)
    if reach is None:
        return None
    plan = _plan(ctx, lay.gshape, reach, pads)
    out_shape = tuple(ax.result[1] - ax.result[0] - sum(p) for ax, p in zip(plan.axes, pads))
    out = halo_stencil(x, plan, _conv_op(b, w, out_shape), w, bias)
    ctx.fuse_counts[0] += 1
    return adopt(out, _step(lay, reach, pads, (key, 0, ((0, 0),) * 3)))


def _conv_op(b, w, out_shape) -> ConvOp:
    """The valid convolution of an extended piece (the layers' own kernel routes)."""
    return ConvOp((1, 1, 1), _dilation(b), b["groups"], w.shape[0], out_shape,
                  tuple(w.shape[2:]))


def _step(lay: Layout, reach, pads, run) -> Layout:
    """The layout after one convolution of ``run`` took its halo ``pads`` of ``reach``."""
    key, convs, used = run
    took = tuple(p if any(r) else (0, 0) for r, p in zip(reach, pads))
    left = tuple((r[0] - t[0], r[1] - t[1]) for r, t in zip(reach, took))
    used = tuple((u[0] + t[0], u[1] + t[1]) for u, t in zip(used, took))
    if not any(any(r) for r in left):
        return lay if type(lay) is Layout else Layout(lay.ctx, lay.sdims, lay.gshape)
    return MarginLayout(lay.ctx, lay.sdims, lay.gshape, left, (key, convs + 1, used))


def _go_on(call: Call) -> torch.Tensor | None:
    """Convolve a margin tensor without exchange where its margin holds the halo, else None."""
    b = call.bind(*CONV_ARGS)
    x = b["input"]
    if not isinstance(x, SplitTensor) or type(x._hp) is not MarginLayout or \
            any(t is not x for t in call.splits):
        return None
    w, bias = call.replicated(b["weight"]), call.replicated(b["bias"])
    pads = _fusable(b, w)
    lay = x._hp
    if pads is None or any(any(r) and (r[0] < p[0] or r[1] < p[1])
                           for r, p in zip(lay.reach, pads)):
        return None
    grid = call.ctx.grid
    # padding on global sides only: an inner side reads the margin instead
    own = tuple((p[0] if c == 0 else 0, p[1] if c == n - 1 else 0)
                for p, n, c in zip(pads, grid.spatial_shape, grid.spatial_coords))
    local = tuple(n + sum(o) - sum(p) for n, o, p in zip(x.shape_local[2:], own, pads))
    out = _PaddedConv.apply(x, w, bias, torch_pad(own), _conv_op(b, w, local))
    return adopt(out, _step(lay, lay.reach, pads, lay.run))


class _PaddedConv(torch.autograd.Function):
    """Zero-pad (global sides), then the layers' own :class:`~hpcpar.nn.conv.ConvOp`; holds the
    unpadded input for backward (padded again there): no more than the plain layer."""

    @staticmethod
    def forward(ctx, x, weight, bias, pad, op):
        xp = F.pad(x, pad) if any(pad) else x
        ctx.pad, ctx.op = pad, op
        ctx.save_for_backward(x, weight, bias)
        return op.forward(xp, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        pad, needs = ctx.pad, ctx.needs_input_grad
        holder = [F.pad(x, pad) if any(pad) else x]
        fmt = memory_format(input_layout(holder[0]))   # the input's order (channels-last)
        del x
        gi, gw, gb = ctx.op.backward(holder, grad.contiguous(memory_format=fmt),
                                     (weight, bias), needs[:3])
        if gi is not None and any(pad):
            gi = F.pad(gi, [-p for p in pad])
        return gi, gw, gb, None, None


def _pointwise(call: Call, channelwise: bool = False) -> torch.Tensor | None:
    """An elementwise op on margin tensors of one layout (and operands that broadcast over every
    spatial dim, or act per channel): computed on the whole piece, margin kept; else None."""
    lay = call.splits[0]._hp
    if any(t._hp != lay for t in call.splits):
        return None
    ndim = call.splits[0].dim()
    for t in [] if channelwise else leaves(call.args, call.kwargs):
        if isinstance(t, torch.Tensor) and not isinstance(t, SplitTensor):
            if t.dim() > ndim or any(t.shape[d - ndim + t.dim()] != 1 for d in lay.sdims
                                     if d - ndim + t.dim() >= 0):
                return None
    args, kwargs = call.plain()
    out = call.func(*args, **kwargs)
    first = call.args[0] if call.args else None
    if isinstance(first, SplitTensor) and args and out is args[0]:
        return first   # in place
    if isinstance(out, torch.Tensor) and not isinstance(out, SplitTensor) and \
            out.dim() == ndim and out.shape[2:] == call.splits[0].shape_local[2:]:
        return adopt(out, lay)
    return None


def crop(t: SplitTensor, learn: bool = True) -> SplitTensor:
    """A margin tensor as this rank's piece (a copy). ``learn``: the run ends here (not so for a
    look at the piece, :func:`~hpcpar.nn.local` or the first-step check's)."""
    lay = t._hp
    assert isinstance(lay, MarginLayout)   # what every caller checked
    if learn:   # cropped before its margin was used up: the next forwards take the halo it used
        key, convs, used = lay.run
        lay.ctx.fuse_counts[1] += 1
        old = lay.ctx.fuse_seen.get(key)
        if old is None or convs < old[0]:
            lay.ctx.fuse_seen[key] = (convs, used)
    with torch._C.DisableTorchFunction():
        p = t.as_subclass(torch.Tensor)
        fmt = memory_format(input_layout(p))
        for d, (lo, hi) in zip(lay.sdims, lay.margins()):
            if lo or hi:
                p = p.narrow(d, lo, p.shape[d] - lo - hi)
        p = p.contiguous(memory_format=fmt)
    return adopt(p, lay.owned())


def _batch_norm(call: Call) -> torch.Tensor | None:
    """Statistics of the owned voxels (the same global ones as unfused), every voxel normalised,
    margin kept; eval with running statistics per channel. None for a tensor split otherwise."""
    b = call.bind(("input", "running_mean", "running_var", "weight", "bias", "training",
                   "momentum", "eps"), (None, None, False, 0.1, 1e-5))
    x = b["input"]
    if not isinstance(x, SplitTensor) or any(t is not x for t in call.splits) or x.dim() != 5:
        return None
    if not b["training"] and b["running_mean"] is not None:
        return _pointwise(call, channelwise=True)
    lay = x._hp
    assert isinstance(lay, MarginLayout)   # only margin tensors come here
    grid = call.ctx.grid
    owned = (slice(None), slice(None), *(slice(lo, n - hi) for (lo, hi), n in
                                         zip(lay.margins(), x.shape_local[2:])))
    comm = grid.comm if call.ctx.bn_include_data else grid.spatial_comm
    out = _GlobalBatchNorm.apply(x, call.replicated(b["weight"]), call.replicated(b["bias"]),
                                 b["running_mean"], b["running_var"], b["momentum"], b["eps"],
                                 comm, "batch_norm", owned)
    return adopt(out, lay)


def _kept(form):
    """``form(call)`` as the layout's form: its result, or (None) the op on cropped pieces."""
    def run(call: Call, redo):
        out = form(call)
        return out if out is not None else call.layout.no_form(None, call, redo)
    return run


MarginLayout.forms.update({sops.conv3d: _kept(_go_on), rules.pointwise: _kept(_pointwise),
                           rules.channelwise: _kept(partial(_pointwise, channelwise=True)),
                           sops.batch_norm: _kept(_batch_norm)})
#: the split volume's convolution: the first of a run where fused halos are on
Layout.forms[sops.conv3d] = lambda call, redo: sops.conv3d(
    call, start if call.ctx.fuse_halos > 1 else None)
