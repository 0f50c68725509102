"""The sharded volume dataset format (version 1): names, manifest, chunking and checks.

A dataset is a directory::

    manifest.json            format, version, sample count, x/y shapes+dtypes, shard list
    shard-00000.h5 ...       x (n, C, D, H, W), y (n, K); root attrs: format, format_version,
                             shard_index, sample_start, sample_stop (global [start, stop))

``x`` is chunked ``(1, C, cd, ch, cw)``: one sample per chunk row and every channel in a chunk (a
rank reads all channels of its sub-volume), so a rank's hyperslab of one sample touches only the
chunks overlapping its box. By default chunks span half of H and all of W (long contiguous pieces a
rank reads straight into its output); ``grid:XxYxZ`` makes one chunk per rank block. Every check
here raises :class:`DataError` with one line that names the file and the field. numpy + h5py only
(the prefetch process imports this)."""

from __future__ import annotations

import bisect
import json
import math
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpcpar._digest import sha256_file
from hpcpar.errors import DataError
from hpcpar.parallel.partition import split_sizes

if TYPE_CHECKING:
    import h5py
    import numpy as np
    from numpy.typing import ArrayLike

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "shard_name", "chunk_edge", "PerRankChunks",
           "parse_chunk", "chunk_from_options", "x_chunks", "Array", "Shard", "Manifest",
           "read_manifest", "member_path", "sha256_file", "check_file", "open_h5", "check_shard",
           "verify_dataset", "value_stats", "merge_stats", "dataset_stats", "check_finite",
           "open_regular"]

FORMAT = "hpcpar-volume-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
DEFAULT_CHUNK = 32  # largest automatic chunk edge along D (H: half the axis, W: all of it)
MAX_AUTO_CHUNK = 1 << 22  # elements: automatic chunks are at most 16 MiB of float32


