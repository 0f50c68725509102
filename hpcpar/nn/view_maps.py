"""Shape ops as dimension maps, and the one function that runs them on split tensors.

Each shape op is one entry of :data:`MAPS`: from the input's global shape and the call's
arguments (read by torch's own signature, :func:`by_name`) to a tuple of :class:`Out`, one per
output dim, saying which input dims it is made of (kept, merged, cut into pieces, repeated, or
new). :func:`propagate` reads the map against the split dims, the same way for every op: a
split dim may move, be merged with whole dims after it or be cut with itself outermost, as long
as every rank's piece stays its partition-rule piece of the output dim; anything else is
refused in one line. (The idea is DTensor's ``_view_ops``; the code is ours.)
"""

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

    def length(self, shape) -> int:
        """Its global length, given the input's global ``shape``."""
        if self.sizes is not None:
            return self.sizes[self.i]
        return math.prod(shape[s] for s in self.src) * self.times


# -- arguments by torch's signature -------------------------------------------------------------
_NONE = inspect.Parameter.empty


@functools.cache
def _signatures(func) -> tuple:
    """``((name, type, default, keyword_only), ...)`` for each form of ``func``: the Python
    signature of a Python function, else the schema of each overload of the aten op of its
    name (``self`` called ``input``, as torch's Python functions call it)."""
    try:
        params = inspect.signature(func).parameters.values()
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            raise ValueError("a wrapper (F.max_pool3d's): its op's schemas say more")
        return (tuple(("input" if i == 0 and p.name == "self" else p.name, "", p.default,
                       p.kind == p.KEYWORD_ONLY) for i, p in enumerate(params)),)
    except (TypeError, ValueError):   # a builtin: its aten op's schemas
        pass
    op = getattr(torch.ops.aten, getattr(func, "__name__", ""), None)
    forms = [getattr(op, o)._schema.arguments for o in op.overloads()] if op else []
    return tuple(tuple(("input" if a.name == "self" else a.name, str(a.real_type),
                        a.default_value if a.has_default_value() else _NONE, a.kwarg_only)
                       for a in form) for form in forms)


def _takes(kind: str, v) -> bool:
    """Whether an argument of schema type ``kind`` may be ``v`` (loosely: enough to tell
    torch's overloads apart, ``x.var(1)``'s dim from ``x.var(False)``'s flag)."""
    if not kind or v is None:   # a Python signature; None where Optional
        return not kind or kind.startswith("Optional[")
    kind = kind[9:-1] if kind.startswith("Optional[") else kind
    if isinstance(v, torch.Tensor) or kind == "Tensor":
        return isinstance(v, torch.Tensor) and "Tensor" in kind
    if kind == "List[int]":
        return isinstance(v, int) or isinstance(v, (list, tuple)) and \
            all(isinstance(i, int) for i in v)
    check = _CHECKS.get(kind)
    return check is None or isinstance(v, check)


_CHECKS: dict[str, type | tuple[type, ...]] = {
    "int": int, "SymInt": int, "bool": bool, "float": (float, int), "ScalarType": torch.dtype,
    "str": str}


def _bind(form, args, kwargs) -> dict | None:
    if len(args) > 2 and len(form) > 1 and form[1][1] == "List[int]" and \
            all(isinstance(a, int) for a in args[1:]):
        args = (args[0], list(args[1:]))   # x.view(2, 3): the method's int varargs
    positional = [p for p in form if not p[3]]
    if len(args) > len(positional) or not set(kwargs) <= {p[0] for p in form}:
        return None
    out = dict(zip((p[0] for p in positional), args))
    for name, kind, default, _ in form:
        value = out.get(name, kwargs.get(name, default))
        if name in out and name in kwargs or value is _NONE or not _takes(kind, value):
            return None
        out[name] = value
    return out


def by_name(func, args, kwargs) -> dict | None:
    """The call's arguments by torch's own names, defaults filled in, in torch's order
    (``topk(x, 1, 3)``'s dim is 3): the first form of ``func`` that takes them, or None."""
    for form in _signatures(func):
        bound = _bind(form, args, kwargs)
        if bound is not None:
            return bound
    return None


# -- the maps -----------------------------------------------------------------------------------
def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def dims_arg(dims, ndim) -> list[int]:
    """A dim argument (None: every dim; an int or a sequence) as non-negative dims."""
    if dims is None:
        return list(range(ndim))
    return [norm_dim(int(d), ndim) for d in ([dims] if isinstance(dims, int) else dims)]


def _keep(order) -> tuple[Out, ...]:
    return tuple(Out((d,)) for d in order)


def _swap(shape, a, b) -> tuple[Out, ...]:
    order = list(range(len(shape)))
    a, b = norm_dim(a, len(shape)), norm_dim(b, len(shape))
    order[a], order[b] = order[b], order[a]
    return _keep(order)


def _movedim(shape, source, destination) -> tuple[Out, ...]:
    src, dst = dims_arg(source, len(shape)), dims_arg(destination, len(shape))
    order = [d for d in range(len(shape)) if d not in src]
    for d, s in sorted(zip(dst, src)):
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
    """Pairs (old dims, new dims) whose sizes multiply to the same number, in order: how a
    view maps dims (size-1 dims stand alone)."""
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
    """repeat, or (``expand``) expand: new leading dims, and each dim repeated (an expanded
    dim of length 1 is repeated to its new length)."""
    reps = _ints(repeats)
    lead = len(reps) - len(shape)
    kept = [Out((d,)) if r in (1, -1) or expand and r == shape[d] else
            Out((d,), None, 0, r // shape[d] if expand else r)
            for d, r in enumerate(reps[lead:])]
    return (*(Out((), (r,)) for r in reps[:lead]), *kept)


#: op name -> (its dimension map: ``map(global shape, *arguments after the tensor)``, the op
#: that runs it on a piece given the piece's output shape, or None where the call runs as
#: made: its arguments name no lengths)
MAPS: dict[str, tuple[Callable[..., tuple[Out, ...]], Callable | None]] = {
    "permute": (lambda shape, dims: _keep(dims_arg(dims, len(shape))), None),
    **dict.fromkeys(("transpose", "transpose_", "swapaxes", "swapdims"), (_swap, None)),
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
def _aligned(n: int, inner: int, rows: int, row: int, parts: int) -> bool:
    """Whether every rank's piece of ``n`` rows of ``inner`` elements is, read as ``rows``
    rows of ``row`` elements, its partition-rule piece of those rows."""
    return all(tuple(x * inner for x in part_range(n, parts, c)) ==
               tuple(x * row for x in part_range(rows, parts, c)) for c in range(parts))


def propagate(outs, shape, local, sdims, parts, refuse):
    """``(the piece's output shape, the output's split dims, their global lengths)`` of the
    op whose map is ``outs``, on a tensor of global ``shape`` whose piece has shape ``local``,
    split on ``sdims`` into ``parts`` ranks each; ``refuse(why, todo)`` raises otherwise."""
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
        if not _aligned(shape[d], inner, glen[first], row, p):
            raise refuse("merges or splits a split dim into pieces that are not the ranks' "
                         "own", MERGE_TODO)
        loc[first] = local[d] * inner // row
        new_sdims.append(first)
    return loc, new_sdims, [glen[j] for j in new_sdims]


MERGE_TODO = ("flatten all of (C, D, H, W) at once (x.flatten(1), x.view(x.size(0), -1): "
              "the next F.linear takes the features split), or reduce the spatial dims "
              "first (x.mean(dim=(2, 3, 4)), nn.AdaptiveAvgPool3d(1))")
