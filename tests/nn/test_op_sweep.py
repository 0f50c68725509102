"""The op sweep: every local, shape, stencil, norm, reduction and loss entry of
:mod:`hpcpar.nn.optable`, run inside a spatialized forward on a split float64 volume of uneven
sizes on grids 1x2x1x1, 1x2x2x1 and 2x2x1x1, against the plain op on one process: outputs and
input gradients to 1e-12. The table drives the sweep (as DTensor's sweep is driven by
PyTorch's op database): an entry with no sample below fails the sweep, and the ops hpcpar
refuses are listed with the line each refusal must say (a refused op that turns exact fails
too: take it off the list)."""

from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcpar.testing import mpi_case

#: the table's classes the sweep covers (dropout and random draws have their own tests,
#: tests/nn/test_reduce_dropout.py and test_noise.py; metadata: test_spatialize.py)
KINDS = ("local", "shape", "stencil", "norm", "reduction", "loss")

#: the global (N, C, D, H, W): uneven over 2 ranks on every axis
SHAPE = (2, 4, 7, 5, 6)
GRIDS = [(1, 2, 1, 1), (1, 2, 2, 1), (2, 2, 1, 1)]
RTOL = 1e-12


def _const(*shape, seed=7):
    """A replicated operand (a weight, a bias): the same numbers on every rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def _y(x):
    """A non-leaf copy, for ops that write in place (a leaf that requires grad cannot)."""
    return x * 1.0


def _hooked(f, x):
    y = _y(x)
    f(y, lambda g: g * 2)
    return y * 3


def _retained(f, x):
    y = _y(x)
    f(y)
    return y * 3


def _set(f, x):
    y = _y(x)
    f(y, (slice(None), slice(0, 1)), x[:, 1:2] * 3)
    return y


def _copied(f, x):
    y = torch.zeros_like(x)
    f(y, x * 2)
    return y


def _transposed_in_place(f, x):
    """The tensor itself transposed in place, then used."""
    y = _y(x)
    f(y, 1, 4)
    return y * 2


def _cl(x):
    """Channels-last, as ConvNeXt applies its Linear layers."""
    return x.permute(0, 2, 3, 4, 1)


def _target(x):
    return torch.cos(x).detach()


def _labels(x):
    return x.detach().argmax(1)


#: name (the op's name in hpcpar.nn.optable.entries; "Tensor.name" where the method's
#: signature differs) -> sample(op, x): the op applied to a 5D volume as a model
#: would. The reference runs the same sample on the whole volume.
SAMPLES = {
    # -- local: casts and copies
    "to": lambda f, x: f(x, torch.float32),
    "type": lambda f, x: f(x, torch.float32),
    "type_as": lambda f, x: f(x, x),
    **{n: (lambda f, x: f(x)) for n in (
        "float", "double", "half", "bfloat16", "int", "long", "bool", "byte", "char", "short",
        "cpu", "contiguous", "clone", "detach", "hardswish", "hardsigmoid", "relu6", "celu",
        "selu", "softsign", "tanhshrink", "hardtanh", "elu", "logsigmoid", "mish", "silu",
        "nan_to_num", "relu", "leaky_relu", "gelu", "hardshrink", "softshrink", "softplus",
        "sigmoid", "tanh")},
    **{n: (lambda f, x: f(_y(x))) for n in (
        "detach_", "zero_", "relu_", "leaky_relu_", "elu_", "celu_", "selu_", "hardtanh_")},
    "requires_grad_": lambda f, x: f(x.detach() * 2),
    "retain_grad": _retained,
    "register_hook": _hooked,
    "fill_": lambda f, x: f(_y(x), 0.5),
    "copy_": _copied,
    "threshold": lambda f, x: f(x, 0.1, 20.0),
    "threshold_": lambda f, x: f(_y(x), 0.1, 20.0),
    "float_power": lambda f, x: f(x, 2),
    "clamp_min": lambda f, x: f(x, 0.1),
    "clamp_max": lambda f, x: f(x, 0.1),
    "masked_fill": lambda f, x: f(x, x > 0.5, 0.25),
    "prelu": lambda f, x: f(x, _const(4)),
    "rrelu": lambda f, x: f(x, training=False),
    "rrelu_": lambda f, x: f(_y(x), training=False),
    "where": lambda f, x: f(x > 0, x, x * 2),
    "Tensor.where": lambda f, x: f(x, x > 0, x * 2),
    "zeros_like": lambda f, x: f(x) + x,
    "ones_like": lambda f, x: f(x) * x,
    "empty_like": lambda f, x: f(x).zero_() + x,
    "full_like": lambda f, x: f(x, 2.0) * x,
    "new_zeros": lambda f, x: f(x, x.shape) + x,
    "new_ones": lambda f, x: f(x, x.shape) * x,
    "new_empty": lambda f, x: f(x, x.shape).zero_() + x,
    "new_full": lambda f, x: f(x, x.shape, 2.0) * x,
    "new_tensor": lambda f, x: x * f(x, [1.0, 2.0, 3.0, 4.0]).view(1, 4, 1, 1, 1),
    "flip": lambda f, x: f(x, (1,)),
    # -- local: aliases, in-place forms (on a fresh copy), comparisons, casts to complex
    #    (complex outputs: values compared, no gradient, as the integer casts; ops torch
    #    cannot differentiate run on detached data, as requires_grad_)
    **{n: (lambda f, x: f(x)) for n in ("cdouble", "cfloat", "conj", "resolve_conj",
                                        "resolve_neg", "isreal")},
    # complex32 has no CPU torch.equal and no numpy dtype (the gather): its values widened
    "chalf": lambda f, x: f(x).cfloat(),
    "fill": lambda f, x: f(x, 0.5) * x,
    "floor_divide": lambda f, x: f(x.detach(), 0.3),
    "floor_divide_": lambda f, x: f(_y(x.detach()), 0.3),
    "true_divide_": lambda f, x: f(_y(x), 3.0),
    "isclose": lambda f, x: f(x, x * 2, atol=0.5),
    # -- local: per voxel across its channels
    "channel_shuffle": lambda f, x: f(x, 2),
    "native_channel_shuffle": lambda f, x: f(x.detach(), 2),
    "local_response_norm": lambda f, x: f(x, 3),
    "one_hot": lambda f, x: f(_labels(x), num_classes=4),
    "one_hot without num_classes": lambda f, x: f(_labels(x)),
    # -- local: along a dim that is not split
    **{n: (lambda f, x: f(x, 1)) for n in (
        "softmax", "log_softmax", "softmin", "cumsum", "cumprod", "cummax", "cummin", "sort",
        "argsort", "glu", "logcumsumexp", "special_softmax", "special_log_softmax")},
    **{n: (lambda f, x: f(_y(x), 1)) for n in ("cumsum_", "cumprod_")},
    "topk": lambda f, x: f(x, 2, 1),
    "normalize": lambda f, x: f(x, 2.0, 1),
    "diff": lambda f, x: f(x, dim=1),
    "linear": lambda f, x: f(_cl(x), _const(3, 4), _const(3, seed=8)),
    "matmul": lambda f, x: f(_cl(x), _const(4, 3)),
    "__matmul__": lambda f, x: f(_cl(x), _const(4, 3)),
    "mm": lambda f, x: f(x.flatten(1), _const(4 * 7 * 5 * 6, 3)),
    # -- shape
    "permute": lambda f, x: f(x, (0, 2, 3, 4, 1)),
    **{n: (lambda f, x: f(x, 1, 4)) for n in ("transpose", "swapaxes", "swapdims", "movedim",
                                              "moveaxis")},
    "transpose_": lambda f, x: f(_y(x), 1, 4),
    "view": lambda f, x: f(x, (2, 2, 2, 7, 5, 6)),
    "reshape": lambda f, x: f(x, (2, 2, 2, 7, 5, 6)),
    "view_as": lambda f, x: f(x[:, :2] * 1, x[:, 2:]),
    "reshape_as": lambda f, x: f(x[:, :2] * 1, x[:, 2:]),
    "flatten": lambda f, x: f(x, 0, 1),
    "unflatten": lambda f, x: f(x, 1, (2, -1)),
    "unsqueeze": lambda f, x: f(x, 1),
    "squeeze": lambda f, x: f(x[:, :1], 1),
    "expand": lambda f, x: f(x[:, :1], 2, 3, 7, 5, 6),
    "expand_as": lambda f, x: f(x[:, :1], x),
    "repeat": lambda f, x: f(x, 1, 2, 1, 1, 1),
    **{n: (lambda f, x: f([x, x * 2], 1)) for n in ("cat", "concat", "concatenate", "stack")},
    **{n: (lambda f, x: f([x, x * 2])) for n in ("hstack", "vstack", "dstack")},
    "dstack of (N, D, C, H, W)": lambda f, x: f([x.movedim(1, 2), x.movedim(1, 2) * 2]),
    # a split dim cut with itself outermost, or merged with whole dims after it (W: the sweep's
    # grids do not split it; tests/nn/test_view_maps.py cuts a split one)
    "view cutting W": lambda f, x: f(x, (*x.shape[:4], 3, 2)),
    "reshape merging W with the channels last": lambda f, x: f(_cl(x), (*x.shape[:1], 7, 5, -1)),
    "flatten of W and the channels last": lambda f, x: f(_cl(x), 3),
    "unflatten of W": lambda f, x: f(x, -1, (3, 2)).sum(-1),
    # arguments by keyword, by torch's names (read by position, these crashed)
    "transpose by keyword": lambda f, x: f(x, dim1=4, dim0=1),
    "swapaxes by keyword": lambda f, x: f(x, axis0=1, axis1=4),
    "transpose_ of the tensor used after": _transposed_in_place,
    **{n: (lambda f, x: f(x, 2, 1)) for n in ("chunk", "split", "tensor_split")},
    "unbind": lambda f, x: f(x, 1),
    "narrow": lambda f, x: f(x, 1, 1, 2),
    "select": lambda f, x: f(x, 1, 2),
    "__getitem__": lambda f, x: f(x, (slice(None), slice(1, 3), Ellipsis)),
    "__setitem__": _set,
    # -- stencils
    "conv3d": lambda f, x: f(x, _const(3, 4, 3, 3, 3), _const(3, seed=8), padding=1),
    "conv_transpose3d": lambda f, x: f(x, _const(4, 3, 2, 2, 2), stride=2),
    "max_pool3d": lambda f, x: f(x, 3, stride=2, padding=1),
    "avg_pool3d": lambda f, x: f(x, 2, ceil_mode=True),
    "adaptive_avg_pool3d": lambda f, x: f(x, (3, 2, 4)),
    "adaptive_max_pool3d": lambda f, x: f(x, (3, 2, 4)),
    "interpolate": lambda f, x: f(x, scale_factor=2, mode="trilinear"),
    "upsample": lambda f, x: f(x, scale_factor=2, mode="nearest"),
    "upsample_nearest": lambda f, x: f(x, scale_factor=2),
    "pad": lambda f, x: f(x, (1, 2, 0, 1, 2, 0), mode="reflect"),
    # -- norms (training: the batch's statistics)
    "batch_norm": lambda f, x: f(x, None, None, _const(4), _const(4, seed=8), training=True),
    "group_norm": lambda f, x: f(x, 2, _const(4), _const(4, seed=8)),
    "instance_norm": lambda f, x: f(x, weight=_const(4), bias=_const(4, seed=8)),
    "layer_norm": lambda f, x: f(x, (4, 7, 5, 6)),
    # -- reductions: over every split dim (the global value)
    **{n: (lambda f, x: f(x, (2, 3, 4))) for n in (
        "sum", "mean", "amax", "amin", "var", "std", "nansum", "nanmean", "logsumexp",
        "var_mean", "std_mean")},
    **{n: (lambda f, x: f(x)) for n in ("max", "min", "prod", "argmax", "argmin", "median")},
    "norm": lambda f, x: f(x, 2, (2, 3, 4)),
    "vector_norm": lambda f, x: f(x, 1, (2, 3, 4)),
    "all": lambda f, x: f(x > -3),
    "any": lambda f, x: f(x > 2),
    "count_nonzero": lambda f, x: f(x > 0, (2, 3, 4)),
    **{n: (lambda f, x: f(x, 0.5)) for n in ("quantile", "nanquantile")},
    # -- losses (mean over every element: the single-process value)
    **{n: (lambda f, x: f(x, _target(x))) for n in ("mse_loss", "l1_loss", "smooth_l1_loss",
                                                    "huber_loss")},
    "binary_cross_entropy": lambda f, x: f(torch.sigmoid(x), torch.sigmoid(_target(x))),
    "binary_cross_entropy_with_logits": lambda f, x: f(x, torch.sigmoid(_target(x))),
    "cross_entropy": lambda f, x: f(x, _labels(x)),
    "nll_loss": lambda f, x: f(F.log_softmax(x, 1), _labels(x)),
    "kl_div": lambda f, x: f(F.log_softmax(x, 1), F.softmax(_target(x), 1),
                             reduction="batchmean"),
}

#: a second sample of an op: its name here -> the op's name in the table (a call that the
#: op's own sample does not make)
VARIANTS = {"one_hot without num_classes": "one_hot", "dstack of (N, D, C, H, W)": "dstack",
            "view cutting W": "view", "reshape merging W with the channels last": "reshape",
            "flatten of W and the channels last": "flatten", "unflatten of W": "unflatten",
            "transpose by keyword": "transpose", "swapaxes by keyword": "swapaxes",
            "transpose_ of the tensor used after": "transpose_"}

#: name -> why the sweep cannot run it here (torch's own op does not take this volume)
NOT_RUN = {
    "cuda": "needs a CUDA device",
    "pin_memory": "needs a CUDA device",
    "upsample_bilinear": "torch's op takes 4D inputs only",
}

#: name -> what its refusal must say (a regular expression), on every grid of the sweep
_NO_GLOBAL = "reduces over a split dim and has no global form in hpcpar"
REFUSED = {
    **dict.fromkeys(("argmax", "argmin", "median", "prod", "quantile", "nanquantile"),
                    _NO_GLOBAL),
    "mm": "is a matrix product over a flattened split tensor",
    "one_hot without num_classes": "takes the class count from the largest label of this "
                                   "rank's piece.*pass num_classes",
    "dstack": "joins along a split dim",   # dim 2, D (exact where it is not: its variant)
}


def swept_ops() -> list[tuple[str, object]]:
    """(name, op) for every entry of the covered classes; a method whose sample differs
    from the function's is "Tensor.name"."""
    from hpcpar.nn import optable

    rows = [(f"Tensor.{name}" if f"Tensor.{name}" in SAMPLES and
             op is getattr(torch.Tensor, name, None) else name, op)
            for name, op, _ in optable.entries(KINDS)]
    return rows + [(v, op) for v, base in VARIANTS.items() for name, op in rows if name == base]


