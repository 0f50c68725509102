"""Atomic, verifiable checkpoints of a distributed run, and resume from the newest valid one.

Layout (one directory per checkpoint, ``N`` = steps completed)::

    RUN/checkpoints/step-000100/
        model.pt           FULL unpartitioned model state_dict (plain torch, weights_only-safe):
                           loads into the single-process model with torch.load(weights_only=True)
        trainer.pt         optimizer + lr-scheduler state, global like model.pt: the state of a
                           sharded (tensor-parallel) parameter is gathered to its full shape
        rank-00000.pt ...  per rank: RNG states, data-loader position, local buffers
        manifest.json      step, epoch, grid, world size, sha256 + size of every file

Nothing in a checkpoint depends on the grid it was written on, so it resumes on any grid that
fits the job (another spatial split, data width or node count): the model and optimizer state
are global and re-sharded on load; the loader position counts global batches (the sample order
does not depend on the grid, :mod:`hpcpar.data._schedule`); dropout masks hash global
coordinates (:mod:`hpcpar.nn.dropout`), and every rank draws its seeds from the same
generator state. What a rank file holds is therefore the same on every rank of a data group
(buffers may differ between data groups when batch norm does not reduce over them), and a rank
of the new grid takes the file of :func:`source_rank`.

Writing is collective: every rank writes its file into ``.tmp-step-000100/`` and fsyncs it,
rank 0 and the last rank add the shared files (:func:`writes`), rank 0 the manifest, fsyncs,
renames the directory to its final name (atomic on POSIX) and fsyncs the parent, then prunes
to the newest ``keep``. A crash at any moment leaves either the previous set or the complete
new one. On resume rank 0 verifies the
manifest's checksums newest first, warns once about a corrupt one and renames it aside
(``step-N.corrupt``: kept, never rotated away), and broadcasts the choice; when checkpoints
exist but none verifies, resume is an error naming them (never a silent restart).

Tensor-parallel (or otherwise sharded) modules take part through two optional, collective
methods: ``module.full_state_dict()`` returns the gathered single-process entries of that module
(keys relative to it) and ``module.load_full_state_dict(sd)`` re-shards them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import random
import shutil
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpcpar._digest import sha256_file
from hpcpar.errors import RunDirError
from hpcpar.parallel.agree import agree

__all__ = ["MANIFEST", "FORMAT_VERSION", "PREFIX", "step_dir_name", "rank_file", "full_state_dict",
           "load_full_state_dict", "local_buffers", "rng_state", "set_rng_state", "sha256_file",
           "checkpoint_step", "list_checkpoints", "check_step", "read_manifest", "verify", "save",
           "in_memory", "temp_dir", "prepare", "writer", "writes", "write_part",
           "write_and_commit", "commit", "finish",
           "find_resumable", "CORRUPT_SUFFIX", "set_aside", "choose_resumable", "rotated",
           "check_optimizer", "finite_flags", "nonfinite_entries", "check_compatible",
           "grid_change", "source_rank", "PackedHistory", "history_rows",
           "full_optimizer_state", "load_full_optimizer_state", "restore_buffers", "load",
           "check_chosen"]

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
PREFIX = "step-"
_TEMP = ".tmp-"   # marks a checkpoint's directory until its rename (temp_dir)


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
    found: list = []
    for name, mod in model.named_modules():
        if callable(getattr(mod, attr, None)) and not any(
                name == p or name.startswith(p + ".") if p else True for p, _ in found):
            found.append((name, mod))
    return found


def full_state_dict(model: Any, root: int | None = None, spill_dir: Any = None,
                    copy: bool = True) -> dict:
    """Gather the single-process state_dict of a (possibly partitioned) model, on CPU.

    Collective when a module has ``full_state_dict()`` or a split head is cut; spatial
    layers' parameters are replicated already.

    Args:
        model: The model, possibly wrapped (its ``module`` is used) or partitioned.
        root: The only rank that needs a split head's full weight (the writer of
            ``model.pt``): the others keep their own columns in its place
            (:func:`hpcpar.nn.split_head.gathered_to`); None: every rank.
        spill_dir: Where ``root`` backs that full weight by a file instead of memory
            (:mod:`hpcpar.nn.spill`); None: memory.
        copy: False on a rank that only checks the state (not the writer of ``model.pt``):
            its tensors stay the model's own, detached, on their device; a copy of the whole
            model on every rank of a node would not divide by the ranks (each copied to the
            host, at every checkpoint, to be dropped).

    Returns:
        The full state_dict, every tensor detached and (``copy``) on CPU, none sharing
        memory with the model (a tensor gathered for it is not copied again).
    """
    from hpcpar.nn.split_head import gathered_to  # deferred: loads torch, numpy

    model = getattr(model, "module", model) if not callable(
        getattr(model, "full_state_dict", None)) else model
    hooked = _hooked_modules(model, "full_state_dict")
    with gathered_to(root, spill_dir):
        if hooked and hooked[0][0] == "":
            sd = dict(hooked[0][1].full_state_dict())
        else:
            sd = dict(model.state_dict())
            for prefix, mod in hooked:
                for k in [k for k in sd if k.startswith(prefix + ".")]:
                    del sd[k]
                sd.update({f"{prefix}.{k}": v for k, v in mod.full_state_dict().items()})
    if not copy:
        return {k: v.detach() if hasattr(v, "detach") else v for k, v in sd.items()}
    live = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    return {k: _private(v.detach().cpu(), live) if hasattr(v, "detach") else v
            for k, v in sd.items()}


def _private(t, live: set) -> Any:
    """``t``, copied when it shares memory with a live tensor (``live``: storage pointers)."""
    return t.clone() if t.untyped_storage().data_ptr() in live else t


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
    assert isinstance(np_state, tuple)  # the legacy form, which get_state returns by default
    pyver, pystate, pygauss = random.getstate()
    # the Mersenne state as one tensor, not 625 ints: torch.save pickles a list item by item
    # through a Python callback (0.5 ms of every rank's checkpoint)
    out = {"python": [pyver, torch.tensor(pystate, dtype=torch.int64), pygauss],
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
    random.setstate((ver, tuple(st.tolist() if hasattr(st, "tolist") else st), gauss))  # or
    # the list of ints that checkpoints before 2026-12 hold
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
    history = history_rows(trainer_state.get("history")) \
        if isinstance(trainer_state, dict) else []
    logged = max((h[0] for h in history if isinstance(h, (list, tuple)) and h), default=0)
    if counted is not None and counted != step or not isinstance(logged, int) or logged > step:
        raise RunDirError(f"{path}: manifest step {step} does not match the saved training "
                          f"state (scheduler at step {counted}, loss logged to step {logged}): "
                          f"restore the checkpoint or start over with --fresh")
    return step


class PackedHistory:
    """A history as a checkpoint holds it: the loss history's [step, loss] pairs as an (N, 2)
    float64 tensor, the validation history's ``{"step": s, "val_loss": v, ...}`` records as
    ``{"columns": [...], "rows": (N, K) tensor}``. torch.save pickles a list item by item
    through a Python callback: 15 ms a checkpoint at 10,000 log points, growing with the run;
    a tensor is one record. The rows converted for an earlier checkpoint are kept, so each
    converts only the new ones. Steps (ints) and Python floats are exact in float64; a
    history holding anything else (an int metric, another set of keys) stays a list."""

    def __init__(self):
        self.rows: Any = None
        self.columns: tuple | None = None

    def __call__(self, history: list) -> Any:
        """What a checkpoint holds for ``history``, a list that only grows (else it is
        converted anew)."""
        import torch

        columns = _columns(history[0]) if history else None
        done = 0 if self.rows is None or columns != self.columns else self.rows.shape[0]
        if done > len(history):
            done = 0
        new = [_row(h, columns) for h in history[done:]]
        if columns == () or any(r is None for r in new):
            self.rows, self.columns = None, None
            return history
        width = 2 if columns is None else len(columns)
        new_rows = torch.tensor(new, dtype=torch.float64).reshape(-1, width)
        self.rows = new_rows if not done else torch.cat([self.rows, new_rows])
        self.columns = columns
        return self.rows if columns is None else {"columns": list(columns), "rows": self.rows}


def _columns(first: Any) -> tuple | None:
    """A history's kind from its first entry: None for [step, loss] pairs, the keys of
    ``{"step": ...}`` records, () for anything else."""
    if isinstance(first, dict):
        return tuple(first) if first and next(iter(first)) == "step" else ()
    return None if isinstance(first, (list, tuple)) else ()


def _row(entry: Any, columns: tuple | None) -> list | None:
    """One entry as numbers, or None when float64 would not give it back as it was."""
    if columns is None:
        values = list(entry) if isinstance(entry, (list, tuple)) and len(entry) == 2 else None
    elif isinstance(entry, dict) and columns and tuple(entry) == columns:
        values = [entry[c] for c in columns]
    else:
        return None
    if values is None or type(values[0]) is not int or abs(values[0]) > 2 ** 53 or \
            not all(isinstance(v, float) for v in values[1:]):   # numpy's float64 too
        return None
    return values


def history_rows(saved: Any) -> list:
    """A history back from a trainer state: the [step, loss] pairs or the records of
    :class:`PackedHistory`, steps as ints; a list (checkpoints before 2026-12, or a history
    that stayed one) as it is; anything else (an edited file) gives no rows."""
    import torch

    if isinstance(saved, dict) and isinstance(saved.get("columns"), list):
        columns, rows = saved["columns"], history_rows(saved.get("rows"))
        if not columns or columns[0] != "step" or any(len(r) != len(columns) for r in rows):
            return []
        return [dict(zip(columns, r)) for r in rows]
    if isinstance(saved, torch.Tensor):
        if saved.dim() != 2 or not saved.shape[1] or not saved.is_floating_point():
            return []
        return [[int(r[0]), *r[1:]] for r in saved.tolist()]
    return [list(h) if isinstance(h, tuple) else h for h in saved] \
        if isinstance(saved, (list, tuple)) else []


def read_manifest(path: str | os.PathLike) -> dict:
    """A checkpoint's manifest, checked against its directory (the step its name states, plain
    file names, a grid) but not its files' checksums: what a launcher may read cheaply.

    Raises:
        RunDirError: The manifest is unreadable or does not match the directory.
    """
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise RunDirError(f"{path}: unreadable manifest ({exc})") from None
    return _check_manifest(path, manifest)


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
    manifest = read_manifest(path)
    for name, info in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise RunDirError(f"{path}: missing {name}")
        if f.stat().st_size != info["bytes"] or sha256_file(f) != info["sha256"]:
            raise RunDirError(f"{path}: {name} is corrupt (sha256 mismatch)")
    return manifest


# -- collective save / load -----------------------------------------------------------------------
_ATOMS = (int, float, str, bytes, bool, type(None))


def in_memory(obj: Any) -> Any:
    """A copy of ``obj`` that training can no longer change: every tensor copied to CPU memory,
    containers rebuilt, anything else deep-copied. What an asynchronous checkpoint writes
    while the next steps run (the optimizer's ``state_dict()`` holds its live tensors).

    Args:
        obj: Nested dicts, lists and tuples of tensors and plain values.

    Returns:
        The copy.
    """
    import torch

    if isinstance(obj, _ATOMS):   # immutable: the data state's sample orders are lists of
        return obj                # many ints, and deepcopy costs the step ~3 us each
    if isinstance(obj, torch.Tensor):
        return obj if _FRESH.get(id(obj)) is obj else obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: in_memory(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        if all(type(v) in _ATOMS for v in obj):   # a sample order, the loss history's
            return obj if type(obj) is tuple else type(obj)(obj)   # entries: no call each
        return type(obj)(in_memory(v) for v in obj)
    return copy.deepcopy(obj)


def temp_dir(ckpt_dir: str | os.PathLike, step: int) -> Path:
    """Where the files of checkpoint ``step`` are written before :func:`commit` names it."""
    return Path(ckpt_dir) / f"{_TEMP}{step_dir_name(step)}"


def prepare(ckpt_dir: str | os.PathLike, comm: Any) -> None:
    """Collective, once before a run's checkpoints: rank 0 removes the temporary directories
    (:func:`temp_dir`) that a run killed before finishing them left. Each rank makes a
    checkpoint's temporary directory itself when it writes its part (:func:`write_part`), so a
    checkpoint costs no collective of its own before its files are written.

    Args:
        ckpt_dir: Directory holding the checkpoints (nothing is made when it is missing).
        comm: MPI communicator of all ranks.

    Raises:
        RunDirError: On every rank, when one cannot be removed.
    """
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
    """This rank's files of a checkpoint, each fsynced; calls no MPI, so a background
    thread may run it.

    Args:
        tmp: The temporary directory (:func:`temp_dir`; made when missing).
        rank: This rank: it also writes the shared files :func:`writes` gives it.
        model_state: Full state_dict (used by the rank that writes ``model.pt``).
        trainer_state: Trainer state (used by the rank that writes ``trainer.pt``).
        rank_state: This rank's own state.
        size: The number of ranks.

    Returns:
        File name to its ``bytes`` and ``sha256``, or ``{"error": one line}`` when a file
        could not be written.
    """
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
    """Collective, once every rank wrote its part (:func:`write_part`): rank 0 finishes the
    checkpoint (:func:`finish`).

    Args:
        ckpt_dir: Directory holding the checkpoints.
        step: Training step the checkpoint was taken at.
        comm: MPI communicator of all ranks.
        mine: What :func:`write_part` returned on this rank.
        info: Extra entries for the manifest.
        keep: How many of the newest checkpoints to keep.

    Returns:
        The final path of the checkpoint directory.

    Raises:
        RunDirError: On every rank, when any rank could not write its part or the checkpoint
            could not be finished.
    """
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
    writer runs it in a thread.

    Args:
        ckpt_dir: Directory holding the checkpoints.
        step: Training step the checkpoint was taken at.
        parts: What :func:`write_part` returned on each rank.
        world_size: Number of ranks.
        info: Extra entries for the manifest.
        keep: How many of the newest checkpoints to keep.

    Returns:
        None, or one line saying why the checkpoint could not be finished.
    """
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
    :mod:`hpcpar.run.checkpoint_writer`, runs the middle one in a thread).

    Args:
        ckpt_dir: Directory holding the checkpoints; created when missing.
        step: Training step the checkpoint is written at.
        comm: MPI communicator of all ranks.
        model_state: Full state_dict, written by rank 0 (pass it on every rank; other ranks'
            copies are ignored).
        trainer_state: Trainer state, written by the last rank (:func:`writes`).
        rank_state: This rank's own state, written by each rank.
        info: Extra entries for the manifest.
        keep: How many of the newest checkpoints to keep.

    Returns:
        The final path of the checkpoint directory.

    Raises:
        RunDirError: On every rank, when any rank could not write its part or the checkpoint
            could not be finished.
    """
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
    after a later step (not written by this run: resume set it aside or it is not hpcpar's).

    Args:
        ckpt_dir: Directory holding the checkpoints.
        step: The step just written.
        keep: How many to keep (at least the one just written).

    Returns:
        The checkpoint directories to delete.
    """
    mine = [p for p in list_checkpoints(ckpt_dir) if (checkpoint_step(p) or 0) <= step]
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


