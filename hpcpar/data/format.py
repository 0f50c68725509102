"""The sharded volume dataset format (version 1): names, manifest, chunking and checks.

A dataset is a directory::

    manifest.json            format, version, sample count, x/y shapes+dtypes, shard list
    shard-00000.h5 ...       x (n, C, D, H, W), y (n, K); root attrs: format, format_version,
                             shard_index, sample_start, sample_stop (global [start, stop))

``x`` is chunked ``(1, C, cd, ch, cw)``: one sample per chunk row and every channel in a chunk
(a rank reads all channels of its sub-volume), so a rank's hyperslab of one sample touches only
the chunks overlapping its box. Every check here raises :class:`DataError` with one line that
names the file and the field. numpy + h5py only (the prefetch process imports this).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

from hpcpar.parallel.partition import split_sizes
from .errors import DataError

FORMAT = "hpcpar-volume-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
DEFAULT_CHUNK = 32  # largest automatic chunk edge: 4 x 32^3 float32 = 512 KiB per chunk


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.h5"


def chunk_edge(n: int, target: int | None = None) -> int:
    """Chunk length on an axis of length ``n``: about ``target``, splitting ``n`` evenly.

    ``None`` (the default): at most 32 and at most a quarter of the axis, so grids of up to 4
    ranks per axis read their own quarter, not a whole small sample; 0: the whole axis."""
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


def parse_chunk(text) -> int | tuple | PerRankChunks | None:
    """``"auto"`` -> None (see :func:`chunk_edge`); ``"32"`` -> 32 (target edge on every
    axis); ``"16,128,128"`` -> per-axis targets; ``"grid:2x2x1"`` (or a 4D ``DxXxYxZ`` grid
    spec, data part ignored) -> one chunk per rank block of that spatial grid."""
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
    parts = [p for p in text.replace("x", ",").split(",") if p.strip()]
    try:
        vals = tuple(int(p) for p in parts)
    except ValueError:
        vals = ()
    if len(vals) not in (1, 3) or any(v < 0 for v in vals):
        raise DataError(f"--chunk: expected EDGE, D,H,W (non-negative integers) or "
                        f"grid:XxYxZ, got {text!r}")
    return vals[0] if len(vals) == 1 else vals


def x_chunks(sample_shape, target=None) -> tuple[int, ...]:
    """Chunk shape of ``x`` for per-sample shape (C, D, H, W); ``target`` is None (auto), one
    edge for D, H, W, a (D, H, W) triple (0 means the whole axis) or :class:`PerRankChunks`
    (the largest rank block of the balanced split on each axis)."""
    c, *spatial = sample_shape
    if isinstance(target, PerRankChunks):
        target = tuple(split_sizes(n, p)[0] for n, p in zip(spatial, target.parts))
    targets = target if isinstance(target, (tuple, list)) else (target,) * len(spatial)
    return (1, c, *(chunk_edge(n, t) for n, t in zip(spatial, targets)))


@dataclass
class Array:
    """Per-sample shape and dtype of one dataset key (``x`` or ``y``)."""

    key: str
    shape: tuple
    dtype: str
    chunks: tuple | None = None
    names: list | None = None

    def to_json(self) -> dict:
        out = {"key": self.key, "shape": list(self.shape), "dtype": self.dtype}
        if self.chunks is not None:
            out["chunks"] = list(self.chunks)
        if self.names is not None:
            out["names"] = list(self.names)
        return out

    @classmethod
    def from_json(cls, d: dict) -> "Array":
        return cls(d["key"], tuple(d["shape"]), d["dtype"],
                   tuple(d["chunks"]) if d.get("chunks") else None, d.get("names"))


@dataclass
class Shard:
    file: str
    start: int
    count: int
    bytes: int = 0
    sha256: str = ""

    @property
    def stop(self) -> int:
        return self.start + self.count


@dataclass
class Manifest:
    """``manifest.json`` of a dataset directory."""

    num_samples: int
    x: Array
    y: Array
    shards: list
    source: dict = field(default_factory=dict)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict:
        return {"format": self.format, "format_version": self.format_version,
                "num_samples": self.num_samples, "x": self.x.to_json(), "y": self.y.to_json(),
                "shards": [vars(s) for s in self.shards], "source": self.source}

    def write(self, directory: str) -> None:
        with open(os.path.join(directory, MANIFEST), "w") as fh:
            json.dump(self.to_json(), fh, indent=1)
            fh.write("\n")

    @property
    def offsets(self) -> list[int]:
        return [s.start for s in self.shards]

    def locate(self, sample: int) -> tuple[int, int]:
        """(shard index, row in shard) of global ``sample``."""
        import bisect

        s = bisect.bisect_right(self.offsets, sample) - 1
        return s, sample - self.shards[s].start


def read_manifest(directory: str) -> Manifest:
    """Load and check ``DIR/manifest.json`` (missing directory, bad JSON, wrong version)."""
    if not os.path.isdir(directory):
        raise DataError(f"{directory}: dataset directory not found")
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise DataError(f"{path}: manifest not found (is {directory} an hpcpar dataset?)")
    try:
        with open(path) as fh:
            d = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not valid JSON ({exc})") from None
    if d.get("format") != FORMAT:
        raise DataError(f"{path}: field 'format' is {d.get('format')!r}, expected {FORMAT!r}")
    if d.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: field 'format_version' is {d.get('format_version')!r}, "
                        f"this hpcpar reads version {FORMAT_VERSION}")
    try:
        m = Manifest(int(d["num_samples"]), Array.from_json(d["x"]), Array.from_json(d["y"]),
                     [Shard(**s) for s in d["shards"]], d.get("source", {}))
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{path}: missing or malformed field {exc}") from None
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


def sha256_file(path: str, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()


def check_file(path: str, expected_bytes: int | None = None) -> None:
    """Exists, starts with the HDF5 signature, and is as long as the manifest says."""
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


def open_h5(path: str, **kwargs):
    """``h5py.File(path, 'r')`` with HDF5's open errors turned into one-line DataErrors."""
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


