"""Split tensors: a rank's piece of a tensor whose spatial dims are split over the grid.

A :class:`SplitTensor` holds this rank's piece ``(N, C, d, h, w)`` of a global tensor
``(N, C, D, H, W)`` and knows where its spatial dims are (``sdims``) and their global lengths
(``gshape``). It answers shape questions (``.shape``, ``.size()``, ``.numel()``) with the GLOBAL
shape, as sharded-tensor libraries do, so a user's ``forward`` that reasons about sizes
(``F.interpolate(x, size=skip.shape[2:])``, centre crops, ``F.pad`` by a size difference) means
the same thing split or whole. Every torch call that sees one is routed by
:mod:`hpcpar.nn.dispatch`: run locally, run an exact spatial twin, or refused with the user's
source line. :func:`local` is the explicit way out (this rank's piece as a plain tensor).
"""

from __future__ import annotations

import functools
import os
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from hpcpar.errors import LayerError
from hpcpar.parallel.partition import box as part_box
from hpcpar.parallel.spatial import gather

if TYPE_CHECKING:
    from hpcpar.parallel.grid import ProcessGrid

__all__ = ["SplitTensor", "Layout", "FlatLayout", "TokenLayout", "SplitContext", "local", "whole",
           "is_split", "split_like", "user_frame"]


@dataclass
class SplitContext:
    """What every split tensor of one spatialized model shares: the grid, the options, the caches
    of spatial twins and what the last forward learned about each parameter."""

    grid: ProcessGrid
    bn_include_data: bool = False
    twins: dict = field(default_factory=dict)       # op signature -> cached spatial twin
    spatial_params: set = field(default_factory=set)     # ids used directly by split ops
    replicated_params: set = field(default_factory=set)  # ids used by replicated ops
    unscaled: set = field(default_factory=set)   # ids used replicated with no _ReplicatedUse
    dropout: bool = True    # False: dropout is the identity (the first-step check's probe)
    root: Any = None        # weakref to the spatialized model (a split head finds its Linear)
    fuse_halos: int = 1     # longest run of convolutions sharing one exchange (fused_halo)
    fuse_plan: dict = field(default_factory=dict)   # run key -> (convolutions, halo used)
    fuse_seen: dict = field(default_factory=dict)   # learned this forward, applied at the next
    fuse_counts: list = field(default_factory=lambda: [0, 0])   # this forward's runs, crops
    gathered_at: set = field(default_factory=set)   # where a shrunk volume was gathered
    notices: Any = None     # the grid's error notices (hpcpar.nn.error_notice), from a forward


@dataclass(frozen=True)
class Layout:
    """Where the split dims of a tensor are and how long they are globally."""

    ctx: SplitContext
    sdims: tuple[int, ...]   # positions of the x, y, z axes in the tensor (FlatLayout: one)
    gshape: tuple[int, ...]  # their global lengths

    #: This layout type's forms of the op table's rules (:mod:`hpcpar.nn.optable`), registered
    #: beside its own code: rule -> ``form(call, redo)``, ``redo(func, args, kwargs)`` the
    #: dispatch again. A rule with none (and not in ``optable.AS_IS``) goes to :meth:`no_form`.
    forms: ClassVar[dict] = {}
    #: ``(why, todo)`` of the one-line refusal of a rule with no form here, and of a call that
    #: mixes this layout with another; None: the op table's rule itself runs.
    refusal: ClassVar[tuple[str, str] | None] = None
    mixed: ClassVar[tuple[str, str] | None] = None

    def no_form(self, rule, call, redo):
        """``call`` (split operands of this layout, maybe others too) by a ``rule`` with no form."""
        if self.refusal is None:
            return rule(call)
        alike = all(type(t._hp) is type(self) for t in call.splits)
        raise call.refuse(*(self.refusal if alike or self.mixed is None else self.mixed))

    def own(self, t: SplitTensor, end: bool = False) -> SplitTensor:
        """``t`` holding only this rank's own piece (a fused run's margin is cropped; ``end``:
        the value leaves the run there, not just a look at the piece)."""
        return t

    def with_(self, sdims=None, gshape=None) -> Layout:
        """Itself where equal: most ops keep both, and a layout is made per op."""
        sdims = self.sdims if sdims is None else tuple(sdims)
        gshape = self.gshape if gshape is None else tuple(gshape)
        if sdims == self.sdims and gshape == self.gshape:
            return self
        return Layout(self.ctx, sdims, gshape)

    def global_shape(self, local_shape) -> torch.Size:
        shape = list(local_shape)
        for d, n in zip(self.sdims, self.gshape):
            shape[d] = n
        return torch.Size(shape)

    @functools.cached_property
    def shrunk(self) -> bool:
        """Shorter than its ranks on a split axis: some rank holds none of it (a volume pooled
        or strided down to fewer voxels than the grid splits it into)."""
        return type(self) is Layout and any(n < p for n, p in zip(self.gshape,
                                                                    self.ctx.grid.spatial_shape))

    @property
    def standard(self) -> bool:
        """Laid out as (N, C, D, H, W): what the stencil twins take."""
        return self.sdims == (2, 3, 4)