def set_aside(path: str | os.PathLike, suffix: str = CORRUPT_SUFFIX) -> Path:
    """Rename a corrupt checkpoint aside: kept for the user, never resumed from nor rotated away.

    The new name is ``step-N.corrupt`` (``.corrupt-2``, ... if taken).

    Args:
        path: The corrupt checkpoint directory.
        suffix: What the name gets (another reason to keep a checkpoint aside).

    Returns:
        The checkpoint's new path.
    """
    path = Path(path)
    dest, n = path.with_name(path.name + suffix), 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}{suffix}-{n}")
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


def finite_flags(tensors: Sequence[Any]) -> list[bool]:
    """Whether each tensor holds only finite values. A sum carries NaN and inf through, so a
    finite sum proves its tensor finite in one vectorised read-only pass, with no temporary
    (a maximum of |x| does too, but torch's CPU kernel for it took 4-7x as long: 0.55-0.67
    ms a checkpoint of the demo model); only a tensor whose sum is not finite, which overflow of
    finite values can also give, is checked element by element.

    Args:
        tensors: Floating-point tensors, on any devices.

    Returns:
        One flag per tensor.
    """
    import torch

    flags: dict[int, bool] = {}
    by_device: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():   # one stack and one read back per device
        sums = torch.stack([tensors[i].sum().float() for i in idx]).isfinite().tolist()
        flags.update(zip(idx, sums))
    return [flags[i] or bool(torch.isfinite(t).all()) for i, t in enumerate(tensors)]


