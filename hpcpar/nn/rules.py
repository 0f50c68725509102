"""The generic rules of the dispatch (:mod:`.dispatch`) for shapes, pointwise and channel ops,
indexing, reshapes, concatenation and replicated operands, and :class:`Call`, what a rule is
given. The op table (:mod:`.optable`) maps each torch op to one of these or to a spatial twin.

Replicated operands of a split op (conventions of DESIGN §2, the conjugate pair):

* a parameter is used as it is: its gradient is this rank's partial one and the gradient sync
  sums it over the spatial group (it is recorded as *spatial*);
* any other replicated tensor that needs a gradient passes through
  :class:`hpcpar.parallel.primitives.SumGrad` (identity forward, allreduce of the gradient
  backward), so whatever made it (a squeeze-excitation gate, a global mean) gets its full
  gradient on every rank; parameters used only on replicated tensors are therefore complete on
  every rank (recorded as *replicated*, tagged data-only);
* a replicated tensor whose spatial dims have the GLOBAL lengths is sliced to this rank's piece;
  length 1 broadcasts; this rank's LOCAL lengths are refused (:func:`localize`).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils._pytree import tree_map

from hpcpar.parallel.partition import part_range, torch_pad
from hpcpar.parallel.primitives import SumGrad

from . import padding
from .split import FlatLayout, Layout, SplitTensor, TokenLayout, adopt, raw, refuse, wrap
from .view_maps import MAPS, Out, by_name, propagate
from .view_maps import dims_arg as _dims_arg
from .view_maps import norm_dim as _norm_dim

__all__ = ["Call", "FAST", "leaves", "localize", "wrap_like", "pointwise", "channelwise"]


def leaves(args, kwargs) -> list:
    """The arguments, with lists and tuples opened one level (``cat``'s tensors): torch ops take
    no deeper nesting of tensors, and a pytree walk costs ~50 us a call."""
    out = []
    for a in (*args, *kwargs.values()):
        if type(a) in (list, tuple):
            out.extend(a)
        else:
            out.append(a)
    return out


def map_args(fn, args, kwargs):
    """``fn`` over every argument (lists and tuples opened one level, as :func:`leaves`)."""
    def one(a):
        if type(a) in (list, tuple):
            return type(a)(fn(v) for v in a)
        return fn(a)
    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def bind_args(names, defaults, args, kwargs) -> dict:
    """A call's arguments by name (``names`` in the op's order; ``defaults`` for its trailing
    names): the rules and the planner's tracer read an op the same way."""
    out = dict(zip(names[len(names) - len(defaults):], defaults))
    out.update(zip(names, args))
    out.update(kwargs)
    return out


class Call:
    """One call of ``func`` with at least one split argument, with the helpers rules share."""

    def __init__(self, func, args, kwargs, splits):
        self.func, self.args, self.kwargs, self.splits = func, args, kwargs, splits
        self.layout: Layout = splits[0]._hp
        self.ctx = self.layout.ctx

    @property
    def name(self) -> str:
        return op_name(self.func)

    def refuse(self, why: str, todo: str):
        return refuse(self.name, why, todo)

    def bind(self, names, defaults=()) -> dict:
        return bind_args(names, defaults, self.args, self.kwargs)

    def by_name(self) -> dict:
        """The arguments by torch's own names, defaults filled in, or refused."""
        b = by_name(self.func, self.args, self.kwargs)
        if b is None:
            raise self.refuse("is called with arguments hpcpar cannot match to torch's "
                              "signature", "pass them as torch documents the op")
        return b

    def replicated(self, t):
        if not isinstance(t, torch.Tensor):
            return t
        if isinstance(t, nn.Parameter):
            self.ctx.spatial_params.add(id(t))
            return t
        grid = self.ctx.grid
        if t.requires_grad and torch.is_grad_enabled() and grid.spatial_size > 1:
            return SumGrad.apply(t, grid.spatial_comm)
        return t

    def plain(self, localize_to: Layout | None = None, ndim: int | None = None):
        """``(args, kwargs)`` with split tensors unwrapped and replicated tensors prepared (and,
        given ``localize_to``, cut to this rank's piece of that layout)."""
        def one(t):
            if isinstance(t, SplitTensor):
                return raw(t)
            if isinstance(t, torch.Tensor):
                t = self.replicated(t)
                if localize_to is not None:
                    t = localize(t, localize_to, ndim, self.name)
            return t
        return map_args(one, self.args, self.kwargs)

    def run_plain(self, **plain_kw):
        args, kwargs = self.plain(**plain_kw)
        return self.func(*args, **kwargs)


