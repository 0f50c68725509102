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
  opt-in reuse pool (:data:`POOL`) trades memory for fewer page faults.

Plans: :class:`HaloPlan` knows, for this rank, what to send and receive on each axis. Every
rank derives every rank's needs, so size checks fail identically everywhere (no hangs).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hpcpar.errors import LayerError
from hpcpar.parallel.counters import COUNTERS, profiled
from hpcpar.parallel.partition import AxisHalo, split_sizes

if TYPE_CHECKING:
    from hpcpar.parallel.grid import ProcessGrid

__all__ = ["global_spatial_shape", "AxisPlan", "HaloPlan", "halo_exchange",
           "HaloExchange", "HaloStencil", "StencilOp", "halo_stencil", "exchange_forward", "POOL",
           "BufferPool", "new_buffer", "input_layout", "CHANNELS_LAST",
           "exchange_adjoint", "rebuild", "AXIS_NAMES"]

AXIS_NAMES = ("x", "y", "z")
_TAG_FWD = 0x4A10
_TAG_BWD = 0x4A20


# --------------------------------------------------------------------------------------------
# global shape
# --------------------------------------------------------------------------------------------
@functools.cache
def _dtype_code(dtype) -> int:
    """Same number for the same dtype on every rank (stable across processes)."""
    import zlib

    return zlib.crc32(str(dtype).encode())


def global_spatial_shape(x: torch.Tensor, grid: ProcessGrid,
                         what: str = "input") -> tuple[int, int, int]:
    """The global spatial shape of a partitioned ``(N, C, D, H, W)`` tensor.

    Collective over ``grid.spatial_comm`` (one small allgather). Every rank sees every
    rank's local shape, so it also checks, identically on all ranks, that batch, channels,
    dtype and ``requires_grad`` agree and that the local extents follow the partition rule.
    No caching by local shape: two global sizes can give a rank the same local extent (9 or
    10 over 2 ranks: rank 0 holds 5) and a stale plan on one rank would hang the others. The
    checks are memoized by the whole gathered table instead, which every rank holds alike.

    Args:
        x: This rank's piece.
        grid: The process grid.
        what: What ``x`` is, for messages (the layer's name).

    Returns:
        ``(Nx, Ny, Nz)``.

    Raises:
        LayerError: Not 5D, or pieces that disagree across the spatial group (the same
            error on every rank).
    """
    import numpy as np

    if x.dim() != 5:
        raise LayerError(f"{what}: expected a 5D (N, C, D, H, W) tensor, got shape "
                         f"{tuple(x.shape)}")
    comm = grid.spatial_comm
    mine = np.array([*x.shape, _dtype_code(x.dtype), int(x.requires_grad),
                     int(input_layout(x) == CHANNELS_LAST)], dtype=np.int64)
    table = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
    comm.Allgather(mine, table)
    # every rank holds the same table, so every rank hits or misses this memo together;
    # only tables that passed the checks are kept (a bad one raises again, on all ranks)
    key = (grid.spatial_shape, table.tobytes())
    shape = _CHECKED.get(key)
    if shape is None:
        shape = _check_table(table, grid.spatial_shape, what)
        if len(_CHECKED) >= 1024:
            _CHECKED.clear()
        _CHECKED[key] = shape
    return shape


#: Global shapes of gathered shape tables already checked (``global_spatial_shape``).
_CHECKED: dict = {}


