"""The first-step check: whatever escapes the dispatch (an op run with torch-function handling
disabled, a C++ extension reading the raw piece) is caught before it trains.

On the first forward of a model spatialized with ``check=True``, each data group takes the first
sample of its input, the spatial root gathers it whole, runs the plain model on it and records every
module's output, then every rank runs a copy of the spatialized model on its piece and the outputs
are gathered and compared module by module in call order, followed by the parameter gradients of
``sum(output * w)``. Dropout is off in both (masks are random) and batch-norm statistics cover the
probe only; both runs start from the same random state (other random draws, a VAE's sampling, match)
and the check leaves it as it found it; a float32 mismatch is decided again in float64
(:data:`FLOAT64_LIMIT_BYTES`), so rounding is never taken for an escape. A mismatch raises one line
on every rank naming the first module that differs. Copies are used, so the model's state does not
change. The plain model is kept as a :func:`skeleton` (its code, no weights) until then: the check
loads the weights the spatial model trains from anyway.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from hpcpar.errors import LayerError
from hpcpar.parallel.comm import allreduce_
from hpcpar.parallel.spatial import gather, local_slices

from .split import SplitTensor, local, split_like, unwrap
from .split_head import column_split

__all__ = ["first_step_check", "skeleton", "materialize", "PROBE_LIMIT_BYTES",
           "FLOAT64_LIMIT_BYTES"]

#: A probe sample larger than this is not gathered (the check is skipped with a warning):
#: the plain model's activations for the whole sample must fit on the spatial root, and a
#: sample that is split because it does not fit on one rank never would.
PROBE_LIMIT_BYTES = 2 << 20
#: a float32 mismatch is decided again in float64 for weights up to this size (two float64
#: copies of them exist then); larger ones are judged in float32, with its tolerance
FLOAT64_LIMIT_BYTES = 256 << 20

_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
             F.feature_alpha_dropout}


class _NoDropout(TorchFunctionMode):
    """Dropout is the identity (the probe compares deterministic maths)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        return func(*args, **(kwargs or {}))


def _tol(dtype) -> float:
    return 1e-9 if dtype == torch.float64 else 1e-3


def _rel(a, b, floor: float = 1e-12) -> float:
    """max |a - b| relative to max |b| (at least ``floor``: a gradient that is zero in exact
    arithmetic, as a conv bias before a norm, is judged against the others' scale)."""
    scale = max(float(b.abs().max()) if b.numel() else 0.0, floor)
    return float((a - b).abs().max()) / scale if b.numel() else 0.0


@contextmanager
def _recording(model: nn.Module, grid, gathered: bool):
    """Record (name, type, output) of every module call, in call order; split outputs are
    gathered whole to the spatial root (collective, the same order on every rank)."""
    calls = []

    def hook(module, args, out):
        t = out[0] if isinstance(out, (tuple, list)) and out else out
        if not isinstance(t, torch.Tensor):
            return
        if gathered and isinstance(t, SplitTensor):
            whole = gather(local(t).detach(), grid) if t._hp.standard else None
        else:
            whole = unwrap(t).detach().clone()  # a later in-place op must not change it
        calls.append((names.get(id(module), "?"), type(module).__name__, whole))

    names = {id(m): n or "<model>" for n, m in model.named_modules()}
    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters hold no memory (meta tensors; buffers are copied): the
    first-step check needs the plain model's code, not its weights, which it loads from the spatial
    model it checks (:func:`materialize`). Keeping a real copy until the first forward would hold a
    second full-size dense head on every rank through the start-up. ``model`` is not modified; tied
    parameters stay tied in the copy."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    return copy.deepcopy(model, memo)


def materialize(model: nn.Module, state: dict) -> nn.Module:
    """Give a :func:`skeleton`'s parameters memory on the device of ``state`` and load
    ``state`` into it (strict); returns ``model``."""
    device = next((v.device for v in state.values() if isinstance(v, torch.Tensor)), None)
    made: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty_like(p, device=device),
                                               p.requires_grad)
                mod._parameters[name] = made[id(p)]
    model.load_state_dict(state)
    return model



def first_step_check(spatial_model: nn.Module, plain: nn.Module, args: tuple, ctx,
                     spatialize: Callable[..., nn.Module]) -> None:
    """Run the check (module docstring) for the first call's positional ``args``; ``plain``
    is the plain model's :func:`skeleton`; ``spatialize`` makes the fresh spatial copy it
    compares (passed in by the spatializer, the module that defines it)."""
    grid = ctx.grid
    xs = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 5]
    if len(xs) != 1 or len(args) != 1:
        return  # one volume argument: the common case; others are not probed
    x = unwrap(xs[0])
    nbytes = x[:1].numel() * x.element_size() * grid.spatial_size
    if nbytes > PROBE_LIMIT_BYTES:
        if grid.rank == 0:
            warnings.warn(f"spatialize check skipped: the probe sample ({nbytes / 2**20:.0f} MiB)"
                          f" is larger than {PROBE_LIMIT_BYTES >> 20} MiB, too large to run "
                          "whole on one rank", stacklevel=2)
        return
    piece = x[:1].detach()   # the probe's backward must not reach the caller's input
    whole = gather(piece, grid)  # the whole first sample, on the spatial root
    state = spatial_model.state_dict()   # collective once a split head is cut (split_head)
    rng = torch.get_rng_state()   # the training run draws what it would have without the check
    try:
        bad = _verdict(plain, state, piece, whole, grid, spatialize, x.dtype)
        # float32's rounding, which a batch norm over many voxels amplifies in the first
        # layers' gradients (UNet3D at 64³ on 8 ranks: 1e-3), is not an escape; an escape is
        # wrong in any precision: a float32 mismatch is decided again in float64
        weights = sum(v.numel() * v.element_size() for v in state.values()
                      if isinstance(v, torch.Tensor))
        if bad and x.dtype == torch.float32 and weights <= FLOAT64_LIMIT_BYTES:
            bad = _verdict(plain, state, piece, whole, grid, spatialize, torch.float64)
    finally:
        torch.set_rng_state(rng)
    if bad:
        raise LayerError(f"spatialize check: {bad}; the spatial run would be wrong there "
                         "(an op that escaped the dispatch?): fix that module or spatialize "
                         "with check=False to train anyway")