def op_name(func) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__" and hasattr(func, "__self__"):
        return f"Tensor.{func.__self__.__name__}"
    return name


# -- replicated operands ---------------------------------------------------------------------
def localize(t: torch.Tensor, layout: Layout, ndim: int | None, op: str) -> torch.Tensor:
    """A replicated operand broadcast against a split result of ``ndim`` dims with ``layout``:
    global lengths are cut to this rank's piece, 1 broadcasts. This rank's LOCAL lengths are
    refused (a reduction of someone's piece alone would silently be a share: ``split_like``)."""
    ndim = ndim if ndim is not None else max(layout.sdims) + 1
    grid = layout.ctx.grid
    for a, (n, p, c) in enumerate(zip(layout.gshape, grid.spatial_shape, grid.spatial_coords)):
        start, stop = part_range(n, p, c)
        d = layout.sdims[a] - ndim + t.dim()  # the operand's dim aligned with the split dim
        if d < 0:
            continue
        size = t.shape[d]
        if size == 1 or size == n == stop - start:
            continue
        if size == n:
            t = t.narrow(d, start, stop - start)
            continue
        if size == stop - start:
            raise refuse(op, f"combines a plain tensor of this rank's local length {size} "
                             f"(dim {d}) with a split one", "mark this rank's piece with "
                             "hpcpar.nn.split_like(piece, split_tensor), or pass the whole "
                             "tensor")
        raise refuse(op, f"combines a tensor of length {size} on dim {d} with a split dim of "
                         f"global length {n}", "make it the global length or 1")
    return t


# -- results ----------------------------------------------------------------------------------
def wrap_like(out, layout: Layout, ndim: int, inputs=()):
    """Every tensor of ``out`` that has ``ndim`` dims, split with ``layout``; one of the call's
    ``inputs`` returned as it is (``type_as`` of the same type) is aliased, never changed."""
    def one(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, SplitTensor) and t.dim() == ndim:
            return wrap(t, layout) if any(t is a for a in inputs) else adopt(t, layout)
        return t
    return tree_map(one, out)


def same_split(call: Call, what: str = "its operands", broadcast: bool = False):
    """The split operands' common layout relative to the last dim, or refused. ``broadcast``: an
    extent of 1 meets any other on an axis the grid does not split (on a split one, one rank)."""
    rel = None
    axes = call.ctx.grid.spatial_shape
    for t in call.splits:
        lay = t._hp
        mine = (tuple(d - t.dim() for d in lay.sdims), lay.gshape)
        if rel is None or mine == rel:
            rel = mine
        elif broadcast and mine[0] == rel[0] and all(
                a == b or (min(a, b) == 1 and axes[i] == 1)
                for i, (a, b) in enumerate(zip(rel[1], mine[1]))):
            rel = (rel[0], tuple(max(a, b) for a, b in zip(rel[1], mine[1])))
        else:
            raise call.refuse(f"gets {what} split differently (global spatial shapes "
                              f"{rel[1]} and {mine[1]})", "crop, pad or resample them to one "
                              "size first")
    return rel


