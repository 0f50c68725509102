"""Every torch call that touches a split tensor comes here, and is run exactly or refused.

Two doors lead in: :class:`SplitTensor.__torch_function__ <hpcpar.nn.split.SplitTensor>` (any call
with a split argument, also after ``forward`` returned: the loss) and :class:`SpatialMode`, a
``TorchFunctionMode`` that a spatialized model holds during its ``forward``, so calls on replicated
tensors are seen too (which parameters a replicated head uses, dropout there). :func:`handle` asks
:mod:`hpcpar.nn.optable` for the op's rule and the split tensor's layout for its form of that rule
(:attr:`Layout.forms <hpcpar.nn.split.Layout.forms>`, registered beside each layout), or its
one-line refusal; the generic rules (shapes, pointwise ops, replicated operands) live in
:mod:`hpcpar.nn.rules`, the spatial twins in :mod:`hpcpar.nn.spatial_ops`. Importing this module
opens the first door (:func:`hpcpar.nn.split.set_handler`).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hpcpar.errors import LayerError

from . import optable, tokens  # noqa: F401  (tokens registers its layout's forms)
from . import rules as _rules
from .gather import gather_shrunk
from .optable import AS_IS, METADATA
from .rules import FAST, Call, leaves, map_args, op_name
from .split import FlatLayout, Layout, SplitTensor, refuse, set_handler, user_frame, wrap
from .split_head import COLUMNS_ATTR, has_flat_form

__all__ = ["handle", "mode_call", "SpatialMode"]


class SpatialMode(TorchFunctionMode):
    """Active during a spatialized model's ``forward``: sees calls on replicated tensors too."""

    def __init__(self, ctx):
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return mode_call(func, types, args, kwargs or {}, self.ctx)


def mode_call(func, types, args, kwargs, ctx):
    """The mode's door: ``types`` (torch's types of the overloaded arguments) names
    :class:`SplitTensor` exactly when a split tensor is among them, so a call on replicated
    tensors only (a buffer's ``add_``, a head's ``linear``) skips :func:`handle`'s scan."""
    if SplitTensor in types:
        return handle(func, args, kwargs, ctx)
    return _replicated_call(func, args, kwargs, leaves(args, kwargs), ctx)


def handle(func, args, kwargs, ctx=None):
    """Run ``func`` on split and replicated arguments by its rule (see the module docstring).

    A model's forward makes the same few calls every step, so this is its per-op cost: a
    rule's ``fast`` form (:data:`FAST`) takes the common case — every tensor operand split
    alike, nothing to prepare — without building a :class:`Call`."""
    flat = leaves(args, kwargs)
    splits = [t for t in flat if isinstance(t, SplitTensor)]
    if not splits:
        return _replicated_call(func, args, kwargs, flat, ctx)
    rule, fast = _ROUTES.get(func) or _route(func)
    if rule not in METADATA and any(t._hp.shrunk for t in splits):
        return _gathered_call(func, args, kwargs, ctx, splits)
    # rules run with torch-function handling off: there a split tensor is its plain piece
    # (raw), and what ops return is plain until a rule adopts it
    try:
        with torch._C.DisableTorchFunction():
            if fast is not None:
                out = fast(func, args, kwargs, flat, splits)
                if out is not NotImplemented:
                    return out
            # the layout's form of the rule (the split volume's: the rule itself); a call
            # that mixes the volume with another layout is that layout's
            lay = next((t._hp for t in splits if type(t._hp) is not Layout), splits[0]._hp)
            form = type(lay).forms.get(rule)
            call = Call(func, args, kwargs, splits)

            def redo(f, a, k):
                return handle(f, a, k, ctx)
            if form is not None and all(type(t._hp) is type(lay) for t in splits):
                return form(call, redo)
            return rule(call) if rule in AS_IS else lay.no_form(rule, call, redo)
    except LayerError as exc:
        raise _told(_located(exc, func), splits) from exc
    except (RuntimeError, IndexError) as exc:
        if type(exc) not in (RuntimeError, IndexError):   # out of memory, MPI: not the op's
            raise
        raise _told(_torch_refusal(exc, func), splits) from exc


