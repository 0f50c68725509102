"""The trained model ``hpcpar predict`` runs: from a run directory or one of its checkpoints
(the job's plain model with the checkpoint's full ``model.pt``: a checkpoint does not depend on
the grid it was written on, :mod:`hpcpar.run.checkpoint`, so any grid predicts with it), or
from a model file and weights (``--model net.py:UNet --weights model.pt``). Every weights file
is read with ``torch.load(weights_only=True)``: no pickled code runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hpcpar.errors import ConfigError, RunDirError
from hpcpar.formats.kinds import load_object

from .checkpoint import store

__all__ = ["load_model"]


def checkpoint_of(target: str | os.PathLike) -> tuple[Path, Path]:
    """(run directory, checkpoint directory) of a run directory (its newest valid
    checkpoint) or of one checkpoint directory (``RUN/checkpoints/step-N``)."""
    path = Path(target)
    if store.checkpoint_step(path) is not None and (path / store.MANIFEST).is_file():
        chosen, run_dir = path, path.parent.parent
    else:
        run_dir = path
        if not (path / "job.json").is_file():
            raise RunDirError(f"{path}: not a run directory (no job.json) or a checkpoint "
                              "(step-N with manifest.json)")
        found = None
        for candidate in store.list_checkpoints(path / "checkpoints"):
            try:
                store.verify(candidate)
            except RunDirError:
                continue
            found = candidate
            break
        if found is None:
            raise RunDirError(f"{path}: no valid checkpoint in {path / 'checkpoints'}")
        chosen = found
    if not (run_dir / "job.json").is_file():
        raise RunDirError(f"{chosen}: its run directory {run_dir} has no job.json")
    store.verify(chosen)
    return run_dir, chosen


def model_class(spec: str) -> Any:
    """``file.py:Name`` or ``package.module:Name``: the class (or factory) it names, resolved
    as ``[model] kind`` is (:func:`hpcpar.formats.kinds.load_object`)."""
    return load_object(spec, "--model")


def _weights(path: str | os.PathLike) -> dict:
    import torch

    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"--weights {path}: not a loadable state_dict "
                          f"({str(exc).splitlines()[0][:200]})") from None
    if not isinstance(sd, dict):
        raise ConfigError(f"--weights {path}: expected a state_dict (a dict), "
                          f"got {type(sd).__name__}")
    return sd


def _load(model, sd: dict, where: str):
    try:
        model.load_state_dict(sd)
    except RuntimeError as exc:
        raise ConfigError(f"{where}: the weights do not fit the model "
                          f"({str(exc).splitlines()[0][:300]})") from None
    return model.eval()


def load_model(target: str | None, model: str | None,
               weights: str | None) -> tuple[Any, int | None]:
    """(plain model in eval mode, input channels to read (None: all)) for ``hpcpar predict``,
    from a run directory or checkpoint ``target``, or from ``model`` (``file.py:Class``,
    instantiated without arguments) with the state_dict file ``weights``. ConfigError for
    neither or both, an import or weights that fail; RunDirError for no valid checkpoint."""
    if (target is None) == (model is None):
        raise ConfigError("predict needs a RUN_DIR_OR_CHECKPOINT or --model FILE.py:Class "
                          "with --weights, not both")
    if target is None:
        if weights is None:
            raise ConfigError("--model needs --weights FILE (a state_dict)")
        assert model is not None
        return _load(model_class(model)(), _weights(weights), weights), None
    from hpcpar.formats.jobspec import load_resolved  # deferred: only for a run directory
    from hpcpar.formats.kinds import get_workload  # deferred: only for a run directory

    run_dir, chosen = checkpoint_of(target)
    job = load_resolved(run_dir / "job.json")
    cls = get_workload(job.model.kind)
    channels = job.data.params.get("channels")
    if not hasattr(cls, "build_plain") or channels is None:
        raise ConfigError(f"{run_dir}: predict runs volume models whose job states [data] "
                          f"channels (kind {job.model.kind!r})")
    size = job.data.params.get("size") or 2 ** 8
    net = cls.build_plain(job, channels, (size,) * 3, 1)
    in_channels = channels - getattr(cls, "label_channels", 0)
    return _load(net, _weights(chosen / "model.pt"), str(chosen / "model.pt")), in_channels