def nonfinite_entries(state: dict) -> list[str]:
    """Find the floating-point tensors holding NaN or inf, so a diverged state is not saved or used.

    Args:
        state: Mapping of names to values; only floating-point tensors are checked.

    Returns:
        The names of the entries holding NaN or inf.
    """
    import torch

    tensors = {k: v.detach() for k, v in state.items()
               if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()}
    bad = {k for k, ok in zip(tensors, finite_flags(list(tensors.values()))) if not ok}
    return [k for k in state if k in bad]


def check_compatible(path: str | os.PathLike, shape: Sequence[int]) -> dict:
    """Read the manifest of a checkpoint to resume on grid ``shape``.

    Any grid resumes any checkpoint (module docstring): whether the grid fits the job (its
    split of the sample, the data width of the global batch) is the job's and the model's
    check, made before any checkpoint is read. Every rank calls this with the same arguments.

    Args:
        path: Checkpoint directory.
        shape: This run's grid shape, (data, X, Y, Z).

    Returns:
        The checkpoint's manifest.

    Raises:
        ValueError: An unreadable manifest (resume skips it: :func:`choose_resumable`).
    """
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
        old = _grid_shape(manifest)
    except (RecursionError, AttributeError, ValueError) as exc:   # not a JSON object/grid
        raise ValueError(f"{path}: unreadable manifest ({type(exc).__name__})") from None
    if len(old) != 4 or min(old) < 1 or len(shape) != 4:
        raise ValueError(f"{path}: unreadable manifest (grid {manifest.get('grid')!r})")
    return manifest


