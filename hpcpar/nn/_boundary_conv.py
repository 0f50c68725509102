"""The fast path of SpatialConv3d: torch's own padded convolution of the local piece, plus thin
corrections where the neighbours' ghosts enter.

A "same" convolution (stride 1, dilation 1, kernel 2p+1, padding p) of the halo-extended piece is
linear in it, and the extended piece is the local piece zero-padded plus the ghosts (faces, and with
several split axes edges and corners): ``conv(x + ghosts) = conv_padded(x) + conv(ghosts)``. The
second term is non-zero only on the p output planes next to each side a neighbour sent, and reaches
them only through the p kernel taps that fall into the ghost region. So the piece is never copied
into an extended buffer (neither in forward nor backward), torch picks its fastest kernel for the
padded convolution, and every ghost block travels while it runs: all of them, edges and corners
included, come straight from the rank that owns them (one message per neighbour, up to 26), posted
first and waited for after the interior's convolution. In backward the ghosts' gradients, computed
first, travel back to their owners while the piece's own backward runs.

The ghost shell is cut into disjoint **slabs**, one per split axis and side with a neighbour:
the slab beyond side ``s`` of split axis ``a`` holds the ghosts there, spanning the ghosts of
every *later* split axis too (edges, corners) but only the owned extent of the *earlier* ones
(whose slabs hold those edges). Its term is a convolution of 2p - 1 planes along ``a`` (the p
ghost planes and p - 1 zero planes, only the p taps that reach the ghosts), valid along the
later split axes (their ghosts are in the slab) and padded along the others; the terms add up
to ``conv(ghosts)`` exactly.

Used where every rank holds at least p planes on each split axis (a thinner piece needs ghosts
from beyond its neighbour: the general halo path); with nothing split it is torch's conv. The
decision depends only on the global shape, the batch, the grid and the layer, so every rank
of the spatial group takes the same path.
"""

from __future__ import annotations

import itertools
import time

import torch

from hpcpar.parallel import replay
from hpcpar.parallel.counters import COUNTERS, profiled
from hpcpar.parallel.partition import conv_pads, split_sizes, torch_pad, xyz

from ._conv_route import onednn, onednn_backward, prepadded_weight_grad, torch_picks_slow_conv

__all__ = ["BoundarySpec", "boundary_spec", "boundary_conv", "ENABLED"]

#: False sends every convolution through the general halo path (a switch for benchmarks that
#: time both paths in one run, and for tests of what the fast path would otherwise take).
ENABLED = True

# a message's tag is the base plus the code of the sender's offset to its receiver (< 27)
_TAG_FWD = 0x4A40
_TAG_BWD = 0x4A60

Offset = tuple[int, int, int]


def _code(o: Offset) -> int:
    return (o[0] + 1) + 3 * (o[1] + 1) + 9 * (o[2] + 1)


def _face(axis: int, side: int) -> Offset:
    """The offset of the neighbour beyond side ``side`` (0 lo, 1 hi) of ``axis``."""
    return xyz((1 if side else -1) if a == axis else 0 for a in range(3))


def _toward(n: int, p: int, o: int) -> slice:
    """Along an axis of extent ``n``: the ``p`` items toward offset ``o`` (-1 lo, +1 hi); 0: all."""
    return slice(None) if o == 0 else slice(0, p) if o < 0 else slice(n - p, n)


