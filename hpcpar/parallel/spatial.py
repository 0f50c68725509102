"""Whole volumes <-> the pieces each rank of a spatial group holds.

A volume ``(N, C, D, H, W)`` (any leading dims) has its last three dims split over the grid's
x, y, z axes with the partition rule (:mod:`hpcpar.parallel.partition`). Every function here is
about ONE spatial group (``grid.spatial_comm``): each data group moves its own samples, and ``root``
is a rank of the spatial group (spatial rank ``i + X*(j + Y*k)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hpcpar.errors import LayerError
from hpcpar.parallel.comm import allgatherv, irecv, isend
from hpcpar.parallel.grid import ProcessGrid, coords_of
from hpcpar.parallel.partition import box

__all__ = ["scatter", "gather", "allgather_volume", "local_shape", "local_slices"]

_TAG = 7301  # point-to-point tag for scatter/gather traffic


def _spatial_coords(rank: int, grid) -> tuple[int, int, int]:
    return coords_of(rank, (1, *grid.spatial_shape))[1:]


def _check_shape(global_shape, grid) -> tuple[int, ...]:
    shape = tuple(int(s) for s in global_shape)
    if len(shape) < 3:
        raise LayerError(f"volume shape {shape}: needs at least 3 (spatial) dims")
    for axis, n, p in zip("xyz", shape[-3:], grid.spatial_shape):
        if n < p:
            raise LayerError(f"volume shape {shape}: axis {axis} has {n} voxels but the grid "
                             f"splits it over {p} ranks (need at least {p})")
    return shape


def local_slices(global_shape: Sequence[int], grid: ProcessGrid,
                 rank: int | None = None) -> tuple[slice, ...]:
    """Where the piece of ``rank`` (of ``grid.spatial_comm``; this rank when None) sits in a
    volume of ``global_shape`` whose last three dims are split over x, y, z: one slice per dim,
    whole for the leading dims. LayerError: fewer than 3 dims or fewer voxels than ranks on an
    axis."""
    shape = _check_shape(global_shape, grid)
    coords = grid.spatial_coords if rank is None else _spatial_coords(rank, grid)
    lead = [slice(None)] * (len(shape) - 3)
    return tuple(lead + [slice(*r) for r in box(shape[-3:], grid.spatial_shape, coords)])


def local_shape(global_shape: Sequence[int], grid: ProcessGrid,
                rank: int | None = None) -> tuple[int, ...]:
    """Shape of the piece ``rank`` holds: the partition rule on the last three dims (as
    :func:`local_slices`, with its LayerError)."""
    shape = _check_shape(global_shape, grid)
    sl = local_slices(shape, grid, rank)
    return tuple(shape[:-3]) + tuple(s.stop - s.start for s in sl[-3:])


def scatter(volume: torch.Tensor | None, grid: ProcessGrid, root: int = 0,
            device: torch.device | str | None = None) -> torch.Tensor:
    """Split a whole ``(..., D, H, W)`` volume on spatial rank ``root`` (ignored, may be None,
    elsewhere) over the spatial group: this rank's contiguous piece, shaped as
    :func:`local_shape` (with its LayerError). Collective over ``grid.spatial_comm``.
    Non-root ranks allocate on ``device`` (CPU when None); the root keeps the volume's device.
    """
    comm = grid.spatial_comm
    me = comm.Get_rank()
    meta = None
    if me == root:
        assert volume is not None, "scatter: the root rank passes the volume"
        meta = (tuple(volume.shape), volume.dtype)
    shape, dtype = comm.bcast(meta, root=root)
    shape = _check_shape(shape, grid)
    if me == root:
        assert volume is not None
        handles = []
        for r in range(comm.Get_size()):
            piece = volume[local_slices(shape, grid, r)]
            if r == root:  # a copy, never a view of the caller's volume
                local = piece.clone(memory_format=torch.contiguous_format)
            else:
                handles.append(isend(piece.contiguous(), r, comm, _TAG))
        for h in handles:
            h.wait()
        return local
    local = torch.empty(local_shape(shape, grid), dtype=dtype, device=device)
    irecv(local, root, comm, _TAG).wait()
    return local


def _layout(shapes, grid):
    """Global shape and per-rank slices from every rank's local shape (x/y/z offsets are
    prefix sums of the extents along each grid axis; no split rule assumed). LayerError,
    alike on every rank checking the same shapes, when the pieces do not tile one volume:
    leading dims that differ, or two ranks at the same coordinate of a grid axis with
    different extents along it (e.g. a piece whose split dims were moved on its way here).
    """
    X, Y, Z = grid.spatial_shape
    coords = [_spatial_coords(r, grid) for r in range(len(shapes))]
    lead = shapes[0][:-3]
    for r, s in enumerate(shapes):
        if len(s) < 3:
            raise LayerError(f"spatial rank {r} holds shape {tuple(s)}: a piece needs at least "
                             f"3 (spatial) dims")
        if tuple(s[:-3]) != tuple(lead):
            raise LayerError(f"spatial rank {r} holds shape {tuple(s)}, rank 0 holds "
                             f"{tuple(shapes[0])}: leading (batch, channel) dims differ")
    extents = []  # per axis: extent of coordinate c along that axis
    for a, P in enumerate((X, Y, Z)):
        ext = [0] * P
        for r, c in enumerate(coords):
            ext[c[a]] = shapes[r][len(lead) + a]
        extents.append(ext)
    offsets = [[sum(e[:c]) for c in range(len(e))] for e in extents]
    global_shape = tuple(lead) + tuple(sum(e) for e in extents)
    slices = []
    for r, c in enumerate(coords):
        slices.append(tuple([slice(None)] * len(lead) + [
            slice(offsets[a][c[a]], offsets[a][c[a]] + extents[a][c[a]]) for a in range(3)]))
        for a in range(3):   # a rank at the same coordinate of axis a set the extent
            if extents[a][c[a]] != shapes[r][len(lead) + a]:
                raise LayerError(
                    f"spatial rank {r} holds shape {tuple(shapes[r])}, {shapes[r][len(lead) + a]}"
                    f" voxels along grid axis {'xyz'[a]} where another rank at its coordinate "
                    f"{c[a]} holds {extents[a][c[a]]}: the pieces do not tile one volume; pass "
                    f"each rank's piece in (N, C, D, H, W) order")
    return global_shape, slices


def _split_dims(dims: Sequence[int], ndim: int) -> tuple[int, ...]:
    """``dims`` as three distinct non-negative dim positions of an ``ndim``-dim tensor."""
    out = tuple(int(d) % ndim if -ndim <= int(d) < ndim else -1 for d in dims)
    if len(out) != 3 or -1 in out or len(set(out)) != 3:
        raise LayerError(f"gather: dims={tuple(dims)} must be the positions of the x, y, z split "
                         f"dims: three distinct dims of a {ndim}-dim piece")
    return out


def _piece_shapes(local: torch.Tensor, comm, what: str) -> list[tuple[int, ...]]:
    """Every spatial rank's piece shape, on every rank (collective); raises on every rank
    when the pieces' dtypes differ (their bytes would be misread, not refused)."""
    meta = comm.allgather((tuple(local.shape), str(local.dtype)))
    dtypes = sorted({dtype for _, dtype in meta})
    if len(dtypes) > 1:
        raise LayerError(f"{what}: the spatial ranks' pieces have different dtypes {dtypes}")
    return [shape for shape, _ in meta]