def _check_table(table, dims, what: str) -> tuple[int, int, int]:
    """The global shape of every rank's local shape in ``table``, after checking that they
    agree and follow the partition rule (the same verdict on every rank)."""
    import numpy as np
    for col, name in ((0, "batch size"), (1, "channels"), (5, "dtype"), (6, "requires_grad"),
                      (7, "memory format (channels-last or not)")):
        bad = np.nonzero(table[:, col] != table[0, col])[0]
        if bad.size:
            raise LayerError(f"{what}: {name} differs across the spatial group (rank 0 and "
                             f"rank {bad[0]} disagree)")
    coords = [_spatial_coords(r, dims) for r in range(len(table))]
    out = []
    for a in range(3):
        line = sorted((c[a], table[r, 2 + a]) for r, c in enumerate(coords)
                      if all(c[b] == 0 for b in range(3) if b != a))
        n = int(sum(e for _, e in line))
        expect = split_sizes(n, dims[a])
        for r, c in enumerate(coords):
            if table[r, 2 + a] != expect[c[a]]:
                raise LayerError(f"{what}: rank {r} holds {table[r, 2 + a]} items on axis "
                                 f"{AXIS_NAMES[a]}, but the partition rule gives "
                                 f"{expect[c[a]]} for a global size of {n} over {dims[a]} ranks")
        out.append(n)
    return tuple(out)


