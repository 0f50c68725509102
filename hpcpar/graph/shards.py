"""The sharded graph format (version 1): one HDF5 file per partition and a manifest.

A directory, written by ``hpcpar data graph partition``::

    manifest.json     format="hpcpar-graph-shards", format_version, num_nodes, num_edges,
                      num_features, num_classes, directed, parts, offsets (P+1 vertex ids),
                      partition (method, edge cut, balance, measured peak memory), shards
                      (file, start, count, bytes, sha256: as the volume format's)
    part-00000.h5     attrs: format="hpcpar-graph-part", part, vertex_start, vertex_stop
      /indptr         (n+1,) int64   in-edge CSR rows of the part's vertices, from 0
      /indices        (E_p,) int64   GLOBAL (renumbered) source ids, sorted per row
      /features       (n, F) float32
      /labels         (n,)   int64
      /masks/train    (n,)   bool    (also val, test)
      /original_ids   (n,)   int64   each vertex's id in the source graph

Vertices are renumbered so that part ``p`` owns the contiguous ids ``[offsets[p], offsets[p+1])``
(source order kept inside a part): a vertex's owner is a binary search over ``P + 1`` offsets, so no
rank needs an N-length owner array, and a rank reads only its own file. Files are checked with the
volume format's helpers (path containment, HDF5 signature, size, sha256), so ``hpcpar data verify``
checks both formats alike."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import numpy as np

from hpcpar.data.format import (
    Shard,
    check_file,
    member_path,
    open_h5,
    open_regular,
    sha256_file,
)
from hpcpar.errors import DataError
from hpcpar.graph._csr import check_csr
from hpcpar.graph.format import MASKS

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "is_sharded_graph", "read_graph_manifest",
           "PartWriter", "write_graph_manifest", "read_part", "part_halo", "verify_graph_shards",
           "RangeOwner"]

FORMAT = "hpcpar-graph-shards"
PART_FORMAT = "hpcpar-graph-part"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_FIELDS = ("num_nodes", "num_edges", "num_features", "num_classes", "parts")


def part_name(index: int) -> str:
    """The file name of part ``index``: ``part-00000.h5``."""
    return f"part-{index:05d}.h5"


def is_sharded_graph(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory whose manifest says it is a sharded graph (cheap: reads
    the manifest only), so ``[data] path`` and ``data verify`` can take either format."""
    try:
        with open_regular(os.path.join(path, MANIFEST)) as fh:
            return json.load(fh).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


class RangeOwner:
    """Owner rank of global vertex ids when part ``p`` holds ``[offsets[p], offsets[p+1])``.

    Indexes like an owner array (``owner[ids]``, ``owner[a:b]``) with ``P + 1`` integers of state:
    what ``DistGraph`` needs instead of an N-length array."""

    def __init__(self, offsets):
        self.offsets = np.asarray(offsets, np.int64)

    def __getitem__(self, ids):
        if isinstance(ids, slice):
            ids = np.arange(*ids.indices(int(self.offsets[-1])), dtype=np.int64)
        return np.searchsorted(self.offsets, ids, side="right").astype(np.int64) - 1

    def __len__(self) -> int:
        return int(self.offsets[-1])


class GraphManifest(dict):
    """``manifest.json`` of a sharded graph (a dict; ``shards`` as volume-format ``Shard``)."""

    @property
    def shards(self) -> list[Shard]:
        return [Shard(**s) for s in self["shards"]]


def _whole(v, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def read_graph_manifest(directory: str | os.PathLike) -> GraphManifest:
    """Load and check a sharded graph's manifest. DataError: a missing directory or manifest,
    invalid JSON, another format or version, or a field out of range (naming it)."""
    directory = str(directory)
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise DataError(f"{directory}: sharded graph directory not found")
    try:
        with open_regular(path) as fh:
            d = json.load(fh)
    except FileNotFoundError:
        raise DataError(f"{path}: manifest not found (is {directory} a sharded graph? "
                        "hpcpar data graph partition writes one)") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise DataError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(d, dict):
        raise DataError(f"{path}: expected a JSON object, got a {type(d).__name__}")
    if d.get("format") != FORMAT:
        raise DataError(f"{path}: field 'format' is {d.get('format')!r}, expected {FORMAT!r}")
    if d.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: field 'format_version' is {d.get('format_version')!r}, this "
                        f"hpcpar reads version {FORMAT_VERSION}")
    for k in _FIELDS:
        if not _whole(d.get(k), 1 if k in ("parts", "num_classes") else 0):
            raise DataError(f"{path}: field '{k}' is {d.get(k)!r}, expected an integer")
    p = d["parts"]
    offsets, shards = d.get("offsets"), d.get("shards")
    if not (isinstance(offsets, list) and len(offsets) == p + 1 and offsets[0] == 0
            and offsets[-1] == d["num_nodes"] and all(_whole(o, 0) for o in offsets)
            and all(a < b for a, b in zip(offsets, offsets[1:]))):
        raise DataError(f"{path}: field 'offsets' must be {p + 1} rising vertex ids from 0 to "
                        f"{d['num_nodes']} (one non-empty range per part)")
    if not isinstance(shards, list) or len(shards) != p:
        raise DataError(f"{path}: field 'shards' must list {p} part files")
    for i, s in enumerate(shards):
        try:
            sh = Shard(**s)
        except TypeError:
            raise DataError(f"{path}: field 'shards[{i}]' is malformed (expected file, start, "
                            "count, bytes, sha256)") from None
        if (sh.start, sh.stop) != (offsets[i], offsets[i + 1]):
            raise DataError(f"{path}: field 'shards[{i}]' covers [{sh.start}, {sh.stop}), "
                            f"offsets say [{offsets[i]}, {offsets[i + 1]})")
        member_path(directory, sh.file, f"{path}: field 'shards[{i}].file'")
    if not isinstance(d.get("directed"), bool):
        raise DataError(f"{path}: field 'directed' is {d.get('directed')!r}, expected a boolean")
    return GraphManifest(d)