def gather(local: torch.Tensor, grid: ProcessGrid, root: int = 0, *,
           dims: Sequence[int] | None = None) -> torch.Tensor | None:
    """The pieces of the spatial group assembled into the whole volume on spatial rank
    ``root``; None on every other rank. Collective over ``grid.spatial_comm``; the inverse of
    :func:`scatter`.

    ``dims``: where the x, y, z split dims are in ``local`` (default: its last three); a
    split tensor knows them: ``hpcpar.nn.whole(t)`` passes them for you. LayerError on every
    rank when the pieces do not tile one volume (every rank checks all the shapes before any
    piece travels: an error, never a rank left sending).
    """
    if dims is not None:
        moved = _split_dims(dims, local.dim())
        full = gather(local.movedim(moved, (-3, -2, -1)), grid, root)
        return None if full is None else full.movedim((-3, -2, -1), moved).contiguous()
    comm = grid.spatial_comm
    me = comm.Get_rank()
    shapes = _piece_shapes(local, comm, "gather")
    global_shape, slices = _layout(shapes, grid)
    if me != root:
        isend(local.contiguous(), root, comm, _TAG).wait()
        return None
    full = torch.empty(global_shape, dtype=local.dtype, device=local.device)
    for r, sl in enumerate(slices):
        if r == root:
            full[sl] = local
        else:
            piece = torch.empty(shapes[r], dtype=local.dtype, device=local.device)
            irecv(piece, r, comm, _TAG).wait()
            full[sl] = piece
    return full


def allgather_volume(local: torch.Tensor,
                     grid: ProcessGrid) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The full volume on every rank of the spatial group (e.g. for a layer that needs it
    whole), and the slices of it that are this rank's piece. Collective over
    ``grid.spatial_comm`` (one object allgather of shapes + one Allgatherv); LayerError on
    every rank when the pieces do not tile one volume."""
    comm = grid.spatial_comm
    shapes = _piece_shapes(local, comm, "allgather_volume")
    global_shape, slices = _layout(shapes, grid)
    flat = allgatherv(local.reshape(-1), comm)
    full = torch.empty(global_shape, dtype=local.dtype, device=local.device)
    start = 0
    for shape, sl in zip(shapes, slices):
        count = 1
        for s in shape:
            count *= s
        full[sl] = flat[start:start + count].view(shape)
        start += count
    return full, slices[comm.Get_rank()]
