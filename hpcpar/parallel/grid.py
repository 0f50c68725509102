"""The 4D Cartesian process grid (data, x, y, z).

Rank order is x fastest, then y, then z, then data slowest:
``rank = x + X*(y + Y*(z + Z*d))``. Consecutive ranks therefore share a spatial group, so a
spatial group (all ranks holding pieces of the same samples, which exchange halos every layer)
lands on as few nodes as possible, while the data-parallel allreduce crosses nodes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from hpcpar.errors import GridError

AXES = ("data", "x", "y", "z")
SPATIAL_AXES = ("x", "y", "z")


def coords_of(rank: int, shape: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """(d, i, j, k) of ``rank`` in a grid of ``shape`` = (data, x, y, z); x varies fastest."""
    d, x, y, z = shape
    i = rank % x
    j = (rank // x) % y
    k = (rank // (x * y)) % z
    dd = rank // (x * y * z)
    return (dd, i, j, k)


def rank_of(coords: tuple[int, int, int, int], shape: tuple[int, int, int, int]) -> int:
    """Inverse of :func:`coords_of`."""
    d, i, j, k = coords
    _, x, y, z = shape
    return i + x * (j + y * (k + z * d))


def parse_spec(spec: str) -> tuple[int, int, int, int]:
    """Parse ``"2x2x1x1"`` (data x X x Y x Z; trailing axes may be omitted, one may be -1)."""
    text = str(spec).strip().lower()
    parts = re.split(r"[x×,]", text) if text else []
    if not 1 <= len(parts) <= 4:
        raise GridError(f"grid spec {spec!r}: expected DATAxXxYxZ such as 2x2x1x1")
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise GridError(f"grid spec {spec!r}: expected integers such as 2x2x1x1") from None
    vals += [1] * (4 - len(vals))
    return tuple(vals)  # type: ignore[return-value]


def resolve_shape(shape, size: int) -> tuple[int, int, int, int]:
    """Check ``shape`` against ``size`` ranks, inferring at most one ``-1`` axis."""
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
    value = os.environ.get("HPCPAR_FAKE_NODES")
    if not value:
        return None
    try:
        k = int(value)
    except ValueError:
        raise GridError(f"HPCPAR_FAKE_NODES={value!r}: expected a positive integer") from None
    if k < 1:
        raise GridError(f"HPCPAR_FAKE_NODES={value!r}: expected a positive integer")
    return k


def node_of(rank: int, size: int, nodes: int) -> int:
    """Node index of ``rank`` when ``size`` ranks are packed in blocks onto ``nodes`` nodes."""
    per_node = -(-size // nodes)
    return rank // per_node


@dataclass(frozen=True)
class Layout:
    """One rank's place in the grid, computable without MPI (used by ``hpcpar info``)."""

    rank: int
    coords: tuple[int, int, int, int]
    node: int


def layout(shape, ranks_per_node: int) -> list[Layout]:
    """The rank -> (data, x, y, z) -> node table of a grid, block-placed on nodes."""
    size = 1
    for s in shape:
        size *= s
    if ranks_per_node < 1:
        raise GridError(f"ranks per node must be positive, got {ranks_per_node}")
    return [Layout(r, coords_of(r, shape), r // ranks_per_node) for r in range(size)]


class ProcessGrid:
    """4D process grid over an MPI communicator.

    ``ProcessGrid(data=-1, x=1, y=1, z=1, comm=None)``: one axis may be ``-1`` and is
    inferred from the communicator size. Sub-communicators are created once, collectively,
    at construction (every rank of ``comm`` must construct the grid).
    """

    def __init__(self, data: int = -1, x: int = 1, y: int = 1, z: int = 1, comm=None):
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

    # -- construction helpers -------------------------------------------------------------
    @classmethod
    def parse(cls, spec: str, comm=None) -> "ProcessGrid":
        """``ProcessGrid.parse("2x2x1x1")``: data x X x Y x Z."""
        d, x, y, z = parse_spec(spec)
        return cls(d, x, y, z, comm=comm)

    @classmethod
    def from_spec(cls, spec, comm=None) -> "ProcessGrid":
        """Build from a string, a 4-sequence or a mapping with keys data/x/y/z."""
        if isinstance(spec, ProcessGrid):
            return spec
        if isinstance(spec, str):
            return cls.parse(spec, comm=comm)
        if isinstance(spec, dict):
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

    # -- queries ----------------------------------------------------------------------------
    @property
    def data(self) -> int:
        return self.shape[0]

    @property
    def spatial_shape(self) -> tuple[int, int, int]:
        """(X, Y, Z): how each sample's volume is split."""
        return self.shape[1:]  # type: ignore[return-value]

    @property
    def spatial_coords(self) -> tuple[int, int, int]:
        return self.coords[1:]  # type: ignore[return-value]

    @property
    def spatial_size(self) -> int:
        X, Y, Z = self.spatial_shape
        return X * Y * Z

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def ranks_per_node(self) -> int:
        return self.node_comm.Get_size()

    def axis_index(self, name: str) -> int:
        return self.coords[self._axis(name)]

    def axis_size(self, name: str) -> int:
        return self.shape[self._axis(name)]

    def axis_comm(self, name: str):
        """Communicator of the ranks that differ only in axis ``name`` (rank = coordinate)."""
        self._axis(name)
        return self._axis_comms[name]

    def neighbors(self, axis) -> tuple[int, int]:
        """(lo, hi) neighbours along a spatial axis, as ranks of ``spatial_comm``.

        ``MPI.PROC_NULL`` at the global boundary, so sends/receives there are no-ops.
        ``axis`` is 'x'/'y'/'z' or 0/1/2.
        """
        from mpi4py import MPI

        name = SPATIAL_AXES[axis] if isinstance(axis, int) else axis
        if name not in SPATIAL_AXES:
            raise GridError(f"neighbors: axis must be one of x, y, z, got {axis!r}")
        a = SPATIAL_AXES.index(name)
        c = list(self.spatial_coords)
        dims = self.spatial_shape
        out = []
        for step in (-1, 1):
            n = c[a] + step
            if 0 <= n < dims[a]:
                cc = list(c)
                cc[a] = n
                out.append(cc[0] + dims[0] * (cc[1] + dims[1] * cc[2]))
            else:
                out.append(MPI.PROC_NULL)
        return out[0], out[1]

    def _axis(self, name: str) -> int:
        if name not in AXES:
            raise GridError(f"unknown grid axis {name!r}, expected one of {', '.join(AXES)}")
        return AXES.index(name)

    def spec(self) -> str:
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
