"""Shape ops as dimension maps, and the one function that runs them on split tensors.

Each shape op is one entry of :data:`MAPS`: from the input's global shape and the call's
arguments (read by torch's own signature, :func:`by_name`) to one :class:`Out` per output dim,
made of input dims kept, merged, cut, repeated, or of none (new). :func:`propagate` reads the
map against the split dims alike for every op: a split dim may move, merge with whole dims
after it or be cut with itself outermost, while each rank's piece stays its partition-rule
piece; else one-line refusal. (DTensor's ``_view_ops`` idea; our code.)"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from hpcpar.parallel.partition import part_range

__all__ = ["Out", "MAPS", "by_name", "propagate"]


class Out(NamedTuple):
    """One output dim: the input dims ``src`` merged row-major (none: a new dim), cut into
    ``sizes`` (None: not cut) of which it is piece ``i``, repeated ``times``."""

    src: tuple[int, ...]
    sizes: tuple[int, ...] | None = None
    i: int = 0
    times: int = 1

    def length(self, shape) -> int:   # global, given the input's global shape
        return self.sizes[self.i] if self.sizes is not None else \
            math.prod(shape[s] for s in self.src) * self.times


# -- arguments by torch's signature -------------------------------------------------------------
_NONE = inspect.Parameter.empty


@functools.cache
def _signatures(func) -> tuple:
    """Each form of ``func``: its Python signature, else its aten op's overloads' schemas."""
    try:
        params = inspect.signature(func).parameters.values()
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            raise ValueError("a wrapper (F.max_pool3d's): its op's schemas say more")
        forms = [[(p.name, "", p.default, p.kind == p.KEYWORD_ONLY) for p in params]]
    except (TypeError, ValueError):   # a builtin: its aten op's schemas
        op = getattr(torch.ops.aten, getattr(func, "__name__", ""), None)
        forms = [[(a.name, str(a.real_type), a.default_value if a.has_default_value() else
                   _NONE, a.kwarg_only) for a in getattr(op, o)._schema.arguments]
                 for o in (op.overloads() if op else ())]
    return tuple(_form(f) for f in forms)


def _form(params) -> tuple:
    """(the positional count, the names, ``(name, optional, type, default)`` of each) of a form's
    ``(name, schema type, default, keyword_only)``; ``self`` called ``input``, as in Python."""
    params = [("input" if n == "self" else n, *rest) for n, *rest in params]
    return (sum(1 for p in params if not p[3]), frozenset(p[0] for p in params),
            tuple((n, k.startswith("Optional["), k[9:-1] if k.startswith("Optional[") else k,
                   d) for n, k, d, _ in params))


def _takes(optional: bool, kind: str, v) -> bool:
    """Whether an argument of schema type ``kind`` may be ``v``: enough to tell overloads apart
    (``max(x, y)``, ``max(x, 1)``; ``x.var(1)``, ``x.var(False)``; ``x.view(torch.half)``)."""
    if not kind or v is None:   # a Python signature; None where Optional
        return not kind or optional
    if isinstance(v, torch.Tensor) or kind == "Tensor":
        return isinstance(v, torch.Tensor) and kind == "Tensor"
    want = {"bool": bool, "int": int, "SymInt": int, "ScalarType": torch.dtype}.get(kind)
    return isinstance(v, want) if want else not isinstance(v, torch.dtype)


def _bind(form, args, kwargs) -> dict | None:
    npos, names, params = form
    if len(args) > 2 and npos == 2 and params[1][1:3] == (False, "List[int]") and \
            all(type(a) is int for a in args[1:]):   # x.view(2, 3): an int list's varargs
        args = (args[0], list(args[1:]))
    if len(args) > npos or not names.issuperset(kwargs):
        return None
    out = {}
    for i, (name, optional, kind, default) in enumerate(params):
        value = args[i] if i < len(args) else kwargs.get(name, default)
        if i < len(args) and name in kwargs or value is _NONE or \
                not _takes(optional, kind, value):
            return None
        out[name] = value
    return out


def by_name(func, args, kwargs) -> dict | None:
    """The call's arguments by torch's own names, defaults filled in, in torch's order
    (``topk(x, 1, 3)``'s dim is 3): the first form of ``func`` that takes them, or None."""
    return next((b for f in _signatures(func) if (b := _bind(f, args, kwargs)) is not None), None)


# -- the maps -----------------------------------------------------------------------------------
def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def dims_arg(dims, ndim) -> list[int]:
    """A dim argument (None: every dim; an int or a sequence) as non-negative dims."""
    if dims is None:
        return list(range(ndim))
    return [norm_dim(int(d), ndim) for d in ([dims] if isinstance(dims, int) else dims)]


def _keep(order) -> tuple[Out, ...]:   # the dims in this order
    return tuple(Out((d,)) for d in order)


def _movedim(shape, source, destination) -> tuple[Out, ...]:
    src, dst = dims_arg(source, len(shape)), dims_arg(destination, len(shape))
    order = [d for d in range(len(shape)) if d not in src]
    for d, s in sorted(dict(zip(dst, src)).items()):   # transpose(x, 1, 1): once
        order.insert(d, s)
    return _keep(order)


def _ints(v) -> list[int]:
    return [int(v)] if isinstance(v, int) else [int(s) for s in v]


def _resolve(shape, total: int) -> list[int]:
    shape = _ints(shape)
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = total // known if known else 0
    return shape


def _groups(old, new):
    """How a view maps dims: pairs (old dims, new dims) of equal products (size-1 dims alone)."""
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        if i < len(old) and old[i] == 1 and (j == len(new) or new[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(new) and new[j] == 1 and (i == len(old) or old[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        gi, gj, po, pn = [i], [j], old[i], new[j]
        i, j = i + 1, j + 1
        while po != pn:
            if po < pn:
                po *= old[i]
                gi.append(i)
                i += 1
            else:
                pn *= new[j]
                gj.append(j)
                j += 1
        groups.append((gi, gj))
    return groups


def _view(shape, size, *_) -> tuple[Out, ...]:
    new = _resolve(size, math.prod(shape))
    if math.prod(new) != math.prod(shape):
        raise ValueError(f"cannot view global shape {tuple(shape)} as {tuple(new)}")
    return tuple(Out(tuple(gi), None if len(gj) == 1 else tuple(new[j] for j in gj), k)
                 for gi, gj in _groups(list(shape), new) for k in range(len(gj)))


def _flatten(shape, start_dim=0, end_dim=-1) -> tuple[Out, ...]:
    s, e = norm_dim(start_dim, len(shape)), norm_dim(end_dim, len(shape)) + 1
    return _view(shape, [*shape[:s], math.prod(shape[s:e]), *shape[e:]])


def _unflatten(shape, dim, sizes) -> tuple[Out, ...]:
    d = norm_dim(dim, len(shape))
    return _view(shape, [*shape[:d], *_resolve(sizes, shape[d]), *shape[d + 1:]])


def _squeeze(shape, dim=None) -> tuple[Out, ...]:
    """By the GLOBAL shape: a piece of length 1 on one rank is not squeezed."""
    drop = [d for d in dims_arg(dim, len(shape)) if shape[d] == 1]
    return _keep(d for d in range(len(shape)) if d not in drop)


def _unsqueeze(shape, dim) -> tuple[Out, ...]:
    d = norm_dim(dim, len(shape) + 1)
    return (*_keep(range(d)), Out(()), *_keep(range(d, len(shape))))


def _repeat(shape, repeats, expand=False) -> tuple[Out, ...]:
    """repeat, or expand (an expanded dim of length 1 is repeated to its new length)."""
    reps = _ints(repeats)
    lead = len(reps) - len(shape)
    kept = [Out((d,)) if r in (1, -1) or expand and r == shape[d] else
            Out((d,), None, 0, r // shape[d] if expand else r)
            for d, r in enumerate(reps[lead:])]
    return (*(Out((), (r,)) for r in reps[:lead]), *kept)


#: op name -> (its dimension map ``map(global shape, *arguments after the tensor)``, the op
#: run on a piece with the piece's output shape; None: the call as made names no lengths)
MAPS: dict[str, tuple[Callable[..., tuple[Out, ...]], Callable | None]] = {
    "permute": (lambda shape, dims: _keep(dims_arg(dims, len(shape))), None),
    **dict.fromkeys(("transpose", "transpose_", "swapaxes", "swapdims"),
                    (lambda shape, a, b: _movedim(shape, (a, b), (b, a)), None)),
    **dict.fromkeys(("movedim", "moveaxis"), (_movedim, None)),
    "view": (_view, torch.Tensor.view),
    "reshape": (_view, torch.Tensor.reshape),
    "flatten": (_flatten, None),
    "unflatten": (_unflatten, torch.Tensor.view),
    "squeeze": (_squeeze, torch.Tensor.view),
    "unsqueeze": (_unsqueeze, None),
    "expand": (lambda shape, size, *_: _repeat(shape, size, expand=True), torch.Tensor.expand),
    "repeat": (_repeat, None),
}


# -- propagation --------------------------------------------------------------------------------
def propagate(outs, shape, local, sdims, parts, refuse):
    """``(the piece's output shape, the output's split dims, their global lengths)`` of the op
    whose map is ``outs``, on a tensor of global ``shape`` whose piece has shape ``local``, split
    on ``sdims`` into ``parts`` ranks each; ``refuse(why, todo)`` raises otherwise."""
    glen = [o.length(shape) for o in outs]
    loc, new_sdims = list(glen), []
    for d, p in zip(sdims, parts):
        hits = [j for j, o in enumerate(outs) if d in o.src]
        if not hits:
            raise refuse("removes a split dim", "keep the spatial dims")
        o = outs[hits[0]]
        if o.times != 1:
            raise refuse("expands or repeats a split dim", "expand or repeat batch and "
                         "channel dims only")
        at = o.src.index(d)
        if any(s in sdims for s in o.src if s != d) or any(shape[s] != 1 for s in o.src[:at]):
            raise refuse("merges a split dim with others", MERGE_TODO)
        first = next((j for j in hits if glen[j] != 1), hits[0])
        inner = math.prod(shape[s] for s in o.src[at + 1:])
        row = math.prod(glen[j] for j in hits if j > first)
        # each rank's piece of shape[d] rows of `inner` must be, read as rows of `row`, its
        # partition-rule piece of the output dim's glen[first] rows
        if any(tuple(x * inner for x in part_range(shape[d], p, c)) !=
               tuple(x * row for x in part_range(glen[first], p, c)) for c in range(p)):
            raise refuse("merges or splits a split dim into pieces that are not the ranks' "
                         "own", MERGE_TODO)
        loc[first] = local[d] * inner // row
        new_sdims.append(first)
    return loc, new_sdims, [glen[j] for j in new_sdims]


MERGE_TODO = ("flatten all of (C, D, H, W) at once (x.flatten(1), x.view(x.size(0), -1): "
              "the next F.linear takes the features split), or reduce the spatial dims "
              "first (x.mean(dim=(2, 3, 4)), nn.AdaptiveAvgPool3d(1))")
