"""The output file of ``hpcpar predict``: one array ``y`` (N, C, D, H, W) written in pieces.

Two ways, chosen by what h5py can do:

- ``mpio`` (h5py built with MPI): every rank opens ``OUT`` collectively and writes its
  hyperslabs into the one data set;
- otherwise every rank writes its pieces into ``OUT.parts/rank-NNNNN.h5`` (a data set of the
  full shape, chunked, so what a rank does not write takes no space) and ``OUT`` holds ``y``
  as an HDF5 virtual data set mapping every piece to its rank's file (paths relative to
  ``OUT``'s folder: the pair moves together). Plain h5py reads ``OUT['y']`` as one array.

Incomplete outputs are marked: ``OUT`` gets the attribute ``complete = 0`` when it is created
and ``complete = 1`` only after every rank wrote everything, with the run's record (samples,
grid, throughput, peak memory). Rules for an existing ``OUT`` (:func:`check_out`): an
incomplete prediction is restarted from scratch; anything else (a user's file, a finished
prediction) is replaced only with ``force``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from hpcpar.errors import DataError, RunDirError
from hpcpar.parallel.agree import agree

__all__ = ["KEY", "check_out", "prepare", "Output"]

KEY = "y"
MARK = "hpcpar_predict"  # attribute: this file is an hpcpar prediction (its settings, JSON)
PART = "rank-{:05d}.h5"


def parts_dir(out: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(out)}.parts")


def _ours(out: Path) -> dict | None:
    """The settings attribute of an hpcpar prediction file ``out`` (None: not one)."""
    import h5py

    try:
        with h5py.File(out, "r") as f:
            if MARK not in f.attrs:
                return None
            return {"complete": int(f.attrs.get("complete", 0)), **json.loads(f.attrs[MARK])}
    except (OSError, ValueError):
        return None


def check_out(out: str | os.PathLike, force: bool) -> str:
    """What to do with the output path: ``"new"``, ``"restart"`` (an incomplete prediction
    of ours) or ``"replace"`` (``force``). The parts folder of a run that never created
    ``OUT`` holds only rank files: it is ours too. RunDirError when ``OUT`` is a folder, or it
    (or its parts folder) exists, is not an incomplete prediction, and ``force`` is not set."""
    out, parts = Path(out), parts_dir(out)
    if out.is_dir():
        raise RunDirError(f"{out}: is a folder; --out needs an HDF5 file path")
    if not out.parent.is_dir():
        raise RunDirError(f"{out}: folder {out.parent} does not exist")
    stray = parts.exists() and not (parts.is_dir() and all(
        p.name.startswith("rank-") and p.suffix == ".h5" for p in parts.iterdir()))
    if not out.exists() and not stray:
        return "new"
    mine = _ours(out) if out.exists() else {"complete": 0}
    if mine is not None and not mine["complete"] and not stray:
        return "restart"
    if force:
        return "replace"
    what = (f"{parts} holds files hpcpar did not write" if stray else
            f"{out}: a finished prediction already exists" if mine else
            f"{out}: the file exists and is not an hpcpar prediction")
    raise RunDirError(f"{what}; pass --force to overwrite it")


def prepare(out: str | os.PathLike, force: bool) -> None:
    """:func:`check_out`, then remove what it allowed to go: an old ``OUT`` and its parts."""
    if check_out(out, force) == "new":
        return
    out, parts = Path(out), parts_dir(out)
    if out.exists() or out.is_symlink():
        out.unlink()
    if parts.is_dir():
        shutil.rmtree(parts)
    elif parts.exists():
        parts.unlink()


class Output:
    """This rank's writer of ``y`` (``shape`` (N, C, D, H, W)) into ``out``, already cleared by
    rank 0 (collective open and close). ``regions``, on rank 0: every rank's pieces,
    ``[(rank, sample, ((d0, d1), (h0, h1), (w0, w1))), ...]``, the virtual data set's map
    (unused with ``mpio``: one file written collectively); ``settings`` are stored as JSON in
    the ``hpcpar_predict`` attribute."""

    def __init__(self, out: str | os.PathLike, shape: tuple, dtype: Any, comm: Any,
                 regions: list, settings: dict, mpio: bool):
        import h5py

        self.out, self.shape, self.dtype = Path(out), tuple(shape), np.dtype(dtype)
        self.comm, self.mpio, self.settings = comm, mpio, settings
        rank = comm.Get_rank()
        chunks = (1, shape[1], *(min(n, 64) for n in shape[2:]))
        if not mpio:
            agree(comm, lambda: self._writing(lambda: self._virtual(regions)), root=0)
        mine = dict(driver="mpio", comm=comm) if mpio else {}
        path = self.out if mpio else parts_dir(self.out) / PART.format(rank)
        self.file = self._writing(lambda: h5py.File(path, "w", **mine))
        self.data = self._writing(lambda: self.file.create_dataset(
            KEY, shape, self.dtype, chunks=None if mpio else chunks))
        if mpio:
            self._mark(self.file, 0)

    def _writing(self, fn):
        """``fn()``, an OSError as one line naming the output."""
        try:
            return fn()
        except OSError as exc:
            raise DataError(f"{self.out}: cannot write ({str(exc).splitlines()[0]})") from None

    def _mark(self, f, complete: int, record: dict | None = None) -> None:
        f.attrs[MARK] = json.dumps({**self.settings, **(record or {})})
        f.attrs["complete"] = complete

    def _virtual(self, regions: list) -> None:
        """(Rank 0) the parts folder, and ``OUT`` as a virtual data set over the parts."""
        import h5py

        parts_dir(self.out).mkdir(exist_ok=True)
        layout = h5py.VirtualLayout(self.shape, self.dtype)
        parts = parts_dir(self.out).name
        for rank, sample, box in regions:
            sel = (sample, slice(None), *(slice(a, b) for a, b in box))
            source = h5py.VirtualSource(f"{parts}/{PART.format(rank)}", KEY, shape=self.shape)
            layout[sel] = source[sel]
        with h5py.File(self.out, "w") as f:
            f.create_virtual_dataset(KEY, layout, fillvalue=0)
            self._mark(f, 0)

    def write(self, sample: int, box, piece: np.ndarray) -> None:
        """``piece`` (C, d, h, w) to ``y[sample, :, box]``."""
        self.data[(sample, slice(None), *(slice(a, b) for a, b in box))] = piece

    def close(self, record: dict) -> None:
        """Flush this rank's writes; with every rank done, mark ``OUT`` complete (collective:
        a rank that failed never reaches it, so ``OUT`` stays incomplete)."""
        if self.mpio:
            self._mark(self.file, 1, record)
            self.file.close()
            return
        self.file.flush()
        self.file.close()
        self.comm.Barrier()
        if self.comm.Get_rank() == 0:
            import h5py

            with h5py.File(self.out, "r+") as f:
                self._mark(f, 1, record)
