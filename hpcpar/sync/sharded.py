"""Sharded optimizer state and gradients (ZeRO-1/2 style): ``[train] shard_optimizer = true``.

Every gradient bucket of :class:`~hpcpar.sync.ddp.DistributedDataParallel` is reduced over the
group of ranks that replicates its parameters (the whole grid for replicated weights, the data
axis for tensor-parallel shards) and is already cut into one chunk per rank of that group.
With sharding on, the bucket reduction stops after its reduce-scatter (no allgather of
gradients): rank r holds the reduced gradient of chunk r only. :class:`ShardedOptimizer`
gives the wrapped torch optimizer (Adam, AdamW, SGD: all elementwise) one flat piece per
parameter slice inside the chunk, so its state is about 1/R of the unsharded one; after the
step each bucket's updated chunks are all-gathered back into the parameters.

Exact: an elementwise update of a slice equals the slice of the full update, the reduction
sums in the same canonical order as the unsharded path, and a parameter with no gradient on
any rank is skipped exactly as torch skips a ``None`` gradient. Checkpoints keep the plain
single-process format: :meth:`ShardedOptimizer.consolidated` gathers the state into a plain
optimizer over the model's own parameters and :meth:`ShardedOptimizer.load_consolidated`
slices one back, so a run resumes sharded from unsharded and back, on any grid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hpcpar.errors import ConfigError
from hpcpar.parallel.buffers import as_buffer
from hpcpar.sync.layout import flat_in_order, shaped_like

__all__ = ["ShardedOptimizer"]


@dataclass
class _Piece:
    """This rank's slice ``[lo, hi)`` of ``param``'s flat elements, at ``at`` in its bucket."""

    param: torch.nn.Parameter
    bucket: Any
    lo: int
    hi: int
    at: int
    master: torch.Tensor  # the slice the inner optimizer updates (a view of a flat shard)


def _chunk(bucket) -> tuple[int, int]:
    """The flat range of ``bucket`` this rank owns after the reduce-scatter."""
    size = bucket.flat.numel() // bucket.group.size
    return bucket.group.rank * size, (bucket.group.rank + 1) * size


class ShardedOptimizer:
    """A torch optimizer whose state and gradients are split over the ranks of each
    parameter's replica group.

    Use it instead of the plain optimizer: gradients visible after ``backward`` are this
    rank's shard (:attr:`params`, each with a ``.grad``; the model's own ``.grad`` are None),
    ``step()`` updates the shard and all-gathers the parameters, ``zero_grad()`` clears both.
    The group's learning rates live in :attr:`param_groups` (the inner optimizer's), so an lr
    scheduler attaches to :attr:`optimizer`.

    Collective (every rank builds its own over the model's ``DistributedDataParallel``, else
    ConfigError); ``make`` builds the inner torch optimizer from a list of param-group dicts.
    """

    def __init__(self, ddp, make: Callable[[list[dict]], torch.optim.Optimizer], param_groups):
        if not callable(getattr(ddp, "_shard_gradients", None)):
            raise ConfigError(f"[train] shard_optimizer: the model is wrapped in "
                              f"{type(ddp).__name__}, expected hpcpar's DistributedDataParallel")
        self.ddp = ddp
        self._make = make
        items = list(param_groups)
        groups = [dict(g) for g in items] if items and isinstance(items[0], dict) \
            else [{"params": items}]
        for g in groups:
            g["params"] = list(g["params"])
        self._groups = groups
        self._planned_for: list = []   # the buckets the pieces were cut from
        self.pieces: list[_Piece] = []
        self.optimizer = make([{**g, "params": []} for g in groups])
        self._build()
        ddp._shard_gradients(self._attach_grads)

    def _build(self) -> None:
        """Pieces, master shards and the inner optimizer's params from the current buckets."""
        self._planned_for = self.ddp._buckets
        group_of = {id(p): i for i, g in enumerate(self._groups) for p in g["params"]}
        self.pieces = []
        self._masters = []
        for b in self._planned_for:
            start, end = _chunk(b)
            end = min(end, b.numel)
            master = torch.empty(max(0, end - start), dtype=b.flat.dtype, device=b.flat.device)
            self._masters.append(master)
            offset = 0
            for p in b.params:
                lo, hi = max(offset, start), min(offset + p.numel(), end)
                if lo < hi:
                    self.pieces.append(_Piece(p, b, lo - offset, hi - offset, lo,
                                              master[lo - start:hi - start]))
                offset += p.numel()
        for g in self.optimizer.param_groups:
            g["params"] = []
        for piece in self.pieces:
            gi = group_of.get(id(piece.param))
            if gi is not None:
                self.optimizer.param_groups[gi]["params"].append(piece.master)
        self.optimizer.state.clear()

    def _replan(self) -> None:
        """The gradient sync re-planned its buckets (a spatialized model's first forward):
        carry the state over to the new pieces (collective, on every rank alike)."""
        if self.ddp._buckets is self._planned_for:
            return
        full = self._consolidate_from(self._planned_for, self.pieces)
        self._build()
        self.ddp._release_retired()   # the old buckets' state is in ``full``
        self.load_consolidated(full)

    @property
    def params(self) -> list[torch.Tensor]:
        """This rank's shard: one flat tensor per parameter slice it updates."""
        return [piece.master for piece in self.pieces]

    def norm_params(self, counted: Callable[[torch.nn.Parameter], bool]) -> list[torch.Tensor]:
        """This rank's pieces that count in the global gradient norm: every piece of a
        parameter reduced over the whole grid (no other rank holds it), and a piece of one
        reduced over the data axis only where ``counted(param)`` (e.g. a tensor-parallel
        shard; see hpcpar.run.grad_clip)."""
        world = self.ddp._groups["world"]
        return [pc.master for pc in self.pieces if pc.bucket.group is world or counted(pc.param)]

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's param groups (learning rates, ...)."""
        return self.optimizer.param_groups

    @property
    def state(self):
        """The inner optimizer's state, keyed by the shard tensors."""
        return self.optimizer.state

    def _attach_grads(self) -> None:
        """Called by the gradient sync when its reduce-scatters are done: each piece's
        gradient is its slice of the reduced chunk, or None where the parameter had no
        gradient on any rank of its group (one small allreduce of the flags per group)."""
        from mpi4py import MPI

        self._replan()
        has: dict[int, bool] = {}
        by_comm: dict[int, list] = {}
        for b in self._planned_for:
            by_comm.setdefault(id(b.group), []).append(b)
        for buckets in by_comm.values():
            flags = torch.tensor([f for b in buckets for f in b.local_flags], dtype=torch.int32)
            comm = buckets[0].group.comm
            if comm.Get_size() > 1:
                comm.Allreduce(MPI.IN_PLACE, flags.numpy(), op=MPI.MAX)
            params = [p for b in buckets for p in b.params]
            has.update((id(p), bool(f)) for p, f in zip(params, flags.tolist()))
        for piece in self.pieces:
            piece.master.grad = (piece.bucket.flat[piece.at:piece.at + piece.hi - piece.lo]
                                 if has[id(piece.param)] else None)

    # -- the optimizer API --------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's shard, then all-gather every bucket's chunks into the parameters."""
        self._replan()
        for piece in self.pieces:   # the parameters may have been loaded since the last step
            piece.master.copy_(flat_in_order(piece.param.detach())[piece.lo:piece.hi])
        self.optimizer.step()
        self._gather_params(self._planned_for, self.pieces, lambda piece: piece.master)
        for piece in self.pieces:
            piece.master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the shard's and the model's gradients (the shard's are views of the sync's
        buffers, so they are always dropped, never zeroed)."""
        for piece in self.pieces:
            piece.master.grad = None
        for g in self._groups:
            for p in g["params"]:
                if set_to_none or p.grad is None:
                    p.grad = None
                else:
                    p.grad.zero_()

    def twin(self) -> torch.optim.Optimizer:
        """A plain optimizer over the model's parameters with this one's hyperparameters
        (learning rates included) and no state."""
        plain = self._make([dict(g) for g in self._groups])
        for mine, theirs in zip(self.optimizer.param_groups, plain.param_groups):
            for key in ("lr", "initial_lr"):
                if key in mine:
                    theirs[key] = mine[key]
        return plain

    def consolidated(self) -> torch.optim.Optimizer:
        """Collective: :meth:`twin` holding the full state every rank's shard makes up, in
        exactly the single-process optimizer's form."""
        self._replan()
        return self._consolidate_from(self._planned_for, self.pieces)

    @torch.no_grad()
    def _consolidate_from(self, buckets, pieces) -> torch.optim.Optimizer:
        plain = self.twin()
        params = [p for b in buckets for p in b.params]
        position = {id(p): i for i, p in enumerate(params)}
        state = {id(piece.master): self.optimizer.state.get(piece.master, {})
                 for piece in pieces}
        # scalars (Adam's step), and which parameters have state at all, from the rank that
        # owns each parameter's first element; the tensor keys from everyone
        small, keys = {}, set()
        for piece in pieces:
            st = state[id(piece.master)]
            keys |= {k for k, v in st.items() if _sliced(v, piece)}
            if st and piece.lo == 0:
                small[position[id(piece.param)]] = {k: v for k, v in st.items()
                                                    if not _sliced(v, piece)}
        known: dict = {}
        for comm in {id(b.group): b.group.comm for b in buckets}.values():
            for part, their_keys in comm.allgather((small, sorted(keys))):
                known.update(part)
                keys.update(their_keys)
        for p in params:
            entry = known.get(position[id(p)])
            if entry is not None:
                plain.state[p] = {k: v.clone() if torch.is_tensor(v) else v
                                  for k, v in entry.items()}

        def store(p, view, key):
            if p in plain.state:   # a parameter that never had a gradient has no state
                plain.state[p][key] = view.clone()

        for key in sorted(keys):
            self._gather_params(buckets, pieces,
                                lambda piece, key=key: state[id(piece.master)].get(key),
                                into=lambda p, view, key=key: store(p, view, key), scratch=True)
        return plain

    @torch.no_grad()
    def load_consolidated(self, plain: torch.optim.Optimizer) -> None:
        """Take a plain optimizer's state (over the model's parameters) and hyperparameters,
        keeping this rank's slices."""
        self._replan()
        for mine, theirs in zip(self.optimizer.param_groups, plain.param_groups):
            mine.update({k: v for k, v in theirs.items() if k not in ("params", "fused")})
        self.optimizer.state.clear()
        for piece in self.pieces:
            full = plain.state.get(piece.param)
            if not full:
                continue
            n = piece.param.numel()
            self.optimizer.state[piece.master] = {
                k: (flat_in_order(v.detach(), piece.param)[piece.lo:piece.hi].clone()
                    if torch.is_tensor(v) and v.dim() > 0 and v.numel() == n
                    else v.clone() if torch.is_tensor(v) else v)
                for k, v in full.items()}

    def state_dict(self) -> dict:
        """Collective: the single-process optimizer's state_dict (see :meth:`consolidated`)."""
        return self.consolidated().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a single-process optimizer's state_dict."""
        plain = self.twin()
        plain.load_state_dict(state_dict)
        self.load_consolidated(plain)

    def _gather_params(self, buckets, pieces, source, into=None, scratch=False) -> None:
        """Per bucket: this rank's pieces (``source(piece)``; None = leave) into its chunk of
        the bucket's flat buffer, one in-place allgather over the bucket's group, then each
        parameter's full flat view to ``into(param, view)`` (default: copied into the
        parameter). The buffer is the gradient's (consumed by the step), or a temporary one
        with ``scratch``."""
        from mpi4py import MPI

        by_bucket: dict[int, list[_Piece]] = {}
        for piece in pieces:
            by_bucket.setdefault(id(piece.bucket), []).append(piece)
        for b in buckets:
            flat = torch.zeros_like(b.flat) if scratch else b.flat
            for piece in by_bucket.get(id(b), []):
                value = source(piece)
                if value is not None:
                    flat[piece.at:piece.at + piece.hi - piece.lo].copy_(value.reshape(-1))
            if b.group.size > 1:
                buf = as_buffer(flat)
                b.group.comm.Allgather(MPI.IN_PLACE, buf.mpi)
                buf.finish()
            offset = 0
            for p in b.params:
                view = shaped_like(flat[offset:offset + p.numel()], p)
                offset += p.numel()
                if into is None:
                    p.copy_(view)
                else:
                    into(p, view)


def _sliced(value, piece: _Piece) -> bool:
    """Whether a state entry is per element (a slice of the parameter's full state)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == piece.hi - piece.lo
