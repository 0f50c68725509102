"""Halo plans: per rank and axis, which global ranges a stencil layer's owned outputs read,
what this rank sends to and receives from each neighbour, and the global shape every rank
agrees on (checked collectively, so a size mismatch fails on every rank at once, never hangs).
Every rank derives every rank's needs from the partition rule.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hpcpar.errors import LayerError
from hpcpar.parallel.halo_buffers import CHANNELS_LAST, input_layout, new_message
from hpcpar.parallel.partition import AxisHalo, split_sizes, xyz
from hpcpar.parallel.replay import count_sent, received

if TYPE_CHECKING:
    from hpcpar.parallel.grid import ProcessGrid

__all__ = ["AXIS_NAMES", "global_spatial_shape", "AxisPlan", "HaloPlan", "neighbour_only"]

AXIS_NAMES = ("x", "y", "z")


@functools.cache
def _dtype_code(dtype) -> int:
    """Same number for the same dtype on every rank (stable across processes)."""
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
    LayerError (the same on every rank, naming ``what``): not 5D, or pieces that disagree.
    """
    import numpy as np

    if x.dim() != 5:
        raise LayerError(f"{what}: expected a 5D (N, C, D, H, W) tensor, got shape "
                         f"{tuple(x.shape)}")
    comm = grid.spatial_comm
    mine = np.array([*x.shape, _dtype_code(x.dtype), int(x.requires_grad),
                     int(input_layout(x) == CHANNELS_LAST)], dtype=np.int64)

    def gather():
        if comm.Get_size() > 1:
            count_sent(mine.nbytes)
        table = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
        comm.Allgather(mine, table)
        return table

    table = received(("shape table", what, tuple(x.shape)), gather)  # a recomputation: no message
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
    return xyz(out)


def _spatial_coords(rank: int, dims) -> tuple[int, int, int]:
    X, Y, _ = dims
    return (rank % X, (rank // X) % Y, rank // (X * Y))


def _spatial_rank(c, dims) -> int:
    return c[0] + dims[0] * (c[1] + dims[1] * c[2])


@dataclass(frozen=True)
class AxisPlan:
    """One rank's exchange along one axis, in local coordinates (0 = first owned item).

    ``length`` items owned; ``hull``: the owned-relative range the buffer spans (needed items,
    and owned items a neighbour needs), with ``pad_lo``/``pad_hi`` padding around it (global
    boundary only); ``recv_*``/``send_*``: items from/to the lower and upper neighbours, whose
    spatial ranks are ``lo``/``hi`` (None: none); ``result``: the buffer range returned.
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
    passes only its own halos; one allgather). ``trims``: the result is a strict sub-range
    of the buffer on some axis; ``covers_owned``: the buffer holds every owned item;
    ``pad_regions``: slices of the buffer outside the global volume.
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

        Safe for what is finished when :mod:`.halo_swap`'s swap returns (sends; receives the adjoint
        adds at once), not for the forward's receives (kept for backward). A fresh buffer per
        exchange cost 15-25% of the face pack in malloc and first touch (benchmarks/spatial.py).
        """
        t = self._messages.get((key, layout))
        if t is None or t.shape != shape or t.dtype != like.dtype or t.device != like.device:
            t = self._messages[key, layout] = new_message(shape, like, layout)
        return t

    @property
    def message_nbytes(self) -> int:
        """Bytes held by the plan's reused message buffers."""
        return sum(t.numel() * t.element_size() for t in self._messages.values())

    @classmethod
    def from_halos(cls, grid: ProcessGrid, halos_per_axis: Sequence[Sequence[AxisHalo]],
                   layer: str = "halo exchange") -> HaloPlan:
        """This rank's plan from every rank's halos (no communication):
        ``halos_per_axis[a][i]`` is the ``AxisHalo`` of coordinate ``i`` on axis ``a``.
        LayerError: a wrong number of halos, or halos inconsistent with the partition rule or
        larger than a neighbour's extent."""
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
        return cls(grid, xyz(axes), layer)

    @classmethod
    def gather(cls, grid: ProcessGrid, halos: Sequence[AxisHalo],
               layer: str = "halo exchange") -> HaloPlan:
        """This rank's plan from each rank's own three ``AxisHalo`` (x, y, z); collective over
        the spatial group. LayerError: not three, or inconsistent across ranks."""
        halos = tuple(halos)
        if len(halos) != 3 or not all(isinstance(h, AxisHalo) for h in halos):
            raise LayerError(f"{layer}: halos must be 3 hpcpar.parallel.partition.AxisHalo "
                             "(x, y, z)")
        table = grid.spatial_comm.allgather(halos)
        dims = grid.spatial_shape
        per_axis = []
        for a in range(3):
            line: dict = {}
            for r, hs in enumerate(table):
                c = _spatial_coords(r, dims)
                # one line per axis is enough for the plan, but every line is checked
                line.setdefault(tuple(c[b] for b in range(3) if b != a), {})[c[a]] = hs[a]
            for parts in line.values():
                _check_axis([parts[i] for i in range(dims[a])], a, layer)
            mine = tuple(grid.spatial_coords[b] for b in range(3) if b != a)
            per_axis.append([line[mine][i] for i in range(dims[a])])
        return cls.from_halos(grid, per_axis, layer)

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


def _short_neighbour(halos: Sequence[AxisHalo]) -> tuple[AxisHalo, int, int, int] | None:
    """The first ghost of an axis line (``halos[i]``: coordinate i's) that the adjacent rank
    does not hold: ``(halo, neighbour, its extent, items needed)``, or None."""
    ext = [h.owned[1] - h.owned[0] for h in halos]
    for i, h in enumerate(halos):
        for j, need in ((i - 1, max(0, h.halo_lo)), (i + 1, max(0, h.halo_hi))):
            if need and (not 0 <= j < len(halos) or ext[j] < need):
                return h, j, ext[j] if 0 <= j < len(halos) else 0, need
    return None


def neighbour_only(halos: Sequence[AxisHalo]) -> bool:
    """Whether every ghost of an axis line comes from the adjacent rank's items, as the
    exchange needs."""
    return _short_neighbour(halos) is None


def _check_axis(halos, a: int, layer: str) -> None:
    """Neighbour-only exchange: every ghost must come from the adjacent rank's items."""
    short = _short_neighbour(halos)
    if short is not None:
        h, j, have, need = short
        name = AXIS_NAMES[a]
        raise LayerError(
            f"{layer}: local extent {have} on axis {name} (rank {j} of {len(halos)} on "
            f"that axis) is smaller than the halo of {need} its neighbour needs; each "
            f"rank must hold at least {need} items on {name}: use a larger volume or "
            f"fewer ranks on {name} (global size {h.n_in})")