def test_every_entry_of_the_table_has_a_sample():
    """The table drives the sweep: an op added to optable with no sample here fails."""
    missing = [n for n, _ in swept_ops() if n not in SAMPLES and n not in NOT_RUN]
    assert not missing, f"optable entries with no sample in the sweep: {missing}"
    unknown = set(REFUSED) - set(SAMPLES)
    assert not unknown, unknown


class _Apply(nn.Module):
    def __init__(self, op, sample):
        super().__init__()
        self.op, self.sample = op, sample

    def forward(self, x):
        return self.sample(self.op, x)


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def _scalar(outs):
    """The function whose input gradient is compared: a sum of squares of every float
    output (a cotangent that differs per element)."""
    total = None
    for t in outs:
        if t.is_floating_point() and t.requires_grad:
            s = (t.double() * t.double()).sum()
            total = s if total is None else total + s
    return total


def _close(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not want.is_floating_point():
        assert torch.equal(got, want), f"{what}: values differ"
        return
    scale = max(float(want.double().abs().max()) if want.numel() else 0.0, 1.0)
    tol = RTOL if want.dtype == torch.float64 else 1e-6 if want.dtype == torch.float32 else 1e-2
    err = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
    assert err <= tol * scale, f"{what}: max |diff| {err:.3e}"


def _one(grid, name, op, x):
    """'exact', or 'refused: <line>'; raises AssertionError where a value differs."""
    from hpcpar.errors import LayerError
    from hpcpar.nn import is_split, local, spatialize, whole
    from hpcpar.parallel.spatial import local_slices

    sample = SAMPLES[name]
    xr = x.clone().requires_grad_()
    ref = _tensors(sample(op, xr))
    s = _scalar(ref)
    if s is not None:
        s.backward()
    model = spatialize(_Apply(op, sample), grid)
    xs = x[local_slices(x.shape, grid)].clone().requires_grad_()
    try:
        outs = _tensors(model(xs))
        s = _scalar(outs)
        if s is not None:
            s.backward()
    except LayerError as exc:
        return f"refused: {exc}"
    assert len(outs) == len(ref), f"{name}: {len(outs)} outputs, torch gives {len(ref)}"
    for i, (got, want) in enumerate(zip(outs, ref)):
        what = f"{name} on {grid.spec()}: output {i}"
        assert tuple(got.shape) == tuple(want.shape), \
            f"{what}: global shape {tuple(got.shape)} != {tuple(want.shape)}"
        if is_split(got) and type(got._hp).__name__ == "Layout":
            full = whole(got)
            if full is not None:
                _close(full, want.detach(), what)
        elif is_split(got):   # merged split dims (a flattened volume): its global sums
            _close(got.double().sum().detach().reshape(1), want.double().sum().reshape(1),
                   what + " sum")
            _close((got.double() ** 2).sum().detach().reshape(1),
                   (want.double() ** 2).sum().reshape(1), what + " sum of squares")
        else:
            _close(local(got).detach(), want.detach(), what)
    if xr.grad is not None or xs.grad is not None:
        assert xs.grad is not None and xr.grad is not None, f"{name}: a gradient is missing"
        _close(xs.grad, xr.grad[local_slices(x.shape, grid)], f"{name} on {grid.spec()}: "
               "input gradient")
    return "exact"


def _sweep(grid, outcomes):
    from hpcpar.testing.oracles import batch_slice

    x = torch.randn((SHAPE[0] * grid.data, *SHAPE[1:]), dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))
    x = x[batch_slice(x.shape[0], grid)]   # this replica's samples: the reference's batch
    for name, op in swept_ops():
        if name in NOT_RUN:
            continue
        key = f"{name} ({getattr(op, '__module__', None) or type(op).__name__})"
        try:
            got = _one(grid, name, op, x)
        except AssertionError as exc:
            got = f"WRONG: {exc}"
        except Exception as exc:   # noqa: BLE001 - a crash is an outcome to report
            got = f"CRASH: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        outcomes.setdefault((name, key), {})[grid.spec()] = got


