"""The one table that decides what every torch call on a split tensor does.

Each op is in exactly one class: local (this rank's piece), stencil (halo exchange), norm and
reduction (global statistics, allreduce), loss (the single-process value), dropout and random
(from the seed and GLOBAL coordinates), shape (the split dims tracked), metadata (the GLOBAL
shape) or refused (one line naming the op and the user's source line). The models guide prints
the table (:func:`table`, through ``docs/optable_table.py``). Ops not listed by name are
classified by torch's own tags: an aten op tagged ``pointwise`` is local; everything else is
refused. Nothing is guessed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import rules as d
from . import spatial_ops as s

__all__ = ["rule_for", "kind_of", "table", "entries", "AS_IS", "METADATA", "REPLICATED_RULES"]

_T, _TORCH = torch.Tensor, torch


def _names(kind, rule, names, spaces=(_T, _TORCH, F)):
    return [(kind, rule, obj) for n in names for ns in spaces
            if (obj := getattr(ns, n, None)) is not None]


_LOCAL_EXTRA = (
    "to", "type", "type_as", "float", "double", "half", "bfloat16", "int", "long", "bool",
    "byte", "char", "short", "cpu", "cuda", "contiguous", "clone", "detach", "detach_",
    "requires_grad_", "retain_grad", "zero_", "fill_", "copy_", "hardswish", "hardsigmoid",
    "relu6", "celu", "selu", "softsign", "tanhshrink", "hardtanh", "elu", "logsigmoid", "mish",
    "silu", "threshold", "float_power", "clamp_min", "clamp_max", "nan_to_num", "pin_memory",
    "register_hook", "masked_fill",
    # every elementwise activation by name: torch's pointwise tags differ between versions
    # (2.11 leaves leaky_relu and the in-place elu_, celu_, selu_, hardtanh_ untagged)
    "relu", "relu_", "leaky_relu", "leaky_relu_", "elu_", "celu_", "selu_", "hardtanh_",
    "gelu", "hardshrink", "softshrink", "softplus", "sigmoid", "tanh", "threshold_",
    # elementwise, but untagged in torch 2.11 (aliases, comparisons, casts to complex)
    "floor_divide", "floor_divide_", "isclose", "isreal", "fill", "true_divide_", "cdouble",
    "cfloat", "chalf", "conj", "resolve_conj", "resolve_neg",
)

_ENTRIES = [
    *_names("local", d.pointwise, _LOCAL_EXTRA),
    # per voxel, across its channels only: the piece's voxels are whole
    *_names("local", d.channelwise, ("prelu", "channel_shuffle", "native_channel_shuffle",
                                     "local_response_norm")),
    *_names("local", d.one_hot, ("one_hot",), (F,)),
    *_names("local", d.rrelu, ("rrelu", "rrelu_")),
    *_names("local", d.where, ("where",)),
    *_names("local", d.like_factory, ("zeros_like", "ones_like", "empty_like", "full_like")),
    *_names("local", d.new_factory, ("new_zeros", "new_ones", "new_empty", "new_full",
                                        "new_tensor"), (_T,)),
    *_names("local", d.flip, ("flip",)),
    *_names("refused", d.refuse_random, ("randint_like", "bernoulli", "bernoulli_", "random_",
                                         "exponential_", "multinomial")),
    *_names("local", d.dim_local, ("softmax", "log_softmax", "softmin", "cumsum", "cumprod",
                                   "cummax", "cummin", "sort", "argsort", "topk", "glu",
                                   "normalize", "logcumsumexp", "diff", "cumsum_",
                                   "cumprod_"), (_T, _TORCH, F, torch.special)),
    *_names("local", d.linear, ("linear", "matmul", "mm", "__matmul__")),
    *_names("shape", d.reshape, ("view", "reshape", "view_as", "reshape_as")),
    *_names("shape", d.shape_op, ("permute", "transpose", "transpose_", "swapaxes", "swapdims",
                                  "movedim", "moveaxis", "flatten", "unflatten", "unsqueeze",
                                  "squeeze", "expand", "expand_as")),
    *_names("shape", d.shape_op, ("repeat",), (_T,)),
    *_names("shape", d.cat, ("cat", "concat", "concatenate", "stack", "hstack", "vstack",
                             "dstack")),
    *_names("shape", d.split_like, ("chunk", "split", "tensor_split", "unbind", "narrow",
                                    "select")),
    *_names("shape", d.getitem, ("__getitem__",)),
    *_names("shape", d.setitem, ("__setitem__",)),
    *_names("metadata", d.global_size, ("size",), (_T,)),
    *_names("metadata", d.global_numel, ("numel", "nelement"), (_T, _TORCH)),
    *_names("metadata", d.global_len, ("__len__",), (_T,)),
    *_names("metadata", d.as_plain, ("dim", "ndimension", "__repr__", "__format__",
                                     "__reduce_ex__", "__deepcopy__", "__hash__",
                                     "is_contiguous", "stride", "data_ptr", "element_size",
                                     "storage_offset", "is_floating_point", "is_complex",
                                     "get_device", "untyped_storage", "__dlpack__",
                                     "backward"), (_T,)),
    *_names("refused", d.refuse_local_values, ("numpy", "tolist", "item", "__array__",
                                               "__float__", "__int__", "__bool__",
                                               "__index__", "__iter__"), (_T,)),
    *_names("stencil", s.conv3d, ("conv3d",), (F,)),
    *_names("stencil", s.conv_transpose3d, ("conv_transpose3d",), (F,)),
    *_names("stencil", s.max_pool3d, ("max_pool3d",), (F,)),
    *_names("stencil", s.avg_pool3d, ("avg_pool3d",), (F,)),
    *_names("stencil", s.adaptive_pool, ("adaptive_avg_pool3d", "adaptive_max_pool3d"), (F,)),
    *_names("stencil", s.interpolate, ("interpolate", "upsample", "upsample_nearest",
                                       "upsample_bilinear"), (F,)),
    *_names("stencil", s.pad, ("pad",), (F,)),
    *_names("norm", s.batch_norm, ("batch_norm",), (F,)),
    *_names("norm", s.group_norm, ("group_norm",), (F,)),
    *_names("norm", s.instance_norm, ("instance_norm",), (F,)),
    *_names("norm", s.layer_norm, ("layer_norm",), (F,)),
    *_names("reduction", s.reduction, tuple(s._REDUCE_NAMES), (_T, _TORCH)),
    ("reduction", s.reduction, torch.linalg.vector_norm),
    *_names("dropout", s.dropout, ("dropout", "dropout2d", "dropout3d", "dropout1d",
                                   "alpha_dropout", "feature_alpha_dropout"), (F,)),
    *_names("loss", s.loss, tuple(s._LOSS_NAMES), (F,)),
    *_names("random", s.noise, tuple(s._NOISE)),
]

_RULES: dict = {}
_KIND: dict = {}
for _kind, _rule, _obj in _ENTRIES:
    _RULES.setdefault(_obj, _rule)
    _KIND.setdefault(_obj, _kind)

#: Rules that only read a split tensor's global shape or look at its piece: a volume shorter
#: than its ranks (``Layout.shrunk``) is not gathered for them.
METADATA = frozenset((d.global_size, d.global_numel, d.global_len, d.attribute, d.as_plain))
#: Rules that take a split tensor of any layout as they are: those, a tensor made like it, and
#: refusals (:meth:`hpcpar.nn.split.Layout.no_form`).
AS_IS = METADATA | {d.like_factory, d.refuse_local_values, d.refuse_random}

#: Calls with no split argument that still need care under a spatialized forward.
REPLICATED_RULES = {getattr(F, n): s.replicated_dropout for n in ("dropout", "dropout2d",
                                                                 "dropout3d", "dropout1d")}
REPLICATED_RULES[F.batch_norm] = s.replicated_batch_norm


#: Python's operator names and torch's aliases -> the aten op that carries the tags
_ATEN_NAME = {
    "radd": "add", "rmul": "mul", "truediv": "div", "rtruediv": "div", "rdiv": "div",
    "div": "div", "floordiv": "floor_divide", "rfloordiv": "floor_divide", "rpow": "pow",
    "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor", "rand": "bitwise_and",
    "ror": "bitwise_or", "rxor": "bitwise_xor", "invert": "bitwise_not", "iadd": "add_",
    "isub": "sub_", "imul": "mul_", "itruediv": "div_", "idiv": "div_",
    "ifloordiv": "floor_divide_", "imod": "remainder_", "iand": "bitwise_and_",
    "ior": "bitwise_or_", "ixor": "bitwise_xor_", "ilshift": "bitwise_left_shift_",
    "irshift": "bitwise_right_shift_", "mod": "remainder", "rmod": "remainder",
    "lshift": "bitwise_left_shift", "rlshift": "bitwise_left_shift",
    "rshift": "bitwise_right_shift", "rrshift": "bitwise_right_shift",
    # torch's aliases (untagged) and torch.special's names (``special_erf``)
    "absolute": "abs", "arccos": "acos", "arccosh": "acosh", "arcsin": "asin",
    "arcsinh": "asinh", "arctan": "atan", "arctan2": "atan2", "arctanh": "atanh",
    "divide": "div", "multiply": "mul", "subtract": "sub", "negative": "neg", "fix": "trunc",
    "greater": "gt", "greater_equal": "ge", "less": "lt", "less_equal": "le",
    "not_equal": "ne", "true_divide": "div", "expit": "sigmoid", "gammaln": "lgamma",
    "psi": "digamma", "gammainc": "igamma", "gammaincc": "igammac",
    "multigammaln": "mvlgamma", "ndtr": "special_ndtr",
}


def _aten_pointwise(name: str) -> bool:
    """torch's own classification: an aten op whose tensor overload is tagged pointwise. An
    alias is read as the op it names, and an in-place form (``abs_``, ``eq_``, ``x /= y``,
    untagged) as its out-of-place twin."""
    base = name.strip("_") if name.startswith("__") else name
    inplace = base.endswith("_")
    base = base.rstrip("_")
    base = base if base == "special_ndtr" else base.removeprefix("special_")
    base = _ATEN_NAME.get(base, base).rstrip("_")
    if base in _LOCAL_NAMES:
        return True
    op = getattr(torch.ops.aten, base, None)
    if op is None:
        return False
    tensor_forms = [getattr(op, o) for o in op.overloads() if o in _TENSOR_OVERLOADS]
    return any(torch.Tag.pointwise in o.tags for o in tensor_forms) and \
        (not inplace or hasattr(torch.ops.aten, base + "_"))


_LOCAL_NAMES = frozenset(n.rstrip("_") for n in _LOCAL_EXTRA)
#: The overloads that take tensors (the others are TorchScript's int/float/str forms).
_TENSOR_OVERLOADS = ("default", "Tensor", "Scalar", "self", "Tensor_Scalar", "Tensor_Tensor")
#: calls on a tensor itself, not on its values (a hook must go on the parameter)
_NOT_VALUES = {"__get__", "__set__", "__delete__", "__setitem__", "register_hook",
               "register_post_accumulate_grad_hook", "retain_grad", "backward"}


def reads_values(func) -> bool:
    """Whether ``func`` computes from its tensors' values, so that a parameter among them gets a
    gradient from the call: not an attribute, metadata or an in-place write."""
    name = getattr(func, "__name__", "")
    if name in _NOT_VALUES or _KIND.get(func) == "metadata":
        return False
    if name.startswith("__"):
        return not name.startswith("__i")   # __iadd__ and friends write in place
    return not name.endswith("_")


def rule_for(func):
    """The rule of ``func`` (see the module docstring); cached per function object."""
    rule = _RULES.get(func)
    if rule is not None:
        return rule
    name = getattr(func, "__name__", "")
    if name == "__get__" and hasattr(func, "__self__"):
        prop = func.__self__.__name__
        rule = d.global_size if prop == "shape" else \
            d.refuse_unknown if prop in ("T", "mT", "H", "mH") else d.attribute
    elif name == "__set__":
        rule = d.as_plain
    elif _aten_pointwise(name):
        rule = d.pointwise
    else:
        rule = d.refuse_unknown
    try:
        _RULES[func] = rule
    except TypeError:  # unhashable callables are classified every time
        pass
    return rule


def kind_of(func) -> str | None:
    """The class ``func`` is named under here, or None where torch's tags decide."""
    return _KIND.get(func)


