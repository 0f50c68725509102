"""Activation checkpointing that reuses the halo faces: ``[train] activation_checkpointing``.

A checkpointed segment keeps only its input for backward (``torch.utils.checkpoint``,
non-reentrant). Segments are cut from the model's *chains*, its outermost ``nn.Sequential``
modules: a chain of L layers into ``min(N, L)`` contiguous segments (the partition rule);
``"auto"`` picks N so that the model has about sqrt(total layers in chains) segments, at least
one per chain (Chen et al.'s rule: stored inputs and one segment's recomputation then weigh
about the same). More in the jobs guide's *Activation checkpointing*.

Spatialized models: the recomputation runs in backward, after the model's dispatch mode has
exited, so each segment re-enters it. Every halo exchange and collective the segment made in its
forward is recorded on a :class:`~hpcpar.parallel.replay.Tape` and replayed in the
recomputation: it sends no message (``recompute_msgs`` in the step records proves it) and the
faces it uses are the ones the forward received. Batch-norm running statistics are restored
after the recomputation, so a step updates them once, as without checkpointing.

A model that calls ``torch.utils.checkpoint`` itself (either form, ``checkpoint_sequential``)
gets the same for its own regions: the recomputation re-enters the dispatch mode and replays the
region's tape (:func:`install_user_checkpoint_replay`; the reentrant form through
:class:`Recomputed`, when a split tensor enters the region). Otherwise torch would recompute
the region on this rank's plain piece, with no halo and local reductions. Running statistics are
left as torch leaves them (updated again by the recomputation), as in one process. A reentrant
region that no split tensor enters is refused (:mod:`hpcpar.nn.custom_functions`): it may close
over split tensors, which it would then recompute on this rank's piece.
"""

from __future__ import annotations

import functools
import inspect
import math
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint

from hpcpar.errors import ConfigError
from hpcpar.parallel.partition import split_sizes
from hpcpar.parallel.replay import Tape

from .dispatch import SpatialMode
from .split import SplitTensor, wrap

__all__ = ["chains", "segment_sizes", "plan_segments", "checkpoint_activations",
           "check_setting", "install_user_checkpoint_replay", "remove_user_checkpoint_replay",
           "Recomputed"]

_SEGMENTS = "_hpcpar_segments"
_ROOT = "_hpcpar_root_split"


def check_setting(value, where: str = "[train] activation_checkpointing") -> int | str | None:
    """``false``, ``"auto"`` or N >= 1 segments per chain as None, "auto" or N; else ConfigError."""
    if value is False or value is None:
        return None
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ConfigError(f"{where}: expected false, \"auto\" or a number of segments per chain "
                      f">= 1, got {value!r}")


def chains(model: nn.Module) -> list[nn.Sequential]:
    """The model's outermost ``nn.Sequential`` modules of at least two layers, in registration
    order (the model itself when it is one)."""
    def walk(m: nn.Module) -> Iterator[nn.Sequential]:
        if isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward:
            if len(m) >= 2:
                yield m
            return
        for child in m.children():
            yield from walk(child)
    return list(walk(model))


def segment_sizes(lengths: list[int], setting) -> list[list[int]]:
    """Per chain of ``lengths[i]`` layers, its segments' layer counts (module docstring)."""
    if setting == "auto":
        n = max(1, round(math.sqrt(sum(lengths)) / max(1, len(lengths))))
    else:
        n = int(setting)
    return [split_sizes(L, min(n, L)) for L in lengths]


def plan_segments(model: nn.Module, setting) -> list[tuple[nn.Sequential, list[int]]]:
    """``(chain, segment sizes)`` per chain of ``model``. A segment never starts with an in-place
    layer (``ReLU(inplace=True)``), which would overwrite the input it keeps: such a boundary
    moves one layer on."""
    found = chains(model)
    out = []
    for chain, sizes in zip(found, segment_sizes([len(c) for c in found], setting)):
        layers, fixed, start = list(chain), [], 0
        for n in sizes:
            end = max(start + n, start + 1)
            while end < len(layers) and getattr(layers[end], "inplace", False):
                end += 1
            if start < len(layers):
                fixed.append(min(end, len(layers)) - start)
            start = end
        out.append((chain, fixed))
    return out


