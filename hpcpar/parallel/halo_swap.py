"""The halo exchange itself, without autograd: pack the faces a neighbour needs, swap them
axis by axis (x, y, z; each message spans the ghosts of the axes before it, so edges and
corners arrive with two messages per axis), unpack into the extended buffer, write the global
boundary padding; and its exact adjoint (ghost gradients sent back and added by their owner).
"""

from __future__ import annotations

import time

import torch

from hpcpar.parallel import replay
from hpcpar.parallel.counters import COUNTERS, profiled
from hpcpar.parallel.halo_buffers import BufferPool, new_buffer, new_message
from hpcpar.parallel.halo_plan import HaloPlan

__all__ = ["exchange_forward", "rebuild", "exchange_adjoint"]

_TAG_FWD = 0x4A10
_TAG_BWD = 0x4A20


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The dense memory of a message as a contiguous tensor, for MPI."""
    return t if t.is_contiguous() else t.permute(0, 2, 3, 4, 1)


def _pack(plan: HaloPlan, key, view: torch.Tensor, layout) -> torch.Tensor:
    """Pack ``view`` into the plan's reused message buffer ``key``."""
    from hpcpar.kernels.halo_pack import pack  # deferred: loads numpy

    return pack(view, plan.message(key, view.shape, view, layout))


def _unpack(view: torch.Tensor, buf: torch.Tensor, add: bool = False) -> None:
    from hpcpar.kernels.halo_pack import unpack  # deferred: loads numpy

    unpack(view, buf, add)


def _swap(plan: HaloPlan, a: int, sends, recvs, tag: int) -> int:
    """Post the receives and sends of axis ``a`` and wait for them; returns the bytes sent.

    ``sends[side]``: the message for neighbour ``side`` (0 lo, 1 hi) or None; ``recvs[side]``:
    the message to receive from it or None (messages are dense: see :func:`_wire`).
    """
    from hpcpar.parallel.transport import exchange  # deferred: loads numpy

    ax = plan.axes[a]
    nbr = (ax.lo, ax.hi)
    # the neighbour sent what we receive from its opposite side
    posted_recvs = [(_wire(recvs[s]), nbr[s], tag + 2 * a + (1 - s)) for s in (0, 1)
                    if recvs[s] is not None]
    posted_sends = [(_wire(sends[s]), nbr[s], tag + 2 * a + s) for s in (0, 1)
                    if sends[s] is not None]
    assert all(peer is not None for _, peer, _ in posted_recvs + posted_sends)  # neighbours only
    nbytes = sum(t.numel() * t.element_size() for t, _, _ in posted_sends)
    handles = exchange(plan.grid.spatial_comm, posted_recvs, posted_sends)
    t0 = time.perf_counter()
    for h in handles:
        h.wait()
    COUNTERS.t_halo_wait += time.perf_counter() - t0
    return nbytes


def _fill_start(x: torch.Tensor, plan: HaloPlan, pad_value, pool: BufferPool | None = None,
                perm=None) -> torch.Tensor:
    """Get a buffer, copy the owned items it holds, write global-boundary padding."""
    shape = plan.buffer_shape(x.shape[:2])
    buf = pool.take(shape, x.dtype, x.device, perm) if pool is not None else \
        new_buffer(shape, x.dtype, x.device, perm)
    buf[plan.owned_region()].copy_(x[plan.owned_local_region()])
    for sl in plan.pad_regions:
        buf[sl].fill_(pad_value)
    return buf