def grid_change(manifest: dict, shape: Sequence[int]) -> str | None:
    """The one line saying a checkpoint resumes on another grid, or None on the same grid.

    Args:
        manifest: The checkpoint's manifest.
        shape: This run's grid shape, (data, X, Y, Z).

    Returns:
        ``resuming step N of grid A on grid B``, or None when A is B.
    """
    old, new = "x".join(map(str, _grid_shape(manifest))), "x".join(map(str, shape))
    return None if old == new else f"resuming step {manifest.get('step')} of grid {old} on " \
                                   f"grid {new}"


def _grid_shape(manifest: dict) -> tuple[int, ...]:
    return tuple(int(v) for v in str(manifest.get("grid", "")).split("x"))


def source_rank(manifest: dict, coords: Sequence[int]) -> int:
    """Pick the checkpoint rank whose per-rank file (RNG, loader position, buffers) a rank takes.

    Data index ``d`` modulo the old data width (buffers may differ between data groups);
    within it, the rank at the same spatial place when the spatial split is unchanged (so an
    unchanged grid reads its own files), else the group's first rank: the files of a data
    group are alike (module docstring).

    Args:
        manifest: The checkpoint's manifest (it names the old grid).
        coords: This rank's coordinates (d, i, j, k) in this run's grid.

    Returns:
        The rank in the checkpoint's grid whose per-rank file to load.
    """
    old_d, x, y, z = _grid_shape(manifest)
    d, i, j, k = coords
    fits = i < x and j < y and k < z
    i, j, k = (i, j, k) if fits else (0, 0, 0)
    return i + x * (j + y * (k + z * (d % old_d)))


