"""Users' own volumes as a writer source: image files, with label volumes or per-sample
targets, for ``hpcpar data shard OUT --images ... --labels ...``.

One file per sample: ``.npy``, ``.npz`` (its one array), NIfTI ``.nii``/``.nii.gz`` (nibabel, ``pip
install 'hpcpar[imaging]'``), TIFF stacks ``.tif``/``.tiff`` (tifffile, the same extra) or
``.h5``/``.hdf5`` (its one dataset). An image is ``(D, H, W)`` or ``(C, D, H, W)`` (NIfTI's channels
come last: ``(X, Y, Z, C)``); a label volume ``(D, H, W)``. Images and labels pair by file stem
(``case7.nii.gz`` with ``case7.nii.gz`` in the labels folder); per-sample targets come from a CSV
file whose first column is the stem. Only each file's header is read up front (shapes);
:meth:`VolumeFiles.read` loads the few samples the writer asks for, so memory is bounded by a block
of samples, not by the data set."""

from __future__ import annotations

import csv
import glob
import importlib
import os
from collections.abc import Sequence

import numpy as np

from hpcpar.errors import DataError

__all__ = ["stem", "expand", "VolumeFiles"]

#: the file endings read, longest first (``.nii.gz`` before ``.gz``)
EXTENSIONS = (".nii.gz", ".nii", ".npy", ".npz", ".tiff", ".tif", ".hdf5", ".h5")

_EXTRA = {"nibabel": "NIfTI", "tifffile": "TIFF"}


def stem(path: str) -> str:
    """The file name without its volume extension: the key images and labels pair by."""
    name = os.path.basename(path)
    for ext in EXTENSIONS:
        if name.lower().endswith(ext):
            return name[:-len(ext)]
    return os.path.splitext(name)[0]


def expand(pattern: str, option: str) -> list[str]:
    """The sorted volume files of a glob pattern or a folder; one line when none match."""
    if os.path.isdir(pattern):
        files = [os.path.join(pattern, n) for n in os.listdir(pattern)]
    else:
        files = glob.glob(os.path.expanduser(pattern))
    files = sorted(f for f in files if os.path.isfile(f) and f.lower().endswith(EXTENSIONS))
    if not files:
        raise DataError(f"{option} {pattern!r}: no volume files ({', '.join(EXTENSIONS)}) "
                        f"match (working directory {os.getcwd()})")
    return files


