"""The rules of split ops that need their neighbours or the whole sample: convolutions, pools,
resampling, padding, norms, reductions, dropout and losses.

Each rule takes a :class:`~hpcpar.nn.rules.Call` and runs the exact spatial implementation on
this rank's piece (``nn.Conv3d.forward`` calls ``F.conv3d``, so one rule serves module and
function). Stencils reuse the spatial layers' cached halo plans through a twin per op signature
(built once, on the meta device: it holds the geometry, the caller's tensors the parameters).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hpcpar.parallel.partition import box, xyz
from hpcpar.parallel.primitives import ReplicatedSum

from . import global_norm, padding, resample
from ._base import triple
from .conv import SpatialConv3d, SpatialConvTranspose3d
from .dropout import spatial_dropout
from .noise import spatial_noise
from .norm import _GlobalBatchNorm
from .pool import SpatialAvgPool3d, SpatialMaxPool3d
from .reduce import global_reduce
from .rules import Call, _dims_arg, channelwise, localize, pointwise, wrap_like
from .split import Layout, adopt, raw
from .view_maps import by_name

__all__ = ["conv3d", "conv_transpose3d", "max_pool3d", "avg_pool3d", "adaptive_pool",
           "interpolate", "pad", "batch_norm", "group_norm", "instance_norm", "layer_norm",
           "reduction", "dropout", "loss"]


def _standard(call: Call, x) -> Layout:
    lay = x._hp
    if x.dim() != 5 or not lay.standard:
        raise call.refuse(f"needs an (N, C, D, H, W) tensor split on dims 2-4 (got {x.dim()} "
                          f"dims, split dims {lay.sdims})", "keep the volume layout for 3D "
                          "layers")
    if len(call.splits) > 1 or call.splits[0] is not x:
        raise call.refuse("takes a split tensor as a parameter", "pass replicated weights")
    return lay


def _hashable(v):
    """Keys use the arguments as given (lists as tuples; normalised only when a twin is made):
    ``padding=1`` and ``(1, 1, 1)`` may get two equal twins, and no call pays for normalising."""
    return tuple(v) if isinstance(v, list) else v


def _twin(call: Call, key, make):
    twin = call.ctx.twins.get(key)
    if twin is None:
        twin = call.ctx.twins[key] = make()
    return twin


def _run_twin(call: Call, twin, x, *params):
    """The twin's forward on this rank's piece, called directly: a twin has no hooks."""
    lay = _standard(call, x)
    xl = raw(x)
    out = twin.spatial_forward(xl, *params, lay.gshape) if params else \
        twin.forward(xl, lay.gshape)
    return adopt(out, lay.with_(gshape=twin.out_gshape(lay.gshape)))


# -- convolutions ----------------------------------------------------------------------------
#: ``F.conv3d``'s arguments by name, with the defaults of the trailing ones.
CONV_ARGS = (("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
             (None, 1, 0, 1, 1))


def conv3d(call: Call, start=None):
    """``start(call, bound_args, weight, bias)`` may take the call where the layer has no route of
    its own around the exchange (:mod:`hpcpar.nn.fused_halo`), or decline with None."""
    b = call.bind(*CONV_ARGS)
    w, bias = call.replicated(b["weight"]), call.replicated(b["bias"])
    key = ("conv3d", w.shape, *(_hashable(b[k]) for k in ("stride", "padding", "dilation")),
           b["groups"], bias is not None)
    twin = _twin(call, key, lambda: _conv_twin(call, b, w, bias))
    x = b["input"]
    lay = x._hp
    std = type(lay) is Layout and lay.standard and x.dim() == 5
    trimmed = twin.trimmed(xyz(lay.gshape)) if std else None
    if trimmed is not None:
        # kernel taps that only read padding dropped: the smaller convolution, its own halo
        small, taps = trimmed
        return _run_twin(call, small, x, w[taps], bias)
    # the first of a run of convolutions sharing one exchange? Not where the layer gathers the
    # map or takes its boundary path, which already hides the faces behind the interior's
    # compute (UNet3D's demo, batch 4 on 1x2x1x1: 0.74x fused through the general path)
    if start is not None and not (std and (
            twin.whole_route(raw(x), xyz(lay.gshape)) is not None or
            twin.boundary_path(raw(x), twin.spatial_plan(raw(x), xyz(lay.gshape))))):
        out = start(call, b, w, bias)
        if out is not None:
            return out
    return _run_twin(call, twin, x, w, bias)


def _conv_twin(call: Call, b, w, bias) -> SpatialConv3d:
    padding = b["padding"] if isinstance(b["padding"], str) else triple(b["padding"],
                                                                         "padding", "conv3d")
    return SpatialConv3d(w.shape[1] * b["groups"], w.shape[0], tuple(w.shape[2:]),
                         triple(b["stride"], "stride", "conv3d"), padding,
                         triple(b["dilation"], "dilation", "conv3d"), b["groups"],
                         bias is not None, device="meta", grid=call.ctx.grid)


def conv_transpose3d(call: Call):
    b = call.by_name()
    w, bias = call.replicated(b["weight"]), call.replicated(b["bias"])
    names = ("stride", "padding", "output_padding", "dilation")
    key = ("conv_transpose3d", w.shape, *(_hashable(b[k]) for k in names), b["groups"],
           bias is not None)

    def make():
        geo = tuple(triple(b[k], k, "conv_transpose3d") for k in names)
        return SpatialConvTranspose3d(w.shape[0], w.shape[1] * b["groups"], tuple(w.shape[2:]),
                                      geo[0], geo[1], geo[2], b["groups"], bias is not None,
                                      geo[3], device="meta", grid=call.ctx.grid)
    return _run_twin(call, _twin(call, key, make), b["input"], w, bias)


# -- pools -------------------------------------------------------------------------------------
class PoolRule:
    """The rule of a windowed pool whose spatial layer is ``cls`` (built from the call's
    arguments by ``names``, ``defaults`` for the trailing ones). A new pool is its layer and one
    :mod:`~hpcpar.nn.optable` row holding its ``PoolRule``: the planner's tracer reads the
    window by the same names; ``keeps`` what backward holds ("none": indices only)."""

    def __init__(self, cls, names, defaults, keeps=None):
        self.cls, self.names, self.defaults, self.keeps = cls, names, defaults, keeps
        self.__name__ = self.__qualname__ = f"pool[{cls.__name__}]"

    def __call__(self, call: Call):
        b = call.bind(self.names, self.defaults)
        if b.get("return_indices"):
            raise call.refuse("returns indices into the local piece",
                              "use return_indices=False")
        kw = {k: b[k] for k in self.names[1:] if k != "return_indices"}
        key = (self.cls.__name__, *map(_hashable, kw.values()))
        twin = _twin(call, key, lambda: self.cls(**kw, grid=call.ctx.grid))
        return _run_twin(call, twin, b["input"])


_WINDOW = ("input", "kernel_size", "stride", "padding")
max_pool3d = PoolRule(SpatialMaxPool3d, (*_WINDOW, "dilation", "ceil_mode", "return_indices"),
                      (None, 0, 1, False, False), keeps="none")
avg_pool3d = PoolRule(SpatialAvgPool3d, (*_WINDOW, "ceil_mode", "count_include_pad",
                                         "divisor_override"), (None, 0, False, True, None))


def adaptive_pool(call: Call):
    """Size 1 on every axis: a global reduction (replicated); else :mod:`hpcpar.nn.resample`."""
    b = call.bind(("input", "output_size", "return_indices"), (False,))
    x = b["input"]
    lay = _standard(call, x)
    size = b["output_size"]
    sizes = tuple(size) if isinstance(size, (tuple, list)) else (size,) * 3
    if b.get("return_indices"):
        raise call.refuse("returns indices into the local piece", "use return_indices=False")
    op = "mean" if "avg" in call.name else "amax"
    if all(s == 1 for s in sizes):
        return global_reduce(raw(x), op, (2, 3, 4), True, grid=call.ctx.grid, gshape=lay.gshape)
    fn = resample.adaptive_avg_pool3d if op == "mean" else resample.adaptive_max_pool3d
    out, gshape = fn(raw(x), sizes, grid=call.ctx.grid, gshape=lay.gshape)
    return adopt(out, lay.with_(gshape=gshape))


# -- resampling and padding ---------------------------------------------------------------------
def interpolate(call: Call):
    b = call.by_name()
    x = b["input"]
    lay = _standard(call, x)
    if b["antialias"]:
        raise call.refuse("antialias is for 2D inputs", "use antialias=False")
    out, gshape = resample.interpolate(
        raw(x), b["size"], b["scale_factor"], b["mode"], b["align_corners"],
        b["recompute_scale_factor"], grid=call.ctx.grid, gshape=lay.gshape)
    return adopt(out, lay.with_(gshape=gshape))


def pad(call: Call):
    b = call.by_name()
    x = b["input"]
    lay = _standard(call, x)
    out, gshape = padding.pad(raw(x), tuple(b["pad"]), b["mode"], b["value"],
                               grid=call.ctx.grid, gshape=lay.gshape)
    return adopt(out, lay.with_(gshape=gshape))


# -- norms -------------------------------------------------------------------------------------
def batch_norm(call: Call):
    """Training (or no running statistics): statistics of the whole volume (and the whole global
    batch with ``bn_include_data``); eval with running statistics: per channel, local."""
    b = call.by_name()
    x = b["input"]
    if not b["training"] and b["running_mean"] is not None:
        return channelwise(call)
    lay = _standard(call, x)
    grid = call.ctx.grid
    comm = grid.comm if call.ctx.bn_include_data else grid.spatial_comm
    out = _GlobalBatchNorm.apply(raw(x), call.replicated(b["weight"]),
                                 call.replicated(b["bias"]), b["running_mean"],
                                 b["running_var"], b["momentum"], b["eps"], comm, "batch_norm")
    return adopt(out, lay)


def group_norm(call: Call):
    b = call.by_name()
    lay = _standard(call, b["input"])
    out = global_norm.group_norm(raw(b["input"]), b["num_groups"], call.replicated(b["weight"]),
                                 call.replicated(b["bias"]), b["eps"], grid=call.ctx.grid,
                                 gshape=lay.gshape)
    return adopt(out, lay)


def instance_norm(call: Call):
    b = call.by_name()
    lay = _standard(call, b["input"])
    out = global_norm.instance_norm(raw(b["input"]), b["running_mean"], b["running_var"],
                                    call.replicated(b["weight"]), call.replicated(b["bias"]),
                                    b["use_input_stats"], b["momentum"], b["eps"],
                                    grid=call.ctx.grid, gshape=lay.gshape,
                                    include_data=call.ctx.bn_include_data)
    return adopt(out, lay)


def layer_norm(call: Call):
    """Over trailing dims: local when none of them is split, else global per-sample."""
    b = call.by_name()
    x = b["input"]
    shape = b["normalized_shape"]
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    lay = x._hp
    if all(d < x.dim() - len(shape) for d in lay.sdims):
        if b["weight"] is None:
            return pointwise(call)
        args, kwargs = call.plain()  # weights over non-split dims: used whole
        return adopt(call.func(*args, **kwargs), lay)
    lay = _standard(call, x)
    out = global_norm.layer_norm(raw(x), shape, call.replicated(b["weight"]),
                                 call.replicated(b["bias"]), b["eps"], grid=call.ctx.grid,
                                 gshape=lay.gshape)
    return adopt(out, lay)


# -- reductions --------------------------------------------------------------------------------
_REDUCE_NAMES = {"sum": "sum", "mean": "mean", "amax": "amax", "amin": "amin", "var": "var",
                 "std": "std", "max": "amax", "min": "amin", **dict.fromkeys((
                     "nansum", "nanmean", "prod", "logsumexp", "norm", "all", "any",
                     "count_nonzero", "argmax", "argmin", "median", "linalg_vector_norm",
                     "quantile", "nanquantile", "var_mean", "std_mean"))}


def reduction(call: Call):
    """Over no split dim: local; over every one: the global value, replicated; else refused."""
    x = call.splits[0]
    lay = x._hp
    n = x.dim()
    name = call.name
    b = call.by_name()   # torch's names: x.var(1)'s dim, quantile's q, norm's p are not mixed
    if "other" in b:   # torch.max(a, b): elementwise
        return pointwise(call)
    dim = None if b.get("dim") in ([], ()) else b.get("dim")   # amax(x): dim=[], every dim
    dims = _dims_arg(dim, n)
    split = [d for a, d in enumerate(lay.sdims) if call.ctx.grid.spatial_shape[a] > 1]
    spatial = [d for d in lay.sdims if d in dims]
    keepdim = bool(b.get("keepdim", False))
    if len(spatial) < 3 and not any(d in dims for d in split):
        if spatial and not keepdim:
            raise call.refuse("removes a spatial dim", "use keepdim=True, or reduce all of "
                              "dims (2, 3, 4)")
        out = call.run_plain()
        gshape = [1 if d in dims else g for d, g in zip(lay.sdims, lay.gshape)]
        keep = lay.with_(gshape=gshape) if keepdim else lay.with_(
            sdims=[d - sum(1 for r in dims if r < d) for d in lay.sdims])
        return wrap_like(out, keep, n if keepdim else n - len(dims))
    op = _REDUCE_NAMES.get(name)
    if (op is None and name not in _COMPOSED) or (name in ("max", "min") and dim is not None):
        raise call.refuse("reduces over a split dim and has no global form in hpcpar",
                          "use sum/mean/amax/amin/var/std (or var_mean, std_mean, nansum, "
                          "nanmean, logsumexp, count_nonzero, any, all) over all of dims "
                          "(2, 3, 4)")
    xl = raw(x) if b.get("dtype") is None else raw(x).to(b["dtype"])
    dim = None if dim is None else tuple(dims)

    # global_reduce takes (..., D, H, W); a permuted tensor ((N, D, H, W, C) after a
    # channels-last permute) is reduced through a view in that order, then put back
    order = [d for d in range(n) if d not in lay.sdims] + list(lay.sdims)
    back = [order.index(d) for d in range(n)]
    moved = None if dim is None else tuple(back[d] for d in dims)

    def reduce(t, how, keep=keepdim, **extra):
        if order == list(range(n)):
            return global_reduce(t, how, dim, keep, grid=call.ctx.grid, gshape=lay.gshape,
                                 **extra)
        out = global_reduce(t.permute(order), how, moved, keep, grid=call.ctx.grid,
                            gshape=lay.gshape, **extra)
        return out.permute(back) if keep and out.dim() == n else out

    if name in _NORMS:
        return _p_norm(call, xl, reduce, b[_NORMS[name]])
    if op is None:
        return _composed(name, xl, reduce, keepdim, dims, _correction(b))
    return reduce(xl, op, **({"correction": _correction(b)} if op in ("var", "std") else {}))


#: torch reductions made of the global ones over something pointwise (:func:`_composed`)
_COMPOSED = ("var_mean", "std_mean", "nansum", "nanmean", "logsumexp", "count_nonzero", "any",
             "all", "norm", "linalg_vector_norm")
#: the vector norms, by name: the name of their order argument
_NORMS = {"norm": "p", "linalg_vector_norm": "ord"}


def _p_norm(call, xl, reduce, p):
    """``torch.norm`` / ``torch.linalg.vector_norm`` of order ``p`` over the split dims (a global
    response norm's ``torch.norm(x, p=2, dim=(-3, -2, -1))``) from global sums and maxima."""
    if p is None or p == "fro" or p == 2:
        return reduce(xl, "norm")
    if isinstance(p, str) or not isinstance(p, (int, float)):
        raise call.refuse(f"takes the {p!r} norm over split dims", "use p=2 (or any number)")
    if p == 0:
        return reduce((xl != 0).to(xl.dtype), "sum")
    if math.isinf(p):
        return reduce(xl.abs(), "amax" if p > 0 else "amin")
    if p == 1:
        return reduce(xl.abs(), "sum")
    return reduce(xl.abs().pow(p), "sum").pow(1.0 / p)


def _composed(name, xl, reduce, keepdim, dims, correction):
    """``var_mean``, ``std_mean``, ``nansum``, ``nanmean``, ``logsumexp``, ``count_nonzero``,
    ``any`` and ``all`` over the split dims, from global sums, means and maxima."""
    if name in ("var_mean", "std_mean"):
        return reduce(xl, name[:3], correction=correction), reduce(xl, "mean")
    if name in ("count_nonzero", "any", "all"):   # counts of nonzero elements, in float64
        nonzero = (xl != 0).to(torch.float64)
        if name == "count_nonzero":
            return reduce(nonzero, "sum", keep=False).to(torch.int64)
        return reduce(nonzero, "amax" if name == "any" else "amin") > 0
    nan = torch.isnan(xl)
    if name == "nansum":
        return reduce(torch.where(nan, 0, xl), "sum")
    if name == "nanmean":
        return reduce(torch.where(nan, 0, xl), "sum") / reduce((~nan).to(xl.dtype), "sum")
    # logsumexp: the global maximum (a constant: its gradient cancels), then a global sum
    top = reduce(xl.detach(), "amax", keep=True)
    top = torch.where(torch.isinf(top), 0, top)
    out = torch.log(reduce(torch.exp(xl - top), "sum", keep=True)) + top
    return out if keepdim else out.squeeze(tuple(dims))


def _correction(b) -> float:
    """var/std's correction: given, or from the older ``unbiased`` flag (True by default)."""
    if b.get("correction") is not None:
        return b["correction"]
    return 0 if b.get("unbiased") is False else 1


# -- dropout -----------------------------------------------------------------------------------
def dropout(call: Call):
    """Masks depend on the seed and the GLOBAL sample, channel and voxel: split-independent."""
    name = call.name
    if name in ("alpha_dropout", "feature_alpha_dropout", "dropout1d"):
        raise call.refuse("has no split-independent form", "use nn.Dropout or nn.Dropout3d")
    b = call.by_name()
    x = b["input"]
    if not call.ctx.dropout:
        return x
    lay = _standard(call, x)
    out = spatial_dropout(raw(x), b["p"], b["training"], b["inplace"], grid=call.ctx.grid,
                          gshape=lay.gshape, feature=name != "dropout",
                          seed=forward_seed(call.ctx))
    return x if b["inplace"] else adopt(out, lay)


def forward_seed(ctx, generator: torch.Generator | None = None) -> int:
    """Drawn on every rank (their streams in step); the spatial root's value taken."""
    drawn = int(torch.randint(0, 2**62, (1,), generator=generator).item())
    grid = ctx.grid
    return grid.spatial_comm.bcast(drawn, root=0) if grid.spatial_size > 1 else drawn


# -- random numbers ----------------------------------------------------------------------------
_NOISE = {"randn_like": "normal", "rand_like": "uniform", "normal_": "normal",
          "uniform_": "uniform"}


def noise(call: Call):
    """Numbers that depend on the seed and each element's GLOBAL coordinates (hpcpar.nn.noise);
    in the first-step check's probe, torch's own for the whole tensor (its plain model drew
    them)."""
    x = call.splits[0]
    lay = x._hp
    if x is not call.args[0] or len(lay.sdims) != 3 or 0 in lay.sdims:
        raise call.refuse("draws for a tensor that is not a batch-first split volume",
                          "draw the noise for the volume itself")
    generator = call.kwargs.get("generator")
    if not call.ctx.dropout:
        return _probe_noise(call, x, generator)
    in_place = call.name.endswith("_")
    names = ("self", "mean", "std") if call.name == "normal_" else ("self", "from", "to")
    b = call.bind(names, (0.0, 1.0)) if in_place else call.bind(("input",))
    out = spatial_noise(raw(x), _NOISE[call.name], grid=call.ctx.grid, sdims=lay.sdims,
                        gshape=lay.gshape, seed=forward_seed(call.ctx, generator),
                        dtype=None if in_place else b.get("dtype"))
    if in_place:
        low, high = b[names[1]], b[names[2]]
        scale = high - low if call.name == "uniform_" else high
        raw(x).copy_(out.mul_(scale).add_(low))
        return x
    if b.get("device") is not None:
        out = out.to(b["device"])
    return adopt(out.requires_grad_(bool(b.get("requires_grad", False))), lay)


def _probe_noise(call: Call, x, generator):
    """torch's call on the whole tensor from the spatial root's generator state, cut."""
    grid, lay = call.ctx.grid, x._hp
    gen = generator if generator is not None else torch.default_generator
    gen.set_state(grid.spatial_comm.bcast(gen.get_state(), root=0))
    whole = torch.empty(lay.global_shape(x.shape_local), dtype=x.dtype, device=x.device)
    drawn = call.func(whole, *call.args[1:], **call.kwargs)
    cut = [slice(None)] * x.dim()
    for d, (start, stop) in zip(lay.sdims, box(lay.gshape, grid.spatial_shape,
                                                     grid.spatial_coords)):
        cut[d] = slice(start, stop)
    if call.name.endswith("_"):
        raw(x).copy_(drawn[tuple(cut)])
        return x
    return adopt(drawn[tuple(cut)].clone(), lay)


def replicated_dropout(func, args, kwargs, ctx):
    """Dropout on a replicated tensor: the same mask on every rank of the spatial group."""
    b = by_name(func, args, kwargs)
    x = b["input"]
    if not b["training"] or b["p"] == 0.0 or not ctx.dropout:
        return x
    g = torch.Generator(device=x.device)
    g.manual_seed(forward_seed(ctx))
    feature = getattr(func, "__name__", "") != "dropout"
    shape = (*x.shape[:2], *([1] * (x.dim() - 2))) if feature else tuple(x.shape)
    # drawn for the GLOBAL batch and cut to this data group's rows: the masks depend on the
    # sample, not on how the batch is split (as hpcpar.nn.dropout does for split tensors)
    grid, n = ctx.grid, x.shape[0]
    keep = torch.empty((n * grid.data, *shape[1:]), dtype=x.dtype, device=x.device)
    keep = keep.bernoulli_(1.0 - b["p"], generator=g)[grid.coords[0] * n:][:n]
    keep = keep.div_(1.0 - b["p"]) if b["p"] < 1.0 else keep
    return x.mul_(keep) if b["inplace"] else x * keep


def replicated_batch_norm(func, args, kwargs, ctx):
    """Batch norm in training on a replicated tensor (after a global pooling, or a volume
    gathered whole): with ``bn_include_data`` its statistics are those of the global batch, as
    the split volume's are; each data group holds its own samples, whole."""
    b = by_name(func, args, kwargs)
    grid = ctx.grid
    use_stats = b["training"] or b["running_mean"] is None
    if not (ctx.bn_include_data and grid.data > 1 and use_stats):
        return func(*args, **kwargs)
    x = b["input"]
    return _GlobalBatchNorm.apply(x, b["weight"], b["bias"], b["running_mean"],
                                  b["running_var"], b["momentum"], b["eps"], grid.data_comm,
                                  "batch_norm")


# -- losses ------------------------------------------------------------------------------------
_CLASS_LOSSES = ("cross_entropy", "nll_loss")
_LOSS_NAMES = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
               "binary_cross_entropy_with_logits", "cross_entropy", "nll_loss", "kl_div")


