"""Halo exchange of spatially partitioned (N, C, D, H, W) tensors, with its exact adjoint.

A rank holds the sub-volume the partition rule gives it on each of the grid's x, y, z axes
(tensor dims 2, 3, 4). A stencil layer (conv, pool, upsample) needs, per axis, the global
input range its owned outputs read: :class:`hpcpar.parallel.partition.AxisHalo`. The exchange builds
one buffer per call holding, per axis::

    [pad_lo][ghosts from lo][owned items the layer or a neighbour needs][ghosts from hi][pad_hi]

The axes are swept in order x, y, z; the message of axis ``a`` spans the full buffer on the
axes before ``a`` (so it carries their ghosts: edges and corners arrive with 2 messages per
axis) and the owned items on the axes after it. Global-boundary padding is written locally.
The backward pass is the adjoint: in reverse axis order each ghost's gradient goes back to
its owner, which ADDS it into the cells it sent; padding gradients are dropped.

Two entry points share this machinery:

* :func:`halo_exchange` (autograd ``HaloExchange``): returns the extended tensor; composable.
* :func:`halo_stencil` (autograd ``HaloStencil``): exchange fused with a local op (conv,
  pool). It saves only the input and the received ghost faces for backward, not the extended
  copy, and rebuilds the extended tensor in backward: activation memory stays ~1x. An
  opt-in reuse pool (``halo_buffers.POOL``) trades memory for fewer page faults.

The parts live in their own modules, each imported from there: the plans
(:mod:`.halo_plan`: ``HaloPlan`` knows, for this rank, what to send and receive on each axis;
every rank derives every rank's needs, so size checks fail identically everywhere, no hangs),
the buffers and their pool (:mod:`.halo_buffers`) and the exchange without autograd
(:mod:`.halo_swap`). This module is the autograd face.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hpcpar.parallel.halo_buffers import POOL, input_layout, memory_format, new_buffer
from hpcpar.parallel.halo_plan import HaloPlan
from hpcpar.parallel.halo_swap import exchange_adjoint, exchange_forward, rebuild
from hpcpar.parallel.partition import AxisHalo

if TYPE_CHECKING:
    from hpcpar.parallel.grid import ProcessGrid

__all__ = ["halo_exchange", "HaloExchange", "HaloStencil", "StencilOp", "halo_stencil",
           "autocast_cast"]


class HaloExchange(torch.autograd.Function):
    """x -> x extended by ghosts and padding; backward = exact adjoint."""

    @staticmethod
    def forward(ctx, x, plan: HaloPlan, pad_value):
        buf, _ = exchange_forward(x, plan, pad_value)
        ctx.plan = plan
        ctx.shape = x.shape
        return buf[plan.result_region()] if plan.trims else buf

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        gbuf = torch.zeros(plan.buffer_shape(grad.shape[:2]), dtype=grad.dtype,
                           device=grad.device) if plan.trims else grad.clone(
            memory_format=torch.contiguous_format)
        if plan.trims:
            gbuf[plan.result_region()] = grad
        like = grad.new_empty(ctx.shape) if not plan.covers_owned else None
        return exchange_adjoint(gbuf, plan, like), None, None


def halo_exchange(x: torch.Tensor, grid: ProcessGrid,
                  halos: HaloPlan | Sequence[AxisHalo], pad_value: float = 0.0) -> torch.Tensor:
    """``x``, this rank's ``(N, C, D, H, W)`` piece, extended by the halo widths on every side
    (trimmed where a halo is negative) over ``grid.spatial_comm``; backward is the adjoint.

    ``halos``: this rank's three ``AxisHalo`` (x, y, z), e.g. from ``partition.conv_axis_halo``
    (then one small allgather over the spatial group tells each rank what its neighbours
    need), or a ready ``HaloPlan`` (no collective). ``pad_value`` fills outside the global
    volume (0 for conv and average pooling, ``-inf`` for max pooling). LayerError on every
    rank when a rank holds fewer items than a neighbour's halo needs.
    """
    plan = halos if isinstance(halos, HaloPlan) else HaloPlan.gather(grid, halos)
    return HaloExchange.apply(x, plan, pad_value)


class StencilOp:
    """A local op applied to the halo-extended tensor by :func:`halo_stencil`.

    ``forward(ext, *params) -> out`` (a new tensor, never a view of ``ext``: the halo buffer
    is reused). ``backward(holder, grad_out, params, needs) -> (grad_ext,
    *param_grads)``; the default recomputes ``forward`` under autograd (fine for pools; convs
    override it with the direct convolution backward).
    ``holder`` is a one-item list holding the rebuilt extended tensor: ``holder.pop()`` it
    and drop it as early as possible (a conv frees it before its input gradient, so the
    backward peak holds one volume fewer).
    """

    #: True for ops that autocast runs in lower precision (convolutions): halo_stencil then
    #: casts the input and parameters itself and runs the fused op with autocast off, so that
    #: forward and backward see the same dtypes.
    autocast = False

    #: False for an op whose backward reads only what :meth:`forward_saving` keeps and the
    #: extended tensor's shape (max pooling keeps its argmax indices, as torch does): the
    #: fused path then keeps neither the input nor the ghost faces and rebuilds no buffer,
    #: so its backward holds one volume (the gradient), as torch's does.
    needs_input = True

    def forward_saving(self, ext, *params):
        """``(out, tensors backward needs)``; called instead of ``forward`` when
        ``needs_input`` is False."""
        raise NotImplementedError

    def backward_saved(self, grad_ext, grad_out, saved, params, needs):
        """Write the gradient of the extended tensor into ``grad_ext`` (uninitialised, its
        shape and layout; None when not needed) from ``forward_saving``'s tensors; return the
        parameters' gradients. Writing in place keeps it one buffer, as torch's kernel."""
        raise NotImplementedError

    def layout(self, ext_shape, dtype, device):
        """Memory order of the spatial dims of the extended buffer (a permutation of
        (0, 1, 2)) when the op runs faster on it, else None (contiguous). Not asked for a
        channels-last input: its buffer stays channels-last."""
        return None

    def forward(self, ext, *params):
        raise NotImplementedError

    def backward(self, holder, grad_out, params, needs):
        ext = holder.pop()  # the only reference: freed when this frame drops it
        with torch.enable_grad():
            ext = ext.detach().requires_grad_(needs[0])
            ps = [p.detach().requires_grad_(n) if p is not None else None
                  for p, n in zip(params, needs[1:])]
            out = self.forward(ext, *ps)
            wrt = [t for t, n in zip([ext, *ps], needs) if n and t is not None]
            if out.grad_fn is None:   # this rank holds none of the output (a pool's window
                # as large as the volume): its values reach the owner's output through the
                # halo, whose adjoint brings their gradient back; nothing flows from here
                grads = iter([torch.zeros_like(t) for t in wrt])
            else:
                grads = iter(torch.autograd.grad(out, wrt, grad_out)) if wrt else iter(())
        return tuple(next(grads) if n and t is not None else None
                     for t, n in zip([ext, *ps], needs))


def _local_only(plan: HaloPlan, x: torch.Tensor, perm) -> bool:
    """True when the extended tensor would equal ``x``: no ghost, padding, trim or message on
    any axis (a 1x1x1 convolution; a 2x2x2 pooling of even pieces; anything on one rank that
    pads nothing) and ``x`` already in the buffer's memory layout."""
    return not isinstance(perm, tuple) and \
        x.is_contiguous(memory_format=memory_format(perm)) and \
        all(ax.hull == (0, ax.length) and ax.result == (0, ax.length) and
            not (ax.pad_lo or ax.pad_hi or ax.send_lo or ax.send_hi) for ax in plan.axes)