def entries(kinds=None) -> list[tuple[str, object, str]]:
    """(name, callable, class) for every op named here (of ``kinds`` only, if given), named
    where torch binds it (``torch.nn.functional``, ``torch``, ``torch.linalg``, ``Tensor``; an
    alias by the op's own name): what the op sweep and the models guide's table read. Names that
    torch binds to non-callables (``torch.float`` is a dtype) are left out."""
    names: dict = {}
    own = {o: getattr(o, "__name__", None) for o in _KIND}   # aliases compare equal
    for ns in (F, _TORCH, torch.linalg, _T):
        for n in dir(ns):
            obj = getattr(ns, n, None)
            if (n.startswith("_") and not n.startswith("__")) or not callable(obj):
                continue
            try:
                if obj in _KIND and (obj not in names or n == own[obj]):
                    names[obj] = n
            except TypeError:   # unhashable: not in the table
                pass
    return sorted(((names.get(o, getattr(o, "__name__", repr(o))), o, k)
                   for o, k in _KIND.items() if callable(o) and (kinds is None or k in kinds)),
                  key=lambda r: (r[2], r[0], repr(r[1])))


def table() -> list[tuple[str, str]]:
    """(op name, class) for every op named here, once per name (the models guide's table)."""
    return sorted({(name, kind) for name, _, kind in entries()}, key=lambda r: (r[1], r[0]))