class _Replay:
    """The recomputation's context: dispatch mode re-entered, tape replaying, buffers restored
    after. Re-enterable: a graph kept by ``retain_graph`` is recomputed per backward."""

    def __init__(self, tape: Tape, root, layers):
        self.tape, self.root, self.layers = tape, root, layers
        self._stack: ExitStack | None = None

    def __enter__(self):
        stack = ExitStack()
        stack.enter_context(self.tape.replaying())
        kept = [(b, b.clone()) for m in self.layers for b in m.buffers()]
        stack.callback(lambda: [b.copy_(v) for b, v in kept])
        root = self.root
        if root is not None and root.depth == 0:   # backward: the forward's mode has exited
            root.depth += 1
            stack.callback(_leave_depth, root)
            stack.enter_context(root.mode)
        self._stack = stack
        return self

    def __exit__(self, *exc):
        stack, self._stack = self._stack, None
        assert stack is not None
        with torch.no_grad():
            return stack.__exit__(*exc)


def _leave_depth(root) -> None:
    root.depth -= 1


def _run(x, *layers):
    for layer in layers:
        x = layer(x)
    return x


def _contexts(tape: Tape, root, seg) -> tuple:
    return tape.recording(), _Replay(tape, root, seg)


#: True while a region the model checkpoints itself runs (its forward or recomputation)
_IN_USER_REGION: ContextVar[bool] = ContextVar("hpcpar_user_checkpoint", default=False)


@contextmanager
def _user_region() -> Iterator[None]:
    token = _IN_USER_REGION.set(True)
    try:
        yield
    finally:
        _IN_USER_REGION.reset(token)


class _Both:
    """Two context managers entered as one, re-enterably (once per backward of a kept graph)."""

    def __init__(self, first, second):
        self.first, self.second = first, second
        self._stacks: list[ExitStack] = []

    def __enter__(self):
        stack = ExitStack()
        stack.enter_context(self.first)
        stack.enter_context(self.second)
        stack.enter_context(_user_region())
        self._stacks.append(stack)
        return self

    def __exit__(self, *exc):
        return self._stacks.pop().__exit__(*exc)


def _user_contexts(user_context_fn, tape: Tape, root) -> tuple:
    """A user's region's own contexts plus the tape (no buffer is restored: torch updates
    running statistics again when it recomputes, and so do we)."""
    forward, recompute = user_context_fn()
    return _Both(forward, tape.recording()), _Both(recompute, _Replay(tape, root, []))


def _split_context():
    """The running spatialized forward's split context, or None (also in hpcpar's own layers)."""
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, SpatialMode):
            ctx = mode.ctx
            return ctx if ctx.depth > 0 and not ctx.suspended else None
    return None


class Recomputed:
    """The function of a reentrant ``torch.utils.checkpoint`` region in a spatialized forward.
    Its first call (torch's forward) records the region's tape; a later call (torch's
    recomputation) re-enters the dispatch mode and replays the tape, on the inputs labelled split
    again (torch detaches them, which drops the label)."""

    def __init__(self, fn, root):
        self.fn, self.root, self.tape = fn, root, Tape()
        self.layouts: list | None = None

    def __call__(self, *args):
        if self.layouts is None:
            self.layouts = [a._hp if isinstance(a, SplitTensor) else None for a in args]
            with self.tape.recording(), _user_region():
                return self.fn(*args)
        args = tuple(wrap(a, lay) if lay is not None and type(a) is torch.Tensor else a
                     for a, lay in zip(args, self.layouts))
        with _Replay(self.tape, self.root, []), _user_region():
            return self.fn(*args)


def _patch_reentrant() -> Callable[[], None] | None:
    """The reentrant form gets a :class:`Recomputed` function where a split tensor enters it (the
    split context read from the inputs). Returns what puts torch's own back, or None."""
    fn_cls = getattr(_torch_checkpoint, "CheckpointFunction", None)
    kept = vars(fn_cls).get("forward") if fn_cls is not None else None
    original = getattr(fn_cls, "forward", None)
    if kept is None or original is None or list(inspect.signature(original).parameters)[:3] \
            != ["ctx", "run_function", "preserve_rng_state"]:
        return None

    @functools.wraps(original)
    def forward(ctx, run_function, preserve_rng_state, *args):
        split = next((a for a in args if isinstance(a, SplitTensor)), None)
        if split is not None and not isinstance(run_function, Recomputed):
            run_function = Recomputed(run_function, split._hp.ctx)
        return original(ctx, run_function, preserve_rng_state, *args)

    fn_cls.forward = staticmethod(forward)   # type: ignore[union-attr]
    return lambda: setattr(fn_cls, "forward", kept)