# -- pointwise -------------------------------------------------------------------------------
def pointwise(call: Call):
    """Elementwise with broadcasting. Written in place into a plain tensor (``buf.add_(split)``,
    ``out=plain``) it would update this rank's piece of what every rank holds whole: refused."""
    first = call.args[0] if call.args else None
    if isinstance(first, torch.Tensor) and not isinstance(first, SplitTensor) and \
            writes_by_name(call.name, call.kwargs) or \
            isinstance(call.kwargs.get("out"), torch.Tensor) and \
            not isinstance(call.kwargs["out"], SplitTensor):
        raise call.refuse("writes a split tensor in place into a plain tensor that every rank "
                          "holds whole (this rank would update only its piece, the rest stale)",
                          "compute it out of place (prior = prior + conv(x): the result is "
                          "split like its operands), and keep in a buffer only what every rank "
                          "holds alike (a statistic reduced over the spatial dims)")
    rel, gshape = same_split(call, broadcast=True)
    ndim = max(t.dim() for t in leaves(call.args, call.kwargs) if isinstance(t, torch.Tensor))
    layout = call.layout.with_(sdims=[ndim + r for r in rel], gshape=gshape)
    args, kwargs = call.plain(localize_to=layout, ndim=ndim)
    out = call.func(*args, **kwargs)
    if isinstance(first, SplitTensor) and args and out is args[0]:
        return first  # in place: the caller's own object
    return wrap_like(out, layout, ndim, leaves(args, kwargs))


def _pointwise_alike(func, args, kwargs, flat, splits):
    """:func:`pointwise` when every tensor operand is split with one layout and has the same
    dims (``x + skip``, ``relu(x)``, ``x * 0.5``): nothing to align or prepare."""
    first = splits[0]
    lay, n = first._hp, first.dim()
    for t in flat:
        if t is not first and isinstance(t, torch.Tensor) and (
                type(t) is not SplitTensor or t.dim() != n or (t._hp is not lay and
                                                                t._hp != lay)):
            return NotImplemented
    out = func(*args, **kwargs)
    if type(out) is torch.Tensor:
        return adopt(out, lay) if out.dim() == n else out
    if type(out) is SplitTensor:
        return out  # in place, or an operand returned as it is (``x.float()`` of a float)
    return wrap_like(out, lay, n, flat)


def channelwise(call: Call):
    """Per voxel across its channels (dim 1), replicated operands per channel (``prelu``'s
    weight): no alignment; a split dim 1 would mix a voxel with its neighbours."""
    if 1 in call.layout.sdims:
        raise call.refuse("acts along dim 1, which is split here", "apply it with the "
                          "channels at dim 1")
    args, kwargs = call.plain()
    return wrap_like(call.func(*args, **kwargs), call.layout, call.splits[0].dim())


def like_factory(call: Call):
    """``zeros_like`` and friends: a new split tensor of the same layout."""
    return wrap_like(call.run_plain(), call.layout, call.splits[0].dim())


# -- metadata -----------------------------------------------------------------------------------
def global_size(call: Call):
    """``.shape`` / ``.size()``: the GLOBAL shape (module docstring of hpcpar.nn.split)."""
    t = call.splits[0]
    shape = t._hp.global_shape(t.shape_local)
    b = call.bind(("self", "dim"), (None,))
    return shape if b["dim"] is None else shape[b["dim"]]


def global_numel(call: Call):
    return math.prod(_global_shape_of(call.splits[0]))


def global_len(call: Call):
    return _global_shape_of(call.splits[0])[0]


def attribute(call: Call):
    """Getters (dtype, grad, data, ...): the piece's own; a tensor of its shape stays split."""
    out = call.run_plain()
    t = call.splits[0]
    if isinstance(out, torch.Tensor) and out.shape == t.shape_local:
        return adopt(out, t._hp)
    return out


def as_plain(call: Call):
    """Calls that only look at the piece and return no tensor (printing, pickling, hooks)."""
    return call.run_plain()


def one_hot(call: Call):
    """``F.one_hot`` of a split label volume: each voxel alone, its classes a new last dim. The
    class count must be given: torch takes it from the largest label, on a piece this rank's."""
    b = call.bind(("tensor", "num_classes"), (-1,))
    if b["num_classes"] < 0:
        raise call.refuse("takes the class count from the largest label of this rank's "
                          "piece", "pass num_classes: F.one_hot(labels, num_classes)")
    return wrap_like(call.run_plain(), call.layout, call.splits[0].dim() + 1)


def refuse_local_values(call: Call):
    raise call.refuse("would read only this rank's piece", "reduce it first (x.sum(), "
                      "x.mean(...)) or take this rank's piece explicitly with "
                      "hpcpar.nn.local(x)")


