"""The fast path of SpatialConv3d: torch's own padded convolution of the local piece, plus thin
corrections where a neighbour's faces enter.

A "same" convolution (stride 1, dilation 1, kernel 2p+1, padding p) of the halo-extended
piece is linear in it, and the extended piece is the local piece zero-padded plus the ghost
faces: ``conv(x + ghosts) = conv_padded(x) + conv(ghosts)``. The second term is non-zero only
on the p output planes next to each face a neighbour sent, and reaches them only through the
p kernel taps that fall into the ghost region: a convolution of a slab of 2p - 1 planes. So
the piece is never copied into an extended buffer (neither in forward nor backward), torch
picks its fastest kernel for the padded convolution, and the faces travel while it runs
(posted first, waited for after it: halo exchange overlapped with the interior computation);
in backward the ghosts' gradients, computed first, travel back while the piece's own
backward runs.

Used when at most one axis is split (no edge or corner ghosts; other grids take the general
halo path) and every rank holds at least p planes (with nothing split it is torch's conv).
The decision depends only on the global shape, the batch, the grid and the layer, so every
rank of the spatial group takes the same path.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from hpcpar.parallel import replay
from hpcpar.parallel.counters import COUNTERS, profiled
from hpcpar.parallel.partition import conv_pads, split_sizes, torch_pad, xyz

from ._conv_route import prepadded_weight_grad, torch_picks_slow_conv

__all__ = ["BoundarySpec", "boundary_spec", "boundary_conv"]

_TAG_FWD = 0x4A30
_TAG_BWD = 0x4A40


class BoundarySpec:
    """What the fast path needs: the split axis, the pads, the neighbours (spatial ranks, None
    at the volume's edge), the communicator, and the layer's geometry on the thinnest piece
    (for torch's kernel choice)."""

    def __init__(self, axis: int, pads: tuple[int, int, int], lo, hi, comm, layer, thinnest):
        self.axis, self.pads, self.nbr, self.comm = axis, pads, (lo, hi), comm
        self.groups = layer.groups
        self.p = pads[axis]
        other = list(pads)
        other[axis] = 0
        self.slab_pads = tuple(other)  # the correction: valid along the axis, padded elsewhere
        self._geometry = (layer.in_channels, tuple(thinnest), layer.kernel_size, layer.stride,
                          layer.dilation)

    def fast(self, batch: int) -> bool:
        """False where torch would pick its slow CPU kernel for the thinnest piece at this
        batch (the same on every rank); the general path permutes the axes for that case."""
        channels, local, k, s, d = self._geometry
        return not torch_picks_slow_conv((batch, channels, *local), k, s, d, self.groups)

    def edge(self, t: torch.Tensor, side: int) -> tuple[slice, ...]:
        """Slices of the p planes of ``t`` at ``side`` (0 lo, 1 hi) along the axis: a face of
        a piece, the ghost part of a slab, or the kernel taps that reach into the ghosts."""
        n = t.shape[2 + self.axis]
        sl = [slice(None)] * 5
        sl[2 + self.axis] = slice(0, self.p) if side == 0 else slice(n - self.p, n)
        return tuple(sl)

    def slab(self, ghost: torch.Tensor, side: int) -> torch.Tensor:
        """The ghost faces with the p - 1 zero planes (the local piece's share of the window,
        zero in this term) on the side away from the ghosts."""
        if self.p == 1:
            return ghost
        pad = [0] * 6
        pad[2 * (2 - self.axis) + (1 if side == 0 else 0)] = self.p - 1
        return F.pad(ghost, pad)


def boundary_spec(layer, global_shape, grid) -> BoundarySpec | None:
    """The fast-path spec for ``layer`` (a SpatialConv3d) on ``global_shape``, or None when
    the general halo path must run. Global facts only: the same answer on every rank."""
    k = layer.kernel_size
    if any(v != 1 for v in (*layer.stride, *layer.dilation)):
        return None
    pads = [conv_pads(layer.padding, a, k[a]) for a in range(3)]
    if any((lo, hi) != ((kk - 1) // 2, (kk - 1) // 2) or kk % 2 == 0
           for (lo, hi), kk in zip(pads, k)):
        return None  # only "same" convolutions: kernel 2p + 1, padding p on both sides
    pad = xyz(lo for lo, _ in pads)
    dims = grid.spatial_shape
    split = [a for a in range(3) if dims[a] > 1]
    if len(split) > 1:
        return None
    a = split[0] if split else 0  # nothing split: torch's padded conv, no messages
    smallest = min(split_sizes(global_shape[a], dims[a]))
    if split and smallest < max(pad[a], 1):
        return None
    local = list(global_shape)
    local[a] = smallest
    from mpi4py import MPI

    lo, hi = grid.neighbors("xyz"[a])
    if not pad[a]:  # a 1x1 kernel along the split axis: no ghosts, nothing to exchange
        lo = hi = MPI.PROC_NULL
    return BoundarySpec(a, pad, None if lo == MPI.PROC_NULL else lo,
                        None if hi == MPI.PROC_NULL else hi, grid.spatial_comm, layer, local)


def _exchange(spec: BoundarySpec, sends, recvs, tag: int):
    """Post the receives and sends (messages are dense contiguous tensors); returns the
    handles and the bytes sent."""
    from hpcpar.parallel.comm import irecv, isend  # deferred: loads numpy

    handles, nbytes = [], 0
    for side in (0, 1):
        if recvs[side] is not None:  # the neighbour sent it from its opposite side
            handles.append(irecv(recvs[side], spec.nbr[side], spec.comm, tag + 1 - side))
    for side in (0, 1):
        if sends[side] is not None:
            handles.append(isend(sends[side], spec.nbr[side], spec.comm, tag + side))
            nbytes += sends[side].numel() * sends[side].element_size()
    return handles, nbytes


def _wait(handles) -> None:
    if not handles:  # no neighbour: nothing waited for, so no halo-wait time either
        return
    t0 = time.perf_counter()
    for h in handles:
        h.wait()
    COUNTERS.t_halo_wait += time.perf_counter() - t0


class BoundaryConv(torch.autograd.Function):
    """``conv_padded(x) + corrections(ghost faces)``; backward is the exact adjoint (the
    ghost faces' gradients go back to their owners)."""

    @staticmethod
    @profiled("hpcpar.halo_exchange")
    def forward(ctx, x, weight, bias, spec: BoundarySpec):
        t0 = time.perf_counter()
        x = x.detach()
        sig = ("boundary conv faces", tuple(x.shape), spec.axis)
        hit, recvs = replay.recorded(sig)  # a recomputed segment reuses the forward's faces
        handles, nbytes = [], 0
        if not hit:
            sends = [x[spec.edge(x, s)].contiguous() if spec.nbr[s] is not None else None
                     for s in (0, 1)]
            recvs = [None if send is None else torch.empty_like(send) for send in sends]
            handles, nbytes = _exchange(spec, sends, recvs, _TAG_FWD)
            replay.record(sig, recvs)
        COUNTERS.t_halo += time.perf_counter() - t0
        out = F.conv3d(x, weight, bias, 1, spec.pads, 1, spec.groups)  # faces in flight
        t0 = time.perf_counter()
        _wait(handles)
        COUNTERS.t_halo += time.perf_counter() - t0
        COUNTERS.bytes_halo += nbytes
        for s, recv in enumerate(recvs):
            if recv is not None:
                out[spec.edge(out, s)] += F.conv3d(spec.slab(recv, s),
                                                   weight[spec.edge(weight, s)], None, 1,
                                                   spec.slab_pads, 1, spec.groups)
        ctx.spec = spec
        ctx.save_for_backward(x, weight, *(r for r in recvs if r is not None))
        ctx.has = [r is not None for r in recvs]
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    @profiled("hpcpar.halo_exchange.backward")
    def backward(ctx, grad_out):
        spec = ctx.spec
        x, weight, *ghosts = ctx.saved_tensors
        ctx.spec = None
        recvs = [ghosts.pop(0) if has else None for has in ctx.has]
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias

        def grads(g, inp, w, pads, mask, bias_sizes=None):   # stride 1, dilation 1
            return torch.ops.aten.convolution_backward(
                g, inp, w, bias_sizes, [1, 1, 1], list(pads), [1, 1, 1], False, [0, 0, 0],
                spec.groups, mask)

        # the ghosts' terms first (thin slabs): their gradients travel to their owners while
        # the piece's own backward runs, as the faces did in forward
        back, g_taps = [None, None], [None, None]
        for s in (0, 1):
            if recvs[s] is None:
                continue
            g = grad_out[spec.edge(grad_out, s)].contiguous()
            g_slab, g_taps[s], _ = grads(g, spec.slab(recvs[s], s),
                                         weight[spec.edge(weight, s)].contiguous(),
                                         spec.slab_pads, [need_x, need_w, False])
            if need_x:
                back[s] = g_slab[spec.edge(g_slab, s)].contiguous()
        handles, nbytes, mine = [], 0, [None, None]
        if need_x:  # the ghosts' gradients go to their owners, who add them to their faces
            t0 = time.perf_counter()
            mine = [torch.empty_like(back[s]) if back[s] is not None else None for s in (0, 1)]
            handles, nbytes = _exchange(spec, back, mine, _TAG_BWD)
            COUNTERS.t_halo += time.perf_counter() - t0
        bias_sizes = [weight.shape[0]] if ctx.has_bias else None
        if need_w and prepadded_weight_grad(x, weight, spec.groups):
            gx = grads(grad_out, x, weight, spec.pads, [True, False, False])[0] \
                if need_x else None
            xp = F.pad(x, torch_pad([(p, p) for p in spec.pads]))
            _, gw, gb = grads(grad_out, xp, weight, (0, 0, 0), [False, True, need_b],
                              bias_sizes)
            del xp
        else:
            gx, gw, gb = grads(grad_out, x, weight, spec.pads, [need_x, need_w, need_b],
                               bias_sizes)
        for s in (0, 1):
            if need_w and g_taps[s] is not None:
                gw[spec.edge(weight, s)] += g_taps[s]
        if need_x:
            t0 = time.perf_counter()
            _wait(handles)
            for s in (0, 1):
                if mine[s] is not None:
                    gx[spec.edge(gx, s)] += mine[s]
            COUNTERS.t_halo += time.perf_counter() - t0
            COUNTERS.bytes_halo += nbytes
        return gx, gw, gb, None


def boundary_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  spec: BoundarySpec) -> torch.Tensor:
    """SpatialConv3d's forward on the fast path (see the module docstring)."""
    return BoundaryConv.apply(x, weight, bias, spec)