def open_regular(path: str | os.PathLike):
    """Open a manifest for reading (text), refusing anything but a regular file (OSError saying
    so): a FIFO named ``manifest.json`` would block its reader forever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path}: not a regular file")
    return os.fdopen(fd)


def shard_name(index: int) -> str:
    """The file name of shard ``index`` (0-based), zero-padded: ``shard-00000.h5``."""
    return f"shard-{index:05d}.h5"


def chunk_edge(n: int, target: int | None = None) -> int:
    """Chunk length on an axis of length ``n``: about ``target``, splitting the axis evenly.

    ``target`` None: at most 32 and at most a quarter of the axis, so grids of up to 4 ranks per
    axis read their own quarter, not a whole small sample; 0: the whole axis."""
    if target is None:
        target = min(DEFAULT_CHUNK, -(-n // 4))
    if target <= 0 or target >= n:
        return n
    pieces = -(-n // target)
    return -(-n // pieces)


@dataclass(frozen=True)
class PerRankChunks:
    """Chunks of one rank's block for a spatial grid (x, y, z): each rank of that grid then
    reads one chunk per sample straight into place."""

    parts: tuple


def parse_chunk(text: str | None) -> int | tuple | PerRankChunks | None:
    """Parse a ``--chunk`` option into what ``x_chunks`` takes: ``"auto"`` or None -> None,
    ``"32"`` (edge on every axis) -> int, ``"16,128,128"`` -> (D, H, W) tuple, ``"grid:2x2x1"``
    (or a 4D ``DxXxYxZ`` spec, data part ignored) -> ``PerRankChunks``; else DataError."""
    if text is None or str(text).strip().lower() == "auto":
        return None
    text = str(text).strip()
    if text.lower().startswith("grid:"):
        try:
            parts = tuple(int(p) for p in text[5:].lower().split("x"))
        except ValueError:
            parts = ()
        if len(parts) not in (3, 4) or any(p < 1 for p in parts):
            raise DataError(f"--chunk: expected grid:XxYxZ or grid:DxXxYxZ (positive "
                            f"integers), got {text!r}")
        return PerRankChunks(parts[-3:])
    pieces = [p for p in text.replace("x", ",").split(",") if p.strip()]
    try:
        vals = tuple(int(p) for p in pieces)
    except ValueError:
        vals = ()
    if len(vals) not in (1, 3) or any(v < 0 for v in vals):
        raise DataError(f"--chunk: expected EDGE, D,H,W (non-negative integers) or "
                        f"grid:XxYxZ, got {text!r}")
    return vals[0] if len(vals) == 1 else vals


def chunk_from_options(chunk: str, grid: str | None) -> int | tuple | PerRankChunks | None:
    """The writer's ``chunk`` from ``--chunk`` and ``--grid`` of ``hpcpar data make/shard``.
    DataError for both given (a contradiction) or a grid that is not DxXxYxZ / XxYxZ."""
    if grid is None:
        return parse_chunk(chunk)
    if str(chunk).strip().lower() != "auto":
        raise DataError(f"--grid {grid} and --chunk {chunk}: give one of them (--grid chooses "
                        "the chunks)")
    try:
        return parse_chunk(f"grid:{grid}")
    except DataError:
        raise DataError(f"--grid: expected DxXxYxZ or XxYxZ (positive integers), got "
                        f"{grid!r}") from None


def x_chunks(sample_shape: Sequence[int],
             target: int | Sequence[int] | PerRankChunks | None = None) -> tuple[int, ...]:
    """The HDF5 chunk shape ``(1, C, d, h, w)`` of ``x`` (one sample, all channels per chunk)
    for a sample of shape ``(C, D, H, W)``.

    ``target``: None (auto: the D edge as ``chunk_edge`` chooses, half of H, all of W, halving
    the larger D/H edge while a chunk exceeds ``MAX_AUTO_CHUNK`` elements), one edge for D, H, W,
    a (D, H, W) triple (0 means the whole axis) or ``PerRankChunks`` (the largest rank block of
    the balanced split on each axis).

    Auto chunks span W because a grid that does not split W then reads each chunk as long contiguous
    pieces straight into its output (as fast as a plain read): one piece per channel and D plane, or
    per channel when the box spans the chunk's H (a grid splitting H in two), so few pieces. Grids
    that split W read whole rows (W/z times their share), and grids splitting H in more than 2 read
    whole half-planes, unless the data is chunked for them (``PerRankChunks``)."""
    c, *spatial = sample_shape
    if target is None:
        edges = [chunk_edge(spatial[0]), chunk_edge(spatial[1], -(-spatial[1] // 2)),
                 spatial[2]]
        while c * math.prod(edges) > MAX_AUTO_CHUNK and max(edges[:-1]) > 1:
            i = edges.index(max(edges[:-1]))
            edges[i] = chunk_edge(spatial[i], edges[i] // 2)
        return (1, c, *edges)
    if isinstance(target, PerRankChunks):
        target = tuple(split_sizes(n, p)[0] for n, p in zip(spatial, target.parts))
    targets = target if isinstance(target, (tuple, list)) else (target,) * len(spatial)
    return (1, c, *(chunk_edge(n, t) for n, t in zip(spatial, targets)))


@dataclass
class Array:
    """Per-sample shape and dtype of one dataset key (``x`` or ``y``): ``key`` is the HDF5
    dataset name in every shard; ``shape`` is ``(C, D, H, W)`` for x, ``(K,)`` for y or ``(D, H,
    W)`` for a label volume; ``dtype`` a numpy dtype name; ``names`` the targets' (y only)."""

    key: str
    shape: tuple
    dtype: str
    chunks: tuple | None = None
    names: list | None = None

    def to_json(self) -> dict:
        """The manifest's JSON form of this entry."""
        out = {"key": self.key, "shape": list(self.shape), "dtype": self.dtype}
        if self.chunks is not None:
            out["chunks"] = list(self.chunks)
        if self.names is not None:
            out["names"] = list(self.names)
        return out

    @classmethod
    def from_json(cls, d: dict) -> Array:
        """Read an entry back from its JSON form."""
        return cls(d["key"], tuple(d["shape"]), d["dtype"],
                   tuple(d["chunks"]) if d.get("chunks") else None, d.get("names"))


@dataclass
class Shard:
    """One shard file of a dataset: ``file`` relative to the dataset directory, ``start`` the
    global index of its first sample, ``sha256`` "" when not recorded."""

    file: str
    start: int
    count: int
    bytes: int = 0
    sha256: str = ""

    @property
    def stop(self) -> int:
        """One past the global index of its last sample."""
        return self.start + self.count