def _told(exc: LayerError, splits) -> LayerError:
    """``exc``, told to every other rank of the spatial group first: a rank whose piece alone
    makes an op raise must not leave the others waiting in the next collective
    (:mod:`hpcpar.nn.error_notice`)."""
    notices = getattr(splits[0]._hp.ctx, "notices", None)
    if notices is not None:
        notices.tell(str(exc))
    return exc


def _torch_refusal(exc: Exception, func) -> LayerError:
    """torch's own error from an op on split tensors, said in one line that names the user's
    line, what hpcpar could not do and what to write instead. torch's text is not repeated
    where its sizes are this rank's piece's (they differ per rank); it stays chained."""
    text = str(exc).split("\n", 1)[0]
    low = text.lower()
    if "inplace" in low or "in-place" in low or "is a view" in low:
        why = "could not write in place there (torch refuses that in-place write on a view " \
              "or a tensor autograd must keep)"
        todo = "write it out of place (y = y + h rather than y += h, torch.relu(x) rather " \
               "than x.relu_())"
    elif any(w in low for w in ("shape", "size", "dimension", "dim ")):
        why = "could not fit the sizes the op asks for to this rank's piece"
        todo = "take sizes from the split tensor itself (its .shape is the global shape) " \
               "and view back only what x.flatten(1) flattened, or gather the tensor first " \
               "(hpcpar.nn.SpatialGather)"
    else:
        why = f"could not run it (torch: {text})"
        todo = "see the supported-op table in the spatial guide"
    return LayerError(f"spatialize: {op_name(func)} at {user_frame()} on a tensor split over "
                      f"the spatial grid: hpcpar {why}; {todo}")


def _located(exc: LayerError, func) -> LayerError:
    """A layer's refusal (a piece too thin for its halo, an axis shorter than its ranks)
    with the op and the user's source line in front, as the rules' own refusals have."""
    msg = str(exc)
    if msg.startswith("spatialize"):
        return exc
    return LayerError(f"spatialize: {op_name(func)} at {user_frame()}: {msg}")


def _gathered_call(func, args, kwargs, ctx, splits):
    """``func`` with its shrunk split operands gathered whole on every rank: the op and what
    follows run replicated, as after a global pooling (exact; backward takes the own slice).
    Warns once per source line: from there on each rank holds the whole tensor."""
    shrunk = [t for t in splits if t._hp.shrunk]
    lay = shrunk[0]._hp
    if args and any(args[0] is t for t in shrunk) and \
            _rules.writes_into_first(func, args, kwargs):
        raise refuse(op_name(func), f"writes in place into a volume {lay.gshape}, fewer "
                     f"voxels than the grid {lay.ctx.grid.spatial_shape} splits it into,",
                     "write y = op(x) there instead (such a volume is gathered whole into a "
                     "new tensor)")
    where = user_frame()
    if where not in lay.ctx.gathered_at:
        lay.ctx.gathered_at.add(where)
        if lay.ctx.grid.rank == 0:
            file, _, line = where.rpartition(":")
            warnings.warn_explicit(
                f"spatialize: {op_name(func)}: the volume {lay.gshape} has fewer voxels than "
                f"the grid splits it into {lay.ctx.grid.spatial_shape}; gathered here, it and "
                f"what follows run whole on every rank", UserWarning, file or where,
                int(line) if line.isdigit() else 0)
    whole = {id(t): gather_shrunk(t) for t in shrunk}
    args, kwargs = map_args(lambda a: whole.get(id(a), a), args, kwargs)
    return handle(func, args, kwargs, ctx)


#: func -> (its rule, the rule's fast form or None): one lookup per op.
_ROUTES: dict = {}


def _route(func):
    rule = optable.rule_for(func)
    route = (rule, FAST.get(rule))
    try:
        _ROUTES[func] = route
    except TypeError:  # unhashable callables are looked up every time
        pass
    return route


