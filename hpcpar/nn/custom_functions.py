"""A user's own ``torch.autograd.Function`` in a spatialized model: refused unless marked local.

hpcpar's dispatch sees every operation a Function's *forward* makes on split tensors (a sum there is
the global one), but not its *backward*, which torch runs on this rank's plain pieces: a backward
that reduces over the volume (``(grad * x).sum()``) gives this rank's share only, and every gradient
before it is silently wrong. ``torch.utils.checkpoint`` in its reentrant form is such a Function
(its recomputation runs after the model's dispatch has exited: wrong gradients too). So the autograd
graph of a spatialized model's output is walked once a forward builds one, and again whenever the
parameters are used differently (:func:`refuse_custom_functions`); a Function defined outside hpcpar
is refused in one line unless its class is marked with :func:`local_function` (an activation, a
clamp: forward and backward need only the values at each voxel, so each rank's piece is enough).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from hpcpar.errors import LayerError

from .checkpointing import Recomputed

__all__ = ["local_function", "refuse_custom_functions"]

_MARK = "_hpcpar_local_function"
#: torch's own Functions that are local: the identity a module's full backward hook puts on
#: its inputs and outputs (its hooks then see each rank's piece of the gradient, as under
#: torch's DDP they see each rank's samples)
_TORCH_LOCAL = {("torch.nn.modules._functions", "BackwardHookFunction")}


def local_function(cls: type) -> type:
    """Mark a custom ``torch.autograd.Function`` as local: its forward and backward each need only
    the values at one voxel, so it runs on each rank's piece of a split volume. Usable as a class
    decorator (returns ``cls``). Without the mark, a spatialized model using the Function is refused
    (module docstring)."""
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise TypeError(f"local_function: {cls!r} is not a torch.autograd.Function subclass")
    setattr(cls, _MARK, True)
    return cls


def _defined_at(cls: type) -> str:
    """`` (file:line)`` where ``cls`` is defined, when Python knows it."""
    try:
        return f" ({inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]})"
    except (OSError, TypeError):
        return ""


def _why(cls: type) -> str:
    name = f"{cls.__module__}.{cls.__qualname__}{_defined_at(cls)}"
    if cls.__module__ == "torch.utils.checkpoint":
        return ("spatialize: torch.utils.checkpoint (use_reentrant=True) in the model: "
                "its recomputation runs outside hpcpar's dispatch and its "
                "gradients would be wrong; pass use_reentrant=False, which hpcpar recomputes "
                "exactly, or use [train] activation_checkpointing")
    return (f"spatialize: custom autograd.Function {name} on a split volume: its backward "
            "runs on this rank's piece, where a sum over the volume would be this rank's "
            "share only; mark it with hpcpar.nn.local_function if forward and backward need "
            "only the values at each voxel, or apply it after a global reduction")


def refuse_custom_functions(output: Any) -> bool:
    """Walk the autograd graph behind ``output`` (any nesting of tensors); raise a one-line
    LayerError naming the Function and what to do on a custom Function defined outside hpcpar and
    not marked local. Returns whether there was a graph to walk (False: no output requires grad)."""
    todo: list[Any] = [t.grad_fn for t in tree_leaves(output)
                       if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    walked = bool(todo)
    seen: set[int] = set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        cls = getattr(node, "_forward_cls", None)   # set on a Python Function's node
        if cls is not None and not getattr(cls, _MARK, False) \
                and not cls.__module__.startswith("hpcpar.") \
                and (cls.__module__, cls.__qualname__) not in _TORCH_LOCAL \
                and not isinstance(getattr(node, "run_function", None), Recomputed):
            raise LayerError(_why(cls))   # a reentrant checkpoint hpcpar re-enters passes
        todo.extend(fn for fn, _ in node.next_functions)
    return walked