def refuse_unknown(call: Call):
    raise call.refuse("has no exact spatial form in hpcpar", "apply it after a global "
                      "reduction or hpcpar.nn.SpatialGather, or see the supported-op table "
                      "in the spatial guide")


def refuse_random(call: Call):
    raise call.refuse("draws random numbers that would depend on the split", "use dropout "
                      "(split-independent in hpcpar) or draw the noise before splitting")


def rrelu(call: Call):
    """Elementwise with the mean slope; while training, refused: random slopes per element."""
    b = call.bind(("input", "lower", "upper", "training"))
    if b.get("training", False):
        return refuse_random(call)
    return pointwise(call)


def where(call: Call):
    """``where(cond, a, b)`` is elementwise; ``where(cond)``'s indices would be this rank's."""
    if len(call.args) + len(call.kwargs) == 1:
        raise call.refuse("lists the indices of the nonzero elements", "use where(cond, a, b), "
                          "or count with (cond).sum(), which is global")
    return pointwise(call)


# -- shapes ---------------------------------------------------------------------------------------
#: dim_local ops whose result has another length along the dim (a spatial one would need a
#: new global shape): refused along any spatial dim
_RESIZING = ("topk", "diff", "glu")


def dim_local(call: Call):
    """Ops that mix values along one dim (softmax, cumsum, sort, ...): local unless the grid
    splits that dim. The dim is read by torch's signature: ``topk(x, 1, 3)`` mixes along dim 3."""
    t = call.splits[0]
    dim = call.by_name().get("dim")
    sdims, name = t._hp.sdims, call.name.rstrip("_")
    if dim is None and name in ("softmax", "log_softmax", "softmin"):
        dim = 0 if t.dim() in (0, 1, 3) else 1   # torch's implicit dim (nn.Softmax())
    spatial = dim is not None and _norm_dim(dim, t.dim()) in sdims
    if dim is None or (spatial and (name in _RESIZING or call.ctx.grid.spatial_shape[
            sdims.index(_norm_dim(dim, t.dim()))] > 1)):
        raise call.refuse("mixes values along a split dim", "apply it along a channel dim, a "
                          "spatial dim the grid does not split, or after a global reduction")
    return pointwise(call)


def flip(call: Call):
    """Along batch or channel dims: local; a split dim would need the mirror rank's piece."""
    t = call.splits[0]
    if any(d in t._hp.sdims for d in _dims_arg(call.by_name()["dims"], t.dim())):
        raise call.refuse("mirrors a split dim", "flip batch or channel dims only")
    return pointwise(call)


def new_factory(call: Call):
    """``x.new_zeros(size)`` and friends: ``x``'s own (global) shape gives a split tensor, as
    ``zeros_like`` does; any other size, and ``new_tensor(data)``, a plain tensor."""
    t = call.splits[0]
    if call.name.endswith("new_tensor"):   # its argument is data, never a shape
        return call.run_plain()
    rest = list(call.args[1:])
    full = call.name.rstrip("_").endswith("new_full")
    if "size" in call.kwargs:
        size = tuple(call.kwargs["size"])
    elif rest and isinstance(rest[0], (tuple, list, torch.Size)):
        size = tuple(rest.pop(0))
    else:
        size = tuple(rest if not full else rest[:-1])
        rest = rest[-1:] if full else []
    if size != tuple(t._hp.global_shape(t.shape_local)):
        return call.run_plain()
    out = call.func(raw(t), tuple(t.shape_local), *rest, **{k: v for k, v in
                                                             call.kwargs.items() if k != "size"})
    return wrap_like(out, t._hp, t.dim())


def _global_shape_of(t) -> torch.Size:
    """A tensor's global shape (rules see a split tensor's local one)."""
    return t._hp.global_shape(t.shape_local) if isinstance(t, SplitTensor) else t.shape