@dataclass
class Manifest:
    """``manifest.json`` of a dataset directory (format: ``docs/guides/data.md``).

    ``shards`` are in sample order, covering ``[0, num_samples)``; ``source`` is free-form facts on
    how the data was made; ``stats`` min/max and NaN/inf counts of x and y (see :func:`value_stats`;
    empty in older datasets). ``transform`` is the input transform readers apply at run time
    (``TRANSFORMS``; the stored values are never transformed): ``"none"`` unless asked for when the
    dataset was made (``hpcpar data shard --transform``); ``"log1p"`` for CosmoFlow data."""

    num_samples: int
    x: Array
    y: Array
    shards: list
    source: dict = field(default_factory=dict)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    stats: dict = field(default_factory=dict)
    transform: str = "none"

    def to_json(self) -> dict:
        """The ``manifest.json`` document."""
        out = {"format": self.format, "format_version": self.format_version,
               "num_samples": self.num_samples, "x": self.x.to_json(), "y": self.y.to_json(),
               "shards": [vars(s) for s in self.shards], "source": self.source,
               "transform": self.transform}
        if self.stats:
            out["stats"] = self.stats
        return out

    def write(self, directory: str) -> None:
        """Write ``directory/manifest.json`` (strict JSON)."""
        with open(os.path.join(directory, MANIFEST), "w") as fh:
            json.dump(self.to_json(), fh, indent=1, allow_nan=False)
            fh.write("\n")

    @property
    def voxel_targets(self) -> bool:
        """Whether ``y`` is a label volume, ``(D, H, W)`` like x's sample (segmentation),
        rather than per-sample targets ``(K,)``."""
        return len(self.y.shape) == 3 and tuple(self.y.shape) == tuple(self.x.shape[1:])

    @property
    def offsets(self) -> list[int]:
        """Global index of each shard's first sample."""
        return [s.start for s in self.shards]

    def locate(self, sample: int) -> tuple[int, int]:
        """``(shard index, row in that shard)`` of a global sample."""
        s = bisect.bisect_right(self.offsets, sample) - 1
        return s, sample - self.shards[s].start


#: Input transforms a dataset may ask readers to apply at run time.
TRANSFORMS = ("none", "log1p")


def _transform_of(d: dict) -> str:
    """The manifest's transform; manifests written before the field existed: ``log1p`` for
    the CosmoFlow generator's data (what those runs applied), else ``none``."""
    if "transform" in d:
        return d["transform"]
    return "log1p" if (d.get("source") or {}).get("generator") == "cosmoflow" else "none"


def _check_numbers(path: str, m: Manifest) -> None:
    """The manifest's shapes and sample ranges are whole numbers in range (a string shape or a
    negative count is one line here, not a failure deep in a reader)."""
    def whole(v, lo: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo

    if not whole(m.num_samples, 0):
        raise DataError(f"{path}: field 'num_samples' is {m.num_samples!r}, expected an "
                        "integer >= 0")
    for name, a in (("x", m.x), ("y", m.y)):
        if not isinstance(a.key, str) or not a.key:
            raise DataError(f"{path}: field '{name}.key' is {a.key!r}, expected a dataset name")
        if not isinstance(a.dtype, str):
            raise DataError(f"{path}: field '{name}.dtype' is {a.dtype!r}, expected a numpy "
                            "dtype name such as 'float32'")
        if not all(whole(n, 1) for n in a.shape):
            raise DataError(f"{path}: field '{a.key}.shape' is {list(a.shape)!r}, expected "
                            "positive integers")
        if a.chunks is not None and not all(whole(n, 1) for n in a.chunks):
            raise DataError(f"{path}: field '{name}.chunks' is {list(a.chunks)!r}, expected "
                            "positive integers")
        if a.names is not None and not (isinstance(a.names, list)
                                        and all(isinstance(n, str) for n in a.names)):
            raise DataError(f"{path}: field '{name}.names' is {a.names!r}, expected a list of "
                            "names")
        if not isinstance(m.stats.get(name) or {}, dict):
            raise DataError(f"{path}: field 'stats.{name}' is {m.stats.get(name)!r}, expected "
                            "a JSON object")
    if not isinstance(m.source, dict):
        raise DataError(f"{path}: field 'source' is {m.source!r}, expected a JSON object")
    for i, s in enumerate(m.shards):
        for name, lo in (("start", 0), ("count", 1), ("bytes", 0)):
            if not whole(getattr(s, name), lo):
                raise DataError(f"{path}: field 'shards[{i}].{name}' is "
                                f"{getattr(s, name)!r}, expected an integer >= {lo}")
        if not isinstance(s.sha256, str):
            raise DataError(f"{path}: field 'shards[{i}].sha256' is {s.sha256!r}, expected a "
                            "hex string")


def _no_constant(name: str):
    """json's hook for NaN/Infinity: a manifest is strict JSON (hpcpar never writes them)."""
    raise ValueError(f"{name} is not a JSON number")


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """Load and check a dataset's ``manifest.json``. DataError for a missing directory or
    manifest, invalid JSON, another format or format version, or malformed fields."""
    if not os.path.isdir(directory):
        raise DataError(f"{directory}: dataset directory not found")
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise DataError(f"{path}: manifest not found (is {directory} an hpcpar dataset?)")
    try:
        with open_regular(path) as fh:
            d = json.load(fh, parse_constant=_no_constant)
    except (OSError, UnicodeDecodeError, ValueError) as exc:   # invalid JSON, NaN, 5000 digits
        raise DataError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise DataError(f"{path}: not valid JSON (arrays or objects nest too deeply)") from None
    if not isinstance(d, dict):
        raise DataError(f"{path}: expected a JSON object, got a {type(d).__name__}")
    if d.get("format") != FORMAT:
        raise DataError(f"{path}: field 'format' is {d.get('format')!r}, expected {FORMAT!r}")
    if d.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: field 'format_version' is {d.get('format_version')!r}, "
                        f"this hpcpar reads version {FORMAT_VERSION}")
    try:
        m = Manifest(d["num_samples"], Array.from_json(d["x"]), Array.from_json(d["y"]),
                     [Shard(**s) for s in d["shards"]], d.get("source", {}),
                     stats=dict(d.get("stats") or {}), transform=_transform_of(d))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DataError(f"{path}: missing or malformed field {exc}") from None
    _check_numbers(path, m)
    if m.transform not in TRANSFORMS:
        raise DataError(f"{path}: field 'transform' is {m.transform!r}, expected one of "
                        f"{', '.join(TRANSFORMS)}")
    for i, s in enumerate(m.shards):
        member_path(directory, s.file, f"{path}: field 'shards[{i}].file'")
    expect = 0
    for s in m.shards:
        if s.start != expect:
            raise DataError(f"{path}: shard {s.file} field 'start' is {s.start}, "
                            f"expected {expect}")
        expect = s.stop
    if expect != m.num_samples:
        raise DataError(f"{path}: shards hold {expect} samples, field 'num_samples' says "
                        f"{m.num_samples}")
    return m