def _verdict(plain, state, piece, whole, grid, spatialize, dtype) -> str | None:
    """The check in ``dtype`` (collective): the first difference, the same on every rank, or
    None (also when the plain model cannot run the probe: a warning says so)."""
    root = grid.spatial_comm.Get_rank() == 0
    rng = torch.get_rng_state()
    w, ref_calls, ref_grads = _reference(plain, state, whole, dtype) if root else \
        (None, [], {})
    w = grid.spatial_comm.bcast(w, root=0)
    # both runs draw the same random numbers (a VAE's torch.randn_like on a replicated
    # latent: MONAI's VarAutoEncoder differed by 0.59 at its decoder and was refused)
    torch.set_rng_state(rng)
    if isinstance(w, str):
        if grid.rank == 0:
            warnings.warn(f"spatialize check skipped: the plain model failed on the probe "
                          f"sample ({w})", stacklevel=3)
        return None
    # a fresh spatialization (the live model carries hooks of its gradient sync), with the
    # weights it trains from; batch-norm statistics of the probe alone, as the plain model
    sp = materialize(spatialize(plain, grid), state).to(dtype)
    sp._hpcpar_split.dropout = False  # type: ignore[union-attr]  # set by spatialize
    with _recording(sp, grid, True) as calls, _NoDropout():
        out = sp(piece.to(dtype))
    weight = split_like(w[local_slices(w.shape, grid)], out) if isinstance(out, SplitTensor) \
        else w
    # an output that is not the plain model's shape (a local piece posing as replicated) has
    # no gradient to compare: every rank must agree before the backward's collectives
    shaped = grid.spatial_comm.allreduce(int(tuple(weight.shape) == tuple(out.shape)))
    grads = {}
    if shaped == grid.spatial_size:
        (out * weight).sum().backward()
        for n, p in sp.named_parameters():
            gr = p.grad if p.grad is not None else torch.zeros_like(p)
            cut = column_split(p)
            if cut is not None:
                grads[n] = cut.gather(gr)
                continue
            grads[n] = gr if getattr(p, "hpcpar_reduce", None) == "data" else allreduce_(
                gr.clone(), grid.spatial_comm)
    verdict = _compare(ref_calls, calls, ref_grads if grads else {}, grads) if root else None
    return next((v for v in grid.comm.allgather(verdict) if v), None)


def _reference(plain, state, whole, dtype) -> tuple:
    """The plain model on the whole probe in ``dtype``, on the spatial root: ``(output
    weights, module outputs, parameter gradients)``; the weights are the one-line reason
    instead when the plain model cannot run it."""
    try:
        ref = materialize(copy.deepcopy(plain), state).to(dtype)  # the weights it trains from
        with _recording(ref, None, False) as calls, _NoDropout():
            out = ref(whole.to(dtype))
        g = torch.Generator().manual_seed(1234)
        w = torch.randn(out.shape, generator=g, dtype=out.dtype)
        (out * w).sum().backward()
        return w, calls, {n: p.grad for n, p in ref.named_parameters()}
    except Exception as exc:  # noqa: BLE001 (the plain model cannot run the probe)
        return f"{type(exc).__name__}: {exc}".splitlines()[0], [], {}


def _compare(ref_calls, calls, ref_grads, grads) -> str | None:
    # an output is judged against the scale of the activations before it too: one that is
    # zero in exact arithmetic (a mean over a batch-normed volume, on a one-sample probe)
    # holds only their rounding, which differs with any summation order
    seen = 0.0
    for (name, kind, want), (_, _, got) in zip(ref_calls, calls):
        if got is None or want is None:
            continue
        if got.shape != want.shape:
            return (f"module '{name}' ({kind}) gives shape {tuple(got.shape)} where the plain "
                    f"model gives {tuple(want.shape)} on the first forward")
        if want.numel() and want.is_floating_point():
            seen = max(seen, float(want.abs().max()))
        err = _rel(got, want, max(1e-12, 1e-3 * seen))
        if err > _tol(want.dtype):
            return (f"module '{name}' ({kind}) differs from the plain model on the first "
                    f"forward (relative error {err:.2g})")
    scales = [float(g.abs().max()) for g in ref_grads.values() if g is not None and g.numel()]
    floor = 1e-3 * max(scales, default=0.0)
    for name, want in ref_grads.items():
        if want is None or name not in grads:
            continue
        err = _rel(grads[name], want, floor)
        if err > _tol(want.dtype):
            return (f"the gradient of '{name}' differs from the plain model's on the first "
                    f"step (relative error {err:.2g})")
    return None
