"""Atomic, verifiable checkpoints of a distributed run, and resume from the newest valid one.

Layout (one directory per checkpoint, ``N`` = steps completed)::

    RUN/checkpoints/step-000100/
        model.pt           FULL unpartitioned model state_dict (plain torch, weights_only-safe):
                           loads into the single-process model with torch.load(weights_only=True)
        trainer.pt         optimizer + lr-scheduler state (identical on every rank: replicated)
        rank-00000.pt ...  per rank: RNG states, data-loader position, local buffers
        manifest.json      step, epoch, grid, world size, sha256 + size of every file

Writing is collective: every rank writes its file into ``.tmp-step-000100/`` and fsyncs it,
rank 0 adds the shared files and the manifest, fsyncs, renames the directory to its final name
(atomic on POSIX) and fsyncs the parent, then prunes to the newest ``keep``. A crash at any
moment leaves either the previous set or the complete new one. On resume rank 0 verifies the
manifest's checksums newest first, warns once about a corrupt one and renames it aside
(``step-N.corrupt``: kept, never rotated away), and broadcasts the choice; when checkpoints
exist but none verifies, resume is an error naming them (never a silent restart).

Tensor-parallel (or otherwise sharded) modules take part through two optional, collective
methods: ``module.full_state_dict()`` returns the gathered single-process entries of that module
(keys relative to it) and ``module.load_full_state_dict(sd)`` re-shards them.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpcpar.errors import RunDirError

__all__ = ["MANIFEST", "FORMAT_VERSION", "PREFIX", "step_dir_name", "rank_file", "full_state_dict",
           "load_full_state_dict", "local_buffers", "rng_state", "set_rng_state", "sha256_file",
           "checkpoint_step", "list_checkpoints", "check_step", "verify", "save",
           "find_resumable", "CORRUPT_SUFFIX", "set_aside", "choose_resumable", "rotated",
           "check_optimizer", "nonfinite_entries", "check_compatible", "source_rank", "load"]

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
PREFIX = "step-"


def step_dir_name(step: int) -> str:
    """Name the directory that holds the checkpoint of one step.

    Args:
        step: Training step the checkpoint was written at.

    Returns:
        The directory name, ``step-`` followed by the step zero-padded to six digits.
    """
    return f"{PREFIX}{step:06d}"


def rank_file(rank: int) -> str:
    """Name the per-rank state file inside a checkpoint directory.

    Args:
        rank: Rank whose state the file holds.

    Returns:
        The file name, ``rank-`` followed by the rank zero-padded to five digits, then ``.pt``.
    """
    return f"rank-{rank:05d}.pt"


# -- full (unpartitioned) model state ------------------------------------------------------------
def _hooked_modules(model, attr: str):
    """(prefix, module) of the outermost submodules defining ``attr`` (deterministic order)."""
    found = []
    for name, mod in model.named_modules():
        if callable(getattr(mod, attr, None)) and not any(
                name == p or name.startswith(p + ".") if p else True for p, _ in found):
            found.append((name, mod))
    return found


def full_state_dict(model: Any) -> dict:
    """Gather the single-process state_dict of a (possibly partitioned) model, on CPU.

    Collective when a module has ``full_state_dict()``; spatial layers' parameters are
    replicated already.

    Args:
        model: The model, possibly wrapped (its ``module`` is used) or partitioned.

    Returns:
        The full state_dict, every tensor detached and copied to CPU.
    """
    model = getattr(model, "module", model) if not callable(
        getattr(model, "full_state_dict", None)) else model
    hooked = _hooked_modules(model, "full_state_dict")
    if hooked and hooked[0][0] == "":
        sd = dict(hooked[0][1].full_state_dict())
    else:
        sd = dict(model.state_dict())
        for prefix, mod in hooked:
            for k in [k for k in sd if k.startswith(prefix + ".")]:
                del sd[k]
            sd.update({f"{prefix}.{k}": v for k, v in mod.full_state_dict().items()})
    return {k: v.detach().cpu().clone() if hasattr(v, "detach") else v for k, v in sd.items()}


def load_full_state_dict(model: Any, sd: dict) -> None:
    """Load a full state_dict into a (possibly partitioned) model; inverse of `full_state_dict`.

    Strict: every key must match.

    Args:
        model: The model, possibly wrapped (its ``module`` is used) or partitioned.
        sd: Full state_dict, as returned by :func:`full_state_dict`.

    Raises:
        RunDirError: The state does not fit the model (shape mismatch, missing or
            unexpected keys).
    """
    model = getattr(model, "module", model) if not callable(
        getattr(model, "load_full_state_dict", None)) else model
    hooked = _hooked_modules(model, "load_full_state_dict")
    if hooked and hooked[0][0] == "":
        hooked[0][1].load_full_state_dict(sd)
        return
    rest = dict(sd)
    for prefix, mod in hooked:
        part = {k[len(prefix) + 1:]: rest.pop(k) for k in list(rest) if k.startswith(prefix + ".")}
        mod.load_full_state_dict(part)
    try:
        missing, unexpected = model.load_state_dict(rest, strict=False)
    except RuntimeError as exc:  # shape mismatches
        detail = " ".join(str(exc).split("\n")[1:2]).strip()
        raise RunDirError(f"checkpoint model state does not fit this model: {detail}") \
            from None
    owned = tuple(p + "." for p, _ in hooked)
    missing = [k for k in missing if not k.startswith(owned)] if owned else missing
    if missing or unexpected:
        raise RunDirError(f"checkpoint model state does not fit this model: missing "
                          f"{missing[:3]}, unexpected {unexpected[:3]}")


def local_buffers(model: Any) -> dict:
    """Copy this rank's buffers (e.g. BatchNorm running statistics), which are saved per rank.

    Args:
        model: The model, possibly wrapped (its ``module`` is used).

    Returns:
        Buffer name to a detached CPU copy of the buffer.
    """
    model = getattr(model, "module", model)
    return {k: v.detach().cpu().clone() for k, v in model.named_buffers()}


# -- RNG -------------------------------------------------------------------------------------------
def rng_state() -> dict:
    """Python, NumPy and torch (CPU + CUDA) generator states in weights_only-safe types."""
    import numpy as np
    import torch

    np_state = np.random.get_state()
    pyver, pystate, pygauss = random.getstate()
    out = {"python": [pyver, list(pystate), pygauss],
           "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)),
                     int(np_state[2]), int(np_state[3]), float(np_state[4])],
           "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict) -> None:
    """Restore the Python, NumPy and torch generator states, so a resumed run draws alike.

    Args:
        state: Generator states as returned by :func:`rng_state`; CUDA states are restored only
            when present and CUDA is available.
    """
    import numpy as np
    import torch

    ver, st, gauss = state["python"]
    random.setstate((ver, tuple(st), gauss))
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- files -----------------------------------------------------------------------------------------
def sha256_file(path: str | os.PathLike) -> str:
    """Checksum a file, to detect corrupt checkpoint files.

    Args:
        path: File to read.

    Returns:
        The hex SHA-256 digest of the file's contents.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_path(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save(obj, path: Path) -> dict:
    import torch

    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step a checkpoint directory's name states: ``step-`` and ASCII digits, named as
    :func:`step_dir_name` names it; None for any other name (not a checkpoint of hpcpar's).

    Args:
        path: The directory.

    Returns:
        The step, or None.
    """
    name = Path(path).name
    digits = name[len(PREFIX):]
    if not name.startswith(PREFIX) or not digits.isascii() or not digits.isdigit():
        return None
    step = int(digits)
    return step if step_dir_name(step) == name else None


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[Path]:
    """List the finished checkpoint directories, newest (highest step) first.

    Args:
        ckpt_dir: Directory holding the ``step-N`` checkpoint directories.

    Returns:
        The checkpoint directories, newest first; empty when ``ckpt_dir`` does not exist.
    """
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step, reverse=True)


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
        shape = _grid_shape(manifest)
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise RunDirError(f"{path}: manifest grid {manifest.get('grid')!r} is not a grid "
                          f"such as 1x2x1x1")
    return manifest


def check_step(path: str | os.PathLike, manifest: dict, trainer_state: dict) -> int:
    """The step to resume at, cross-checked against the saved model state: the learning-rate
    scheduler counts one step per training step, and the loss history never runs past it.

    Args:
        path: The checkpoint directory (for the message).
        manifest: Its (verified) manifest.
        trainer_state: Its ``trainer.pt``.

    Returns:
        The manifest's step.

    Raises:
        RunDirError: The saved state was taken at another step (one line naming the
            checkpoint).
    """
    step = manifest["step"]
    sched = trainer_state.get("scheduler") if isinstance(trainer_state, dict) else None
    counted = sched.get("last_epoch") if isinstance(sched, dict) else None
    history = trainer_state.get("history", []) if isinstance(trainer_state, dict) else []
    logged = max((h[0] for h in history if isinstance(h, (list, tuple)) and h), default=0)
    if counted is not None and counted != step or not isinstance(logged, int) or logged > step:
        raise RunDirError(f"{path}: manifest step {step} does not match the saved training "
                          f"state (scheduler at step {counted}, loss logged to step {logged}): "
                          f"restore the checkpoint or start over with --fresh")
    return step


def verify(path: str | os.PathLike) -> dict:
    """Check every file of a checkpoint against its manifest's size and sha256, and the
    manifest's step against the directory's name.

    Args:
        path: Checkpoint directory.

    Returns:
        The checkpoint's manifest.

    Raises:
        RunDirError: The manifest is unreadable or does not match the directory, or a file
            is missing or corrupt (the first problem is named).
    """
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise RunDirError(f"{path}: unreadable manifest ({exc})") from None
    files = _check_manifest(path, manifest)["files"]
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            raise RunDirError(f"{path}: missing {name}")
        if f.stat().st_size != info["bytes"] or sha256_file(f) != info["sha256"]:
            raise RunDirError(f"{path}: {name} is corrupt (sha256 mismatch)")
    return manifest


# -- collective save / load -----------------------------------------------------------------------
def save(ckpt_dir: str | os.PathLike, step: int, *, comm: Any, model_state: dict | None,
         trainer_state: dict, rank_state: dict, info: dict, keep: int) -> Path:
    """Collective: write checkpoint ``step`` atomically, then drop the oldest beyond ``keep``.

    Args:
        ckpt_dir: Directory holding the checkpoints; created when missing.
        step: Training step the checkpoint is written at.
        comm: MPI communicator of all ranks.
        model_state: Full state_dict, written by rank 0 (pass it on every rank; other ranks'
            copies are ignored).
        trainer_state: Trainer state, written by rank 0 like ``model_state``.
        rank_state: This rank's own state, written by each rank.
        info: Extra entries for the manifest.
        keep: How many of the newest checkpoints to keep.

    Returns:
        The final path of the checkpoint directory.

    Raises:
        RunDirError: On every rank, when any rank could not write its part or the checkpoint
            could not be finished.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / step_dir_name(step)
    tmp = ckpt_dir / f".tmp-{step_dir_name(step)}"
    err = None
    if rank == 0:
        try:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as exc:
            err = f"cannot create {tmp}: {exc}"
    err = comm.bcast(err, root=0)
    if err:
        raise RunDirError(err)
    mine = {}
    try:
        mine[rank_file(rank)] = _save(rank_state, tmp / rank_file(rank))
        if rank == 0:
            mine["model.pt"] = _save(model_state, tmp / "model.pt")
            mine["trainer.pt"] = _save(trainer_state, tmp / "trainer.pt")
    except OSError as exc:
        mine = {"error": f"rank {rank}: {exc}"}
    gathered = comm.gather(mine, root=0)
    err = None
    if rank == 0:
        errors = [g["error"] for g in gathered if "error" in g]
        try:
            if errors:
                raise OSError(errors[0])
            files = {k: v for g in gathered for k, v in g.items()}
            manifest = {"format": FORMAT_VERSION, "step": step, "world_size": size,
                        "files": files, **info}
            with open(tmp / MANIFEST, "w") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            _fsync_path(tmp)
            if final.exists():          # same step written before (e.g. redone after resume)
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_path(ckpt_dir)
            for old in rotated(ckpt_dir, step, keep):
                shutil.rmtree(old, ignore_errors=True)
        except OSError as exc:
            err = f"checkpoint {final} failed: {exc}"
    err = comm.bcast(err, root=0)
    if err:
        raise RunDirError(err)
    return final


def rotated(ckpt_dir: str | os.PathLike, step: int, keep: int) -> list[Path]:
    """The checkpoints to delete after writing ``step``: those beyond the newest ``keep`` at
    or below ``step``. The one just written is never among them, nor is a directory named
    after a later step (not written by this run: resume set it aside or it is not hpcpar's).

    Args:
        ckpt_dir: Directory holding the checkpoints.
        step: The step just written.
        keep: How many to keep (at least the one just written).

    Returns:
        The checkpoint directories to delete.
    """
    mine = [p for p in list_checkpoints(ckpt_dir) if checkpoint_step(p) <= step]
    return mine[max(keep, 1):]


def find_resumable(ckpt_dir: str | os.PathLike, comm: Any,
                   log: Callable[[str], object] = print) -> Path | None:
    """Collective: find the newest checkpoint whose manifest and checksums verify.

    Rank 0 checks, warns about each corrupt one, and broadcasts its choice.

    Args:
        ckpt_dir: Directory holding the checkpoints.
        comm: MPI communicator of all ranks.
        log: Where rank 0 writes a warning for each corrupt checkpoint.

    Returns:
        The newest valid checkpoint, or None when there is none.
    """
    choice = None
    if comm.Get_rank() == 0:
        for path in list_checkpoints(ckpt_dir):
            try:
                verify(path)
            except RunDirError as exc:
                msg = f"warning: skipping corrupt checkpoint: {exc}"
                log(msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
                continue
            choice = str(path)
            break
    choice = comm.bcast(choice, root=0)
    return Path(choice) if choice else None


CORRUPT_SUFFIX = ".corrupt"


def set_aside(path: str | os.PathLike) -> Path:
    """Rename a corrupt checkpoint aside: kept for the user, never resumed from nor rotated away.

    The new name is ``step-N.corrupt`` (``.corrupt-2``, ... if taken).

    Args:
        path: The corrupt checkpoint directory.

    Returns:
        The checkpoint's new path.
    """
    path = Path(path)
    dest, n = path.with_name(path.name + CORRUPT_SUFFIX), 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}{CORRUPT_SUFFIX}-{n}")
    os.rename(path, dest)
    return dest


def choose_resumable(ckpt_dir: str | os.PathLike, comm: Any,
                     log: Callable[[str], object] = print) -> Path | None:
    """Collective: choose the newest valid checkpoint to resume from.

    Rank 0 verifies newest first. Corrupt checkpoints newer than the chosen one are renamed
    aside (:func:`set_aside`) with one warning each; a checkpoint whose manifest step is not the
    step its directory is named after is invalid alike (never trusted). When checkpoints exist
    but none verifies, nothing is renamed: a silent restart from step 0 would throw the run
    away; when only set-aside ones are left, one warning says the run starts from step 0.

    Args:
        ckpt_dir: Directory holding the checkpoints.
        comm: MPI communicator of all ranks.
        log: Where rank 0 writes a warning for each corrupt checkpoint set aside.

    Returns:
        The newest valid checkpoint, or None when there is no checkpoint at all.

    Raises:
        RunDirError: On every rank, when checkpoints exist but none verifies.
    """
    choice, error = None, None
    if comm.Get_rank() == 0:
        bad = []
        for path in list_checkpoints(ckpt_dir):
            try:
                verify(path)
            except RunDirError as exc:
                bad.append((path, str(exc).replace(f"{path}: ", "")))
                continue
            choice = str(path)
            break
        aside = sorted(p.name for p in Path(ckpt_dir).glob(f"{PREFIX}*{CORRUPT_SUFFIX}*")) \
            if not bad and choice is None and Path(ckpt_dir).is_dir() else []
        if aside:
            log(f"warning: {ckpt_dir}: no valid checkpoint, only ones set aside as corrupt "
                f"({', '.join(aside[:3])}{' ...' if len(aside) > 3 else ''}): training starts "
                f"again from step 0")
        if bad and choice is None:
            names = "; ".join(f"{p.name} ({why})" for p, why in bad)
            error = (f"{ckpt_dir}: no valid checkpoint to resume from: {names}; they are left "
                     f"untouched: restore them, or start over with --fresh (moves them aside)")
        for path, why in bad if choice is not None else ():
            try:
                kept = set_aside(path).name
            except OSError as exc:
                kept = f"{path.name} (could not rename: {exc})"
            log(f"warning: skipping corrupt checkpoint: {path}: {why}; kept as {kept}")
    choice, error = comm.bcast((choice, error), root=0)
    if error:
        exc = RunDirError(error)
        exc.collective = True
        raise exc
    return Path(choice) if choice else None


def check_optimizer(path: str | os.PathLike, optimizer: Any, name: str,
                    saved_state: dict) -> None:
    """Refuse a checkpoint written with another optimizer, which torch would load and fail on later.

    Without this check torch fails later with a KeyError inside ``step()``.

    Args:
        path: Checkpoint directory.
        optimizer: This run's optimizer.
        name: This run's optimizer name, from the job.
        saved_state: Optimizer state_dict saved in the checkpoint.

    Raises:
        RunDirError: The checkpoint holds the state of another optimizer (one line, raised
            alike on every rank).
    """
    manifest = json.loads((Path(path) / MANIFEST).read_text())
    saved_name = manifest.get("optimizer")
    saved_groups = saved_state.get("param_groups", [])
    mine = [set(g) - {"params"} for g in optimizer.state_dict()["param_groups"]]
    theirs = [set(g) - {"params"} for g in saved_groups]
    sizes = [len(g["params"]) for g in optimizer.state_dict()["param_groups"]]
    if (saved_name not in (None, name) or mine != theirs
            or sizes != [len(g.get("params", [])) for g in saved_groups]):
        was = f"optimizer {saved_name!r}" if saved_name else "another optimizer"
        exc = RunDirError(f"{path}: written with {was}, this run uses {name!r}: resume with the "
                          f"job's original optimizer settings, or start over with --fresh")
        exc.collective = True
        raise exc


def nonfinite_entries(state: dict) -> list[str]:
    """Find the floating-point tensors holding NaN or inf, so a diverged state is not saved or used.

    Args:
        state: Mapping of names to values; only floating-point tensors are checked.

    Returns:
        The names of the entries holding NaN or inf.
    """
    import torch

    return [k for k, v in state.items() if isinstance(v, torch.Tensor)
            and v.is_floating_point() and not bool(torch.isfinite(v).all())]


def check_compatible(path: str | os.PathLike, shape: Sequence[int]) -> dict:
    """Check that this grid can resume a checkpoint: same spatial split, any data width.

    A job that lost nodes resumes on a smaller data width. Every rank calls this with the same
    arguments, so all raise together.

    Args:
        path: Checkpoint directory.
        shape: This run's grid shape, (data, X, Y, Z).

    Returns:
        The checkpoint's manifest.

    Raises:
        RunDirError: The checkpoint was written with another spatial split.
        ValueError: An unreadable manifest (resume skips it: :func:`choose_resumable`).
    """
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
        old = _grid_shape(manifest)
    except (RecursionError, AttributeError, ValueError) as exc:   # not a JSON object/grid
        raise ValueError(f"{path}: unreadable manifest ({type(exc).__name__})") from None
    if tuple(old[1:]) != tuple(shape[1:]):
        spec = "x".join(map(str, shape))
        raise RunDirError(f"{path}: written by grid {manifest.get('grid')}, this run is grid "
                          f"{spec}: a checkpoint resumes on another data width but not on "
                          f"another spatial split; use --grid DATAx{'x'.join(map(str, old[1:]))}"
                          f" or --fresh")
    return manifest


def _grid_shape(manifest: dict) -> tuple[int, ...]:
    return tuple(int(v) for v in str(manifest.get("grid", "")).split("x"))


def source_rank(manifest: dict, coords: Sequence[int]) -> int:
    """Pick the checkpoint rank whose per-rank file (RNG, loader position, buffers) a rank takes.

    That is the rank at the same spatial place, with data index ``d`` modulo the old data
    width (identical to this rank when the grid is unchanged).

    Args:
        manifest: The checkpoint's manifest (it names the old grid).
        coords: This rank's coordinates (d, i, j, k) in this run's grid.

    Returns:
        The rank in the checkpoint's grid whose per-rank file to load.
    """
    old_d, x, y, z = _grid_shape(manifest)
    d, i, j, k = coords
    return i + x * (j + y * (k + z * (d % old_d)))


def load(path: str | os.PathLike, rank: int) -> tuple[dict, dict, dict, dict]:
    """Read a checkpoint's files for one rank, all with ``weights_only=True``.

    Args:
        path: Checkpoint directory.
        rank: Rank whose per-rank file to read.

    Returns:
        (manifest, model_state, trainer_state, rank_state) of the checkpoint.

    Raises:
        RunDirError: The manifest's step does not match the saved training state
            (:func:`check_step`), alike on every rank.
    """
    import torch

    path = Path(path)
    manifest = json.loads((path / MANIFEST).read_text())

    def rd(name):
        return torch.load(path / name, map_location="cpu", weights_only=True)

    trainer = rd("trainer.pt")
    try:
        check_step(path, manifest, trainer)
    except RunDirError as exc:
        exc.collective = True      # the same files on every rank: the same error
        raise
    return manifest, rd("model.pt"), trainer, rd(rank_file(rank))