def _plain(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached, as a plain tensor (a saved split tensor is not dispatched again)."""
    with torch._C.DisableTorchFunction():
        return x.detach()


class HaloStencil(torch.autograd.Function):
    """Halo exchange fused with a local op; saves the input and ghost faces, not the extended
    copy (rebuilt in backward without messages), or only what the op keeps where its backward
    needs no input values (``StencilOp.needs_input``)."""

    @staticmethod
    def forward(ctx, x, plan: HaloPlan, pad_value, op: StencilOp, *params):
        perm = input_layout(x) or op.layout(plan.result_shape(x.shape[:2]), x.dtype, x.device)
        ctx.local = _local_only(plan, x, perm)
        if ctx.local:  # the extended tensor is x itself: no copy, none rebuilt in backward
            plan.check_input(x)
            buf, received = _plain(x), None
        else:
            buf, received = exchange_forward(x, plan, pad_value, POOL, perm)
        ext = buf[plan.result_region()] if plan.trims else buf
        with torch.no_grad():
            if op.needs_input:
                out, kept = op.forward(ext, *params), (x,)
            else:
                (out, kept), received = op.forward_saving(ext, *params), None
        del ext
        if not ctx.local:
            POOL.give(buf, perm)
        ctx.plan, ctx.pad_value, ctx.op, ctx.received = plan, pad_value, op, received
        ctx.perm, ctx.x_shape, ctx.n_kept = perm, x.shape, len(kept)
        # the gradient in the output's layout: the buffer's, unless torch's kernel chose
        # another (a 1x1x1 conv of a channels-last input gives a contiguous output; making
        # its gradient channels-last would be one more copy than torch makes)
        fmt = memory_format(perm)
        ctx.grad_format = fmt if out.is_contiguous(memory_format=fmt) else \
            torch.contiguous_format
        ctx.save_for_backward(*kept, *params)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors  # read once: a checkpointed segment unpacks only once
        kept, params = saved[:ctx.n_kept], saved[ctx.n_kept:]
        plan = ctx.plan
        needs = (ctx.needs_input_grad[0], *ctx.needs_input_grad[4:])
        grad_out = grad_out.contiguous(memory_format=ctx.grad_format)
        if ctx.op.needs_input:
            # the rebuilt buffer is taken from the pool and NOT given back: the op frees it
            # as soon as it can, so the backward peak does not hold it next to grad_ext
            buf = _plain(kept[0]) if ctx.local else \
                rebuild(kept[0], plan, ctx.received, ctx.pad_value, POOL, ctx.perm)
            ctx.received = None
            shape = buf.shape
            holder = [buf[plan.result_region()] if plan.trims else buf]
            del buf
            grads = ctx.op.backward(holder, grad_out, params, needs)
            gbuf = None
        else:  # the op writes grad_ext straight into the buffer-shaped gradient
            gbuf = None
            if needs[0]:
                gbuf = new_buffer(plan.buffer_shape(ctx.x_shape[:2]), grad_out.dtype,
                                  grad_out.device, ctx.perm)
                if plan.trims:
                    gbuf.zero_()
            grads = (None, *ctx.op.backward_saved(
                gbuf[plan.result_region()] if gbuf is not None and plan.trims else gbuf,
                grad_out, kept, params, needs))
        gx = None
        if ctx.needs_input_grad[0]:
            if gbuf is None:
                gext = grads[0]
                if plan.trims:
                    gbuf = torch.empty(shape, dtype=gext.dtype, device=gext.device,
                                       memory_format=memory_format(ctx.perm)).zero_()
                    gbuf[plan.result_region()] = gext
                else:
                    gbuf = gext
            like = grad_out.new_empty(ctx.x_shape) if not plan.covers_owned else None
            gx = exchange_adjoint(gbuf, plan, like, ctx.perm)
        return (gx, None, None, None, *grads[1:])


def halo_stencil(x: torch.Tensor, plan: HaloPlan, op: StencilOp, *params: torch.Tensor | None,
                 pad_value: float = 0.0) -> torch.Tensor:
    """A halo exchange fused with a local op: ``op.forward(halo_exchange(x), *params)``, the
    op's output on this rank's owned outputs; gradients flow to ``params`` (weight, bias).

    Keeps only the input and the received ghost faces for backward (the extended tensor is
    rebuilt there without messages), so it costs about 1x activation memory. What the
    spatial layers use.
    """
    dev = x.device.type
    if op.autocast and torch.is_autocast_enabled(dev):
        # The casts are differentiable, so parameter gradients come back in their own dtype.
        x, cast = autocast_cast(x), [p if p is None else autocast_cast(p) for p in params]
        with torch.autocast(dev, enabled=False):
            return HaloStencil.apply(x, plan, pad_value, op, *cast)
    return HaloStencil.apply(x, plan, pad_value, op, *params)


def autocast_cast(t: torch.Tensor) -> torch.Tensor:
    """``t`` as torch's autocast casts an operand of a lower-precision op (conv, linear): a
    floating tensor to the autocast dtype of its device, except float64, which autocast
    leaves alone (a float64 model under an fp16 autocast, as the first-step check's float64
    rerun, stays float64 as in plain torch). Anything else, and outside autocast: as it is."""
    if not t.is_floating_point() or t.dtype == torch.float64 or \
            not torch.is_autocast_enabled(t.device.type):
        return t
    return t.to(torch.get_autocast_dtype(t.device.type))
