"""The sharded volume dataset format (version 1): names, manifest, chunking and checks.

A dataset is a directory::

    manifest.json            format, version, sample count, x/y shapes+dtypes, shard list
    shard-00000.h5 ...       x (n, C, D, H, W), y (n, K); root attrs: format, format_version,
                             shard_index, sample_start, sample_stop (global [start, stop))

``x`` is chunked ``(1, C, cd, ch, cw)``: one sample per chunk row and every channel in a chunk
(a rank reads all channels of its sub-volume), so a rank's hyperslab of one sample touches only
the chunks overlapping its box. By default chunks span half of H and all of W (long contiguous
pieces a rank reads straight into its output); ``grid:XxYxZ`` makes one chunk per rank block. Every
check here raises :class:`DataError` with one line that names the file and the field. numpy +
h5py only (the prefetch process imports this).
"""

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
    """Open a manifest for reading (text), refusing anything but a regular file: a FIFO
    named ``manifest.json`` would block its reader forever.

    Raises:
        OSError: It cannot be opened; ``ENXIO``-like ``OSError`` for a non-regular file
            (its message says so).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path}: not a regular file")
    return os.fdopen(fd)


def shard_name(index: int) -> str:
    """Give the file name of shard ``index``, so every writer and reader agree on it.

    Args:
        index: Position of the shard in the manifest (0-based).

    Returns:
        The name, zero-padded to five digits: ``shard-00000.h5``.
    """
    return f"shard-{index:05d}.h5"


def chunk_edge(n: int, target: int | None = None) -> int:
    """Chunk length on one axis: about ``target``, splitting the axis evenly.

    Args:
        n: Length of the axis.
        target: The wanted edge. None (the default): at most 32 and at most a quarter of the
            axis, so grids of up to 4 ranks per axis read their own quarter, not a whole
            small sample; 0: the whole axis.

    Returns:
        The chunk length.
    """
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
    """Parse a ``--chunk`` option.

    Args:
        text: ``"auto"`` (or None), ``"32"`` (target edge on every axis), ``"16,128,128"``
            (per-axis targets) or ``"grid:2x2x1"`` (or a 4D ``DxXxYxZ`` grid spec, data part
            ignored: one chunk per rank block of that spatial grid).

    Returns:
        None, an int, a (D, H, W) tuple or ``PerRankChunks``, as ``x_chunks`` takes.

    Raises:
        DataError: Not one of these forms.
    """
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
    """The writer's ``chunk`` from ``--chunk`` and ``--grid`` of ``hpcpar data make/shard`` (a
    grid hint with an explicit ``--chunk`` other than auto is a contradiction).

    Raises:
        DataError: Both given, or a grid that is not DxXxYxZ / XxYxZ.
    """
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
    """The HDF5 chunk shape of ``x``.

    Args:
        sample_shape: Per-sample shape ``(C, D, H, W)``.
        target: None (auto: the D edge as ``chunk_edge`` chooses, half of H, all of W,
            halving the larger D/H edge while a chunk exceeds ``MAX_AUTO_CHUNK`` elements), one
            edge for D, H, W, a (D, H, W) triple (0 means the whole axis) or
            ``PerRankChunks`` (the largest rank block of the balanced split on each axis).

    Returns:
        ``(1, C, d, h, w)``: one sample and all channels per chunk.

    Auto chunks span W because a grid that does not split W then reads each chunk as long
    contiguous pieces straight into its output (as fast as a plain read): one piece per
    channel and D plane, or per channel when the box spans the chunk's H (a grid splitting H
    in two), so few pieces. Grids that split W read whole rows (W/z times their share), and
    grids splitting H in more than 2 read whole half-planes, unless the data is chunked for
    them (``PerRankChunks``).
    """
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
    """Per-sample shape and dtype of one dataset key (``x`` or ``y``).

    Attributes:
        key: The HDF5 dataset name in every shard.
        shape: Shape of one sample (``(C, D, H, W)`` for x; ``(K,)`` for y, or ``(D, H, W)``
            for a label volume).
        dtype: numpy dtype name.
        chunks: HDF5 chunk shape of one sample, if chunked.
        names: Names of the targets (y only).
    """

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
    """One shard file of a dataset.

    Attributes:
        file: File name, relative to the dataset directory.
        start: Global index of its first sample.
        count: Number of samples.
        bytes: File size.
        sha256: Checksum of the file ("" when not recorded).
    """

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

    Attributes:
        num_samples: Samples in the dataset.
        x: The inputs' per-sample shape and dtype.
        y: The targets' per-sample shape and dtype.
        shards: The shard files in sample order, covering ``[0, num_samples)``.
        source: How the data was made (free-form facts).
        format: ``"hpcpar-volume-shards"``.
        format_version: The format version this manifest follows.
        stats: Min/max and NaN/inf counts of x and y (empty in older datasets).
        transform: The input transform readers apply at run time (``TRANSFORMS``); the
            stored values are never transformed. ``"none"`` unless asked for when the
            dataset was made (``hpcpar data shard --transform``); ``"log1p"`` for CosmoFlow
            data.
    """

    num_samples: int
    x: Array
    y: Array
    shards: list
    source: dict = field(default_factory=dict)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    stats: dict = field(default_factory=dict)  # see value_stats(); {} in older datasets
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
        """Where a global sample is stored.

        Args:
            sample: The global sample index.

        Returns:
            ``(shard index, row in that shard)``.
        """
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
    """Load and check a dataset's ``manifest.json``.

    Args:
        directory: The dataset directory.

    Returns:
        The manifest.

    Raises:
        DataError: A missing directory or manifest, invalid JSON, another format or format
            version, or malformed fields.
    """
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
    """Join a path read from a manifest to its dataset directory, refusing any that leaves it,
    so a manifest can neither read files from elsewhere nor make staging write elsewhere.

    Args:
        directory: The dataset directory.
        name: The path as the manifest gives it (relative to ``directory``).
        field: The manifest and field it came from, for the message.

    Returns:
        ``directory/name``.

    Raises:
        DataError: ``name`` is not a non-empty string, is absolute, or resolves (``..``,
            symbolic links) outside ``directory``.
    """
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
    """Check a shard file exists, is HDF5, and is not truncated, before h5py opens it.

    Args:
        path: The shard file.
        expected_bytes: The size the manifest records; None or 0 skips the size check.

    Raises:
        DataError: The file is missing, lacks the HDF5 signature, or is shorter than
            ``expected_bytes``.
    """
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
    """Open an HDF5 file read-only, turning HDF5's long open errors into one-line DataErrors.

    Args:
        path: The file to open.
        **kwargs: Passed on to ``h5py.File``.

    Returns:
        The open ``h5py.File`` (mode ``'r'``); the caller closes it.

    Raises:
        DataError: The file is truncated, not HDF5, or cannot be opened.
    """
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
    """Check a dataset in an open shard has the shape and dtype the manifest promises.

    Args:
        path: The shard file's path (used in messages).
        f: The open shard file.
        spec: The manifest's description of the dataset (key, per-sample shape, dtype).
        rows: The number of samples the shard should hold; None accepts any.

    Raises:
        DataError: The dataset is missing or has the wrong shape or dtype.
    """
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
    """Check one shard against the manifest.

    Args:
        directory: The dataset directory.
        m: Its manifest.
        index: The shard.
        checksum: Also compare the file's sha256.
        values: Also scan every value for NaN/inf the manifest does not allow.

    Raises:
        DataError: The first problem: missing or not HDF5, wrong size, checksum, missing
            dataset, wrong shape or dtype, or unexpected NaN/inf.
    """
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
    """Find what the manifest's own stats say is wrong, without reading any shard.

    Flags NaN/inf recorded in a dataset that claims to be finite (a dataset made with NaN on
    purpose says ``finite: false``).

    Args:
        directory: The dataset directory (used in messages).
        m: Its manifest.

    Returns:
        One line per problem; empty when the stats are consistent.
    """
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
    """Check a whole dataset: what ``hpcpar data verify`` does.

    Args:
        directory: The dataset directory.
        checksum: Compare every shard's sha256 with the manifest.
        values: Scan every value for NaN/inf; same as ``checksum`` when None.

    Returns:
        Every problem, one line each; empty when the dataset is sound.
    """
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
    """Summarise an array's values so the manifest can record whether the data is finite.

    Min/max are over the finite values only (None when there are none); integer arrays are
    finite by construction.

    Args:
        a: The array (anything ``numpy.asarray`` accepts).

    Returns:
        ``{"nonfinite": count of NaN/inf, "min": ..., "max": ...}``.
    """
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
    """Combine the :func:`value_stats` of two arrays, so shards can be summarised block by block.

    Args:
        a: The running total, or None for the first block.
        b: The stats of the next array.

    Returns:
        The stats of both arrays together (a new dict).
    """
    if a is None:
        return dict(b)
    pick = {"min": min, "max": max}
    out = {"nonfinite": a["nonfinite"] + b["nonfinite"]}
    for k, f in pick.items():
        vals = [v for v in (a[k], b[k]) if v is not None]
        out[k] = f(vals) if vals else None
    return out