def member_path(directory: str | os.PathLike, name: object, field: str) -> str:
    """``directory/name`` for a path ``name`` read from a manifest's ``field`` (named in the
    message), refusing (DataError) one that is not a non-empty string, is absolute, or resolves
    (``..``, symbolic links) outside ``directory``: a manifest can neither read files from
    elsewhere nor make staging write elsewhere."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise DataError(f"{field} is {name!r}: expected a file name inside the dataset directory")
    if os.path.isabs(name):
        raise DataError(f"{field} is {name!r}: an absolute path; a manifest may name only "
                        "files inside its dataset directory")
    root = os.path.realpath(directory)
    full = os.path.join(directory, name)
    if os.path.commonpath([root, os.path.realpath(full)]) != root:
        raise DataError(f"{field} is {name!r}: outside the dataset directory {directory}; a "
                        "manifest may name only files inside it")
    return full


def check_file(path: str, expected_bytes: int | None = None) -> None:
    """Check a shard file exists, is HDF5, and is not shorter than ``expected_bytes`` (None or 0
    skips that), before h5py opens it; DataError if not."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: shard file not found")
    with open(path, "rb") as fh:
        head = fh.read(len(HDF5_SIGNATURE))
    if head != HDF5_SIGNATURE:
        raise DataError(f"{path}: not an HDF5 file")
    size = os.path.getsize(path)
    if expected_bytes and size < expected_bytes:
        raise DataError(f"{path}: truncated file ({size} bytes, manifest says "
                        f"{expected_bytes})")


def open_h5(path: str, **kwargs: Any) -> h5py.File:
    """Open an HDF5 file read-only (the caller closes it), turning HDF5's long open errors
    (truncated, not HDF5, cannot open) into one-line DataErrors."""
    import h5py

    try:
        return h5py.File(path, "r", **kwargs)
    except OSError as exc:
        text = str(exc)
        if "truncated" in text:
            raise DataError(f"{path}: truncated file") from None
        if "signature" in text or "not an HDF5" in text.lower():
            raise DataError(f"{path}: not an HDF5 file") from None
        raise DataError(f"{path}: cannot open as HDF5 ({text.splitlines()[0]})") from None


