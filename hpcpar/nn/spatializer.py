"""``spatialize(model, grid)``: a copy of a plain torch model that runs spatially split, exactly.

Conversion follows dataflow, not registration order: every 5D tensor argument of ``forward`` is
marked split (:class:`~hpcpar.nn.split.SplitTensor`), and while ``forward`` runs a
``TorchFunctionMode`` sees every torch call; each call on a split tensor is run by its rule in
:mod:`hpcpar.nn.optable` (locally, by an exact spatial twin, or refused in one line).

Which parameters are replicated over the spatial group is learned from the same dataflow: after
each ``forward``, a parameter used only on replicated tensors (a head after a global pool) is
tagged data-only (its gradient is complete on every rank); one used on split tensors keeps the
default (partial gradients, summed by the sync), and so does one used both ways: its replicated
uses' gradient is divided by the group's size (:class:`hpcpar.nn.dispatch._ReplicatedUse`).
:class:`hpcpar.DDP` re-plans its buckets when the tags change. Modules that carry
``spatial_twin(grid)`` (``GatherPoint``) are replaced by their twin; hpcpar's own spatial layers
take this rank's piece.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from hpcpar.errors import LayerError
from hpcpar.parallel.grid import ProcessGrid
from hpcpar.parallel.halo_plan import global_spatial_shape
from hpcpar.sync.tags import DATA_ONLY, REDUCE_ATTR, TAGS_VERSION, tag_data_only

from ._base import SpatialModule
from .check import first_step_check, skeleton
from .checkpointing import install_user_checkpoint_replay, remove_user_checkpoint_replay
from .custom_functions import refuse_custom_functions
from .dispatch import SpatialMode, mode_call
from .error_notice import notices_for
from .fused_halo import check_setting as check_fuse
from .fused_halo import settle_runs
from .split import Layout, SplitContext, SplitTensor, unwrap, wrap

__all__ = ["spatialize", "settle"]

_CTX = "_hpcpar_split"

class _Context(SplitContext):
    """The model's split context; a deep copy of the model gets a fresh one (same grid)."""

    def __init__(self, grid, bn_include_data, plain=None, fuse_halos=1):
        super().__init__(grid, bn_include_data, fuse_halos=fuse_halos)
        self.plain = plain      # the plain model's skeleton, kept until the first-step check ran
        self.mode = _Mode(self)  # entered for the outermost forward
        self.depth = 0          # nesting of spatialized forwards (only the outermost acts)
        self.suspended = 0      # inside hpcpar's own spatial layers: no dispatch
        self.tagged = None      # the parameter use the tags were last derived from
        self.settling = False   # inside settle(): no first-step check yet
        self.graph_checked = False   # a forward's autograd graph was searched for Functions

    def __deepcopy__(self, memo):
        new = memo[id(self)] = _Context(self.grid, self.bn_include_data,
                                        fuse_halos=self.fuse_halos)
        return new