def _plain_as(call: Call, other) -> torch.Tensor:
    """``plain.view_as(x)`` / ``reshape_as(x)`` / ``expand_as(x)`` with ``x`` split: given
    ``x``'s global shape (expanded once cut), cut to this rank's piece of ``x``'s layout."""
    whole = call.replicated(call.args[0])
    if call.name == "expand_as":
        piece = localize(whole, other._hp, other.dim(), call.name)
        return adopt(piece.expand(other.shape_local), other._hp)
    whole = getattr(whole, call.name[:-3])(_global_shape_of(other))
    return adopt(localize(whole, other._hp, other.dim(), call.name), other._hp)


def writes_by_name(name: str, kwargs) -> bool:
    """:func:`writes_into_first` by the op's name and keywords only (no signature read: the
    pointwise rule asks on every call with a plain first operand)."""
    return (name.endswith("_") and not name.endswith("__")) or (
        name.startswith("__i") and name not in ("__index__", "__int__", "__invert__")) or \
        name == "__setitem__" or bool(kwargs.get("inplace")) or "out" in kwargs


def writes_into_first(func, args, kwargs) -> bool:
    """``add_``, ``x += y``, ``x[i] = v``, ``inplace=True``, ``out=``."""
    return writes_by_name(op_name(func), kwargs) or \
        bool((by_name(func, args, kwargs) or {}).get("inplace"))


def reshape_target(call: Call) -> tuple[list[int], list[int]]:
    """(the split tensor's global shape, the global shape a view or reshape asks for)."""
    gold, _, outs = _dim_map(call, call.splits[0])
    return gold, [o.length(gold) for o in outs]


def _dim_map(call: Call, t) -> tuple[list[int], str, tuple]:
    """(``t``'s global shape, the op's name in :data:`~hpcpar.nn.view_maps.MAPS`, its dimension
    map for this call): ``x.view_as(y)`` is ``x.view(y.shape)``."""
    b = call.by_name()
    if "dtype" in b:
        raise call.refuse("reinterprets the dtype", "convert with .to(dtype) instead")
    name, args = call.name, list(b.values())[1:]
    if name.endswith("_as"):   # rules see a split `other`'s local shape
        name, args = name[:-3], [list(_global_shape_of(b["other"]))]
    gold = list(t._hp.global_shape(t.shape_local))
    try:
        return gold, name, MAPS[name][0](gold, *args)
    except ValueError as exc:
        raise call.refuse(str(exc), "check the sizes") from None


def same_shape_view(call: Call, gold, gnew):
    """A view or reshape of a split tensor to the global shape it already has: itself, as torch
    gives it (torch's module backward hooks ``view_as`` an output to itself); else None."""
    t = call.splits[0]
    if t is not call.args[0] or gnew != gold:
        return None
    fn = torch.Tensor.reshape if call.name.startswith("reshape") else torch.Tensor.view
    return adopt(fn(raw(t), raw(t).shape), t._hp)


def reshape(call: Call):
    """view / reshape / view_as / reshape_as: a rule of its own, since a layout whose split dims
    are merged takes a view back to its volume (:mod:`hpcpar.nn.tokens`)."""
    return shape_op(call)


def shape_op(call: Call):
    """A shape op of :data:`~hpcpar.nn.view_maps.MAPS`: its dimension map, propagated over the
    split dims. A standard volume flattened to ``(N, C*D*H*W)`` or ``(N, C, D*H*W)`` takes the
    split head's or the tokens' layout."""
    t: SplitTensor = call.splits[0]
    if call.name.endswith("_as") and not isinstance(call.args[0], SplitTensor):
        return _plain_as(call, t)   # a plain tensor shaped like the split `other`
    gold, name, outs = _dim_map(call, t)
    gnew = [o.length(gold) for o in outs]
    layout = _head(t, gold, gnew) if name in ("view", "reshape", "flatten") else None
    if layout is not None:
        local = [*t.shape_local[:len(gnew) - 1], -1]
    else:
        local, sdims, gshape = propagate(outs, gold, t.shape_local, t._hp.sdims,
                                         call.ctx.grid.spatial_shape, call.refuse)
        layout = t._hp.with_(sdims=sdims, gshape=gshape)
    local_op = MAPS[name][1]
    out = call.run_plain() if local_op is None else local_op(raw(t), local)
    if out is t:   # in place (transpose_): the caller's object takes the new layout
        t._hp = layout
        return t
    return adopt(out, layout)