def check_array(path: str, f: h5py.File, spec: Array, rows: int | None) -> None:
    """Check a dataset in an open shard is there, holds its own data and has the shape (``rows``
    samples; None accepts any) and dtype the manifest promises; DataError if not."""
    if spec.key not in f:
        raise DataError(f"{path}: missing dataset '{spec.key}'")
    d = f[spec.key]
    if d.is_virtual or d.external or d.file.filename != f.filename:
        how = "a virtual dataset" if d.is_virtual else "external storage" if d.external else \
            f"a link to {d.file.filename}"
        raise DataError(f"{path}: dataset '{spec.key}' is {how}: its data live outside the "
                        "shard file (and its checksum); a shard must hold its own data")
    want = ((rows,) if rows is not None else (d.shape[0],)) + tuple(spec.shape)
    if tuple(d.shape) != want:
        raise DataError(f"{path}: dataset '{spec.key}' has shape {tuple(d.shape)}, "
                        f"manifest says {want}")
    if str(d.dtype) != spec.dtype:
        raise DataError(f"{path}: dataset '{spec.key}' has dtype {d.dtype}, "
                        f"manifest says {spec.dtype}")


def check_shard(directory: str | os.PathLike, m: Manifest, index: int, checksum: bool = False,
                values: bool = False) -> None:
    """Check one shard against the manifest, also its sha256 if ``checksum`` and every value for
    NaN/inf the manifest does not allow if ``values``. DataError on the first problem."""
    s = m.shards[index]
    path = member_path(directory, s.file, f"{os.path.join(directory, MANIFEST)}: field "
                                          f"'shards[{index}].file'")
    check_file(path, s.bytes)
    if checksum and not s.sha256:
        raise DataError(f"{os.path.join(directory, MANIFEST)}: field 'shards[{index}].sha256' "
                        f"is missing: {s.file} cannot be verified")
    if checksum:
        got = sha256_file(path)
        if got != s.sha256:
            raise DataError(f"{path}: sha256 mismatch (file {got[:12]}..., manifest "
                            f"{s.sha256[:12]}...)")
    with open_h5(path) as f:
        check_array(path, f, m.x, s.count)
        check_array(path, f, m.y, s.count)
        bounds = (f.attrs.get("sample_start"), f.attrs.get("sample_stop"))
        if bounds[0] is not None and (int(bounds[0]), int(bounds[1])) != (s.start, s.stop):
            raise DataError(f"{path}: attrs sample_start/sample_stop are {bounds[0]}/{bounds[1]}, "
                            f"manifest says {s.start}/{s.stop}")
        if values:
            check_values(path, f, m, s)


def manifest_problems(directory: str | os.PathLike, m: Manifest) -> list[str]:
    """One line per problem the manifest's own stats show, without reading any shard: NaN/inf
    recorded in a dataset that claims to be finite (one made with NaN on purpose says ``finite:
    false``)."""
    path = os.path.join(directory, MANIFEST)
    problems = []
    for key in ("x", "y"):
        st = m.stats.get(key) or {}
        if st.get("finite", True) is not False and st.get("nonfinite"):
            problems.append(f"{path}: field 'stats.{key}.nonfinite' is {st['nonfinite']} "
                            f"(NaN/inf values), but 'stats.{key}.finite' says finite")
    return problems


def verify_dataset(directory: str | os.PathLike, checksum: bool = True,
                   values: bool | None = None) -> list[str]:
    """Check a whole dataset (``hpcpar data verify``): every problem, one line each, empty when
    sound. ``checksum`` compares every shard's sha256; ``values`` (default: as ``checksum``)
    scans every value for NaN/inf."""
    try:
        m = read_manifest(directory)
    except DataError as exc:
        return [str(exc)]
    problems = manifest_problems(directory, m)
    for i in range(len(m.shards)):
        try:
            check_shard(directory, m, i, checksum=checksum,
                        values=checksum if values is None else values)
        except DataError as exc:
            problems.append(str(exc))
    return problems


# -- value statistics: is the data finite? ------------------------------------------------------
SCAN_BLOCK_BYTES = 64 << 20  # verify reads x in blocks of about this size