@profiled("hpcpar.halo_exchange")
def exchange_forward(x: torch.Tensor, plan: HaloPlan, pad_value: float = 0.0,
                     pool: BufferPool | None = None,
                     perm: tuple[int, int, int] | str | None = None) -> tuple[torch.Tensor, list]:
    """Build the halo-extended buffer for ``x``, swapping faces with the neighbouring ranks.

    Collective with the neighbours along each split axis. The received faces are kept so the
    backward pass can :func:`rebuild` the buffer without messages: returns the buffer and,
    per axis, a ``(low, high)`` pair of faces (None where nothing was received).

    ``pad_value`` fills where the buffer lies outside the global volume; ``pool``: take the
    buffer from it (give it back when done), else allocate; ``perm`` as in ``new_buffer``.
    LayerError when ``x`` does not have the local shape the plan was made for.
    """
    t0 = time.perf_counter()
    plan.check_input(x)
    x = x.detach()
    buf = _fill_start(x, plan, pad_value, pool, perm)
    sent = [0]

    def swap() -> list:
        received: list[tuple[torch.Tensor | None, ...]] = []
        for a, ax in enumerate(plan.axes):
            if ax.lo is None and ax.hi is None:
                received.append((None, None))
                continue
            sends = [_pack(plan, ("fwd", a, s), buf[plan.region(a, ax.sent(s))], perm)
                     if (ax.send_lo, ax.send_hi)[s] else None for s in (0, 1)]
            # fresh: kept for the backward rebuild (unlike the reused send buffers)
            recvs = [new_message(buf[plan.region(a, ax.ghost(s))].shape, buf, perm)
                     if (ax.recv_lo, ax.recv_hi)[s] else None for s in (0, 1)]
            sent[0] += _swap(plan, a, sends, recvs, _TAG_FWD)
            for side, msg in enumerate(recvs):
                if msg is not None:
                    _unpack(buf[plan.region(a, ax.ghost(side))], msg)
            received.append(tuple(recvs))
        return received

    # a recomputed (checkpointed) segment gets the faces this exchange received then
    received = replay.received(("halo exchange", tuple(x.shape), plan.buffer_shape(x.shape[:2])),
                               swap, restore=lambda faces: _unpack_all(buf, plan, faces))
    COUNTERS.t_halo += time.perf_counter() - t0
    COUNTERS.bytes_halo += sent[0]
    return buf, received


def _unpack_all(buf: torch.Tensor, plan: HaloPlan, received: list) -> list:
    """Write the received faces into their ghost regions of ``buf``; returns them."""
    for a, faces in enumerate(received):
        for side, face in enumerate(faces):
            if face is not None:
                _unpack(buf[plan.region(a, plan.axes[a].ghost(side))], face)
    return received


def rebuild(x: torch.Tensor, plan: HaloPlan, received: list, pad_value: float = 0.0,
            pool: BufferPool | None = None,
            perm: tuple[int, int, int] | str | None = None) -> torch.Tensor:
    """Rebuild the forward halo buffer from ``x`` and the faces received then, with no messages.

    Lets the backward pass recompute the buffer instead of keeping it alive; the arguments
    are those of the forward pass.
    """
    t0 = time.perf_counter()
    with torch._C.DisableTorchFunction():   # a saved tensor subclass: its plain data, no dispatch
        x = x.detach()
    buf = _fill_start(x, plan, pad_value, pool, perm)
    _unpack_all(buf, plan, received)
    COUNTERS.t_halo += time.perf_counter() - t0
    return buf


@profiled("hpcpar.halo_exchange.backward")
def exchange_adjoint(gbuf: torch.Tensor, plan: HaloPlan, like: torch.Tensor,
                     layout: str | None = None) -> torch.Tensor:
    """Apply the adjoint of :func:`exchange_forward`, turning a buffer gradient into the input's.

    Ghost gradients are sent back to their owners and added in. Collective with the
    neighbours along each split axis. ``gbuf`` is modified in place; ``like`` (the forward
    input) gives the gradient's shape, dtype and device; messages travel in ``layout``'s
    memory order.
    """
    t0 = time.perf_counter()
    nbytes = 0
    for a in reversed(range(3)):
        ax = plan.axes[a]
        if ax.lo is None and ax.hi is None:
            continue
        sends = [_pack(plan, ("bwd", a, s), gbuf[plan.region(a, ax.ghost(s))], layout)
                 if (ax.recv_lo, ax.recv_hi)[s] else None for s in (0, 1)]
        recvs = [plan.message(("bwd-recv", a, s), gbuf[plan.region(a, ax.sent(s))].shape, gbuf,
                              layout)
                 if (ax.send_lo, ax.send_hi)[s] else None for s in (0, 1)]
        nbytes += _swap(plan, a, sends, recvs, _TAG_BWD)
        for side, msg in enumerate(recvs):
            if msg is not None:
                _unpack(gbuf[plan.region(a, ax.sent(side))], msg, add=True)
    if plan.covers_owned:
        grad = gbuf[plan.owned_region()]
    else:
        grad = torch.zeros_like(like)
        grad[plan.owned_local_region()] = gbuf[plan.owned_region()]
    COUNTERS.t_halo += time.perf_counter() - t0
    COUNTERS.bytes_halo += nbytes
    return grad