def _head(t, gold, gnew) -> Layout | None:
    """The split head's layout for ``(N, C*D*H*W)``, the tokens' for ``(N, C, D*H*W)``, or None."""
    lay = t._hp
    if not lay.standard or len(gold) != 5:
        return None
    if gnew == [gold[0], math.prod(gold[1:])]:   # nn.Flatten(), x.view(N, -1)
        volume = (gold[1], *lay.gshape)
        return FlatLayout(lay.ctx, (1,), (math.prod(volume),), volume)
    if gnew == [*gold[:2], math.prod(gold[2:])]:   # x.flatten(2): hpcpar.nn.tokens
        return TokenLayout(lay.ctx, (2,), (math.prod(lay.gshape),), tuple(lay.gshape))
    return None


#: the dim hstack / vstack / dstack join tensors of 3 dims or more along (a split tensor has at
#: least its 3 spatial dims): they are then torch.cat along it
_FIXED_DIM = {"hstack": 1, "vstack": 0, "dstack": 2}


def cat(call: Call):
    """Along a dim that is not split: local (the batch dim too: a replica's samples are its own)."""
    rel, gshape = same_split(call, "tensors to join")
    b = call.by_name()
    tensors, fixed = b["tensors"], _FIXED_DIM.get(call.name)
    dim = fixed if fixed is not None else b["dim"]
    ndim = call.splits[0].dim()
    stack = call.name == "stack"
    sdims = [ndim + r for r in rel]
    d = _norm_dim(dim, ndim + 1 if stack else ndim)
    if not stack and d in sdims:
        raise call.refuse("joins along a split dim", "join along the channel dim (dim=1)")
    layout = call.layout.with_(sdims=sdims, gshape=gshape)
    pieces = [raw(t) if isinstance(t, SplitTensor) else
              localize(call.replicated(t), layout, ndim, call.name) for t in tensors]
    kwargs = {k: v for k, v in call.kwargs.items() if k not in ("tensors", "dim")}
    out = call.func(pieces, **kwargs) if fixed is not None else call.func(pieces, d, **kwargs)
    if stack:
        sdims = [s + 1 if s >= d else s for s in sdims]
    return adopt(out, layout.with_(sdims=sdims))


def split_like(call: Call):
    """chunk / split / unbind / narrow / select along a dim that is not split."""
    t = call.splits[0]
    dim = _norm_dim(call.by_name()["dim"], t.dim())
    if dim in t._hp.sdims:
        raise call.refuse("cuts along a split dim", "cut along batch or channel dims")
    out = call.run_plain()
    drop = call.name in ("unbind", "select")
    sdims = [d - 1 if drop and d > dim else d for d in t._hp.sdims]
    return wrap_like(out, t._hp.with_(sdims=sdims), t.dim() - (1 if drop else 0))


def getitem(call: Call):
    """Indexing: ints, slices, None and ... on batch and channel dims; a split dim takes ``:`` or
    a step-1 slice in GLOBAL coordinates (a crop: ``F.pad`` with negative pads)."""
    t = call.splits[0]
    index = call.args[1]
    index = list(index) if isinstance(index, tuple) else [index]
    if not any(i is Ellipsis for i in index):
        index.append(Ellipsis)   # x[a, b] is x[a, b, ...]: every dim is read by an entry
    n = t.dim()
    crops = {}
    for pos, d in _index_dims(index, n):
        i = index[pos]
        if d in t._hp.sdims and isinstance(i, slice) and i != slice(None):
            length = t._hp.gshape[t._hp.sdims.index(d)]
            start, stop, step = i.indices(length)
            if step != 1:
                raise call.refuse("slices a split dim with a step", "use a pool or "
                                  "interpolation to subsample")
            crops[t._hp.sdims.index(d)] = (-start, -(length - max(stop, start)))
            index[pos] = slice(None)
    out = _getitem_whole(call, t, tuple(index))
    if not crops:
        return out
    lay = out._hp
    if out.dim() != 5 or not lay.standard:
        raise call.refuse("crops a split dim while dropping or adding dims", "crop first, "
                          "then index the other dims")
    pads = torch_pad([crops.get(a, (0, 0)) for a in range(3)])
    piece, gshape = padding.pad(raw(out), pads, grid=lay.ctx.grid, gshape=lay.gshape)
    return adopt(piece, lay.with_(gshape=gshape))