def _patch_generator() -> Callable[[], None] | None:
    """The non-reentrant form: hpcpar's contexts for regions in a spatialized forward."""
    original = getattr(_torch_checkpoint, "_checkpoint_without_reentrant_generator", None)
    if original is None or list(inspect.signature(original).parameters)[:3] \
            != ["fn", "preserve_rng_state", "context_fn"]:
        return None

    @functools.wraps(original)
    def generator(fn, preserve_rng_state=True,
                  context_fn=_torch_checkpoint.noop_context_fn, *rest, **kwargs):
        root = _split_context()   # hpcpar's own segments (_contexts) record already
        if root is not None and getattr(context_fn, "func", None) is not _contexts:
            context_fn = functools.partial(_user_contexts, context_fn, Tape(), root)
        return original(fn, preserve_rng_state, context_fn, *rest, **kwargs)

    _torch_checkpoint._checkpoint_without_reentrant_generator = generator
    return lambda: setattr(_torch_checkpoint, "_checkpoint_without_reentrant_generator",
                           original)


class _Holders:
    """How many spatialized forwards run now (any thread), and what puts torch's back."""

    lock = threading.Lock()
    count = 0
    undo: list[Callable[[], None]] = []


def install_user_checkpoint_replay() -> bool:
    """Make ``torch.utils.checkpoint`` exact in spatialized models (module docstring): a
    spatialized model's dispatch mode calls this when entered and
    :func:`remove_user_checkpoint_replay` when left, so torch's is its own outside. Counted: the
    first holder installs, the last one's remove restores. Returns whether both forms are
    installed (False: this torch's checkpoint has another form)."""
    with _Holders.lock:
        if _Holders.count == 0:
            _Holders.undo = [undo for undo in (_patch_reentrant(), _patch_generator())
                             if undo is not None]
        _Holders.count += 1
        return len(_Holders.undo) == 2


def remove_user_checkpoint_replay() -> None:
    """One holder of :func:`install_user_checkpoint_replay` leaves; the last restores torch's."""
    with _Holders.lock:
        _Holders.count -= 1
        if _Holders.count == 0:
            for undo in reversed(_Holders.undo):
                undo()
            _Holders.undo = []


def _segmented_forward(self: nn.Sequential, x):
    """Each segment under ``torch.utils.checkpoint``; plainly in a region the model checkpoints
    itself (nested, their collectives would come in another order per rank)."""
    layers = list(self)
    if not torch.is_grad_enabled() or _IN_USER_REGION.get():
        return _run(x, *layers)
    root = getattr(self, _ROOT, None)
    off = 0
    for n in getattr(self, _SEGMENTS):
        seg = layers[off:off + n]
        off += n
        tape = Tape()
        contexts = functools.partial(_contexts, tape, root, seg)
        x = checkpoint(_run, x, *seg, use_reentrant=False, preserve_rng_state=True,
                       context_fn=contexts)
    return x


def checkpoint_activations(model: nn.Module, setting) -> list[list[int]]:
    """Recompute the activations of ``model``'s segments in backward (module docstring), for
    ``setting`` N segments per chain, ``"auto"``, or False/None (nothing is done; ConfigError
    for anything else). Returns per chain its segments' layer counts (empty when off). In place:
    each chain's ``forward`` is replaced (an instance attribute). Works on plain and
    :func:`~hpcpar.nn.spatialize`'d models (apply it to the spatialized copy)."""
    setting = check_setting(setting)
    if setting is None:
        return []
    planned = plan_segments(model, setting)
    root = getattr(model, "_hpcpar_split", None)   # spatializer's context, if spatialized
    for chain, sizes in planned:
        setattr(chain, _SEGMENTS, tuple(sizes))
        setattr(chain, _ROOT, root)
        chain.forward = types.MethodType(_segmented_forward, chain)  # type: ignore[method-assign]
    return [sizes for _, sizes in planned]