class _Mode(SpatialMode):
    """Entered for the outermost forward and each recomputation in backward; only while it is,
    torch's checkpoint replays the model's own regions."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.held = 0

    def __enter__(self):
        out = super().__enter__()
        install_user_checkpoint_replay()
        self.held += 1
        return out

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self.held:
                self.held -= 1
                remove_user_checkpoint_replay()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.ctx.suspended:
            return func(*args, **(kwargs or {}))
        return mode_call(func, types, args, kwargs or {}, self.ctx)


def _split_inputs(ctx, values):
    """Every 5D floating tensor argument marked split (collective)."""
    def one(v):
        if isinstance(v, torch.Tensor) and not isinstance(v, SplitTensor) and v.dim() == 5 \
                and v.is_floating_point():
            gshape = global_spatial_shape(v, ctx.grid, "spatialized model input")
            return wrap(v, Layout(ctx, (2, 3, 4), gshape))
        return v
    return [one(v) for v in values]


def _enter(module, args, kwargs):
    ctx = getattr(module, _CTX)
    ctx.depth += 1
    if ctx.depth > 1:
        return None
    if ctx.root is None:
        ctx.root = weakref.ref(module)   # a split head finds the Linear of its weight
    # the check compares gradients on its own probe: a first call under no_grad (a validation
    # pass, inference) still gets it, with grad on; inference mode cannot make tensors that
    # backward accepts, so the check waits for the first call outside it
    if ctx.plain is not None and not ctx.settling and not torch.is_inference_mode_enabled():
        plain, ctx.plain = ctx.plain, None
        try:
            with torch.enable_grad():
                first_step_check(module, plain, args, ctx, spatialize)
        except BaseException:
            ctx.depth -= 1
            raise
    ctx.notices = notices_for(ctx.grid)   # collective the first time on the grid
    ctx.notices.look()
    ctx.notices.forwards += 1
    if ctx.notices.pending is not None:   # another rank raised in a forward this one finished
        ctx.notices.check()
    ctx.spatial_params = set()   # new sets: a backward still to come reads its forward's
    ctx.replicated_params = set()
    ctx.unscaled = set()
    settle_runs(ctx)
    args = tuple(_split_inputs(ctx, args))
    kwargs = dict(zip(kwargs, _split_inputs(ctx, kwargs.values())))
    ctx.mode.__enter__()
    return args, kwargs


def _leave(module, args, kwargs, output):
    ctx = getattr(module, _CTX)
    ctx.depth -= 1
    if ctx.depth > 0:
        return None
    if output is None:   # also where the forward raised (a refusal): the mode may be gone
        if ctx.notices is not None:   # others' word of this forward is void
            ctx.notices.raised(ctx.notices.forwards)
        with contextlib.suppress(RuntimeError):
            ctx.mode.__exit__(None, None, None)
        return None
    ctx.mode.__exit__(None, None, None)
    if _retag(module, ctx) or not ctx.graph_checked:
        ctx.graph_checked |= refuse_custom_functions(output)
    if ctx.fuse_halos > 1:   # a fused run's margin never leaves the model
        return tree_map(_end_run, output)
    return None


def _retag(model: nn.Module, ctx) -> bool:
    """Tags from what this forward did (module docstring), the version bumped on a change;
    whether they were derived again (not where the parameters were used as before: ~0.1 ms)."""
    late = ctx.unscaled & ctx.spatial_params
    if late:   # its replicated use this forward went unscaled (dispatch._ReplicatedUse)
        name = next(n for n, p in model.named_parameters() if id(p) in late)
        raise LayerError(f"spatialize: parameter '{name}' was used on replicated tensors only "
                         "until this forward, which used it on split tensors after a "
                         "replicated use: its gradient this step would count that use once "
                         "per rank; use it on split tensors first, or spatialize the model "
                         "again")
    used = (frozenset(ctx.spatial_params), frozenset(ctx.replicated_params),
            getattr(model, TAGS_VERSION, 0))
    if used == ctx.tagged:
        return False
    changed = False
    for p in model.parameters():
        # used on split tensors (and maybe replicated ones, whose gradient part is then
        # divided: _ReplicatedUse): summed; used on replicated tensors only: complete
        spatial, replicated = id(p) in ctx.spatial_params, id(p) in ctx.replicated_params
        was = getattr(p, REDUCE_ATTR, None) == DATA_ONLY
        if replicated and not spatial and not was:
            tag_data_only(p)
            changed = True
        elif spatial and was:
            delattr(p, REDUCE_ATTR)
            changed = True
    if changed:
        setattr(model, TAGS_VERSION, getattr(model, TAGS_VERSION, 0) + 1)
    ctx.tagged = (*used[:2], getattr(model, TAGS_VERSION, 0))
    return True


def _layer_enter(module, args, kwargs):
    """hpcpar's own spatial layers take plain pieces and run undispatched."""
    root = getattr(module, "_hpcpar_root_ctx", None)
    if root is None or root.depth == 0:
        return None
    root.suspended += 1
    for p in module.parameters(recurse=False):
        root.spatial_params.add(id(p))
    return tuple(unwrap(_end_run(a)) for a in args), \
        {k: unwrap(_end_run(v)) for k, v in kwargs.items()}


def _end_run(t):
    """Its own piece where it leaves the model or enters hpcpar's own layer: a fused run ends."""
    return t._hp.own(t, end=True) if isinstance(t, SplitTensor) else t


def _layer_leave(module, args, kwargs, output):
    root = getattr(module, "_hpcpar_root_ctx", None)
    if root is None or root.depth == 0 or root.suspended == 0:
        return None
    root.suspended -= 1
    if output is None or getattr(module, "replicates", False) or root.suspended:
        return None
    if isinstance(output, torch.Tensor) and output.dim() == 5:
        gshape = global_spatial_shape(output, root.grid, module.layer_name)
        return wrap(output, Layout(root, (2, 3, 4), gshape))
    return None


