"""The checkpoint's file protocol: directory and file names, the manifest, the atomic commit,
rotation, and reading a manifest back (:mod:`hpcpar.run.checkpoint`).

Writing is collective: every rank writes its file into ``.tmp-step-000100/`` and fsyncs it,
rank 0 and the last rank add the shared files (:func:`writes`), rank 0 the manifest, fsyncs,
renames the directory to its final name (atomic on POSIX) and fsyncs the parent, then prunes
to the newest ``keep``. A crash at any moment leaves either the previous set or the complete
new one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from hpcpar._digest import sha256_file
from hpcpar.errors import RunDirError
from hpcpar.parallel.agree import agree

__all__ = ["MANIFEST", "FORMAT_VERSION", "PREFIX", "step_dir_name", "rank_file", "checkpoint_step",
           "list_checkpoints", "read_manifest", "verify", "grid_shape", "temp_dir", "prepare",
           "writer", "writes", "write_part", "commit", "finish", "save", "write_and_commit",
           "rotated", "CORRUPT_SUFFIX", "set_aside"]

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
PREFIX = "step-"
_TEMP = ".tmp-"   # marks a checkpoint's directory until its rename (temp_dir)


def step_dir_name(step: int) -> str:
    """``step-`` and the step zero-padded to six digits."""
    return f"{PREFIX}{step:06d}"


def rank_file(rank: int) -> str:
    """The per-rank state file of a checkpoint: ``rank-`` and the rank zero-padded to five
    digits, then ``.pt``."""
    return f"rank-{rank:05d}.pt"


# -- files -----------------------------------------------------------------------------------------
def _fsync_path(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save(obj, path: Path) -> dict:
    """Write ``obj`` to ``path`` durably; its checksum is taken from the bytes written (no
    second read of the file: a checkpoint every step pays for every pass over its bytes)."""
    import torch

    with open(path, "wb") as f:
        out = _Hashing(f)
        torch.save(obj, out)  # type: ignore[arg-type]  # a file: no full copy in memory
        f.flush()
        os.fsync(f.fileno())
        if hasattr(os, "posix_fadvise"):   # its cached pages would count against the rank's
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)   # memory limit
    return {"sha256": out.sha.hexdigest(), "bytes": out.size}


class _Hashing:
    """A file that hashes what is written to it (what :func:`_save` gives ``torch.save``)."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(memoryview(data).cast("B"))
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _remove(path: Path) -> None:
    """Delete a checkpoint so that a kill midway never leaves a part of it under its name:
    renamed out of the ``step-N`` names first (atomic), then removed; best effort, as
    rotation always was (a checkpoint that cannot be renamed stays whole)."""
    doomed = path.with_name(f".old-{path.name}")
    shutil.rmtree(doomed, ignore_errors=True)     # left by a kill during an earlier removal
    try:
        os.rename(path, doomed)
    except OSError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step a checkpoint directory's name states: ``step-`` and ASCII digits, named as
    :func:`step_dir_name` names it; None for any other name (not a checkpoint of hpcpar's)."""
    name = Path(path).name
    digits = name[len(PREFIX):]
    if not name.startswith(PREFIX) or not digits.isascii() or not digits.isdigit():
        return None
    step = int(digits)
    return step if step_dir_name(step) == name else None


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[Path]:
    """The finished ``step-N`` checkpoint directories, newest (highest step) first; empty when
    ``ckpt_dir`` does not exist."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=lambda p: checkpoint_step(p) or 0, reverse=True)


def _check_manifest(path: Path, manifest: Any) -> dict:
    """The manifest's fields the resume trusts, checked against the directory: a JSON object
    whose ``step`` is the step the directory's name states, plain file names, a grid."""
    if not isinstance(manifest, dict):
        raise RunDirError(f"{path}: unreadable manifest (a {type(manifest).__name__}, "
                          f"expected a JSON object)")
    step, named = manifest.get("step"), checkpoint_step(path)
    if type(step) is not int or step != named:
        raise RunDirError(f"{path}: manifest step {step!r} does not match the directory name "
                          f"(step {named}): not resumed")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(n, str) and n == Path(n).name and n not in ("", ".", "..")
            and isinstance(i, dict) and type(i.get("bytes")) is int
            and isinstance(i.get("sha256"), str) for n, i in files.items()):
        raise RunDirError(f"{path}: unreadable manifest ('files' must map plain file names to "
                          f"their bytes and sha256)")
    missing = [n for n in ("model.pt", "trainer.pt", rank_file(0)) if n not in files]
    if missing:
        raise RunDirError(f"{path}: manifest lists no {missing[0]}")
    try:
        shape = grid_shape(manifest)
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise RunDirError(f"{path}: manifest grid {manifest.get('grid')!r} is not a grid "
                          f"such as 1x2x1x1")
    return manifest


