"""Whether a model written in plain torch is exact under ``spatialize``: one model of the zoo's form
(``tests/support/zoo.py`` in the checkout) run on a grid against one process. Shared by
tests/nn/test_model_zoo.py and benchmarks/third_party_models.py (other people's networks)."""

from __future__ import annotations

import copy

import torch
from torch.overrides import TorchFunctionMode

from hpcpar.errors import LayerError
from hpcpar.nn import local, spatialize, split_like
from hpcpar.nn.optable import rule_for
from hpcpar.nn.spatial_ops import noise
from hpcpar.nn.split import is_split
from hpcpar.nn.split_head import column_split
from hpcpar.parallel.comm import allreduce_

from .oracles import batch_slice, one_rank_grid, randn, spatial_slices

__all__ = ["check_model", "RTOL"]

RTOL = 1e-9


def _close(got, want, what, floor=1e-3):
    scale = max(float(want.abs().max()) if want.numel() else 0.0, floor)
    err = float((got - want).abs().max()) if got.numel() else 0.0
    assert err <= RTOL * scale, f"{what}: max |diff| {err:.3e} (scale {scale:.3e})"


class _VolumeNoise(TorchFunctionMode):
    """Notes a random draw shaped like a volume in the plain model, where hpcpar draws its
    own split-independent numbers (:mod:`hpcpar.nn.noise`) instead of torch's."""

    seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 5 \
                and rule_for(func) is noise:
            self.seen = True
        return func(*args, **(kwargs or {}))


def _target(out, kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "like":
        return torch.randn(out.shape, generator=g, dtype=out.dtype)
    if kind == "binary":
        return (torch.rand(out.shape, generator=g) < 0.5).to(out.dtype)
    shape = (out.shape[0], *out.shape[2:])
    return torch.randint(0, out.shape[1], shape, generator=g)


def _piece(t, grid, split):
    """The rank's share of a whole tensor: its samples, and its voxels where ``split``."""
    t = t[batch_slice(t.shape[0], grid)]
    if not split:
        return t
    spatial = t.shape[-3:]
    return t[(slice(None),) * (t.dim() - 3) + spatial_slices(spatial, grid)[2:]]


def _refused(name: str, exc: LayerError) -> tuple[str, str]:
    msg = str(exc)
    assert "\n" not in msg, f"{name}: refusal not one line: {msg!r}"
    assert ".py:" in msg or msg.startswith(("spatialize check:", "spatialize: parameter '")), \
        f"{name}: refusal names no source line (nor a module or parameter): {msg!r}"
    return "refused", msg


def _zero_dropout(model: torch.nn.Module) -> bool:
    """Sets every dropout module's ``p`` to 0; whether the model has any with ``p`` > 0."""
    real = False
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            real = real or m.p > 0
            m.p = 0.0
    return real


def check_model(grid, entry, name: str, seed: int = 0, fuse: int = 1,
                masks: bool = False) -> tuple[str, str]:
    """Spatialize one model of the zoo's form and compare it with one process on the same global
    batch (float64: output, loss value, every parameter gradient after hpcpar.DDP, and every buffer
    after the step: BN's running statistics); ``("exact", line)`` or ``("refused", its line)``.

    ``entry`` is as in the zoo's ``ZOO``; ``seed`` seeds weights, input and target; ``fuse`` goes to
    ``spatialize(..., fuse_halos=)`` (the line then counts the fused runs' exchanges). A silently
    wrong value, or a refusal that is not one line naming the source line, fails an assertion.
    Dropout compares with plain torch at ``p = 0``; ``masks=True`` keeps ``p`` and compares with
    hpcpar's own one-rank run, whose masks do not depend on the split (torch's cannot be reproduced
    on pieces); so is volume noise (``randn_like`` of a split tensor), always."""
    import hpcpar  # deferred: hpcpar.DDP, the user's entry point, as the user calls it

    factory, c, size, loss_fn, kind, _ = entry
    torch.manual_seed(seed)
    pristine = factory(c=c).double()
    dropout = masks and _zero_dropout(copy.deepcopy(pristine))
    if not masks:
        _zero_dropout(pristine)
    plain = copy.deepcopy(pristine)
    x = randn((2 * grid.data, c, *size), seed + 1, torch.float64)
    torch.manual_seed(99)
    noise = _VolumeNoise()
    if not dropout:
        with noise:
            ref_out = plain(x)
    if dropout or noise.seen:
        # reference: the same hpcpar model on one rank (split-independent masks and noise)
        plain = spatialize(copy.deepcopy(pristine), one_rank_grid())
        torch.manual_seed(99)
        try:
            ref_out = plain(x)
        except LayerError as exc:   # refused on one rank: refused on every grid
            return _refused(name, exc)
    target = _target(ref_out, kind, seed + 2)
    ref_loss = loss_fn(ref_out, target)
    ref_loss.backward()
    ref_out = local(ref_out).detach()
    model = None
    try:
        model = hpcpar.DDP(spatialize(pristine, grid, bn_include_data=True, check=True,
                                      fuse_halos=fuse), grid)
        xl = _piece(x, grid, True).clone()
        torch.manual_seed(99)
        out = model(xl)
        # this rank's piece of the target, as a data loader gives it, marked split
        loss = loss_fn(out, split_like(_piece(target, grid, is_split(out)), out))
        loss.backward()
    except LayerError as exc:   # raised alike on every rank: the close below meets
        if model is not None:
            model.close()
        return _refused(name, exc)
    model.close()   # its shared windows now, not at exit; the gradients stay
    what = f"{name} on {grid.spec()}"
    split = is_split(out)
    _close(local(out).detach(), _piece(ref_out, grid, split), f"{what}: output")
    value = allreduce_(loss.detach().reshape(1).clone(), grid.data_comm) / grid.data
    _close(value, ref_loss.detach().reshape(1), f"{what}: loss")
    ref_params = dict(plain.named_parameters())
    # a gradient that is zero in exact arithmetic (a norm's bias before another norm) holds
    # rounding only: it is judged against the largest gradient's scale (as spatialize's check)
    floor = max([1e-3] + [1e-3 * float(p.grad.abs().max()) for p in plain.parameters()
                          if p.grad is not None and p.grad.numel()])
    for pname, p in model.module.named_parameters():
        want = ref_params[pname].grad
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        cut = column_split(p)   # a split head's weight: this rank's columns
        got = cut.gather(got) if cut is not None else got
        _close(got, want if want is not None else torch.zeros_like(p), f"{what}: grad {pname}",
               floor)
    ref_buffers = dict(plain.named_buffers())
    for bname, b in model.module.named_buffers():
        _close(b.to(torch.float64), ref_buffers[bname].to(torch.float64), f"{what}: buffer {bname}")
    return "exact", f"{model.module._hpcpar_split.fuse_counts[0]} fused" if fuse > 1 else ""