def _module(name: str, path: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        raise DataError(f"{path}: reading {_EXTRA[name]} needs {name} (pip install "
                        f"'hpcpar[imaging]')") from None


def _one_array(path: str, names: Sequence[str], what: str) -> str:
    if len(names) != 1:
        raise DataError(f"{path}: expected one {what}, found {len(names)} "
                        f"({', '.join(names) or 'none'})")
    return names[0]


def _open(path: str, load: bool):
    """The array of one file: its shape when not ``load`` (headers only), else the values
    (NIfTI's trailing channel axis moved first)."""
    low = path.lower()
    try:
        if low.endswith(".npy"):
            a = np.load(path, mmap_mode="r", allow_pickle=False)
            return np.asarray(a) if load else a.shape
        if low.endswith(".npz"):
            with np.load(path, allow_pickle=False) as z:
                key = _one_array(path, z.files, "array")
                return z[key] if load else z[key].shape
        if low.endswith((".nii", ".nii.gz")):
            img = _module("nibabel", path).load(path)
            shape = tuple(img.shape)
            if not load:
                return shape if len(shape) != 4 else (shape[3], *shape[:3])
            a = np.asanyarray(img.dataobj)
            return np.moveaxis(a, -1, 0) if a.ndim == 4 else a
        if low.endswith((".tif", ".tiff")):
            tifffile = _module("tifffile", path)
            if load:
                return tifffile.imread(path)
            with tifffile.TiffFile(path) as t:
                return tuple(t.series[0].shape)
        import h5py

        with h5py.File(path, "r") as f:
            names: list[str] = []
            f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
            d = f[_one_array(path, names, "dataset")]
            return d[()] if load else tuple(d.shape)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - any reader's failure: one line naming the file
        raise DataError(f"{path}: cannot read ({type(exc).__name__}: "
                        f"{(str(exc).splitlines() or [''])[0]})") from None


def _fit(a: np.ndarray, size: tuple, pad: bool, path: str) -> np.ndarray:
    """``a`` (..., D, H, W) centre-cropped to ``size``; zero-padded (centred) where smaller
    when ``pad``, else refused."""
    spatial = a.shape[-3:]
    if not pad and any(n < s for n, s in zip(spatial, size)):
        raise DataError(f"{path}: volume {'x'.join(map(str, spatial))} is smaller than --size "
                        f"{'x'.join(map(str, size))} (add --pad to zero-pad it)")
    crop = tuple(slice((n - s) // 2, (n - s) // 2 + s) if n > s else slice(None)
                 for n, s in zip(spatial, size))
    index: tuple = (Ellipsis, *crop)
    a = a[index]
    widths = [(0, 0)] * (a.ndim - 3) + [((s - n) // 2, s - n - (s - n) // 2)
                                         for n, s in zip(a.shape[-3:], size)]
    return np.pad(a, widths) if any(w != (0, 0) for w in widths) else a


class VolumeFiles:
    """Image files, in sample order, and their label volumes (paired by stem) or per-sample
    targets (a CSV file: header row, first column the stem) as a writer source.

    ``size`` crops (and with ``pad`` zero-pads) every volume to this ``(D, H, W)``; None: every
    volume must have the same size. DataError, one line naming the file: a missing partner, a file
    that cannot be read, volumes of different sizes (without ``size``), labels of another size than
    their image, or a malformed targets file."""

    transform = "none"

    def __init__(self, images: Sequence[str], labels: Sequence[str] | None = None,
                 targets: str | None = None, size: tuple | None = None, pad: bool = False):
        if labels is not None and targets is not None:
            raise DataError("--labels and --targets: give one (a label volume or per-sample "
                            "targets)")
        if labels is None and targets is None:
            raise DataError("--images: give --labels (label volumes) or --targets FILE.csv "
                            "(per-sample targets)")
        self.images = list(images)
        self.name = os.path.dirname(self.images[0]) or "."
        self.keys = {"x": "--images", "y": "--labels" if labels is not None else "--targets"}
        self.size, self.pad = size, pad
        stems = [stem(p) for p in self.images]
        self._unique(stems, self.images, "--images")
        self.labels: list[str] | None = None
        self.target_names: list[str] | None = None
        self._targets: np.ndarray | None = None
        if labels is not None:
            by_stem = dict(zip(self._unique([stem(p) for p in labels], labels, "--labels"),
                               labels))
            missing = [p for p, s in zip(self.images, stems) if s not in by_stem]
            if missing:
                raise DataError(f"{missing[0]}: no label file with stem {stem(missing[0])!r} "
                                f"among --labels" + (f" (and {len(missing) - 1} more images "
                                                     f"without one)" if len(missing) > 1 else ""))
            extra = sorted(set(by_stem) - set(stems))
            if extra:
                raise DataError(f"{by_stem[extra[0]]}: no image file with stem {extra[0]!r} "
                                f"among --images")
            self.labels = [by_stem[s] for s in stems]
        else:
            assert targets is not None
            self._targets, self.target_names = self._read_targets(targets, stems)
        self._describe()
        self.attrs = {"images": os.path.abspath(self.name), "files": len(self.images),
                      "targets": "labels" if self.labels else "csv"}

    @staticmethod
    def _unique(stems: list[str], paths: Sequence[str], option: str) -> list[str]:
        seen: dict[str, str] = {}
        for s, p in zip(stems, paths):
            if s in seen:
                raise DataError(f"{option}: {seen[s]} and {p} have the same stem {s!r} (files "
                                f"pair by stem)")
            seen[s] = p
        return stems

    @staticmethod
    def _read_targets(path: str, stems: list[str]) -> tuple[np.ndarray, list[str]]:
        try:
            with open(path, newline="") as fh:
                rows = [r for r in csv.reader(fh) if r]
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"--targets {path}: cannot read ({exc})") from None
        if len(rows) < 2 or len(rows[0]) < 2:
            raise DataError(f"--targets {path}: expected a header row and one row per image "
                            f"(stem, target, ...)")
        header, table = rows[0], {}
        for line, row in enumerate(rows[1:], start=2):
            if len(row) != len(header):
                raise DataError(f"--targets {path}: line {line} has {len(row)} fields, the "
                                f"header {len(header)}")
            try:
                table[row[0].strip()] = [float(v) for v in row[1:]]
            except ValueError:
                raise DataError(f"--targets {path}: line {line}: {row[1:]} are not all "
                                f"numbers") from None
        missing = [s for s in stems if s not in table]
        if missing:
            raise DataError(f"--targets {path}: no row for image stem {missing[0]!r}"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return (np.asarray([table[s] for s in stems], dtype=np.float32),
                [h.strip() for h in header[1:]])

    def _describe(self) -> None:
        """Shapes from the headers: every image the same size (or fitted to ``size``), and
        each label volume the size of its image."""
        shapes = {}
        for p in self.images:
            shape = tuple(_open(p, load=False))
            if len(shape) not in (3, 4):
                raise DataError(f"{p}: shape {shape}, expected (D, H, W) or (C, D, H, W)")
            shapes[p] = shape
        channels = {s[0] if len(s) == 4 else 1 for s in shapes.values()}
        if len(channels) > 1:
            raise DataError(f"--images: the images have different channel counts "
                            f"{sorted(channels)}")
        sizes = sorted({s[-3:] for s in shapes.values()})
        if self.size is None and len(sizes) > 1:
            shown = ", ".join("x".join(map(str, s)) for s in sizes[:4])
            raise DataError(f"--images: volumes of different sizes ({shown}"
                            f"{', ...' if len(sizes) > 4 else ''}); choose one with --size "
                            f"DxHxW (centre crop, --pad to zero-pad smaller ones)")
        for i, p in enumerate(self.labels or ()):
            shape = tuple(_open(p, load=False))
            image = shapes[self.images[i]][-3:]
            if shape != image:
                raise DataError(f"{p}: label volume {'x'.join(map(str, shape))}, its image "
                                f"{self.images[i]} is {'x'.join(map(str, image))}")
        size = self.size or sizes[0]
        self.x_shape = (channels.pop(), *size)
        self.x_dtype = np.dtype(np.float32)
        self.y_dtype: np.dtype
        if self.labels is not None:
            self.y_shape = tuple(size)
            self.y_dtype = np.dtype(np.int64)   # class labels, as cross entropy takes them
        else:
            assert self._targets is not None
            self.y_shape = (self._targets.shape[1],)
            self.y_dtype = np.dtype(np.float32)

    def __len__(self) -> int:
        return len(self.images)

    def _load(self, path: str) -> np.ndarray:
        a = _open(path, load=True)
        return _fit(a, self.size, self.pad, path) if self.size is not None else a

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Samples ``[start, stop)``: x ``(n, C, D, H, W)`` float32, y ``(n, D, H, W)`` labels
        or ``(n, K)`` targets."""
        x = np.empty((stop - start, *self.x_shape), self.x_dtype)
        y = np.empty((stop - start, *self.y_shape), self.y_dtype)
        for j, i in enumerate(range(start, stop)):
            x[j] = self._load(self.images[i]).reshape(self.x_shape)
            if self.labels is not None:
                lab = self._load(self.labels[i])
                if lab.dtype.kind == "f" and not np.array_equal(lab, np.round(lab)):
                    raise DataError(f"{self.labels[i]}: label volume holds non-integer values "
                                    f"(class labels expected)")
                y[j] = lab
            else:
                assert self._targets is not None
                y[j] = self._targets[i]
        return x, y

    def close(self) -> None:
        """Nothing stays open between reads."""