@dataclass(frozen=True)
class FlatLayout(Layout):
    """A split ``(N, C, D, H, W)`` volume flattened to ``(N, C*D*H*W)`` (``sdims`` ``(1,)``,
    ``gshape`` the feature count): this rank holds its sub-box's features, ``C x (d, h, w)`` in
    its piece's row-major order (:mod:`hpcpar.nn.split_head`)."""

    volume: tuple[int, int, int, int] = (0, 0, 0, 0)   # the global (C, D, H, W)
    forms: ClassVar[dict] = {}
    refusal = ("has no form on a flattened split tensor (only elementwise ops, dropout and "
               "F.linear take it)", "apply the nn.Linear right after the flatten, or reduce "
               "the spatial dims before flattening")
    mixed = ("combines a flattened split tensor with an unflattened one", "flatten both alike")

    def box(self) -> tuple[tuple[int, int], ...]:
        return _own_box(self.ctx.grid, self.volume[1:])


@dataclass(frozen=True)
class TokenLayout(Layout):
    """A split ``(N, C, D, H, W)`` volume viewed as ``(N, C, D*H*W)``: ``sdims`` the token dim,
    ``gshape`` its global length; ``volume`` the global ``(D, H, W)``."""

    volume: tuple[int, int, int] = (0, 0, 0)
    forms: ClassVar[dict] = {}
    refusal = ("has no form on a tensor whose split dims are merged (elementwise ops, "
               "reductions, softmax and a view back to the volume take it)", "reduce over the "
               "merged dim, or keep the volume's (N, C, D, H, W) shape")
    mixed = ("combines a tensor whose split dims are merged with one whose are not",
             "view both alike")

    def box(self) -> tuple[tuple[int, int], ...]:
        return _own_box(self.ctx.grid, self.volume)


def _own_box(grid, spatial) -> tuple[tuple[int, int], ...]:
    """This rank's ``(start, stop)`` on each axis of a global ``(D, H, W)`` volume."""
    return part_box(spatial, grid.spatial_shape, grid.spatial_coords)


class SplitTensor(torch.Tensor):
    """This rank's piece of a spatially split tensor (see the module docstring)."""

    _hp: Layout

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if torch._C._current_autograd_node() is not None:
            # inside a backward pass: the rules' own adjoints hold the pieces they saved
            with torch._C.DisableTorchFunction():
                return func(*args, **(kwargs or {}))
        return _HANDLE(func, args, kwargs or {})

    # takes torch's keyword (tensor_contents) and ignores it: the piece is labelled instead
    def __repr__(self, **kwargs) -> str:  # type: ignore[override]
        with torch._C.DisableTorchFunction():
            body = torch.Tensor.__repr__(self)
        return f"SplitTensor(global shape {tuple(self._hp.global_shape(self.shape_local))}, " \
               f"this rank's piece:\n{body})"

    @property
    def shape_local(self) -> torch.Size:
        """The local piece's shape."""
        with torch._C.DisableTorchFunction():
            return torch.Tensor.size(self)


def set_handler(handle) -> None:
    """Where calls on split tensors go: :func:`hpcpar.nn.dispatch.handle`, set when that module is
    imported (it imports this one; ``hpcpar.nn`` imports both)."""
    global _HANDLE
    _HANDLE = handle


def _unset(func, args, kwargs):
    raise RuntimeError("hpcpar.nn.dispatch was not imported: import hpcpar.nn")


_HANDLE = _unset


def wrap(t: torch.Tensor, layout: Layout) -> SplitTensor:
    """A plain local piece as a split tensor (autograd-transparent)."""
    with torch._C.DisableTorchFunction():
        s = t.as_subclass(SplitTensor)
    s._hp = layout
    return s


def adopt(t: torch.Tensor, layout: Layout) -> SplitTensor:
    """A FRESH op output (a plain tensor no one else holds) made split by switching its class: no
    alias node (an ``as_subclass`` per op cost ~15% of a small step); else :func:`wrap`."""
    if type(t) is torch.Tensor:
        t.__class__ = SplitTensor  # the checker cannot follow a class switch: t is split now
        t._hp = layout  # type: ignore[attr-defined]
        return t  # type: ignore[return-value]
    if type(t) is SplitTensor and t._hp == layout:
        return t
    return wrap(t, layout)


def raw(t):
    """A split tensor as its plain piece INSIDE a dispatch rule: rules run with torch-function
    handling off, where a split tensor already acts as its piece (no alias, no autograd node)."""
    return t