class PartWriter:
    """Append rows to part files as a partitioner streams over the source, so no part is ever held
    whole in memory. ``directory`` is created; one holding a manifest is replaced only with
    ``force``, and part files without a manifest never."""

    def __init__(self, directory: str | os.PathLike, parts: int, num_features: int,
                 force: bool = False):
        import h5py

        self.directory = str(directory)
        ours = os.path.exists(os.path.join(self.directory, MANIFEST))
        if ours and not force:
            raise DataError(f"{self.directory}: already holds a dataset (pass --force to "
                            "replace it)")
        clash = [part_name(p) for p in range(parts)
                 if os.path.exists(os.path.join(self.directory, part_name(p)))]
        if clash and not ours:   # never overwrite a file hpcpar did not write
            raise DataError(f"{self.directory}: {clash[0]} exists and is not part of an "
                            "hpcpar graph (no manifest.json there); choose another OUT")
        os.makedirs(self.directory, exist_ok=True)
        self.files = []
        for p in range(parts):
            f = h5py.File(os.path.join(self.directory, part_name(p)), "w")
            f.attrs.update(format=PART_FORMAT, version=FORMAT_VERSION, part=p)
            f.create_dataset("indptr", data=np.zeros(1, np.int64), maxshape=(None,),
                             chunks=(1 << 16,))
            f.create_dataset("indices", (0,), np.int64, maxshape=(None,), chunks=(1 << 18,))
            f.create_dataset("features", (0, num_features), np.float32,
                             maxshape=(None, num_features),
                             chunks=(max(1, (1 << 18) // max(num_features, 1)), num_features))
            for name, dt in (("labels", np.int64), ("original_ids", np.int64),
                             *((f"masks/{m}", bool) for m in MASKS)):
                f.create_dataset(name, (0,), dt, maxshape=(None,), chunks=(1 << 16,))
            self.files.append(f)

    @staticmethod
    def _append(ds, values) -> None:
        n = ds.shape[0]
        ds.resize(n + values.shape[0], axis=0)
        ds[n:] = values

    def append(self, part: int, indptr, indices, x, y, masks: dict, original_ids) -> None:
        """Append rows (their CSR from 0, global renumbered sources) to part ``part``."""
        f = self.files[part]
        last = int(f["indptr"][-1])
        self._append(f["indptr"], np.asarray(indptr[1:], np.int64) + last)
        self._append(f["indices"], np.asarray(indices, np.int64))
        self._append(f["features"], np.asarray(x, np.float32))
        self._append(f["labels"], np.asarray(y, np.int64))
        self._append(f["original_ids"], np.asarray(original_ids, np.int64))
        for m in MASKS:
            self._append(f[f"masks/{m}"], np.asarray(masks[m], bool))

    #: bytes a part file may take beyond its rows: HDF5 allocates each dataset's last chunk
    #: whole (see the chunk shapes above) and keeps its own metadata
    PART_OVERHEAD = 6 << 20

    @classmethod
    def bytes_needed(cls, nodes: int, edges: int, features: int, parts: int) -> int:
        """An upper bound of the part files' total size, claimed before they are written."""
        return (nodes * (4 * features + 8 * 3 + len(MASKS)) + 8 * edges
                + parts * (8 + cls.PART_OVERHEAD))

    def abort(self) -> None:
        """Remove the part files after a failed write (a partial part never stays)."""
        for p, f in enumerate(self.files):
            try:
                f.close()
            except (OSError, ValueError, RuntimeError):
                pass
            try:
                os.unlink(os.path.join(self.directory, part_name(p)))
            except OSError:
                pass
        self.files = []

    def close(self, offsets) -> list[dict]:
        """Close every part, stamping its vertex range; the shard entries (size, sha256)."""
        shards = []
        for p, f in enumerate(self.files):
            f.attrs.update(vertex_start=int(offsets[p]), vertex_stop=int(offsets[p + 1]))
            f.close()
            path = os.path.join(self.directory, part_name(p))
            shards.append(asdict(Shard(part_name(p), int(offsets[p]),
                                       int(offsets[p + 1] - offsets[p]),
                                       os.path.getsize(path), sha256_file(path))))
        return shards


def write_graph_manifest(directory: str | os.PathLike, fields: dict) -> GraphManifest:
    """Write ``manifest.json`` (strict JSON) from the header fields and the shard entries."""
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, **fields}
    with open(os.path.join(directory, MANIFEST), "w") as fh:
        json.dump(doc, fh, indent=1, allow_nan=False)
        fh.write("\n")
    return GraphManifest(doc)


def _part_path(directory: str, m: GraphManifest, p: int) -> tuple[str, Shard]:
    s = m.shards[p]
    path = member_path(directory, s.file, f"{os.path.join(directory, MANIFEST)}: field "
                                          f"'shards[{p}].file'")
    check_file(path, s.bytes)
    return path, s


def _check_part(path: str, f, m: GraphManifest, s: Shard) -> None:
    n, nf = s.count, m["num_features"]
    want = {"indptr": (n + 1,), "features": (n, nf), "labels": (n,), "original_ids": (n,),
            **{f"masks/{k}": (n,) for k in MASKS}}
    for name, shape in want.items():
        if name not in f:
            raise DataError(f"{path}: missing dataset '/{name}'")
        if tuple(f[name].shape) != shape:
            raise DataError(f"{path}: dataset '/{name}' has shape {tuple(f[name].shape)}, "
                            f"expected {shape}")
    if "indices" not in f or f["indices"].shape != (int(f["indptr"][-1]),):
        raise DataError(f"{path}: dataset '/indices' does not hold indptr[-1] entries")
    if (f.attrs.get("vertex_start"), f.attrs.get("vertex_stop")) != (s.start, s.stop):
        raise DataError(f"{path}: attrs vertex_start/vertex_stop are "
                        f"{f.attrs.get('vertex_start')}/{f.attrs.get('vertex_stop')}, manifest "
                        f"says {s.start}/{s.stop}")


def read_part(directory: str | os.PathLike, m: GraphManifest, p: int) -> dict:
    """Read part ``p`` whole: the rows one rank owns (what ``DistGraph.from_shards`` reads), as
    ``GraphFile.read_rows`` returns a block (``indices``: global renumbered ids) plus
    ``original_ids``. DataError: a missing, truncated or malformed part file, or a source id
    outside the graph."""
    directory = str(directory)
    path, s = _part_path(directory, m, p)
    with open_h5(path) as f:
        _check_part(path, f, m, s)
        out = {"indptr": f["indptr"][()], "indices": f["indices"][()],
               "x": f["features"][()], "y": f["labels"][()],
               "original_ids": f["original_ids"][()],
               **{k: f[f"masks/{k}"][()] for k in MASKS}}
    check_csr(out["indptr"], out["indices"], s.count, m["num_nodes"], f"{path}: /indptr, /indices")
    return out


def verify_graph_shards(directory: str | os.PathLike, checksum: bool = True) -> list[str]:
    """Check a sharded graph (``hpcpar data verify``; ``checksum`` compares every part file's
    sha256): every problem, one line each; empty when sound (edge total included)."""
    directory = str(directory)
    try:
        m = read_graph_manifest(directory)
    except DataError as exc:
        return [str(exc)]
    problems, edges = [], 0
    for p in range(m["parts"]):
        try:
            path, s = _part_path(directory, m, p)
            if checksum and s.sha256 != (got := sha256_file(path)):
                raise DataError(f"{path}: sha256 mismatch (file {got[:12]}..., manifest "
                                f"{s.sha256[:12]}...)")
            with open_h5(path) as f:
                _check_part(path, f, m, s)
                edges += int(f["indptr"][-1])
        except DataError as exc:
            problems.append(str(exc))
    if not problems and edges != m["num_edges"]:
        problems.append(f"{os.path.join(directory, MANIFEST)}: field 'num_edges' is "
                        f"{m['num_edges']}, the parts hold {edges}")
    return problems


def part_halo(directory: str | os.PathLike, m: GraphManifest, p: int,
              chunk: int = 1 << 22) -> tuple[int, np.ndarray]:
    """Part ``p``'s in-edges and the distinct ids of its halo (sources owned by other parts),
    reading ``/indices`` ``chunk`` entries at a time: what the planner counts per rank without
    holding a part's edges (its memory is the halo, not the part). DataError: a missing,
    truncated or malformed part file."""
    directory = str(directory)
    path, s = _part_path(directory, m, p)
    halo = [np.zeros(0, np.int64)]
    with open_h5(path) as f:
        _check_part(path, f, m, s)
        ds = f["indices"]
        edges = int(ds.shape[0])
        for lo in range(0, edges, chunk):
            ids = ds[lo:lo + chunk]
            halo.append(np.unique(ids[(ids < s.start) | (ids >= s.stop)]))
            if len(halo) > 8:       # bound the pieces held: merge them
                halo = [np.unique(np.concatenate(halo))]
    return edges, np.unique(np.concatenate(halo))