def _judge(outcomes) -> list[str]:
    bad = []
    for (name, key), by_grid in sorted(outcomes.items()):
        for spec, got in ((s, g) for s, gots in by_grid.items() for g in sorted(gots)):
            want = REFUSED.get(name)
            if want is None and got != "exact":
                bad.append(f"{key} on {spec}: {got}")
            elif want is not None and not (got.startswith("refused: ") and
                                           re.search(want, got) and "\n" not in got and
                                           re.search(r"at \S*test_op_sweep.py:\d+ ", got)):
                bad.append(f"{key} on {spec}: expected a refusal matching {want!r}, got {got}")
    return bad


@mpi_case(nprocs=(4,), timeout=600)
def test_every_op_of_the_table_is_exact_or_refused_as_listed(comm):
    from hpcpar.testing.oracles import on_grids

    outcomes: dict = {}
    on_grids(comm, GRIDS, lambda grid: _sweep(grid, outcomes))
    every = comm.gather(outcomes, root=0)
    if comm.rank == 0:
        merged: dict = {}
        for part in every:
            for k, v in part.items():
                for spec, got in v.items():
                    merged.setdefault(k, {}).setdefault(spec, set()).add(got)
        bad = _judge(merged)
        print(f"op sweep: {len(merged)} ops on {len(GRIDS)} grids, "
              f"{sum(1 for n, _ in merged if n in REFUSED)} refused as listed")
        assert not bad, "\n".join(bad)
