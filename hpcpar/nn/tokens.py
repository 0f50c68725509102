"""A split volume with its spatial dims merged into one: ``x.view(N, C, -1)``, ``x.flatten(2)``.

Squeeze-excitation written as ``x.view(b, c, -1).mean(-1)``, a spatial softmax
(``F.softmax(x.view(N, C, -1), -1)``, the heat maps of a soft-argmax) and attention gates
merge the three spatial dims of a ``(N, C, D, H, W)`` volume into one "token" dim. On a split
volume that gives a *token* tensor (:class:`TokenLayout`): this rank holds the voxels of its
own sub-box, in its piece's row-major order, along that dim. Every op on it is run on the
volume it views: the piece is unflattened to ``(N, C, d, h, w)``, the op runs by the split
volume's own rule (a reduction over the token dim becomes one over dims (2, 3, 4), global; a
softmax over it is composed of global reductions), and a result that is still split is
flattened back. So the same rules, and the same exactness, hold for both spellings.

Taken: elementwise ops among token tensors, scalars and replicated operands whose token dim is 1 or
the whole volume; losses; reductions (over the token dim: global, replicated; over other dims:
local); ``softmax`` / ``log_softmax`` over any dim; dropout; a view or reshape back to the
``(N, C, D, H, W)`` volume; shape questions (the global shape). Anything else (``transpose`` to
tokens-first, a ``matmul`` of tokens with tokens: attention) is refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import rules
from . import spatial_ops as sops
from .rules import Call, leaves, map_args
from .split import Layout, SplitTensor, TokenLayout, adopt, raw

__all__: list[str] = []   # registers the forms of TokenLayout


def _volume(t) -> SplitTensor:
    """A token tensor as the split volume it views (a view: autograd flows through)."""
    lay: TokenLayout = t._hp
    piece = raw(t)
    p = lay.sdims[0]
    local = [b - a for a, b in lay.box()]
    shaped = piece.reshape(*piece.shape[:p], *local, *piece.shape[p + 1:])
    return adopt(shaped, Layout(lay.ctx, (p, p + 1, p + 2), lay.volume))


def _tokens(out, lay: TokenLayout):
    """A result on the volume back as tokens where it is still split with the volume's
    layout; anything else (a replicated reduction) as it is."""
    if not isinstance(out, SplitTensor) or type(out._hp) is not Layout \
            or len(out._hp.sdims) != 3:
        return out
    p = out._hp.sdims[0]
    if out._hp.sdims != (p, p + 1, p + 2) or tuple(out._hp.gshape) != lay.volume:
        return out
    piece = raw(out)
    flat = piece.reshape(*piece.shape[:p], -1, *piece.shape[p + 3:])
    return adopt(flat, lay.with_(sdims=(p,)))


def _operand(a, lay: TokenLayout, ndim: int):
    """An operand of an op on token tensors, as an operand of the op on the volume: a token
    tensor unflattened; a replicated tensor whose token dim is 1 or the whole volume given
    three dims there."""
    if isinstance(a, SplitTensor):
        return _volume(a)
    if not isinstance(a, torch.Tensor) or a.dim() == 0:
        return a
    at = lay.sdims[0] - (ndim - a.dim())   # broadcasting aligns the trailing dims
    if at < 0:
        return a
    n = a.shape[at]
    spatial = (1, 1, 1) if n == 1 else lay.volume if n == lay.gshape[0] else None
    if spatial is None:
        return a   # the op on the volume refuses it, as torch would the shapes
    return a.reshape(*a.shape[:at], *spatial, *a.shape[at + 1:])


def _dim_map(dims, p: int, ndim: int) -> tuple[list[int], bool]:
    """Token-tensor dims as volume dims: the token dim becomes the three spatial ones."""
    out, hit = [], False
    for d in rules._dims_arg(dims, ndim):
        if d == p:
            out += [p, p + 1, p + 2]
            hit = True
        else:
            out.append(d if d < p else d + 2)
    return out, hit


def _with_dim(b: dict, value) -> tuple[tuple, dict]:
    """A call's arguments (``b``: by torch's names, :meth:`Call.by_name`), ``dim`` replaced."""
    return (b["input"],), {**{k: v for k, v in b.items() if k != "input"}, "dim": value}


def _reduction(call: Call, run: Callable) -> Any:
    x = call.splits[0]
    lay: TokenLayout = x._hp
    p, n = lay.sdims[0], x.dim()
    b = call.by_name()
    if b.get("dim") in (None, [], ()):   # every dim: the same on the volume
        args, kwargs = map_args(lambda a: _operand(a, lay, n), call.args, call.kwargs)
        return run(call.func, args, kwargs)
    dims, hit = _dim_map(b["dim"], p, n)
    args, kwargs = map_args(lambda a: _operand(a, lay, n), *_with_dim(b, tuple(dims)))
    out = run(call.func, args, kwargs)
    if hit:   # kept dims (..., 1, 1, 1, ...) back to one token dim of 1, however keepdim came
        def squash(t):
            if not isinstance(t, torch.Tensor) or isinstance(t, SplitTensor) \
                    or t.dim() != n + 2:
                return t
            return t.reshape(*t.shape[:p], 1, *t.shape[p + 3:])
        return type(out)(squash(t) for t in out) if isinstance(out, tuple) else squash(out)
    return _tokens(out, lay) if not isinstance(out, tuple) else \
        type(out)(_tokens(t, lay) for t in out)


def _softmax(call: Call, run: Callable) -> Any:
    """``softmax`` / ``log_softmax`` over the token dim: composed of global reductions on
    the volume (max, then the sum of exponentials); over another dim: the volume's rule."""
    x = call.splits[0]
    lay: TokenLayout = x._hp
    p, n = lay.sdims[0], x.dim()
    if call.name.rstrip("_") not in ("softmax", "log_softmax"):   # the other dim-wise ops
        return lay.no_form(rules.dim_local, call, run)
    b = call.by_name()
    dim = b.get("dim")
    if dim is None or rules._norm_dim(dim, n) != p:   # None: the volume's rule refuses it
        args, kwargs = (call.args, call.kwargs) if dim is None else \
            _with_dim(b, _dim_map(dim, p, n)[0][0])
        args, kwargs = map_args(lambda a: _operand(a, lay, n), args, kwargs)
        return _tokens(run(call.func, args, kwargs), lay)
    if call.kwargs.get("dtype") is not None:
        raise call.refuse("takes a dtype over the merged spatial dims", "cast first")
    v = _volume(x)
    spatial = (p, p + 1, p + 2)
    kept = {"dim": spatial, "keepdim": True}
    shifted = run(torch.sub, (v, run(torch.amax, (v,), kept)), {})
    total = run(torch.sum, (run(torch.exp, (shifted,), {}),), kept)
    if call.name.startswith("log_softmax"):
        out = run(torch.sub, (shifted, run(torch.log, (total,), {})), {})
    else:
        out = run(torch.div, (run(torch.exp, (shifted,), {}), total), {})
    return _tokens(out, lay)