# -- calls with no split argument (under the mode) ------------------------------------------
def _replicated_call(func, args, kwargs, flat, ctx):
    if ctx is not None:
        shared = False
        for t in flat:
            if isinstance(t, nn.Parameter):
                if COLUMNS_ATTR in t.__dict__:   # a split head's weight, cut to its columns
                    return _cut_weight_call(func, args, kwargs, ctx)
                ctx.replicated_params.add(id(t))
                shared = shared or t.requires_grad
        if shared and ctx.grid.spatial_size > 1 and torch.is_grad_enabled() \
                and optable.reads_values(func):
            args, kwargs = map_args(lambda t: _ReplicatedUse.use(t, ctx), args, kwargs)
        rule = optable.REPLICATED_RULES.get(func)
        if rule is not None:
            return rule(func, args, kwargs, ctx)
    return func(*args, **kwargs)


def _cut_weight_call(func, args, kwargs, ctx):
    """A split head's weight read outside its ``nn.Linear`` in the same forward (an L2
    penalty ``fc.weight.pow(2).sum()``, ``fc.weight.shape``): this rank holds its columns of
    the flattened volume, so it is read as what it is, a flattened split tensor
    (:mod:`hpcpar.nn.split_head`): elementwise ops, sums and means over it are global, its
    shape the global one; anything else (a transpose for a tied decoder) is refused there."""
    def one(t):
        info = t.__dict__.get(COLUMNS_ATTR) if isinstance(t, nn.Parameter) else None
        if info is None:
            return t
        if info.grid is not ctx.grid:
            raise refuse(op_name(func), "reads a split head's weight cut for another grid",
                         "use the weight in the model it was cut for")
        return wrap(t, FlatLayout(ctx, (1,), (info.features,), info.volume))
    if not has_flat_form(_route(func)[0]):
        raise refuse(op_name(func), "reads a split head's weight, of which this rank holds "
                     "only its columns (hpcpar.nn.split_head)", "use it through its nn.Linear, "
                     "or elementwise ops, sums and .shape of it; give a tied decoder a weight "
                     "of its own")
    args, kwargs = map_args(one, args, kwargs)
    return handle(func, args, kwargs, ctx)


class _ReplicatedUse(torch.autograd.Function):
    """A parameter as an op on replicated tensors uses it: that use's gradient is complete,
    and the same on every rank of the spatial group. Where the same forward also used the
    parameter on split tensors (a decoder shared by a split path and a replicated one, as in
    MONAI's SegResNetVAE), the gradient sync sums its gradient over the spatial group for the
    split uses' partial parts; this use's part is then divided by the group's size, so the sum
    counts it once. Decided in backward, when the forward has seen every use."""

    @staticmethod
    def forward(ctx, p, key, split_uses, size):
        ctx.key, ctx.split_uses, ctx.size = key, split_uses, size
        return p.view_as(p)

    @staticmethod
    def backward(ctx, grad):
        if ctx.key in ctx.split_uses:
            grad = grad / ctx.size
        return grad, None, None, None

    @staticmethod
    def use(t, ctx):
        """``t`` as this use takes it: through the scaling identity unless it is a parameter
        the last forward used on replicated tensors only and this one has not used on split
        ones yet (the common case, a head: no autograd node; a later split use in the same
        forward is refused by hpcpar.nn.spatializer, which checks ``ctx.unscaled``)."""
        if not (isinstance(t, nn.Parameter) and t.requires_grad):
            return t
        known = getattr(ctx, "tagged", None)
        if known is not None and id(t) not in known[0] and id(t) not in ctx.spatial_params:
            ctx.unscaled.add(id(t))
            return t
        with torch._C.DisableTorchFunction():
            return _ReplicatedUse.apply(t, id(t), ctx.spatial_params, ctx.grid.spatial_size)


set_handler(handle)   # the split tensor's own door (hpcpar.nn.split imports no rule)