def _swap_twins(module: nn.Module, grid) -> nn.Module:
    if hasattr(module, "spatial_twin") and not isinstance(module, SpatialModule):
        twin = module.spatial_twin(grid)  # type: ignore[operator]  # a method, not a submodule
        twin._parameters.update(module._parameters)
        twin._buffers.update(module._buffers)
        twin.train(module.training)
        return twin
    for name, child in list(module.named_children()):
        new = _swap_twins(child, grid)
        if new is not child:
            module._modules[name] = new
    return module


def spatialize(model: nn.Module, grid: ProcessGrid, *, bn_include_data: bool = False,
               check: bool = False, inplace: bool = False, fuse_halos: int = 1) -> nn.Module:
    """Make a copy of a plain torch model that runs on each rank's piece of the volume.

    The copy (same modules, parameters and ``state_dict`` keys) takes every 5D tensor argument of
    ``forward`` as this rank's piece of the global ``(N, C, D, H, W)`` tensor, split on ``grid``'s
    x, y, z axes; each torch call on split data runs exactly or is refused with one line naming
    the op and your source line (LayerError at forward). Outputs still split are
    :class:`~hpcpar.nn.split.SplitTensor`: ``.shape`` is the global shape, and a mean or sum loss
    on them is the single-process loss on every rank (``hpcpar.nn.local(t)``: the piece).

    ``bn_include_data``: batch-norm statistics also cover the data group (what one BatchNorm on
    the whole global batch computes). ``check``: on the first forward, compare a probe (the
    first sample) module by module and gradient by gradient with the plain model on one rank
    (:mod:`hpcpar.nn.check`), catching whatever escapes the dispatch (LayerError naming the first
    module whose output or gradient differs); only the plain model's code is kept for it
    (:func:`skeleton`), not a second copy of its weights. ``inplace``: convert ``model`` itself
    (modified and returned; else it is deep-copied) for a caller that no longer needs the plain
    model: its weights then exist once, not twice, until a split head is cut (:func:`settle`).
    ``fuse_halos``: let up to this many stride-1, size-keeping convolutions with pointwise ops
    between them share one halo exchange of their combined width, recomputing the overlap
    instead of exchanging it again (:mod:`hpcpar.nn.fused_halo`): fewer, larger messages for
    small local volumes; 1 (the default) exchanges per layer.

    Example:
        ```python
        model = spatialize(CosmoFlow.small(input_size=32), grid)
        y = model(spatial.scatter(cube, grid))
        ```
    """
    fuse_halos = check_fuse(fuse_halos)
    plain = skeleton(model) if check else None
    model = _swap_twins(model if inplace else copy.deepcopy(model), grid)
    ctx = _Context(grid, bn_include_data, plain, fuse_halos)
    setattr(model, _CTX, ctx)
    model.register_forward_pre_hook(_enter, with_kwargs=True)
    model.register_forward_hook(_leave, with_kwargs=True, always_call=True)
    for m in model.modules():
        if isinstance(m, SpatialModule):
            m._hpcpar_root_ctx = ctx  # type: ignore[assignment]  # a plain attribute
            m.register_forward_pre_hook(_layer_enter, with_kwargs=True)
            m.register_forward_hook(_layer_leave, with_kwargs=True, always_call=True)
    return model


def settle(model: nn.Module, *args: Any, **kwargs: Any) -> None:
    """Run one forward of a model returned by :func:`spatialize` on its forward's arguments
    (zeros of this rank's piece will do) so its dataflow fixes its layout before anything holds
    state for its parameters: it decides their tags and cuts a split head's weight
    (:mod:`hpcpar.nn.split_head`), which an optimizer's state would not match. Call it before
    building the gradient sync and the optimizer (``hpcpar run`` does). Eval mode, no gradients;
    torch's random stream and batch-norm statistics are left as they were, and the
    ``check=True`` comparison to the first real forward. Collective."""
    ctx = getattr(model, _CTX)
    training, rng = model.training, torch.get_rng_state()
    ctx.settling = True
    try:
        model.eval()
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        ctx.settling = False
        model.train(training)
        torch.set_rng_state(rng)