def check_array(path: str, f, spec: Array, rows: int | None) -> None:
    """Dataset ``spec.key`` exists in open file ``f`` with (rows, *spec.shape) and dtype."""
    if spec.key not in f:
        raise DataError(f"{path}: missing dataset '{spec.key}'")
    d = f[spec.key]
    want = ((rows,) if rows is not None else (d.shape[0],)) + tuple(spec.shape)
    if tuple(d.shape) != want:
        raise DataError(f"{path}: dataset '{spec.key}' has shape {tuple(d.shape)}, "
                        f"manifest says {want}")
    if str(d.dtype) != spec.dtype:
        raise DataError(f"{path}: dataset '{spec.key}' has dtype {d.dtype}, "
                        f"manifest says {spec.dtype}")


def check_shard(directory: str, m: Manifest, index: int, checksum: bool = False) -> None:
    """Every check of one shard against the manifest (``checksum`` adds the sha256)."""
    s = m.shards[index]
    path = os.path.join(directory, s.file)
    check_file(path, s.bytes)
    if checksum and s.sha256:
        got = sha256_file(path)
        if got != s.sha256:
            raise DataError(f"{path}: sha256 mismatch (file {got[:12]}..., manifest "
                            f"{s.sha256[:12]}...)")
    with open_h5(path) as f:
        check_array(path, f, m.x, s.count)
        check_array(path, f, m.y, s.count)
        got = (f.attrs.get("sample_start"), f.attrs.get("sample_stop"))
        if got[0] is not None and (int(got[0]), int(got[1])) != (s.start, s.stop):
            raise DataError(f"{path}: attrs sample_start/sample_stop are {got[0]}/{got[1]}, "
                            f"manifest says {s.start}/{s.stop}")


def verify_dataset(directory: str, checksum: bool = True) -> list[str]:
    """All problems of a dataset, one line each (empty list: the dataset is sound)."""
    try:
        m = read_manifest(directory)
    except DataError as exc:
        return [str(exc)]
    problems = []
    for i in range(len(m.shards)):
        try:
            check_shard(directory, m, i, checksum=checksum)
        except DataError as exc:
            problems.append(str(exc))
    return problems