def unwrap(t):
    """The plain tensor under a split tensor, this rank's own piece; anything else unchanged."""
    if isinstance(t, SplitTensor):
        t = t._hp.own(t)
        with torch._C.DisableTorchFunction():
            return t.as_subclass(torch.Tensor)
    return t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a split tensor as a plain tensor (gradients flow through it): the
    explicit way out of the split world. What you compute from it is this rank's share, and you
    combine the shares (a plain tensor is returned unchanged)."""
    return unwrap(t)


def whole(t: torch.Tensor, root: int = 0) -> torch.Tensor | None:
    """The whole of a split tensor, assembled on spatial rank ``root`` (None on the group's other
    ranks; a plain tensor is returned as it is): a result wanted entire (a prediction, a field to
    write out). Its split dims are taken from where they are, so an output permuted to ``(N, D,
    H, W, C)`` comes back as the single-process model's. Detached. Collective over the spatial
    group. LayerError where ``t`` is flattened (take it before the flatten) or the pieces do not
    tile one volume."""
    if not isinstance(t, SplitTensor):
        return t
    split = t._hp.own(t)
    lay = split._hp
    if type(lay) is not Layout:
        raise LayerError(f"whole: the tensor's split dims are merged ({type(lay).__name__}): "
                         f"there is no volume to assemble; take the tensor before the flatten")
    piece = unwrap(split).detach()
    full = gather(piece, lay.ctx.grid, root, dims=lay.sdims)
    assert full is None or full.shape == lay.global_shape(piece.shape)
    return full


def split_like(piece: torch.Tensor, like: SplitTensor) -> torch.Tensor:
    """Mark ``piece`` — this rank's piece of a tensor split like ``like`` on its LAST three dims
    (a per-voxel target ``(N, d, h, w)``, a mask ``(N, C, d, h, w)``) — as split, so what is
    computed from it (a Dice loss's sums) is global too; unchanged when ``like`` is not split.
    LayerError where its last three lengths are not this rank's local lengths of ``like``."""
    if not isinstance(like, SplitTensor) or isinstance(piece, SplitTensor):
        return piece
    lay = like._hp
    mine = tuple(piece.shape[-3:])
    want = tuple(like.shape_local[d] for d in lay.sdims)
    if piece.dim() < 3 or mine != want:
        raise LayerError(f"split_like: the piece's last three lengths {mine} are not this "
                         f"rank's local lengths {want}")
    n = piece.dim()
    return wrap(piece, lay.with_(sdims=(n - 3, n - 2, n - 1)))


def is_split(t) -> bool:
    """Whether ``t`` is a rank's piece of a spatially split tensor."""
    return isinstance(t, SplitTensor)


_HPCPAR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def own_dirs(torch_dir: str, hpcpar_dir: str) -> tuple[str, str]:
    """torch itself and hpcpar, each a directory with its separator: ``torch_geometric`` and
    ``torchio`` beside torch are the user's, not torch's."""
    return torch_dir.rstrip(os.sep) + os.sep, hpcpar_dir.rstrip(os.sep) + os.sep


#: what :func:`user_frame` skips (hpcpar's own models excepted: they are a user's code)
_OWN = own_dirs(os.path.dirname(os.path.abspath(torch.__file__)), _HPCPAR)
_MODELS = os.path.join(_HPCPAR, "models") + os.sep
#: where no frame is a user's (a loss hpcpar's own loop computes): the innermost outside torch
#: and the layers
_LAYERS = (_OWN[0], *(os.path.join(_HPCPAR, p) + os.sep for p in ("nn", "parallel", "sync")))


def user_frame() -> str:
    """``file:line`` of the innermost caller outside torch itself and hpcpar (where the user's
    ``forward`` applied the op); in hpcpar's own models, their line."""
    fallback = None
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = os.path.abspath(frame.filename)
        if "<frozen" in path:
            continue
        if not path.startswith(_OWN) or path.startswith(_MODELS):
            return f"{frame.filename}:{frame.lineno}"
        if fallback is None and not path.startswith(_LAYERS):
            fallback = f"{frame.filename}:{frame.lineno}"
    return fallback or "<unknown>"


_DYNAMO = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "_dynamo")


def _under_dynamo() -> bool:
    """Whether torch.compile is tracing: ``is_compiling()`` says so from torch 2.13 on, dynamo's
    own frames on the stack on earlier versions (2.11 probes outside it)."""
    return torch.compiler.is_compiling() or any(
        os.path.abspath(f.filename).startswith(_DYNAMO) for f in traceback.extract_stack())


def refuse(op: str, why: str, todo: str) -> LayerError:
    """The one-line refusal: the op, the user's line, why, and what to do. Under ``torch.compile``
    (whose probing of a split tensor would name an op the model never called): that instead."""
    if _under_dynamo():
        return LayerError(f"spatialize: torch.compile cannot trace a model split over the "
                          f"spatial grid (at {user_frame()}: its split tensors run each op "
                          f"through hpcpar in Python); run the spatialized model without "
                          f"torch.compile")
    return LayerError(f"spatialize: {op} at {user_frame()} {why} on a tensor split over the "
                      f"spatial grid; {todo}")
