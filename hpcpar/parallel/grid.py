"""The 4D Cartesian process grid (data, x, y, z).

Rank order is x fastest, then y, then z, then data slowest:
``rank = x + X*(y + Y*(z + Z*d))``. Consecutive ranks therefore share a spatial group, so a
spatial group (all ranks holding pieces of the same samples, which exchange halos every layer)
lands on as few nodes as possible, while the data-parallel allreduce crosses nodes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpcpar import _env
from hpcpar.errors import GridError

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["AXES", "coords_of", "rank_of", "parse_spec", "resolve_shape", "Layout", "layout",
           "MAX_TABLE_RANKS", "ProcessGrid"]

AXES = ("data", "x", "y", "z")
SPATIAL_AXES = ("x", "y", "z")


def coords_of(rank: int, shape: Sequence[int]) -> tuple[int, int, int, int]:
    """The ``(d, i, j, k)`` of ``rank`` in a grid of ``shape`` ``(data, X, Y, Z)``; x varies
    fastest, data slowest."""
    _, x, y, z = shape
    return (rank // (x * y * z), rank % x, (rank // x) % y, (rank // (x * y)) % z)


def rank_of(coords: tuple[int, int, int, int], shape: tuple[int, int, int, int]) -> int:
    """The rank at ``(d, i, j, k)``: ``i + X*(j + Y*(k + Z*d))`` (inverse of ``coords_of``)."""
    d, i, j, k = coords
    _, x, y, z = shape
    return i + x * (j + y * (k + z * d))


#: digits of one grid axis: 7 allow more ranks than any machine has
AXIS_DIGITS = 7


def parse_spec(spec: str) -> tuple[int, int, int, int]:
    """``(data, X, Y, Z)`` of a grid string such as ``"2x2x1x1"`` (``x``, ``×`` or ``,``
    between; omitted trailing axes are 1; one may be -1), not yet checked against a rank count
    (see ``resolve_shape``). GridError unless 1 to 4 integers of ASCII digits (at most
    ``AXIS_DIGITS`` each) or -1."""
    text = str(spec).strip().lower()
    parts = re.split(r"[x×,]", text) if text else []
    if not 1 <= len(parts) <= 4:
        raise GridError(f"grid spec {spec!r}: expected DATAxXxYxZ such as 2x2x1x1")
    if not all(re.fullmatch(rf"\s*(-1|[0-9]{{1,{AXIS_DIGITS}}})\s*", p) for p in parts):
        raise GridError(f"grid spec {str(spec)[:40]!r}: expected integers such as 2x2x1x1 "
                        f"(ASCII digits, at most {AXIS_DIGITS} per axis, or -1)")
    vals = [int(p) for p in parts]
    vals += [1] * (4 - len(vals))
    return tuple(vals)  # type: ignore[return-value]


def resolve_shape(shape: Sequence[int], size: int) -> tuple[int, int, int, int]:
    """``shape`` ``(data, X, Y, Z)`` checked against ``size`` ranks, its one ``-1`` axis
    inferred. GridError: not four axes, an axis 0 or below -1, more than one -1, or a product
    that does not match ``size``."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 4:
        raise GridError(f"grid needs 4 axes (data, x, y, z), got {len(shape)}")
    text = "x".join(str(s) for s in shape)
    unknown = [a for a, s in zip(AXES, shape) if s == -1]
    bad = [a for a, s in zip(AXES, shape) if s == 0 or s < -1]
    if bad:
        raise GridError(f"grid {text}: axis {bad[0]} must be positive (or -1 to infer)")
    if len(unknown) > 1:
        raise GridError(f"grid {text}: at most one axis may be -1, got {', '.join(unknown)}")
    known = 1
    for s in shape:
        if s != -1:
            known *= s
    if unknown:
        if size % known:
            raise GridError(f"grid {text}: {size} ranks are not divisible by {known}")
        shape = tuple(size // known if s == -1 else s for s in shape)
    elif known != size:
        raise GridError(f"grid {text} needs {known} ranks, the job has {size}")
    return shape  # type: ignore[return-value]


def fake_nodes() -> int | None:
    """``HPCPAR_FAKE_NODES=k`` pretends the ranks are spread over k nodes (tests, one machine)."""
    return _env.get("HPCPAR_FAKE_NODES")


def node_of(rank: int, size: int, nodes: int) -> int:
    """The node of ``rank`` when ``size`` ranks are packed in blocks onto ``nodes`` nodes:
    ``rank // ceil(size / nodes)``."""
    return rank // -(-size // nodes)


@dataclass(frozen=True)
class Layout:
    """One rank's ``(d, i, j, k)`` and node index, computable without MPI (``hpcpar info``)."""

    rank: int
    coords: tuple[int, int, int, int]
    node: int


#: the most ranks a printed rank table lists (a million lines; beyond, printing takes minutes)
MAX_TABLE_RANKS = 1 << 20


def layout(shape: Sequence[int], ranks_per_node: int) -> list[Layout]:
    """The rank -> coordinates -> node table of a resolved grid ``shape``, block-placed on
    nodes (no MPI), in rank order. GridError when ``ranks_per_node < 1``."""
    size = 1
    for s in shape:
        size *= s
    if ranks_per_node < 1:
        raise GridError(f"ranks per node must be positive, got {ranks_per_node}")
    return [Layout(r, coords_of(r, shape), r // ranks_per_node) for r in range(size)]


class ProcessGrid:
    """4D process grid (data x X x Y x Z) over an MPI communicator.

    Rank order is x fastest, then y, then z, data slowest
    (``rank = i + X*(j + Y*(k + Z*d))``), so a spatial group sits on as few nodes as possible.
    Sub-communicators are created once, collectively, at construction: every rank of ``comm``
    must construct the grid.

    ``data`` splits the global batch; ``x``, ``y``, ``z`` split tensor dims 2, 3, 4 of
    ``(N, C, D, H, W)``. At most one axis may be ``-1``, inferred from the size of ``comm``
    (``MPI.COMM_WORLD`` when None). GridError: the product of the axes is not the communicator
    size, more than one axis is ``-1``, or an axis is not a positive integer.

    ``coords`` is this rank's ``(d, i, j, k)``; ``spatial_comm`` holds the ranks with this
    rank's data coordinate (rank ``i + X*(j + Y*k)``), ``data_comm`` those with its
    ``(x, y, z)`` (rank ``d``), ``node_comm`` those on its node (shared memory;
    ``HPCPAR_FAKE_NODES`` fakes it), of ``num_nodes`` nodes.

    Example:
        ```python
        grid = ProcessGrid(data=-1, x=2)   # under mpiexec -n 4: shape (2, 2, 1, 1)
        lo, hi = grid.neighbors("x")
        ```
    """

    def __init__(self, data: int = -1, x: int = 1, y: int = 1, z: int = 1,
                 comm: MPI.Comm | None = None):
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.shape = resolve_shape((data, x, y, z), self.comm.Get_size())
        self.size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()
        self.coords = coords_of(self.rank, self.shape)
        d, i, j, k = self.coords
        X, Y, Z = self.shape[1:]
        spatial_key = i + X * (j + Y * k)
        self.spatial_comm = self.comm.Split(color=d, key=spatial_key)
        self.data_comm = self.comm.Split(color=spatial_key, key=d)
        self._axis_comms = {
            "data": self.data_comm,
            "x": self.comm.Split(color=rank_of((d, 0, j, k), self.shape), key=i),
            "y": self.comm.Split(color=rank_of((d, i, 0, k), self.shape), key=j),
            "z": self.comm.Split(color=rank_of((d, i, j, 0), self.shape), key=k),
        }
        self.node_comm, self.node_index, self.num_nodes = self._split_nodes()
        self._closed = False

    @classmethod
    def parse(cls, spec: str, comm: MPI.Comm | None = None) -> ProcessGrid:
        """A grid from a ``"DxXxYxZ"`` string such as ``"2x2x1x1"`` (collective). GridError: the
        string is malformed or does not fit the communicator."""
        d, x, y, z = parse_spec(spec)
        return cls(d, x, y, z, comm=comm)

    @classmethod
    def from_spec(cls, spec: ProcessGrid | str | Sequence[int] | Mapping[str, int],
                  comm: MPI.Comm | None = None) -> ProcessGrid:
        """A grid from any form a job file or a caller may hold: a ``ProcessGrid`` (returned as
        is), a ``"DxXxYxZ"`` string, up to four ints (missing trailing axes are 1) or a mapping
        with keys ``data``/``x``/``y``/``z``. GridError: an unknown axis name, or a shape that
        does not fit the communicator."""
        if isinstance(spec, ProcessGrid):
            return spec
        if isinstance(spec, str):
            return cls.parse(spec, comm=comm)
        if isinstance(spec, Mapping):
            unknown = set(spec) - set(AXES)
            if unknown:
                raise GridError(f"grid: unknown axis {sorted(unknown)[0]!r}, expected data/x/y/z")
            return cls(spec.get("data", -1), spec.get("x", 1), spec.get("y", 1),
                       spec.get("z", 1), comm=comm)
        d, x, y, z = tuple(spec) + (1,) * (4 - len(tuple(spec)))
        return cls(d, x, y, z, comm=comm)

    def _split_nodes(self):
        from mpi4py import MPI

        k = fake_nodes()
        if k is not None:
            node = node_of(self.rank, self.size, min(k, self.size))
            node_comm = self.comm.Split(color=node, key=self.rank)
        else:
            node_comm = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
            # node index = index of this node's lowest world rank among all node leaders
            leader = node_comm.allreduce(self.rank, op=MPI.MIN)
            leaders = sorted(set(self.comm.allgather(leader)))
            node = leaders.index(leader)
        num_nodes = self.comm.allreduce(1 if node_comm.Get_rank() == 0 else 0)
        return node_comm, node, num_nodes

    @property
    def data(self) -> int:
        """Number of ranks along the data axis."""
        return self.shape[0]

    @property
    def spatial_shape(self) -> tuple[int, int, int]:
        """(X, Y, Z): how each sample's volume is split."""
        return self.shape[1:]

    @property
    def spatial_coords(self) -> tuple[int, int, int]:
        """This rank's ``(i, j, k)`` in its spatial group."""
        return self.coords[1:]

    @property
    def spatial_size(self) -> int:
        """Ranks per spatial group, ``X * Y * Z``."""
        X, Y, Z = self.spatial_shape
        return X * Y * Z

    @property
    def is_root(self) -> bool:
        """True on rank 0 of the grid."""
        return self.rank == 0

    @property
    def ranks_per_node(self) -> int:
        """Ranks on this rank's node."""
        return self.node_comm.Get_size()

    def axis_index(self, name: str) -> int:
        """This rank's coordinate along axis ``name`` (GridError if not data/x/y/z)."""
        return self.coords[self._axis(name)]

    def axis_size(self, name: str) -> int:
        """The number of ranks along axis ``name`` (GridError if not data/x/y/z)."""
        return self.shape[self._axis(name)]

    def axis_comm(self, name: str) -> MPI.Comm:
        """Communicator of the ranks that differ only in axis ``name`` (GridError if not
        data/x/y/z); a rank's rank in it is its coordinate on that axis."""
        self._axis(name)
        return self._axis_comms[name]

    def neighbors(self, axis: str | int) -> tuple[int, int]:
        """``(lo, hi)`` neighbours along spatial ``axis`` (x/y/z or 0/1/2, else GridError) as
        ranks of ``spatial_comm``; ``MPI.PROC_NULL`` at the global boundary, so sends and
        receives there are no-ops."""
        name = SPATIAL_AXES[axis] if isinstance(axis, int) else axis
        if name not in SPATIAL_AXES:
            raise GridError(f"neighbors: axis must be one of x, y, z, got {axis!r}")
        a = SPATIAL_AXES.index(name)
        lo, hi = ([step if b == a else 0 for b in range(3)] for step in (-1, 1))
        return self.spatial_neighbor(lo), self.spatial_neighbor(hi)

    def spatial_neighbor(self, offset: Sequence[int]) -> int:
        """The rank of ``spatial_comm`` at ``offset`` (dx, dy, dz) from this one: a face,
        edge or corner neighbour for offsets in {-1, 0, 1}; ``MPI.PROC_NULL`` beyond the global
        boundary."""
        from mpi4py import MPI

        dims = self.spatial_shape
        c = [i + d for i, d in zip(self.spatial_coords, offset)]
        if not all(0 <= i < n for i, n in zip(c, dims)):
            return MPI.PROC_NULL
        return c[0] + dims[0] * (c[1] + dims[1] * c[2])

    def _axis(self, name: str) -> int:
        if name not in AXES:
            raise GridError(f"unknown grid axis {name!r}, expected one of {', '.join(AXES)}")
        return AXES.index(name)

    def spec(self) -> str:
        """The shape as a ``"DxXxYxZ"`` string (what :meth:`parse` reads)."""
        return "x".join(str(s) for s in self.shape)

    def __repr__(self) -> str:
        return (f"ProcessGrid({self.spec()}, rank={self.rank}, coords={self.coords}, "
                f"node={self.node_index}/{self.num_nodes})")

    def free(self) -> None:
        """Free the sub-communicators (optional; MPI frees them at finalize)."""
        if self._closed:
            return
        comms = {id(c): c for c in [self.spatial_comm, self.data_comm, self.node_comm,
                                    *self._axis_comms.values()]}
        for c in comms.values():
            c.Free()
        self._closed = True