def dataset_stats(shards: dict) -> dict:
    """Build the manifest's ``stats`` field from the per-shard value stats.

    Args:
        shards: ``{shard file: {"x": value_stats, "y": value_stats}}``.

    Returns:
        ``{"x": {"finite", "nonfinite", "min", "max"}, "y": {...}, "shards": shards}``.
    """
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
    """Tell whether a dataset's values must be finite, so readers know when NaN/inf is corruption.

    Datasets written without stats are expected finite too: a NaN input never trains.

    Args:
        m: The dataset's manifest.
        key: Which dataset: ``'x'`` or ``'y'``.

    Returns:
        True unless the manifest records that ``key`` holds NaN/inf on purpose.
    """
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

    Cost: one ``sum`` over the batch at memory speed; the per-sample search only on failure.

    Args:
        x: The batch's inputs as read, (n, ...) (a rank's sub-volume is fine).
        y: The batch's targets as read, (n, ...).
        items: The batch's ``[(shard index, row in shard)]`` in order
            (``ShardedVolumeDataset._items``).
        manifest: The dataset's manifest.
        directory: The dataset directory (used in messages).

    Raises:
        DataError: ``x`` or ``y`` holds NaN/inf although the manifest says its values are finite.
    """
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
    """Scan every value of a shard for NaN/inf the manifest does not allow.

    Reads in blocks of about ``SCAN_BLOCK_BYTES``, so memory use stays bounded.

    Args:
        path: The shard file's path (used in messages).
        f: The open shard file.
        m: The dataset's manifest.
        s: The manifest's entry for this shard.

    Raises:
        DataError: A sample holds NaN/inf although the manifest says the dataset is finite.
    """
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