def restore_buffers(model: Any, saved: dict) -> None:
    """Copy a rank file's buffers into the model: those it has, of the same shape (a buffer
    whose shape depends on the split is no state of the model and is left as built).

    Args:
        model: The model, possibly wrapped (its ``module`` is used).
        saved: Buffer name to tensor, as :func:`local_buffers` returned.
    """
    import torch

    model = getattr(model, "module", model)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            value = saved.get(name)
            if value is not None and tuple(value.shape) == tuple(buf.shape):
                buf.copy_(value)


# -- global optimizer state -----------------------------------------------------------------------
def _sharded_state(model: Any, optimizer: Any):
    """(module, [(parameter name, index in the optimizer's state_dict, parameter)], state
    keys) of each sharded module (one with ``full_state_dict``), in the same order on every
    rank; the keys are those of its parameters' state tensors with the parameter's number of
    dimensions (its shard's shape, or the full shape once a saved state is loaded)."""
    model = getattr(model, "module", model)
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups
                                            for p in g["params"])}
    for _, mod in _hooked_modules(model, "full_state_dict"):
        params = [(n, index[id(p)], p) for n, p in mod.named_parameters() if id(p) in index]
        keys = sorted({k for _, _, p in params for k, v in optimizer.state.get(p, {}).items()
                       if hasattr(v, "dim") and v.dim() == p.dim() > 0})
        if params and keys:
            yield mod, params, keys


def _swapped(params, tensors: dict, fn, *args):
    """Call ``fn(*args)`` with each parameter's data replaced by ``tensors[name]`` (restored
    after): the module's own gather and scatter then move optimizer state like weights."""
    kept = [p.data for _, _, p in params]
    try:
        for name, _, p in params:
            p.data = tensors[name]
        return fn(*args)
    finally:
        for (_, _, p), data in zip(params, kept):
            p.data = data