def value_stats(a: ArrayLike) -> dict:
    """``{"nonfinite": count of NaN/inf, "min": ..., "max": ...}`` of an array, so the manifest
    can record whether the data is finite. Min/max are over the finite values only (None when
    there are none); integer arrays are finite by construction."""
    import numpy as np

    a = np.asarray(a)
    if a.size == 0:
        return {"nonfinite": 0, "min": None, "max": None}
    if a.dtype.kind not in "fc":
        if a.dtype.kind not in "iub":
            return {"nonfinite": 0, "min": None, "max": None}
        return {"nonfinite": 0, "min": a.min().item(), "max": a.max().item()}
    if np.isfinite(a.sum()):  # a finite sum has no NaN and no inf in it: the cheap common case
        bad, vals = 0, a
    else:
        ok = np.isfinite(a)
        bad = int(a.size - np.count_nonzero(ok))
        vals = a[ok]
    if a.dtype.kind == "c" or vals.size == 0:
        return {"nonfinite": bad, "min": None, "max": None}
    return {"nonfinite": bad, "min": float(vals.min()), "max": float(vals.max())}


def merge_stats(a: dict | None, b: dict) -> dict:
    """Combine the :func:`value_stats` of two arrays (a new dict), so shards can be summarised
    block by block; ``a`` None for the first block."""
    if a is None:
        return dict(b)
    pick = {"min": min, "max": max}
    out = {"nonfinite": a["nonfinite"] + b["nonfinite"]}
    for k, f in pick.items():
        vals = [v for v in (a[k], b[k]) if v is not None]
        out[k] = f(vals) if vals else None
    return out


def dataset_stats(shards: dict) -> dict:
    """The manifest's ``stats`` field, ``{"x": {"finite", "nonfinite", "min", "max"}, "y": {...},
    "shards": shards}``, from ``shards = {shard file: {"x": value_stats, "y": value_stats}}``."""
    out: dict = {}
    for key in ("x", "y"):
        total = None
        for s in shards.values():
            total = merge_stats(total, s[key])
        total = total or {"nonfinite": 0, "min": None, "max": None}
        out[key] = {"finite": total["nonfinite"] == 0, **total}
    out["shards"] = shards
    return out


def expects_finite(m: Manifest, key: str = "x") -> bool:
    """Whether ``key``'s values must be finite (NaN/inf then is corruption): True unless the
    manifest records NaN/inf on purpose; without stats too, as a NaN input never trains."""
    return (m.stats.get(key) or {}).get("finite", True) is not False


def _first_nonfinite(arr) -> int | None:
    """Index along axis 0 of the first sample of ``arr`` holding NaN/inf, or None."""
    import numpy as np

    if arr.dtype.kind not in "fc" or np.isfinite(arr.sum()):
        return None
    ok = np.isfinite(arr.reshape(len(arr), -1)).all(axis=1)
    return None if ok.all() else int(np.argmin(ok))


def check_finite(x: np.ndarray, y: np.ndarray, items: Sequence[tuple[int, int]],
                 manifest: Manifest, directory: str = "") -> None:
    """Catch NaN/inf in a batch as it is read, naming the shard and sample it came from.

    ``x``, ``y`` are (n, ...) as read (a rank's sub-volume is fine), ``items`` the batch's ``[(shard
    index, row in shard)]`` in order (``ShardedVolumeDataset._items``). DataError when either holds
    NaN/inf although the manifest says its values are finite. Cost: one ``sum`` over the batch at
    memory speed; the per-sample search only on failure."""
    for spec, arr in ((manifest.x, x), (manifest.y, y)):
        if not expects_finite(manifest, spec.key):
            continue
        k = _first_nonfinite(arr)
        if k is not None:
            shard, row = items[k][:2]
            s = manifest.shards[shard]
            raise DataError(f"{os.path.join(directory, s.file)}: sample {s.start + row} (row "
                            f"{row}) holds NaN/inf in '{spec.key}', but the manifest says the "
                            f"dataset is finite (corrupt shard? run `hpcpar data verify`)")


def check_values(path: str, f: h5py.File, m: Manifest, s: Shard) -> None:
    """Scan every value of shard ``s`` for NaN/inf the manifest does not allow (DataError), in
    blocks of about ``SCAN_BLOCK_BYTES`` so memory use stays bounded."""
    import numpy as np

    for spec in (m.x, m.y):
        if not expects_finite(m, spec.key):
            continue
        d = f[spec.key]
        per = max(1, int(np.prod(spec.shape)) * np.dtype(spec.dtype).itemsize)
        block = max(1, SCAN_BLOCK_BYTES // per)
        for a in range(0, s.count, block):
            k = _first_nonfinite(d[a:a + block])
            if k is not None:
                raise DataError(f"{path}: sample {s.start + a + k} (row {a + k}) holds NaN/inf "
                                f"in '{spec.key}' (the manifest says the dataset is finite)")
