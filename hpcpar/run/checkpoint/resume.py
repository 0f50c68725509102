"""Resume policy: which checkpoint a run continues from (the newest that verifies, or the one
``--from`` names), and whether it fits this run (its step, optimizer, grid and model kind).

On resume rank 0 verifies the manifest's checksums newest first, warns once about a corrupt
one and renames it aside (``step-N.corrupt``: kept, never rotated away), and broadcasts the
choice; when checkpoints exist but none verifies, resume is an error naming them (never a
silent restart).
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpcpar.errors import RunDirError
from hpcpar.formats.records.history import history_rows
from hpcpar.parallel.agree import agree
from hpcpar.run.checkpoint.store import (
    CORRUPT_SUFFIX,
    MANIFEST,
    PREFIX,
    checkpoint_step,
    grid_shape,
    list_checkpoints,
    rank_file,
    set_aside,
    verify,
)

__all__ = ["find_resumable", "choose_resumable", "check_optimizer", "check_compatible",
           "grid_change", "source_rank", "load", "check_chosen"]


def check_step(path: str | os.PathLike, manifest: dict, trainer_state: dict) -> int:
    """The step to resume at, cross-checked against the saved model state: the learning-rate
    scheduler counts one step per training step, and the loss history never runs past it.
    RunDirError (one line naming the checkpoint) when the state was taken at another step."""
    step = manifest["step"]
    sched = trainer_state.get("scheduler") if isinstance(trainer_state, dict) else None
    counted = sched.get("last_epoch") if isinstance(sched, dict) else None
    history = history_rows(trainer_state.get("history")) \
        if isinstance(trainer_state, dict) else []
    logged = max((h[0] for h in history if isinstance(h, (list, tuple)) and h), default=0)
    if counted is not None and counted != step or not isinstance(logged, int) or logged > step:
        raise RunDirError(f"{path}: manifest step {step} does not match the saved training "
                          f"state (scheduler at step {counted}, loss logged to step {logged}): "
                          f"restore the checkpoint or start over with --fresh")
    return step


def find_resumable(ckpt_dir: str | os.PathLike, comm: Any,
                   log: Callable[[str], object] = print) -> Path | None:
    """Collective: the newest checkpoint whose manifest and checksums verify, or None. Rank 0
    checks, warns (to ``log``) about each corrupt one, and broadcasts its choice."""
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


def choose_resumable(ckpt_dir: str | os.PathLike, comm: Any,
                     log: Callable[[str], object] = print) -> Path | None:
    """Collective: the newest valid checkpoint to resume from, or None when there is none at all.

    Rank 0 verifies newest first. Corrupt checkpoints newer than the chosen one are renamed
    aside (:func:`set_aside`) with one warning each to ``log``; a checkpoint whose manifest step
    is not the step its directory is named after is invalid alike (never trusted). When
    checkpoints exist but none verifies, nothing is renamed and every rank raises RunDirError: a
    silent restart from step 0 would throw the run away; when only set-aside ones are left, one
    warning says the run starts from step 0."""
    try:
        choice = agree(comm, _choose_resumable, ckpt_dir, log, root=0)
    except RunDirError as exc:
        exc.collective = True
        raise
    return Path(choice) if choice else None


def _choose_resumable(ckpt_dir: str | os.PathLike, log: Callable[[str], object]) -> str | None:
    """Rank 0's part of :func:`choose_resumable`."""
    bad, choice = [], None
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
        raise RunDirError(f"{ckpt_dir}: no valid checkpoint to resume from: {names}; they are "
                          f"left untouched: restore them, or start over with --fresh (moves "
                          f"them aside)")
    for path, why in bad if choice is not None else ():
        try:
            kept = set_aside(path).name
        except OSError as exc:
            kept = f"{path.name} (could not rename: {exc})"
        log(f"warning: skipping corrupt checkpoint: {path}: {why}; kept as {kept}")
    return choice


def check_optimizer(path: str | os.PathLike, optimizer: Any, name: str,
                    saved_state: dict) -> None:
    """Refuse (RunDirError, alike on every rank) a checkpoint written with another optimizer
    than the job's ``name``: torch would load it and fail later with a KeyError in ``step()``."""
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