def _index_dims(index, n):
    """(position in the index, the tensor dim it reads or None for a new dim) of each entry."""
    span, dim = n - sum(1 for i in index if i is not None and i is not Ellipsis), 0
    for pos, i in enumerate(index):
        if i is None:
            yield pos, None
        k = 0 if i is None else span if i is Ellipsis else 1
        yield from ((pos, d) for d in range(dim, dim + k))
        dim += k


def _getitem_whole(call: Call, t, index):
    """``t[index]`` with ``:`` on every split dim, by its dimension map: an int drops its dim,
    None adds one, a slice and ``...`` keep theirs."""
    if any(isinstance(i, torch.Tensor) or not isinstance(i, (int, slice, type(None),
                                                             type(Ellipsis))) for i in index):
        raise call.refuse("indexes with a tensor or list", "index batch/channel dims with "
                          "ints and slices, or use hpcpar.nn.local")
    lay, dims = t._hp, list(_index_dims(index, t.dim()))
    if any(d in lay.sdims and index[p] not in (slice(None), Ellipsis) for p, d in dims):
        raise call.refuse("slices a split dim", "crop with F.pad and negative pads, or keep "
                          "':' on dims 2-4")
    outs = [Out(() if d is None else (d,)) for p, d in dims if not isinstance(index[p], int)]
    _, sdims, _ = propagate(outs, lay.global_shape(t.shape_local), t.shape_local, lay.sdims,
                            call.ctx.grid.spatial_shape, call.refuse)
    return adopt(raw(t)[index], lay.with_(sdims=sdims))


def setitem(call: Call):
    """In-place assignment on batch/channel dims (a split dim: ``:`` only)."""
    t = call.args[0]
    if not isinstance(t, SplitTensor):
        raise call.refuse("writes a split tensor into a replicated one", "keep both split")
    index = call.args[1] if isinstance(call.args[1], tuple) else (call.args[1],)
    if any(isinstance(i, torch.Tensor) for i in index) or Ellipsis in index:
        raise call.refuse("assigns through a tensor index or ...", "index with ints and slices")
    for d, i in enumerate(index):
        if d in t._hp.sdims and i != slice(None):
            raise call.refuse("assigns into part of a split dim", "assign whole spatial dims")
    value = call.args[2]
    if isinstance(value, SplitTensor):
        value = raw(value)
    elif isinstance(value, torch.Tensor):
        value = localize(call.replicated(value), t._hp, t.dim(), call.name)
    raw(t)[call.args[1]] = value
    return None


def linear(call: Call):
    """Exact only when the contracted last dim is not split (a per-voxel MLP, channels last)."""
    t = call.args[0]
    if not isinstance(t, SplitTensor) or any(isinstance(a, SplitTensor) for a in call.args[1:]):
        raise call.refuse("contracts over a split tensor's dims", "apply it per voxel on "
                          "channels, after a global reduction, or after a gather")
    if t.dim() - 1 in t._hp.sdims:
        raise call.refuse("contracts along a split dim", "move the channels last first "
                          "(x.permute(0, 2, 3, 4, 1)) or reduce the spatial dims")
    other = call.args[1] if len(call.args) > 1 else call.kwargs.get("weight",
                                                                     call.kwargs.get("other"))
    if call.name != "linear" and (other is None or other.dim() != 2):
        raise call.refuse("is a batched matrix product over a split tensor", "use F.linear or "
                          "a 2D matrix on the channel dim")
    args, kwargs = call.plain()  # parameters as they are: no alignment with the split dims
    return adopt(call.func(*args, **kwargs), t._hp)


#: Rules' fast forms: ``(func, args, kwargs, leaves, splits)`` -> the result, or
#: ``NotImplemented`` where the rule itself must look (see :func:`handle`).
FAST = {pointwise: _pointwise_alike,
        as_plain: lambda func, args, kwargs, flat, splits: func(*args, **kwargs)}
