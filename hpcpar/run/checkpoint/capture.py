"""The state a checkpoint holds, gathered from and restored into a (possibly partitioned) run:
the full model and optimizer state, this rank's buffers and generator states, and the copy an
asynchronous checkpoint writes (:mod:`hpcpar.run.checkpoint`).

Tensor-parallel (or otherwise sharded) modules take part through two optional, collective
methods: ``module.full_state_dict()`` returns the gathered single-process entries of that module
(keys relative to it) and ``module.load_full_state_dict(sd)`` re-shards them.
"""

from __future__ import annotations

import copy
import random
import weakref
from typing import Any

from hpcpar.errors import RunDirError

__all__ = ["full_state_dict", "load_full_state_dict", "local_buffers", "restore_buffers",
           "rng_state", "set_rng_state", "in_memory", "full_optimizer_state",
           "load_full_optimizer_state"]


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
    """The single-process state_dict of a (possibly wrapped or partitioned) model: every tensor
    detached and (``copy``) on CPU, none sharing memory with the model (a tensor gathered for it
    is not copied again). Collective when a module has ``full_state_dict()`` or a split head is
    cut; spatial layers' parameters are replicated already.

    ``root`` is the only rank that needs a split head's full weight (the writer of
    ``model.pt``; None: every rank): the others keep their own columns in its place
    (:func:`hpcpar.nn.split_head.gathered_to`); ``spill_dir`` backs it there by a file instead
    of memory (:mod:`hpcpar.nn.spill`). ``copy=False`` on a rank that only checks the state:
    its tensors stay the model's own, on their device; a copy of the whole model on every rank
    of a node would not divide by the ranks."""
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
    """Inverse of :func:`full_state_dict`; strict: RunDirError when the state does not fit the
    model (shape mismatch, missing or unexpected keys)."""
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
    """Detached CPU copies of this rank's buffers (e.g. BatchNorm running statistics), which
    are saved per rank."""
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
    """Restore :func:`rng_state`'s states, so a resumed run draws alike (CUDA's only when
    present and CUDA is available)."""
    import numpy as np
    import torch

    ver, st, gauss = state["python"]
    # a tensor, or the list of ints of older checkpoints
    random.setstate((ver, tuple(st.tolist() if hasattr(st, "tolist") else st), gauss))
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- a copy training cannot change ----------------------------------------------------------------
_ATOMS = (int, float, str, bytes, bool, type(None))


def in_memory(obj: Any) -> Any:
    """A copy of ``obj`` that training can no longer change: every tensor copied to CPU memory,
    containers rebuilt, anything else deep-copied. What an asynchronous checkpoint writes
    while the next steps run (the optimizer's ``state_dict()`` holds its live tensors)."""
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


def restore_buffers(model: Any, saved: dict) -> None:
    """Copy a rank file's buffers into the model: those it has, of the same shape (a buffer
    whose shape depends on the split is no state of the model and is left as built)."""
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
    shape (collective when the model has sharded modules), so it loads on any grid; the
    optimizer's own state is not modified. ``root`` and ``spill_dir`` as in
    :func:`full_state_dict`, for the writer of ``trainer.pt``."""
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
    own shape (a checkpoint of an older hpcpar) loads unchanged."""
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