def read_manifest(path: str | os.PathLike) -> dict:
    """A checkpoint's manifest, checked against its directory (the step its name states, plain
    file names, a grid) but not its files' checksums: what a launcher may read cheaply. Raises
    RunDirError when it is unreadable or does not match the directory."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise RunDirError(f"{path}: unreadable manifest ({exc})") from None
    return _check_manifest(path, manifest)


def verify(path: str | os.PathLike) -> dict:
    """The checkpoint's manifest, once every file matches its size and sha256 and the step
    matches the directory's name; RunDirError names the first problem (unreadable manifest,
    missing or corrupt file)."""
    path = Path(path)
    manifest = read_manifest(path)
    for name, info in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise RunDirError(f"{path}: missing {name}")
        if f.stat().st_size != info["bytes"] or sha256_file(f) != info["sha256"]:
            raise RunDirError(f"{path}: {name} is corrupt (sha256 mismatch)")
    return manifest


def temp_dir(ckpt_dir: str | os.PathLike, step: int) -> Path:
    """Where the files of checkpoint ``step`` are written before :func:`commit` names it."""
    return Path(ckpt_dir) / f"{_TEMP}{step_dir_name(step)}"


def prepare(ckpt_dir: str | os.PathLike, comm: Any) -> None:
    """Collective, once before a run's checkpoints: rank 0 removes the temporary directories
    (:func:`temp_dir`) that a run killed before finishing them left. Each rank makes a
    checkpoint's temporary directory itself when it writes its part (:func:`write_part`), so a
    checkpoint costs no collective of its own before its files are written. Nothing is made
    when ``ckpt_dir`` is missing; RunDirError on every rank when one cannot be removed."""
    agree(comm, _remove_unfinished, ckpt_dir, root=0)


def _remove_unfinished(ckpt_dir: str | os.PathLike) -> None:
    try:
        for stale in sorted(Path(ckpt_dir).glob(f"{_TEMP}{PREFIX}*")):
            # only what temp_dir names (a step's name behind the mark), a real directory
            if checkpoint_step(stale.name[len(_TEMP):]) is not None \
                    and stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale)
    except OSError as exc:
        raise RunDirError(f"cannot remove the unfinished checkpoint {exc.filename}: "
                          f"{exc.strerror}") from None


def writer(name: str, size: int) -> int:
    """The rank of ``size`` that writes the shared file ``name``: rank 0 the model, the last
    rank the trainer state (its optimizer state is twice the model's), so with a checkpoint
    every step no one rank does all the serialising (every rank holds both states; on several
    nodes the two files go from different nodes)."""
    return size - 1 if name == "trainer.pt" else 0


def writes(name: str, rank: int, size: int) -> bool:
    """Whether ``rank`` of ``size`` writes the shared file ``name`` (:func:`writer`)."""
    return rank == writer(name, size)


def write_part(tmp: Path, rank: int, *, model_state: dict | None, trainer_state: dict | None,
               rank_state: dict, size: int = 1) -> dict:
    """This rank's files of a checkpoint in ``tmp`` (:func:`temp_dir`, made when missing),
    the shared files :func:`writes` gives it included, each fsynced; calls no MPI, so a
    background thread may run it. Returns file name -> its ``bytes`` and ``sha256``, or
    ``{"error": one line}`` when a file could not be written."""
    mine: dict[str, Any] = {}
    try:
        tmp.mkdir(parents=True, exist_ok=True)   # every rank: whichever comes first makes it
        mine[rank_file(rank)] = _save(rank_state, tmp / rank_file(rank))
        for name, state in (("model.pt", model_state), ("trainer.pt", trainer_state)):
            if writes(name, rank, size):
                mine[name] = _save(state, tmp / name)
    except OSError as exc:
        mine = {"error": f"rank {rank}: {exc}"}
    return mine


def commit(ckpt_dir: str | os.PathLike, step: int, *, comm: Any, mine: dict, info: dict,
           keep: int) -> Path:
    """Collective, once every rank wrote its part (``mine``, from :func:`write_part`): rank 0
    finishes the checkpoint (:func:`finish`); returns its final path. RunDirError on every rank
    when any rank could not write its part or the checkpoint could not be finished."""
    parts = comm.gather(mine, root=0)

    def finished() -> None:
        err = finish(ckpt_dir, step, parts=parts, world_size=comm.Get_size(), info=info,
                     keep=keep)
        if err:
            raise RunDirError(err)

    agree(comm, finished, root=0)
    return Path(ckpt_dir) / step_dir_name(step)


def finish(ckpt_dir: str | os.PathLike, step: int, *, parts: list[dict], world_size: int,
           info: dict, keep: int) -> str | None:
    """Rank 0's end of a checkpoint, given every rank's part: writes the manifest, fsyncs,
    renames the temporary directory to ``step-N`` (the checkpoint exists from this moment),
    fsyncs the parent and drops the oldest beyond ``keep``. Calls no MPI, so the background
    writer runs it in a thread. Returns None, or one line saying why it could not finish."""
    ckpt_dir = Path(ckpt_dir)
    final, tmp = ckpt_dir / step_dir_name(step), temp_dir(ckpt_dir, step)
    try:
        errors = [g["error"] for g in parts if "error" in g]
        if errors:
            raise OSError(errors[0])
        files = {k: v for g in parts for k, v in g.items()}
        manifest = {"format": FORMAT_VERSION, "step": step, "world_size": world_size,
                    "files": files, **info}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp)
        if final.exists():          # same step written before (e.g. redone after resume)
            _remove(final)
        os.rename(tmp, final)
        _fsync_path(ckpt_dir)
        for old in rotated(ckpt_dir, step, keep):
            _remove(old)
    except OSError as exc:
        return f"checkpoint {final} failed: {exc}"
    return None


def save(ckpt_dir: str | os.PathLike, step: int, *, comm: Any, model_state: dict | None,
         trainer_state: dict, rank_state: dict, info: dict, keep: int) -> Path:
    """Collective: write checkpoint ``step`` atomically, then drop the oldest beyond ``keep``
    (:func:`prepare`, :func:`write_part`, :func:`commit` in a row; the background writer,
    :mod:`hpcpar.run.checkpoint_writer`, runs the middle one in a thread). ``model_state`` is
    written by rank 0, ``trainer_state`` by the last rank (:func:`writes`; other ranks' copies
    are ignored), ``rank_state`` by each rank; ``info`` adds manifest entries. Returns the final
    path; RunDirError on every rank when any part or the commit failed."""
    prepare(ckpt_dir, comm)
    return write_and_commit(ckpt_dir, step, comm=comm, model_state=model_state,
                            trainer_state=trainer_state, rank_state=rank_state, info=info,
                            keep=keep)


def write_and_commit(ckpt_dir: str | os.PathLike, step: int, *, comm: Any,
                     model_state: dict | None, trainer_state: dict | None, rank_state: dict,
                     info: dict, keep: int) -> Path:
    """Collective: :func:`save` once :func:`prepare` has run (a writer prepares once, at
    its start, not at every checkpoint); same arguments, result and errors."""
    mine = write_part(temp_dir(ckpt_dir, step), comm.Get_rank(), model_state=model_state,
                      trainer_state=trainer_state, rank_state=rank_state, size=comm.Get_size())
    return commit(ckpt_dir, step, comm=comm, mine=mine, info=info, keep=keep)


def rotated(ckpt_dir: str | os.PathLike, step: int, keep: int) -> list[Path]:
    """The checkpoints to delete after writing ``step``: those beyond the newest ``keep`` at
    or below ``step``. The one just written is never among them, nor is a directory named
    after a later step (not written by this run: resume set it aside or it is not hpcpar's);
    ``keep`` counts at least the one just written."""
    mine = [p for p in list_checkpoints(ckpt_dir) if (checkpoint_step(p) or 0) <= step]
    return mine[max(keep, 1):]


CORRUPT_SUFFIX = ".corrupt"


def set_aside(path: str | os.PathLike, suffix: str = CORRUPT_SUFFIX) -> Path:
    """Rename a corrupt checkpoint aside, returning its new path ``step-N.corrupt``
    (``.corrupt-2``, ... if taken; ``suffix`` for another reason to keep it aside): kept for
    the user, never resumed from nor rotated away."""
    path = Path(path)
    dest, n = path.with_name(path.name + suffix), 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}{suffix}-{n}")
    os.rename(path, dest)
    return dest


def grid_shape(manifest: dict) -> tuple[int, ...]:
    """The grid a manifest names, ``"1x2x1x1"`` as (1, 2, 1, 1) (ValueError when it is not)."""
    return tuple(int(v) for v in str(manifest.get("grid", "")).split("x"))