def _on_volume(call: Call, run: Callable) -> Any:
    """Elementwise ops and dropout: the op on the volume, flattened back."""
    n = max(t.dim() for t in leaves(call.args, call.kwargs) if isinstance(t, torch.Tensor))
    lay: TokenLayout = call.splits[0]._hp
    args, kwargs = map_args(lambda a: _operand(a, lay, n), call.args, call.kwargs)
    if rules.writes_into_first(call.func, call.args, call.kwargs):
        if not (isinstance(args[0], SplitTensor) and args[0]._base is not None):
            raise call.refuse("writes in place into a tensor whose split dims are merged "
                              "and which cannot be viewed as its volume", "write y = op(x)")
        run(call.func, args, kwargs)
        return call.args[0]   # written through its view
    return _tokens(run(call.func, args, kwargs), lay)


def _reshape(call: Call, run: Callable) -> Any:
    """A view or reshape to the ``(N, C, D, H, W)`` volume, or to the shape it has."""
    x = call.splits[0]
    lay: TokenLayout = x._hp
    gold, gnew = rules.reshape_target(call)
    p = lay.sdims[0]
    same = rules.same_shape_view(call, gold, gnew)
    if same is not None:
        return same
    if x is call.args[0] and gnew == [*gold[:p], *lay.volume, *gold[p + 1:]]:
        return _volume(x)
    raise call.refuse("reshapes a tensor whose split dims are merged other than back to its "
                      "volume", "reduce over the merged dim, or view it back as (N, C, D, H, W)")


TokenLayout.forms.update({rules.pointwise: _on_volume, sops.dropout: _on_volume,
                          sops.noise: _on_volume, sops.loss: _on_volume,
                          sops.reduction: _reduction, rules.dim_local: _softmax,
                          rules.reshape: _reshape})