class Slab:
    """One term of the correction: the ghosts beyond side ``side`` (0 lo, 1 hi) of split axis
    ``axis``, with the edges and corners it spans (see the module docstring)."""

    def __init__(self, axis: int, side: int, spec: BoundarySpec):
        self.axis, self.side = axis, side
        self.offset = _face(axis, side)
        self.later = [b for b in spec.axes if b > axis]
        earlier = [b for b in spec.axes if b < axis]
        self.pads = xyz(0 if b == axis or b in self.later else spec.pads[b] for b in range(3))
        self.ghosts = [o for o in spec.nbrs if o[axis] == self.offset[axis]
                       and not any(o[b] for b in earlier)]

    def _extent(self, a: int, n: int, p: int) -> int:
        return 2 * p - 1 if a == self.axis else n + 2 * p if a in self.later else n

    def _place(self, a: int, n: int, p: int, o: int) -> slice:
        """Where ghost offset ``o``'s items lie along axis ``a`` of the slab."""
        if a == self.axis:
            return slice(0, p) if self.side == 0 else slice(p - 1, 2 * p - 1)
        if a in self.later:
            return slice(0, p) if o < 0 else slice(p, p + n) if o == 0 else slice(p + n, n + 2 * p)
        return slice(None)

    def regions(self, x: torch.Tensor, pads) -> dict[Offset, tuple[slice, ...]]:
        """Each ghost block's region in the slab of piece ``x``."""
        n = x.shape[2:]
        return {o: (slice(None), slice(None),
                    *(self._place(a, n[a], pads[a], o[a]) for a in range(3)))
                for o in self.ghosts}

    def build(self, x: torch.Tensor, pads, recvs: dict[Offset, torch.Tensor]) -> torch.Tensor:
        """The slab tensor: the received ghosts in place, zero elsewhere."""
        shape = (*x.shape[:2], *(self._extent(a, x.shape[2 + a], pads[a]) for a in range(3)))
        if len(self.ghosts) == 1 and recvs[self.ghosts[0]].shape == shape:
            return recvs[self.ghosts[0]]  # one face, p = 1, nothing split after it
        slab = x.new_zeros(shape)
        for o, region in self.regions(x, pads).items():
            slab[region] = recvs[o]
        return slab


class BoundarySpec:
    """What the fast path needs: the split axes with a halo, the pads, the neighbours (rank of
    ``spatial_comm`` per offset, only those that exist), the communicator, the slabs, and the
    layer's geometry on the thinnest piece (for torch's kernel choice)."""

    def __init__(self, axes: list[int], pads: tuple[int, int, int], nbrs: dict[Offset, int],
                 comm, layer, thinnest):
        self.axes, self.pads, self.nbrs, self.comm = axes, pads, nbrs, comm
        self.groups = layer.groups
        self.slabs = [Slab(a, s, self) for a in axes for s in (0, 1) if _face(a, s) in nbrs]
        self._geometry = (layer.in_channels, tuple(thinnest), layer.kernel_size, layer.stride,
                          layer.dilation)

    def fast(self, batch: int) -> bool:
        """False where torch would pick its slow CPU kernel for the thinnest piece at this
        batch (the same on every rank); the general path permutes the axes for that case."""
        channels, local, k, s, d = self._geometry
        return not torch_picks_slow_conv((batch, channels, *local), k, s, d, self.groups)

    def block(self, t: torch.Tensor, o: Offset) -> tuple[slice, ...]:
        """The block of ``t`` toward offset ``o``: ``p`` planes along each axis where ``o`` is
        not 0, all of them elsewhere. A piece's block for the neighbour at ``o``, the output
        planes a slab corrects, the kernel taps that reach into its ghosts."""
        return (slice(None), slice(None),
                *(_toward(t.shape[2 + a], self.pads[a], o[a]) for a in range(3)))


