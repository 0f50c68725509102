"""Peak memory per rank of one training step, and the largest sample a memory budget holds.

The point of splitting a sample over ranks is that it then fits: a CosmoFlow cube too big for
one rank's memory trains on 8. Per rank, in bytes, with ``b`` samples per data replica and
every layer's output taken on this rank's piece of the volume (the largest piece the partition
rule gives, so the rank that runs out first):

* ``runtime``: the process itself (Python, torch, MPI, HDF5, Numba): :data:`RUNTIME_BYTES`;
* ``params``: weights, the gradient sync's flat buckets (the gradients live in them: each
  fresh gradient is copied in and dropped as its bucket launches) and optimizer state (Adam 2
  copies, SGD 1). The optimizer step's temporaries (1 copy) exist only while the step runs,
  after backward has freed the activations: they count in ``transient`` when they exceed the
  activations' share there. Measured (per-process anonymous memory sampled through a run,
  CosmoFlow 128³ on 1 rank): 4 copies of the 32 MiB of weights beside the activations, not 6. A
  dense layer after a gather (CosmoFlow's first dense layer grows with the sample) weighs on
  every rank alike; a split head (the same layer taking the flattened volume split,
  :mod:`hpcpar.nn.split_head`) holds only the columns of this rank's voxels, and a
  tensor-parallel one 1/spatial of it; with ``[train] shard_optimizer``
  (:mod:`hpcpar.sync.sharded`) the optimizer state, the shard it updates and the step's
  temporaries divide by the parameter's replicas (all ranks for a replicated weight, the data
  axis for a split one), the weights and buckets do not;
* ``data``: the input batch in use and one prefetched, ``2 b C D H W / spatial``;
* ``saved``: activations kept for backward, every layer's output (the spatial layers keep only
  their input and the received ghost faces: :func:`hpcpar.parallel.halo.halo_stencil`); with
  ``[train] activation_checkpointing`` only each checkpointed segment's output, and the
  transient adds the largest segment's outputs (recomputed in its backward);
* ``transient``: backward holds a layer's output gradient next to its input gradient, twice
  the largest layer output (or, if larger, the optimizer step's temporaries less the saved
  activations they replace).

Two moments outside the step can peak higher, so the total is the largest of the three:

* ``startup``: the model is built whole (seeded, as one process would) and a split head is cut
  to this rank's columns only by the first forward (:func:`hpcpar.nn.spatializer.settle`, one
  sample of zeros, no gradients): the full parameters plus that forward's input and its two
  largest layer outputs, once (the plain model is not copied: ``spatialize(inplace=True)``);
* ``checkpoint``: the rank writing ``trainer.pt`` holds the optimizer state of the full model
  on top of the step's peak: the memory the step's activations freed stays in the process's
  heap (glibc keeps it), and the gathered tensors are fresh large allocations beside it.
  A split head's state is gathered to it alone
  (:func:`hpcpar.nn.split_head.ColumnSplit.gather`) into a file in the checkpoint directory,
  not into memory (:mod:`hpcpar.nn.spill`, from ``HPCPAR_CHECKPOINT_SPILL`` bytes a tensor):
  page cache, which the kernel writes out and drops under a limit. ``model.pt``'s writer
  holds one full copy of the weights, less.

A grid fits a budget when the total is at most :data:`HEADROOM` of it (allocator
fragmentation, page cache, kernel). Checked against a kernel-enforced limit:
``tests/run/test_memory_limit.py`` (CosmoFlow 192³ x 4 under 1.5 GiB per rank: 1 rank is
killed, 8 ranks train, and this model says the same).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpcpar import _env, _units
from hpcpar.parallel.partition import split_sizes

if TYPE_CHECKING:
    from hpcpar.plan.types import Workload

__all__ = ["RUNTIME_BYTES", "HEADROOM", "MemoryEstimate", "optimizer_states", "estimate",
           "largest_edge", "parse_bytes"]

#: resident memory of one rank before any tensor: measured 0.25-0.29 GB per rank (cgroup
#: charge, 8 ranks, CosmoFlow on 32³, CPU) on the 2-core test machine
RUNTIME_BYTES = 0.3e9
#: share of the budget the estimate may use
HEADROOM = 0.9

_OPT_STATE = {"adam": 2, "adamw": 2, "sgd": 1}


def optimizer_states(optimizer: str) -> int:
    """Tensors of state the optimizer keeps per parameter (momentum; Adam's two moments)."""
    return _OPT_STATE.get(optimizer, 2)


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes per rank, by part (see the module docstring)."""

    runtime: float
    params: float
    data: float
    saved: float
    transient: float
    startup: float = 0.0      # peak while the model is built and settled (a whole total)
    checkpoint: float = 0.0   # peak of a checkpoint's optimizer-state writer (a whole total)

    @property
    def step(self) -> float:
        """The training step's peak, bytes (the sum of the parts)."""
        return self.runtime + self.params + self.data + self.saved + self.transient

    @property
    def total(self) -> float:
        """The predicted peak, bytes: the step's, the start-up's or a checkpoint's."""
        return max(self.step, self.startup, self.checkpoint)


def _local_out(layer, parts) -> int:
    """Elements of one sample's output of ``layer`` on the rank holding the largest piece."""
    vol = layer.out_shape[1:]
    if not layer.spatial or len(vol) != 3:
        return math.prod(layer.out_shape)
    return layer.out_shape[0] * math.prod(max(split_sizes(n, p)) for n, p in zip(vol, parts))


def estimate(work: Workload, grid: tuple[int, int, int, int], nbytes: int = 4) -> MemoryEstimate:
    """Predicted peak memory per rank of one training step of ``work`` on ``grid``.

    Args:
        work: The job.
        grid: ``(data, x, y, z)``.
        nbytes: Bytes per activation element (2 under bf16).

    Returns:
        The estimate, by part.
    """
    d, *parts = grid
    spatial = math.prod(parts)
    b = max(1, work.global_batch // d)
    layers = [layer for layer in work.layers if layer.kind != "flatten"]  # a view: not kept
    outs = [_local_out(layer, parts) * b * nbytes for layer in layers]
    saved, recompute = _checkpointed([layer.segment for layer in layers], outs)
    opt = optimizer_states(work.optimizer)
    local = work.local_params(spatial, tuple(parts))
    if work.shard_optimizer:   # weights and buckets whole; the state per replica
        whole = work.replicated_params
        shard = whole / (d * spatial) + (local - whole) / d
        # the step adds the updated shard and its temporary, after the activations are freed
        params, step_tmp = 4 * (2 * local + opt * shard), 4 * 2 * shard
    else:
        params, step_tmp = local * 4 * (2 + opt), local * 4
    data = 2 * b * math.prod(work.sample_shape) * 4 / spatial
    startup = RUNTIME_BYTES + work.params * 4
    if any(layer.kind == "linear" for layer in layers):   # settled: one fp32 sample, no grad
        startup += data / b + 2.0 * max(outs, default=0) / (b * nbytes) * 4
    est = MemoryEstimate(runtime=RUNTIME_BYTES, params=params, data=data, saved=saved,
                         transient=max(2.0 * max(outs, default=0) + recompute,
                                       step_tmp - saved), startup=startup)
    if not work.checkpoints:
        return est
    return dataclasses.replace(est, checkpoint=est.step + opt * _held_whole(work, spatial) * 4)


def _held_whole(work: Workload, spatial: int) -> int:
    """Parameters whose optimizer state the ``trainer.pt`` writer holds whole in memory:
    all but a split head's that it gathers into a file (:mod:`hpcpar.nn.spill`)."""
    least = _env.get("HPCPAR_CHECKPOINT_SPILL")
    if spatial == 1 or least is None:
        return work.params
    return work.params - sum(math.prod(layer.split) * layer.out_shape[-1] for layer in
                             work.layers if layer.split
                             and math.prod(layer.split) * layer.out_shape[-1] * 4 >= least)


def _checkpointed(segments: list[int], outs: Sequence[float]) -> tuple[float, float]:
    """(kept, recomputed) bytes with activation checkpointing: a layer in a segment
    (``segment >= 0``) keeps its output only when it ends the segment (the next one's
    input); the largest segment's outputs exist again while its backward runs."""
    kept = 0.0
    per: dict[int, float] = {}
    for i, (seg, size) in enumerate(zip(segments, outs)):
        if seg < 0 or i + 1 == len(outs) or segments[i + 1] != seg:
            kept += size
        if seg >= 0:
            per[seg] = per.get(seg, 0.0) + size
    return float(kept), max(per.values(), default=0.0)


def largest_edge(fits: Callable[[int], bool], smallest: int, limit: int = 1 << 14) -> int | None:
    """The largest cubic edge ``s >= smallest`` with ``fits(s)``; None when not even the
    smallest fits. Memory grows with the edge, so ``fits`` holds up to some edge and not
    after it: doubling finds a bound, bisection the edge.

    Args:
        fits: Whether a sample of edge ``s`` fits (``s`` never below ``smallest``).
        smallest: The smallest edge the model accepts.
        limit: Largest edge tried.

    Returns:
        The edge, or None.
    """
    if not fits(smallest):
        return None
    lo, hi = smallest, smallest * 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:   # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def parse_bytes(text: str, what: str = "--memory-budget") -> int:
    """Bytes of a memory budget (``hpcpar._units.parse_bytes``, named after the option)."""
    return _units.parse_bytes(text, what)