def loss(call: Call):
    """Mean and sum reductions are the GLOBAL ones, with torch's semantics (class weights and
    ignore_index for cross entropy / NLL): the single-process loss on every rank."""
    b = call.by_name()
    if b.get("size_average") is not None or b.get("reduce") is not None:
        raise call.refuse("uses the deprecated size_average/reduce", "pass reduction=")
    reduction_ = b.get("reduction", "mean")
    x = b["input"]
    if not isinstance(x, type(call.splits[0])):
        raise call.refuse("has a replicated input and a split target", "split both or neither")
    lay, target = x._hp, b["target"]
    # the class dim 1 goes
    out_lay = lay.with_(sdims=[d - 1 for d in lay.sdims]) if call.name in _CLASS_LOSSES else lay
    kwargs = {k: v for k, v in b.items() if k not in ("input", "target", "size_average",
                                                       "reduce", "reduction")}
    for k in ("weight", "pos_weight"):
        if isinstance(kwargs.get(k), torch.Tensor):
            t = call.replicated(kwargs[k])
            kwargs[k] = t if t.dim() < 3 else localize(t, lay, x.dim(), call.name)
    if isinstance(target, type(x)):
        tl = raw(target)
    else:
        # a class-index target lacks the class dim; any other broadcasts by its last dims
        tl = localize(call.replicated(target), out_lay, target.dim(), call.name) \
            if call.name in _CLASS_LOSSES and target.dim() < x.dim() else \
            localize(call.replicated(target), lay, x.dim(), call.name)
    if call.name not in _CLASS_LOSSES:
        # a target with more dims broadcasts the input (torch warns, and computes it): the
        # split dims are counted from the end of the broadcast result
        shape = torch.broadcast_shapes(raw(x).shape, tl.shape)
        extra = len(shape) - x.dim()
        out_lay = lay if extra <= 0 else lay.with_(sdims=[d + extra for d in lay.sdims])
    func = getattr(F, call.name)
    if reduction_ == "none":
        return adopt(func(raw(x), tl, reduction="none", **kwargs), out_lay)
    # this piece's sum by torch's own fused reduction (a per-voxel loss tensor summed
    # afterwards costs a third more), then the sum over the spatial group
    part = func(raw(x), tl, reduction="sum", **kwargs)
    grid = call.ctx.grid
    if reduction_ == "mean" and call.name in _CLASS_LOSSES and not tl.is_floating_point():
        # torch's denominator (class weights, ignore_index) summed in the same message
        count = _class_count(tl, kwargs.get("weight"), kwargs.get("ignore_index", -100))
        total, den = _spatial_sum(torch.stack([part, count.to(part.dtype)]), grid)
        return total / den
    total = _spatial_sum(part.double(), grid).to(part.dtype)
    if reduction_ == "sum":
        return total
    if reduction_ == "batchmean":
        return total / x.shape[0]
    if call.name in _CLASS_LOSSES:  # one loss per sample and voxel: the class dim goes
        per_voxel = (raw(x).shape[0], *raw(x).shape[2:])
    else:
        per_voxel = torch.broadcast_shapes(raw(x).shape, tl.shape)
    return total / math.prod(out_lay.global_shape(per_voxel))


def _spatial_sum(t: torch.Tensor, grid) -> torch.Tensor:
    """Allreduce forward, identity backward (hpcpar.nn.reduce's convention)."""
    return ReplicatedSum.apply(t, grid.spatial_comm) if grid.spatial_size > 1 else t


def _class_count(target, weight, ignore_index):
    """torch's mean's denominator for class-index targets: Σ weight[target] over the voxels not
    ignored (their count without weights)."""
    valid = target != ignore_index
    if weight is None:
        return valid.sum()
    return torch.where(valid, weight.detach()[target.clamp(min=0) * valid], 0.0).sum()