def boundary_spec(layer, global_shape, grid) -> BoundarySpec | None:
    """The fast-path spec for ``layer`` (a SpatialConv3d) on ``global_shape``, or None when
    the general halo path must run. Global facts only: the same answer on every rank."""
    k = layer.kernel_size
    if any(v != 1 for v in (*layer.stride, *layer.dilation)) or all(kk == 1 for kk in k):
        return None   # a 1x1x1 kernel has no halo: the general path's products (pointwise)
    pads = [conv_pads(layer.padding, a, k[a]) for a in range(3)]
    if any((lo, hi) != ((kk - 1) // 2, (kk - 1) // 2) or kk % 2 == 0
           for (lo, hi), kk in zip(pads, k)):
        return None  # only "same" convolutions: kernel 2p + 1, padding p on both sides
    pad = xyz(lo for lo, _ in pads)
    dims = grid.spatial_shape
    thinnest = xyz(min(split_sizes(global_shape[a], dims[a])) for a in range(3))
    if any(dims[a] > 1 and thinnest[a] < max(pad[a], 1) for a in range(3)):
        return None  # a piece thinner than the halo: its ghosts come from further away
    from mpi4py import MPI

    axes = [a for a in range(3) if dims[a] > 1 and pad[a]]
    steps = [(-1, 0, 1) if a in axes else (0,) for a in range(3)]
    nbrs = {o: grid.spatial_neighbor(o) for o in map(xyz, itertools.product(*steps)) if any(o)}
    nbrs = {o: r for o, r in nbrs.items() if r != MPI.PROC_NULL}
    return BoundarySpec(axes, pad, nbrs, grid.spatial_comm, layer, thinnest)


def _slab_conv(slab: torch.Tensor, taps: torch.Tensor, pads, groups: int) -> torch.Tensor:
    """A slab's term. Its shape (one sample, p planes) falls under torch's slow CPU kernel
    rule; oneDNN runs it 3-5x faster there (16 channels, 1 x 66 x 128 planes: 1.6 -> 0.45 ms
    forward, 5.4 -> 1.2 ms backward, measured)."""
    if onednn(slab, taps.shape[2:], (1, 1, 1), (1, 1, 1), groups):
        return torch.mkldnn_convolution(slab, taps, None, list(pads), [1, 1, 1], [1, 1, 1],
                                        groups)
    return torch.nn.functional.conv3d(slab, taps, None, 1, pads, 1, groups)


def _slab_grads(grad: torch.Tensor, slab: torch.Tensor, taps: torch.Tensor, pads, groups: int,
                mask) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The slab's and its taps' gradients of a slab's term (the route of :func:`_slab_conv`)."""
    if onednn(slab, taps.shape[2:], (1, 1, 1), (1, 1, 1), groups):
        return onednn_backward(grad, slab, taps, pads, (1, 1, 1), (1, 1, 1), groups,
                               [*mask, False])[:2]
    args = (None, [1, 1, 1], list(pads), [1, 1, 1], False, [0, 0, 0], groups, [*mask, False])
    return torch.ops.aten.convolution_backward(grad, slab, taps, *args)[:2]


def _exchange(spec: BoundarySpec, sends: dict, recvs: dict, tag: int):
    """Post a receive and a send per neighbour (dense contiguous tensors): (handles, bytes sent)."""
    from hpcpar.parallel.transport import exchange  # deferred: loads numpy

    # the neighbour at o sent it toward -o
    posted = [(buf, spec.nbrs[o], tag + _code(xyz(-v for v in o))) for o, buf in recvs.items()]
    out = [(buf, spec.nbrs[o], tag + _code(o)) for o, buf in sends.items()]
    handles = exchange(spec.comm, posted, out)
    return handles, sum(buf.numel() * buf.element_size() for buf in sends.values())


def _wait(handles) -> None:
    if not handles:  # no neighbour: nothing waited for, so no halo-wait time either
        return
    t0 = time.perf_counter()
    for h in handles:
        h.wait()
    COUNTERS.t_halo_wait += time.perf_counter() - t0


class BoundaryConv(torch.autograd.Function):
    """``conv_padded(x) + corrections(ghosts)``; backward is the exact adjoint (the ghosts'
    gradients go back to their owners)."""

    @staticmethod
    @profiled("hpcpar.halo_exchange")
    def forward(ctx, x, weight, bias, spec: BoundarySpec):
        t0 = time.perf_counter()
        x = x.detach()
        sig = ("boundary conv ghosts", tuple(x.shape), tuple(spec.axes))
        hit, recvs = replay.recorded(sig)  # a recomputed segment reuses the forward's ghosts
        handles, nbytes = [], 0
        if not hit:
            sends = {o: x[spec.block(x, o)].contiguous() for o in spec.nbrs}
            recvs = {o: torch.empty_like(send) for o, send in sends.items()}
            handles, nbytes = _exchange(spec, sends, recvs, _TAG_FWD)
            replay.record(sig, recvs)
        COUNTERS.t_halo += time.perf_counter() - t0
        out = torch.nn.functional.conv3d(x, weight, bias, 1, spec.pads, 1, spec.groups)
        t0 = time.perf_counter()
        _wait(handles)  # the ghosts travelled while the interior was convolved
        COUNTERS.t_halo += time.perf_counter() - t0
        COUNTERS.bytes_halo += nbytes
        slabs = [slab.build(x, spec.pads, recvs) for slab in spec.slabs]
        for slab, s in zip(spec.slabs, slabs):
            out[spec.block(out, slab.offset)] += _slab_conv(
                s, weight[spec.block(weight, slab.offset)].contiguous(), slab.pads, spec.groups)
        ctx.spec = spec
        ctx.save_for_backward(x, weight, *slabs)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    @profiled("hpcpar.halo_exchange.backward")
    def backward(ctx, grad_out):
        spec = ctx.spec
        x, weight, *slabs = ctx.saved_tensors
        ctx.spec = None
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias

        def grads(g, inp, w, pads, mask, bias_sizes=None):   # stride 1, dilation 1
            return torch.ops.aten.convolution_backward(
                g, inp, w, bias_sizes, [1, 1, 1], list(pads), [1, 1, 1], False, [0, 0, 0],
                spec.groups, mask)

        # the slabs' terms first (thin): the ghosts' gradients travel to their owners while
        # the piece's own backward runs, as the ghosts did in forward
        back, g_taps = {}, []
        for slab, s in zip(spec.slabs, slabs):
            g = grad_out[spec.block(grad_out, slab.offset)].contiguous()
            g_slab, g_tap = _slab_grads(g, s, weight[spec.block(weight, slab.offset)]
                                        .contiguous(), slab.pads, spec.groups, [need_x, need_w])
            g_taps.append(g_tap)
            if need_x:
                for o, region in slab.regions(x, spec.pads).items():
                    back[o] = g_slab[region].contiguous()
        handles, nbytes, mine = [], 0, {}
        if need_x:  # the ghosts' gradients go to their owners, who add them to their blocks
            t0 = time.perf_counter()
            mine = {o: torch.empty_like(g) for o, g in back.items()}
            handles, nbytes = _exchange(spec, back, mine, _TAG_BWD)
            COUNTERS.t_halo += time.perf_counter() - t0
        bias_sizes = [weight.shape[0]] if ctx.has_bias else None
        if need_w and prepadded_weight_grad(x, weight, spec.groups):
            gx = grads(grad_out, x, weight, spec.pads, [True, False, False])[0] \
                if need_x else None
            xp = torch.nn.functional.pad(x, torch_pad([(p, p) for p in spec.pads]))
            _, gw, gb = grads(grad_out, xp, weight, (0, 0, 0), [False, True, need_b],
                              bias_sizes)
            del xp
        else:
            gx, gw, gb = grads(grad_out, x, weight, spec.pads, [need_x, need_w, need_b],
                               bias_sizes)
        if need_w:
            for slab, g_tap in zip(spec.slabs, g_taps):
                gw[spec.block(weight, slab.offset)] += g_tap
        if need_x:
            t0 = time.perf_counter()
            _wait(handles)
            for o, g in mine.items():
                gx[spec.block(gx, o)] += g
            COUNTERS.t_halo += time.perf_counter() - t0
            COUNTERS.bytes_halo += nbytes
        return gx, gw, gb, None


def boundary_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  spec: BoundarySpec) -> torch.Tensor:
    """SpatialConv3d's forward on the fast path (see the module docstring)."""
    return BoundaryConv.apply(x, weight, bias, spec)