def full_optimizer_state(model: Any, optimizer: Any, root: int | None = None,
                         spill_dir: Any = None) -> dict:
    """The optimizer's state_dict with every sharded parameter's state gathered to its full
    shape (collective when the model has sharded modules), so it loads on any grid.

    Args:
        model: The model the optimizer trains, possibly wrapped or partitioned.
        optimizer: The optimizer.
        root: The only rank that needs a split head's full state (the writer of
            ``trainer.pt``): the others keep their own columns; None: every rank.
        spill_dir: Where ``root`` backs that full state by a file instead of memory
            (:mod:`hpcpar.nn.spill`); None: memory.

    Returns:
        ``optimizer.state_dict()``, sharded state replaced by full tensors (the optimizer's
        own state is not modified).
    """
    if hasattr(optimizer, "consolidated"):   # [train] shard_optimizer: the plain optimizer
        optimizer = optimizer.consolidated()
    sd = optimizer.state_dict()
    state = dict(sd["state"])
    for mod, params, keys in _sharded_state(model, optimizer):
        for key in keys:
            have = {n: optimizer.state[p][key] if key in optimizer.state.get(p, {})
                    else p.data for n, _, p in params}
            full = _swapped(params, have, mod.full_state_dict)
            for name, i, p in params:
                if key in optimizer.state.get(p, {}):
                    state[i] = dict(state[i], **{key: full[name].detach().cpu().clone()})
    from hpcpar.nn.split_head import gathered_to  # deferred: loads torch, numpy

    with gathered_to(root, spill_dir):
        for i, _, info, keys in _column_state(optimizer):
            state[i] = dict(state[i], **{k: _gathered(info.gather(state[i][k], root).cpu(),
                                                      state[i][k]) for k in keys})
    return dict(sd, state=state)


#: tensors made for a checkpoint (gathered, so no live state shares them), by id: in_memory
#: takes them as they are, instead of a second full-size copy on the writer
_FRESH: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _gathered(full, local) -> Any:
    if full is not local:
        _FRESH[id(full)] = full
    return full


def _column_state(optimizer: Any):
    """(index in the optimizer's state_dict, parameter, its column split, state keys) of each
    split head's weight (:mod:`hpcpar.nn.split_head`: cut to this rank's columns), in the same
    order on every rank; the keys are those of its per-element state."""
    from hpcpar.nn.split_head import column_split  # deferred: loads torch, numpy

    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        info = column_split(p)
        st = optimizer.state.get(p, {})
        if info is not None and st:
            yield i, p, info, sorted(k for k, v in st.items()
                                     if hasattr(v, "dim") and v.dim() == 2 and v.shape[0] ==
                                     p.shape[0])


def load_full_optimizer_state(model: Any, optimizer: Any, saved: dict) -> None:
    """Load what :func:`full_optimizer_state` saved, re-sharding each sharded parameter's state
    for this grid (collective when the model has sharded modules); state saved at the shard's
    own shape (a checkpoint of an older hpcpar) loads unchanged.

    Args:
        model: The model the optimizer trains, possibly wrapped or partitioned.
        optimizer: The optimizer.
        saved: The saved optimizer state_dict.
    """
    import torch

    from hpcpar.sync.layout import match_state_layouts  # deferred: loads torch

    if hasattr(optimizer, "load_consolidated"):   # [train] shard_optimizer: slice a plain one
        plain = optimizer.twin()
        load_full_optimizer_state(model, plain, saved)
        optimizer.load_consolidated(plain)
        return
    optimizer.load_state_dict(saved)
    for mod, params, keys in _sharded_state(model, optimizer):
        full = mod.full_state_dict()                  # full shapes, and entries to keep
        for key in keys:
            given = {n: optimizer.state[p][key] for n, _, p in params
                     if key in optimizer.state.get(p, {})
                     and optimizer.state[p][key].shape == full[n].shape}
            scratch = {n: torch.empty_like(p.data) for n, _, p in params}
            _swapped(params, scratch, mod.load_full_state_dict, dict(full, **given))
            for name, _, p in params:
                if name in given:
                    optimizer.state[p][key] = scratch[name]
    for _, p, info, keys in _column_state(optimizer):
        st = optimizer.state[p]
        for k in keys:
            if st[k].shape[-1] == info.features:   # saved whole: this rank's columns
                st[k] = info.take(st[k]).contiguous()
    match_state_layouts(optimizer)


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
    (:func:`check_compatible`). Rank 0 checks; every rank gets its result or its error.

    Args:
        path: The checkpoint directory, of this run directory or another.
        shape: This run's grid shape, (data, X, Y, Z).
        kind: This job's ``[model] kind``.
        comm: MPI communicator of all ranks; None checks in this process alone.

    Returns:
        The checkpoint's manifest.

    Raises:
        RunDirError: One line naming the checkpoint: missing, damaged or written by an
            incompatible job.
    """
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
