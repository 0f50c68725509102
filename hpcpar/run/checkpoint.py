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
from pathlib import Path

from hpcpar.errors import RunDirError

__all__ = ["MANIFEST", "FORMAT_VERSION", "PREFIX", "step_dir_name", "rank_file", "full_state_dict",
           "load_full_state_dict", "local_buffers", "rng_state", "set_rng_state", "sha256_file",
           "list_checkpoints", "verify", "save", "find_resumable", "CORRUPT_SUFFIX", "set_aside",
           "choose_resumable", "check_optimizer", "nonfinite_entries", "check_compatible",
           "source_rank", "load"]

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
PREFIX = "step-"


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:06d}"


def rank_file(rank: int) -> str:
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


def full_state_dict(model) -> dict:
    """The single-process state_dict of a (possibly partitioned) model, on CPU. Collective when
    a module has ``full_state_dict()``; spatial layers' parameters are replicated already."""
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


def load_full_state_dict(model, sd: dict) -> None:
    """Inverse of :func:`full_state_dict` (strict: every key must match)."""
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


def local_buffers(model) -> dict:
    """This rank's buffers (e.g. BatchNorm running statistics), saved per rank."""
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
def sha256_file(path) -> str:
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


def list_checkpoints(ckpt_dir) -> list[Path]:
    """Finished checkpoint directories, newest (highest step) first."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if p.is_dir() and p.name.startswith(PREFIX)
             and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


def verify(path) -> dict:
    """The manifest of checkpoint ``path`` after checking every file's size and sha256;
    raises RunDirError naming the first problem."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RunDirError(f"{path}: unreadable manifest ({exc})") from None
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            raise RunDirError(f"{path}: missing {name}")
        if f.stat().st_size != info["bytes"] or sha256_file(f) != info["sha256"]:
            raise RunDirError(f"{path}: {name} is corrupt (sha256 mismatch)")
    return manifest


# -- collective save / load -----------------------------------------------------------------------
def save(ckpt_dir, step: int, *, comm, model_state: dict | None, trainer_state: dict,
         rank_state: dict, info: dict, keep: int) -> Path:
    """Collective: write checkpoint ``step`` atomically; returns its final path.

    ``model_state`` (the full state_dict) and ``trainer_state`` are written by rank 0 (pass
    them on every rank; other ranks' copies are ignored); ``rank_state`` by each rank;
    ``info`` goes into the manifest.
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
            for old in list_checkpoints(ckpt_dir)[keep:]:
                shutil.rmtree(old, ignore_errors=True)
        except OSError as exc:
            err = f"checkpoint {final} failed: {exc}"
    err = comm.bcast(err, root=0)
    if err:
        raise RunDirError(err)
    return final


def find_resumable(ckpt_dir, comm, log=print) -> Path | None:
    """Collective: the newest checkpoint whose manifest and checksums verify (rank 0 checks,
    warns about each corrupt one, broadcasts), or None when there is none."""
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


def set_aside(path) -> Path:
    """Rename a corrupt checkpoint to ``step-N.corrupt`` (``.corrupt-2``, ... if taken): kept for
    the user, no longer listed, so never resumed from nor rotated away."""
    path = Path(path)
    dest, n = path.with_name(path.name + CORRUPT_SUFFIX), 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}{CORRUPT_SUFFIX}-{n}")
    os.rename(path, dest)
    return dest


def choose_resumable(ckpt_dir, comm, log=print) -> Path | None:
    """Collective: the newest valid checkpoint, or None when there is no checkpoint at all.

    Rank 0 verifies newest first. Corrupt checkpoints newer than the chosen one are renamed
    aside (:func:`set_aside`) with one warning each. When checkpoints exist but none verifies,
    every rank raises :class:`RunDirError` naming them, and nothing is renamed: a silent
    restart from step 0 would throw the run away."""
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


def check_optimizer(path, optimizer, name: str, saved_state: dict) -> None:
    """Raise a one-line :class:`RunDirError` when checkpoint ``path`` holds the state of another
    optimizer than ``optimizer`` (``name`` from the job): torch would load it and fail later
    with a KeyError inside ``step()``."""
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
    """Names of the floating-point tensors in ``state`` holding NaN or inf."""
    import torch

    return [k for k, v in state.items() if isinstance(v, torch.Tensor)
            and v.is_floating_point() and not bool(torch.isfinite(v).all())]


def check_compatible(path, shape) -> dict:
    """The manifest of ``path`` if this grid (``shape`` = (data, X, Y, Z)) can resume it: the
    same spatial split; the data width may differ (a job that lost nodes resumes on fewer).
    Every rank calls this with the same arguments, so all raise together."""
    manifest = json.loads((Path(path) / MANIFEST).read_text())
    old = _grid_shape(manifest)
    if tuple(old[1:]) != tuple(shape[1:]):
        spec = "x".join(map(str, shape))
        raise RunDirError(f"{path}: written by grid {manifest.get('grid')}, this run is grid "
                          f"{spec}: a checkpoint resumes on another data width but not on "
                          f"another spatial split; use --grid DATAx{'x'.join(map(str, old[1:]))}"
                          f" or --fresh")
    return manifest


def _grid_shape(manifest: dict) -> tuple[int, ...]:
    return tuple(int(v) for v in str(manifest.get("grid", "")).split("x"))


def source_rank(manifest: dict, coords) -> int:
    """The rank of the checkpoint's grid whose per-rank file (RNG, loader position, local
    buffers) rank ``coords`` = (d, i, j, k) of this grid takes: same spatial place, data
    index ``d`` modulo the old data width (identical to ``rank`` when the grid is unchanged)."""
    old_d, x, y, z = _grid_shape(manifest)
    d, i, j, k = coords
    return i + x * (j + y * (k + z * (d % old_d)))


def load(path, rank: int) -> tuple[dict, dict, dict, dict]:
    """(manifest, model_state, trainer_state, rank_state) of checkpoint ``path`` for ``rank``,
    all read with ``weights_only=True``."""
    import torch

    path = Path(path)
    manifest = json.loads((path / MANIFEST).read_text())

    def rd(name):
        return torch.load(path / name, map_location="cpu", weights_only=True)

    return manifest, rd("model.pt"), rd("trainer.pt"), rd(rank_file(rank))