def _spatial_coords(rank: int, dims) -> tuple[int, int, int]:
    X, Y, _ = dims
    return (rank % X, (rank // X) % Y, rank // (X * Y))


def _spatial_rank(c, dims) -> int:
    return c[0] + dims[0] * (c[1] + dims[1] * c[2])


# --------------------------------------------------------------------------------------------
# plans
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AxisPlan:
    """One rank's exchange along one axis, in local coordinates (0 = first owned item).

    Attributes:
        length: Items this rank owns on the axis.
        hull: Owned-relative range the buffer spans (needed items, and owned items a
            neighbour needs).
        pad_lo: Padding items before the hull (global boundary only).
        pad_hi: Padding items after the hull.
        recv_lo: Items received from the lower neighbour.
        recv_hi: Items received from the upper neighbour.
        send_lo: Items sent to the lower neighbour.
        send_hi: Items sent to the upper neighbour.
        lo: The lower neighbour's spatial rank (None: none).
        hi: The upper neighbour's spatial rank (None: none).
        result: Buffer index range returned to the layer.
    """

    length: int
    hull: tuple[int, int]
    pad_lo: int
    pad_hi: int
    recv_lo: int
    recv_hi: int
    send_lo: int
    send_hi: int
    lo: int | None
    hi: int | None
    result: tuple[int, int]

    @property
    def size(self) -> int:
        """Buffer length along this axis."""
        return self.pad_lo + self.hull[1] - self.hull[0] + self.pad_hi

    def _at(self, local: int) -> int:
        return self.pad_lo + local - self.hull[0]

    @property
    def owned(self) -> tuple[int, int]:
        """Buffer range of the owned items held in the buffer."""
        return self._at(max(self.hull[0], 0)), self._at(min(self.hull[1], self.length))

    @property
    def owned_local(self) -> tuple[int, int]:
        """Owned-relative range of the owned items held in the buffer."""
        return max(self.hull[0], 0), min(self.hull[1], self.length)

    def ghost(self, side: int) -> tuple[int, int]:
        """Buffer range of the ghosts received from side 0 (lo) or 1 (hi)."""
        return (self._at(-self.recv_lo), self._at(0)) if side == 0 else \
            (self._at(self.length), self._at(self.length + self.recv_hi))

    def sent(self, side: int) -> tuple[int, int]:
        """Buffer range of the owned items sent to side 0 (lo) or 1 (hi)."""
        return (self._at(0), self._at(self.send_lo)) if side == 0 else \
            (self._at(self.length - self.send_hi), self._at(self.length))

    def pads(self) -> Iterator[tuple[int, int]]:
        """Buffer ranges of the padding, low side first."""
        if self.pad_lo:
            yield 0, self.pad_lo
        if self.pad_hi:
            yield self.size - self.pad_hi, self.size


def _axis_plan(halo: AxisHalo, length: int, send_lo: int, send_hi: int, lo, hi) -> AxisPlan:
    real = halo.needed[1] > halo.needed[0]
    spans = []
    if real:
        n0, n1 = halo.needed[0] - halo.owned[0], halo.needed[1] - halo.owned[0]
        spans.append((n0, n1))
    if send_lo:
        spans.append((0, send_lo))
    if send_hi:
        spans.append((length - send_hi, length))
    h0 = min((s[0] for s in spans), default=0)
    h1 = max((s[1] for s in spans), default=0)
    if not real:  # pure padding (or nothing): the result is the pad block at the buffer's end
        n0 = n1 = h0 if halo.pad_lo else h1
    r0 = n0 - h0
    r1 = r0 + halo.pad_lo + n1 - n0 + halo.pad_hi
    return AxisPlan(length, (h0, h1), halo.pad_lo, halo.pad_hi, max(0, -h0),
                    max(0, h1 - length), send_lo, send_hi, lo, hi, (r0, r1))


class HaloPlan:
    """What this rank sends, receives and pads on each axis for one layer and global shape.

    Build with ``from_halos`` (every rank's ``AxisHalo`` per axis, e.g. from
    ``hpcpar.parallel.partition.conv_axis_halo``, as layers do) or ``gather`` (each rank
    passes only its own halos; one allgather).

    Args:
        grid: The process grid.
        axes: This rank's exchange along x, y and z.
        layer: The layer's name, for messages.

    Attributes:
        trims: True when the result is a strict sub-range of the buffer on some axis.
        covers_owned: True when the buffer holds every owned item on every axis.
        pad_regions: Slices of the buffer outside the global volume (padding).
    """

    def __init__(self, grid: ProcessGrid, axes: tuple[AxisPlan, AxisPlan, AxisPlan],
                 layer: str):
        self.grid = grid
        self.axes = axes
        self.layer = layer
        self._messages: dict = {}
        # the geometry every exchange reads, made once (the axes never change)
        self._owned = (slice(None), slice(None), *(slice(*ax.owned) for ax in axes))
        self._owned_local = (slice(None), slice(None),
                             *(slice(*ax.owned_local) for ax in axes))
        self._result = (slice(None), slice(None), *(slice(*ax.result) for ax in axes))
        self.trims = any(ax.result != (0, ax.size) for ax in axes)
        self.covers_owned = all(ax.owned_local == (0, ax.length) for ax in axes)
        self.pad_regions = tuple((slice(None),) * (2 + a) + (slice(*span),)
                                 for a, ax in enumerate(axes) for span in ax.pads())
        self._regions: dict = {}

    def message(self, key, shape, like: torch.Tensor, layout=None) -> torch.Tensor:
        """A message buffer kept with the plan and reused by every exchange that uses it.

        Safe for what is finished when :func:`_swap` returns (sends; receives the adjoint
        adds at once), not for the forward's receives (kept for backward). A fresh buffer per
        exchange cost 15-25% of the face pack in malloc and first touch (benchmarks/spatial.py).
        """
        t = self._messages.get((key, layout))
        if t is None or t.shape != shape or t.dtype != like.dtype or t.device != like.device:
            t = self._messages[key, layout] = _new_message(shape, like, layout)
        return t

    @property
    def message_nbytes(self) -> int:
        """Bytes held by the plan's reused message buffers."""
        return sum(t.numel() * t.element_size() for t in self._messages.values())

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_halos(cls, grid: ProcessGrid, halos_per_axis: Sequence[Sequence[AxisHalo]],
                   layer: str = "halo exchange") -> HaloPlan:
        """Build the plan from every rank's halos (no communication).

        Args:
            grid: The process grid.
            halos_per_axis: ``halos_per_axis[a][i]`` is the ``AxisHalo`` of the rank at
                coordinate ``i`` on axis ``a``.
            layer: The layer's name, for messages.

        Returns:
            This rank's plan.

        Raises:
            LayerError: A wrong number of halos, or halos inconsistent with the partition
                rule or larger than a neighbour's extent.
        """
        dims = grid.spatial_shape
        coords = grid.spatial_coords
        axes = []
        for a in range(3):
            halos = list(halos_per_axis[a])
            if len(halos) != dims[a]:
                raise LayerError(f"{layer}: {len(halos)} halos for axis {AXIS_NAMES[a]}, "
                                 f"the grid has {dims[a]} ranks there")
            _check_axis(halos, a, layer)
            i = coords[a]
            send_lo = max(0, halos[i - 1].halo_hi) if i > 0 else 0
            send_hi = max(0, halos[i + 1].halo_lo) if i + 1 < dims[a] else 0
            nb = []
            for j in (i - 1, i + 1):
                c = list(coords)
                c[a] = j
                nb.append(_spatial_rank(c, dims) if 0 <= j < dims[a] else None)
            h = halos[i]
            axes.append(_axis_plan(h, h.owned[1] - h.owned[0], send_lo, send_hi, *nb))
        return cls(grid, tuple(axes), layer)

    @classmethod
    def gather(cls, grid: ProcessGrid, halos: Sequence[AxisHalo],
               layer: str = "halo exchange") -> HaloPlan:
        """Build the plan from each rank's own halos (collective over the spatial group).

        Args:
            grid: The process grid.
            halos: This rank's three ``AxisHalo`` (x, y, z).
            layer: The layer's name, for messages.

        Returns:
            This rank's plan.

        Raises:
            LayerError: Not three ``AxisHalo``, or halos inconsistent across ranks.
        """
        halos = tuple(halos)
        if len(halos) != 3 or not all(isinstance(h, AxisHalo) for h in halos):
            raise LayerError(f"{layer}: halos must be 3 hpcpar.parallel.partition.AxisHalo "
                             "(x, y, z)")
        table = grid.spatial_comm.allgather(halos)
        dims = grid.spatial_shape
        per_axis = []
        for a in range(3):
            line = {}
            for r, hs in enumerate(table):
                c = _spatial_coords(r, dims)
                # one line per axis is enough for the plan, but every line is checked
                line.setdefault(tuple(c[b] for b in range(3) if b != a), {})[c[a]] = hs[a]
            for parts in line.values():
                _check_axis([parts[i] for i in range(dims[a])], a, layer)
            mine = tuple(grid.spatial_coords[b] for b in range(3) if b != a)
            per_axis.append([line[mine][i] for i in range(dims[a])])
        return cls.from_halos(grid, per_axis, layer)

    # -- geometry -------------------------------------------------------------------------
    def buffer_shape(self, lead: Sequence[int]) -> tuple[int, ...]:
        """Shape of the halo buffer for leading dims ``lead`` (``(N, C)``)."""
        return (*lead, *(ax.size for ax in self.axes))

    def result_shape(self, lead: Sequence[int]) -> tuple[int, ...]:
        """Shape of the extended tensor returned to the layer, for leading dims ``lead``."""
        return (*lead, *(ax.result[1] - ax.result[0] for ax in self.axes))

    def region(self, a: int, span: tuple[int, int]) -> tuple[slice, ...]:
        """Slices of the buffer for axis ``a``'s message over ``span`` on that axis."""
        sl = self._regions.get((a, span))
        if sl is None:
            sl = [slice(None), slice(None)]
            for b, ax in enumerate(self.axes):
                if b == a:
                    sl.append(slice(*span))
                elif b < a:
                    sl.append(slice(None))
                else:
                    sl.append(slice(*ax.owned))
            sl = self._regions[a, span] = tuple(sl)
        return sl

    def owned_region(self) -> tuple[slice, ...]:
        """Slices of the buffer holding the owned items."""
        return self._owned

    def owned_local_region(self) -> tuple[slice, ...]:
        """Slices of the local input that the buffer holds."""
        return self._owned_local

    def result_region(self) -> tuple[slice, ...]:
        """Slices of the buffer returned to the layer."""
        return self._result

    def check_input(self, x: torch.Tensor) -> None:
        """Raise ``LayerError`` unless ``x`` has the local shape the plan was made for."""
        got = tuple(x.shape[2:])
        want = tuple(ax.length for ax in self.axes)
        if x.dim() != 5 or got != want:
            raise LayerError(f"{self.layer}: local input has spatial shape {got}, the plan was "
                             f"made for {want}")


def _check_axis(halos, a: int, layer: str) -> None:
    """Neighbour-only exchange: every ghost must come from the adjacent rank's items."""
    name = AXIS_NAMES[a]
    for i, h in enumerate(halos):
        ext = [g.owned[1] - g.owned[0] for g in halos]
        for j, need in ((i - 1, max(0, h.halo_lo)), (i + 1, max(0, h.halo_hi))):
            if need and (not 0 <= j < len(halos) or ext[j] < need):
                have = ext[j] if 0 <= j < len(halos) else 0
                raise LayerError(
                    f"{layer}: local extent {have} on axis {name} (rank {j} of {len(halos)} on "
                    f"that axis) is smaller than the halo of {need} its neighbour needs; each "
                    f"rank must hold at least {need} items on {name}: use a larger volume or "
                    f"fewer ranks on {name} (global size {h.n_in})")


# --------------------------------------------------------------------------------------------
# the exchange itself
# --------------------------------------------------------------------------------------------
def _new_message(shape, like: torch.Tensor, layout) -> torch.Tensor:
    """A message in the memory order of the buffers of ``layout``, dense, so it packs from a
    face of the buffer without a transpose. Both ends use the layout all ranks agreed on
    (:func:`global_spatial_shape` checks it), so the bytes on the wire mean the same."""
    return new_buffer(shape, like.dtype, like.device,
                      CHANNELS_LAST if layout == CHANNELS_LAST else None)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The dense memory of a message as a contiguous tensor, for MPI."""
    return t if t.is_contiguous() else t.permute(0, 2, 3, 4, 1)


def _pack(plan: HaloPlan, key, view: torch.Tensor, layout) -> torch.Tensor:
    """Pack ``view`` into the plan's reused message buffer ``key``."""
    from hpcpar.kernels.halo_pack import pack

    return pack(view, plan.message(key, view.shape, view, layout))


def _unpack(view: torch.Tensor, buf: torch.Tensor, add: bool = False) -> None:
    from hpcpar.kernels.halo_pack import unpack

    unpack(view, buf, add)


def _swap(plan: HaloPlan, a: int, sends, recvs, tag: int) -> int:
    """Post the receives and sends of axis ``a`` and wait for them; returns the bytes sent.

    ``sends[side]``: the message for neighbour ``side`` (0 lo, 1 hi) or None; ``recvs[side]``:
    the message to receive from it or None (messages are dense: see :func:`_wire`).
    """
    from hpcpar.parallel.comm import irecv, isend

    ax = plan.axes[a]
    comm = plan.grid.spatial_comm
    nbr = (ax.lo, ax.hi)
    handles, nbytes = [], 0
    for side in (0, 1):
        if recvs[side] is not None:
            # the neighbour sent it from its opposite side
            handles.append(irecv(_wire(recvs[side]), nbr[side], comm, tag + 2 * a + (1 - side)))
    for side in (0, 1):
        if sends[side] is not None:
            handles.append(isend(_wire(sends[side]), nbr[side], comm, tag + 2 * a + side))
            nbytes += sends[side].numel() * sends[side].element_size()
    t0 = time.perf_counter()
    for h in handles:
        h.wait()
    COUNTERS.t_halo_wait += time.perf_counter() - t0
    return nbytes


class BufferPool:
    """Reusable halo buffers for the fused path, where a buffer never outlives one forward or
    backward call. A fresh 67 MB buffer costs ~5x its copy in page faults (measured: 106 ms
    vs 18 ms), but a kept buffer stays allocated from the forward into the backward, where
    the step's memory peaks (measured: +1 volume per rank, 6.2 vs 5 volumes for a 2-conv
    stack). Memory wins: ``keep=0`` by default (no reuse); ``POOL.keep = 4`` trades one
    buffer per shape for speed. ``take`` hands a buffer to one user at a time.

    Args:
        keep: Idle buffers kept for reuse (0: none).
    """

    def __init__(self, keep: int = 0):
        self.keep = keep
        self._idle: list[torch.Tensor] = []

    def take(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str,
             perm: tuple[int, int, int] | str | None = None) -> torch.Tensor:
        """Hand out an ``(N, C, D, H, W)`` buffer, reused when an idle one matches.

        Args:
            shape: The buffer's shape.
            dtype: Its dtype.
            device: Its device.
            perm: Its memory order (of the 3 spatial dims, or ``CHANNELS_LAST``).

        Returns:
            The buffer (contents undefined).
        """
        key = (tuple(shape), dtype, torch.device(device), perm)
        for i, (k, _) in enumerate(self._idle):
            if k == key:
                return self._idle.pop(i)[1]
        return new_buffer(shape, dtype, device, perm)

    def give(self, t: torch.Tensor, perm: tuple[int, int, int] | str | None = None) -> None:
        """Return a buffer from ``take`` (kept when ``keep > 0``)."""
        if self.keep > 0:
            self._idle.append(((tuple(t.shape), t.dtype, t.device, perm), t))
            del self._idle[:-self.keep]

    def clear(self) -> None:
        """Drop every idle buffer."""
        self._idle.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held by idle buffers."""
        return sum(t.numel() * t.element_size() for _, t in self._idle)


POOL = BufferPool()


CHANNELS_LAST = "channels_last"


def input_layout(x: torch.Tensor) -> str | None:
    """Detect a channels-last input, so the halo buffer can keep its layout.

    Like torch's own conv, the buffer then needs no transposing copy per layer, and x and y
    faces are runs of whole rows of channels (they pack at copy speed).

    Args:
        x: The (N, C, D, H, W) input.

    Returns:
        :data:`CHANNELS_LAST` for a channels-last input with more than one channel, else None.
    """
    if x.dim() == 5 and x.shape[1] > 1 and not x.is_contiguous() and \
            x.is_contiguous(memory_format=torch.channels_last_3d):
        return CHANNELS_LAST
    return None


def memory_format(layout: str | None) -> torch.memory_format:
    """Map a buffer layout to the torch memory format, for tensors that must match the buffer.

    Args:
        layout: :data:`CHANNELS_LAST`, or None for contiguous.

    Returns:
        ``torch.channels_last_3d`` or ``torch.contiguous_format``.
    """
    return torch.channels_last_3d if layout == CHANNELS_LAST else torch.contiguous_format


def new_buffer(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str,
               perm: tuple[int, int, int] | str | None = None) -> torch.Tensor:
    """Allocate an empty halo buffer whose memory holds the spatial dims in a chosen order.

    With a permutation, ``t.permute(0, 1, *(2 + p for p in perm))`` is contiguous, so faces
    along any axis can be packed cheaply.

    Args:
        shape: The logical (N, C, D, H, W) shape.
        dtype: Element type.
        device: Where to allocate.
        perm: Order of the spatial dims in memory; None: contiguous; :data:`CHANNELS_LAST`:
            channels innermost.

    Returns:
        The uninitialised tensor, with logical shape ``shape``.
    """
    if perm is None or perm == CHANNELS_LAST:
        return torch.empty(shape, dtype=dtype, device=device, memory_format=memory_format(perm))
    phys = torch.empty((*shape[:2], *(shape[2 + p] for p in perm)), dtype=dtype, device=device)
    inv = [perm.index(a) for a in range(3)]
    return phys.permute(0, 1, *(2 + i for i in inv))


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
    backward pass can :func:`rebuild` the buffer without messages.

    Args:
        x: This rank's local (N, C, D, H, W) input.
        plan: The halo plan made for ``x``'s local shape.
        pad_value: Value written where the buffer lies outside the global volume.
        pool: Buffer pool to take the buffer from (give it back when done); None: allocate.
        perm: Memory order of the buffer's spatial dims, as in :func:`new_buffer`.

    Returns:
        The buffer, and the faces received, per axis a ``(low, high)`` pair (None where
        nothing was received).

    Raises:
        LayerError: ``x`` does not have the local shape the plan was made for.
    """
    t0 = time.perf_counter()
    plan.check_input(x)
    x = x.detach()
    buf = _fill_start(x, plan, pad_value, pool, perm)
    received, nbytes = [], 0
    for a, ax in enumerate(plan.axes):
        if ax.lo is None and ax.hi is None:
            received.append((None, None))
            continue
        sends = [_pack(plan, ("fwd", a, s), buf[plan.region(a, ax.sent(s))], perm)
                 if (ax.send_lo, ax.send_hi)[s] else None for s in (0, 1)]
        # fresh: kept for the backward rebuild (unlike the reused send buffers)
        recvs = [_new_message(buf[plan.region(a, ax.ghost(s))].shape, buf, perm)
                 if (ax.recv_lo, ax.recv_hi)[s] else None for s in (0, 1)]
        nbytes += _swap(plan, a, sends, recvs, _TAG_FWD)
        for side in (0, 1):
            if recvs[side] is not None:
                _unpack(buf[plan.region(a, ax.ghost(side))], recvs[side])
        received.append(tuple(recvs))
    COUNTERS.t_halo += time.perf_counter() - t0
    COUNTERS.bytes_halo += nbytes
    return buf, received


def rebuild(x: torch.Tensor, plan: HaloPlan, received: list, pad_value: float = 0.0,
            pool: BufferPool | None = None,
            perm: tuple[int, int, int] | str | None = None) -> torch.Tensor:
    """Rebuild the forward halo buffer from ``x`` and the faces received then, with no messages.

    Lets the backward pass recompute the buffer instead of keeping it alive.

    Args:
        x: This rank's local (N, C, D, H, W) input, as in the forward pass.
        plan: The halo plan used in the forward pass.
        received: The faces :func:`exchange_forward` returned.
        pad_value: Value written where the buffer lies outside the global volume.
        pool: Buffer pool to take the buffer from (give it back when done); None: allocate.
        perm: Memory order of the buffer's spatial dims, as in :func:`new_buffer`.

    Returns:
        The buffer, equal to the one :func:`exchange_forward` built.
    """
    t0 = time.perf_counter()
    buf = _fill_start(x.detach(), plan, pad_value, pool, perm)
    for a, faces in enumerate(received):
        for side, face in enumerate(faces):
            if face is not None:
                _unpack(buf[plan.region(a, plan.axes[a].ghost(side))], face)
    COUNTERS.t_halo += time.perf_counter() - t0
    return buf


@profiled("hpcpar.halo_exchange.backward")
def exchange_adjoint(gbuf: torch.Tensor, plan: HaloPlan, like: torch.Tensor,
                     layout: str | None = None) -> torch.Tensor:
    """Apply the adjoint of :func:`exchange_forward`, turning a buffer gradient into the input's.

    Ghost gradients are sent back to their owners and added in. Collective with the
    neighbours along each split axis.

    Args:
        gbuf: Gradient with respect to the buffer (buffer-shaped; modified in place).
        plan: The halo plan used in the forward pass.
        like: The forward input, giving the gradient's shape, dtype and device.
        layout: The forward buffer's layout (messages travel in its memory order).

    Returns:
        The gradient with respect to the local input.
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
        for side in (0, 1):
            if recvs[side] is not None:
                _unpack(gbuf[plan.region(a, ax.sent(side))], recvs[side], add=True)
    if plan.covers_owned:
        grad = gbuf[plan.owned_region()]
    else:
        grad = torch.zeros_like(like)
        grad[plan.owned_local_region()] = gbuf[plan.owned_region()]
    COUNTERS.t_halo += time.perf_counter() - t0
    COUNTERS.bytes_halo += nbytes
    return grad


# --------------------------------------------------------------------------------------------
# autograd functions
# --------------------------------------------------------------------------------------------
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
    """Extend the local ``(N, C, D, H, W)`` tensor ``x`` by ghosts and boundary padding.

    Axes are swept x, y, z, each message carrying the ghosts received before, so edges and
    corners arrive with two messages per axis. Autograd-aware: backward is the adjoint (ghost
    gradients go back and are added into their owners' cells).

    Args:
        x: This rank's piece of the volume.
        grid: The process grid (the exchange runs over ``grid.spatial_comm``).
        halos: This rank's three ``AxisHalo`` (x, y, z), e.g. from
            ``partition.conv_axis_halo`` (then one small allgather over the spatial group
            tells each rank what its neighbours need), or a ready ``HaloPlan`` (no collective).
        pad_value: Value of the padding outside the global volume (0 for conv and average
            pooling, ``-inf`` for max pooling); only ranks on the global boundary pad.

    Returns:
        ``x`` extended by the halo widths on every side (trimmed where a halo is negative).

    Raises:
        LayerError: A rank holds fewer items than a neighbour's halo needs (the same error
            on every rank).
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
            grads = iter(torch.autograd.grad(out, wrt, grad_out)) if wrt else iter(())
        return tuple(next(grads) if n and t is not None else None
                     for t, n in zip([ext, *ps], needs))


class HaloStencil(torch.autograd.Function):
    """Halo exchange fused with a local op; saves the input and ghost faces, not the extended
    copy (rebuilt in backward without messages)."""

    @staticmethod
    def forward(ctx, x, plan: HaloPlan, pad_value, op: StencilOp, *params):
        perm = input_layout(x) or op.layout(plan.result_shape(x.shape[:2]), x.dtype, x.device)
        buf, received = exchange_forward(x, plan, pad_value, POOL, perm)
        ext = buf[plan.result_region()] if plan.trims else buf
        with torch.no_grad():
            out = op.forward(ext, *params)
        del ext
        POOL.give(buf, perm)
        ctx.plan, ctx.pad_value, ctx.op, ctx.received = plan, pad_value, op, received
        ctx.perm = perm
        ctx.save_for_backward(x, *params)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, *params = ctx.saved_tensors
        plan = ctx.plan
        # the rebuilt buffer is taken from the pool and NOT given back: the op frees it as
        # soon as it can, so the backward peak does not hold it next to grad_ext
        buf = rebuild(x, plan, ctx.received, ctx.pad_value, POOL, ctx.perm)
        ctx.received = None
        shape = buf.shape
        holder = [buf[plan.result_region()] if plan.trims else buf]
        del buf
        needs = ctx.needs_input_grad[4:]
        grad_out = grad_out.contiguous(memory_format=memory_format(ctx.perm))
        grads = ctx.op.backward(holder, grad_out, params,
                                (ctx.needs_input_grad[0], *needs))
        gx = None
        if ctx.needs_input_grad[0]:
            gext = grads[0]
            if plan.trims:
                gbuf = torch.empty(shape, dtype=gext.dtype, device=gext.device,
                                   memory_format=memory_format(ctx.perm)).zero_()
                gbuf[plan.result_region()] = gext
            else:
                gbuf = gext
            gx = exchange_adjoint(gbuf, plan, x, ctx.perm)
        return (gx, None, None, None, *grads[1:])


def halo_stencil(x: torch.Tensor, plan: HaloPlan, op: StencilOp, *params: torch.Tensor | None,
                 pad_value: float = 0.0) -> torch.Tensor:
    """A halo exchange fused with a local op: ``op.forward(halo_exchange(x), *params)``.

    Keeps only the input and the received ghost faces for backward (the extended tensor is
    rebuilt there without messages), so it costs about 1x activation memory. What the
    spatial layers use.

    Args:
        x: This rank's piece ``(N, C, d, h, w)``.
        plan: The layer's halo plan.
        op: The local op applied to the extended tensor.
        *params: Tensors passed to the op (weight, bias); gradients flow to them.
        pad_value: Padding outside the global volume (``-inf`` for max pooling).

    Returns:
        The op's output on this rank's owned outputs.
    """
    dev = x.device.type
    if op.autocast and torch.is_autocast_enabled(dev):
        # The casts are differentiable, so parameter gradients come back in their own dtype.
        dt = torch.get_autocast_dtype(dev)
        cast = [p.to(dt) if p is not None and p.is_floating_point() else p for p in params]
        with torch.autocast(dev, enabled=False):
            return HaloStencil.apply(x.to(dt), plan, pad_value, op, *cast)
    return HaloStencil.apply(x, plan, pad_value, op, *params)