def check_compatible(path: str | os.PathLike, shape: Sequence[int]) -> dict:
    """The manifest of a checkpoint to resume on grid ``shape`` (data, X, Y, Z); ValueError when
    it is unreadable. Any grid resumes any checkpoint (:mod:`hpcpar.run.checkpoint`): whether the
    grid fits the job is the job's and the model's check, made before any checkpoint is read.
    Every rank calls this with the same arguments."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
        old = grid_shape(manifest)
    except (RecursionError, AttributeError, ValueError) as exc:   # not a JSON object/grid
        raise ValueError(f"{path}: unreadable manifest ({type(exc).__name__})") from None
    if len(old) != 4 or min(old) < 1 or len(shape) != 4:
        raise ValueError(f"{path}: unreadable manifest (grid {manifest.get('grid')!r})")
    return manifest


def grid_change(manifest: dict, shape: Sequence[int]) -> str | None:
    """``resuming step N of grid A on grid B``, or None on the same grid."""
    old, new = "x".join(map(str, grid_shape(manifest))), "x".join(map(str, shape))
    return None if old == new else f"resuming step {manifest.get('step')} of grid {old} on " \
                                   f"grid {new}"


def source_rank(manifest: dict, coords: Sequence[int]) -> int:
    """The rank of the checkpoint's grid whose per-rank file (RNG, loader position, buffers) the
    rank at ``coords`` (d, i, j, k) of this grid takes: data index ``d`` modulo the old data
    width (buffers may differ between data groups); within it, the rank at the same spatial
    place when the spatial split is unchanged (so an unchanged grid reads its own files), else
    the group's first rank: the files of a data group are alike (:mod:`hpcpar.run.checkpoint`)."""
    old_d, x, y, z = grid_shape(manifest)
    d, i, j, k = coords
    fits = i < x and j < y and k < z
    i, j, k = (i, j, k) if fits else (0, 0, 0)
    return i + x * (j + y * (k + z * (d % old_d)))


def load(path: str | os.PathLike, rank: int) -> tuple[dict, dict, dict, dict]:
    """(manifest, model_state, trainer_state, rank_state) of a checkpoint for ``rank``, all read
    with ``weights_only=True``; RunDirError alike on every rank from :func:`check_step`."""
    import torch

    path = Path(path)
    manifest = json.loads((path / MANIFEST).read_text())

    def rd(name):
        try:
            return torch.load(path / name, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:  # a pickle that would run code: never loaded
            try:
                unsafe = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(
                    path / name)[:3]) or "a global"
            except (OSError, RuntimeError, pickle.UnpicklingError):
                unsafe = "a global"
            err = RunDirError(f"{path / name}: refused to unpickle (it needs {unsafe}, which "
                              f"could run code); hpcpar's checkpoints hold tensors and plain "
                              f"values only")
            err.collective = name != rank_file(rank)     # one file for every rank
            raise err from None

    trainer = rd("trainer.pt")
    try:
        check_step(path, manifest, trainer)
    except RunDirError as exc:
        exc.collective = True      # the same files on every rank: the same error
        raise
    return manifest, rd("model.pt"), trainer, rd(rank_file(rank))


def check_chosen(path: str | os.PathLike, shape: Sequence[int], kind: str,
                 comm: Any = None) -> dict:
    """Check a checkpoint chosen by the user (``hpcpar run --from``): it exists, verifies
    (:func:`verify`), was written by the same ``[model] kind`` and resumes on this grid
    (:func:`check_compatible`), and return its manifest. Rank 0 checks (``comm`` None: this
    process alone); every rank gets its result or its error, one line naming the checkpoint."""
    return agree(comm, _check_chosen, Path(path), shape, kind, root=0)


def _check_chosen(path: Path, shape: Sequence[int], kind: str) -> dict:
    if not path.is_dir():
        raise RunDirError(f"--from {path}: no such checkpoint directory")
    if checkpoint_step(path) is None:
        raise RunDirError(f"--from {path}: not a checkpoint directory (expected a "
                          f"{PREFIX}NNNNNN directory of a run's checkpoints/)")
    try:
        manifest = verify(path)
    except RunDirError as exc:
        raise RunDirError(f"--from {exc}: choose another checkpoint") from None
    if manifest.get("kind") not in (None, kind):
        raise RunDirError(f"--from {path}: written by a job of [model] kind "
                          f"{manifest.get('kind')!r}, this job's is {kind!r}")
    try:
        check_compatible(path, shape)
    except (ValueError, RunDirError) as exc:
        raise RunDirError(f"--from {exc}") from None
    return manifest
