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
* ``data``: the input batch in use and one prefetched, ``2 b C D H W / spatial`` (shared
  memory, the prefetching reader's);
* ``saved`` and ``transient``: the activations, followed through the traced dataflow
  (:func:`activations`; :attr:`~hpcpar.plan.types.Layer.inputs`, ``keeps``): an output is
  kept while a layer that needs it for backward (as torch's autograd reported in the trace:
  a convolution its input, ReLU its result, hpcpar's max pool only its indices) has not run
  its backward, so a skip connection's lives from the encoder to the decoder; backward holds
  each gradient from its first reader's backward to its producer's, and a convolution's
  copies of its operands (the padded input its weight gradient reads; on hpcpar's general
  path, where torch's rule would pick its slow kernel for the piece, oneDNN's copies). The
  step's own copy of its input (a transform, channels-last order) counts when the job makes
  one. ``saved`` is what forward keeps, ``transient`` the rest of the peak, the allocator's
  share (:data:`FRAGMENTATION`) included; with ``[train] activation_checkpointing`` a layer
  inside a segment keeps nothing until its segment's backward recomputes it. Checked
  against torch's own allocation trace of hpcpar's model on one rank
  (``tests/plan/test_memory_dataflow.py``, within 15%) and, through the total, against the
  largest sample a real limit holds (``benchmarks/largest_sample.py``). If larger, the
  optimizer step's temporaries (after backward) replace them.

Two moments outside the step can peak higher, so the total is the largest of the three:

* ``startup``: the model is built whole (seeded, as one process would) and a split head is cut
  to this rank's columns only by the first forward (:func:`hpcpar.nn.spatializer.settle`, one
  sample of zeros, no gradients): the full parameters plus that forward's input and its two
  largest layer outputs, once (the plain model is not copied: ``spatialize(inplace=True)``);
* ``checkpoint``: the rank writing ``trainer.pt`` holds the optimizer state of the full model:
  with glibc's malloc on top of the step's peak (the memory the step's activations freed
  stays in its heap, and the gathered tensors are fresh large allocations beside it); with
  jemalloc, which the launcher gives ranks where it is installed, beside the step's state
  alone (the freed memory is reused: a rank's resident memory while CosmoFlow 128³ wrote its
  checkpoint was 0.62-0.75 of the step's peak).
  A split head's state is gathered to it alone
  (:func:`hpcpar.nn.split_head.ColumnSplit.gather`) into a file in the checkpoint directory,
  not into memory (:mod:`hpcpar.nn.spill`, from ``HPCPAR_CHECKPOINT_SPILL`` bytes a tensor):
  page cache, which the kernel writes out and drops under a limit. ``model.pt``'s writer
  holds one full copy of the weights, less.

A grid fits a budget when the total is at most :data:`HEADROOM` of it (page cache, the
kernel; the allocator's share is in the estimate). Checked against a kernel-enforced limit:
``tests/run/test_memory_limit.py`` (CosmoFlow 192³ x 4 under 1.5 GiB per rank: 1 rank is
killed, 8 ranks train, and this model says the same).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpcpar import _env, _units
from hpcpar.launch.allocator import find_jemalloc
from hpcpar.parallel.partition import largest_piece

if TYPE_CHECKING:
    from hpcpar.plan.types import Workload

__all__ = ["RUNTIME_BYTES", "HEADROOM", "FRAGMENTATION", "MemoryEstimate", "optimizer_states",
           "estimate", "activations", "largest_edge", "parse_bytes"]

#: resident memory of one rank before any tensor: measured 0.25-0.29 GB per rank (cgroup
#: charge, 8 ranks, CosmoFlow on 32³, CPU) on the 2-core test machine
RUNTIME_BYTES = 0.3e9
#: share of the budget the estimate may use. At the largest edges a real 768 MiB limit per
#: rank held, the estimate came to 99.5-99.8% of the limit (AVX-512 host, 2026-12-05:
#: CosmoFlow 132 on 1 rank, 136 killed; UNet3D 120 on 1 rank), so the estimate itself does not
#: run short. At 0.95 the planner was 5 edges below CosmoFlow's 132. 0.96 puts every measured
#: row within the bisection step of 4 below what held, on this host and on the AVX2 host of
#: tests/plan/test_memory.py, and none above it.
HEADROOM = 0.96
#: the allocator's resident memory above the live activations at the step's peak (freed
#: blocks a later request of another size cannot reuse), as a share of what
#: :data:`FRAGMENTED` names. jemalloc: of the step's *transient* activations, those above
#: what forward keeps (gradients, recomputations, a convolution's copies: freed and asked
#: again at other sizes; what forward keeps is asked once, in order): the largest samples a
#: real 768 MiB limit per rank held were CosmoFlow 129-130 (1 rank) and 256-257 (8 ranks),
#: UNet3D 118-119 and 234-235, and 0.4 of the transient ones gives 127, 254, 116 and 233,
#: where a share of all activations could not be right for both models (UNet3D's are mostly
#: kept ones: 0.15 of all gave 226 at 8 ranks, CosmoFlow's mostly transient). glibc's malloc:
#: of all activations, 0.47-0.64 (a rank's sampled anonymous memory against torch's own
#: allocation trace of the same step, CosmoFlow 128³ and UNet3D 108³, 1 rank)
FRAGMENTATION = {"jemalloc": 0.4, "system": 0.5}
#: what :data:`FRAGMENTATION` is a share of, per allocator
FRAGMENTED = {"jemalloc": "transient", "system": "activations"}

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
    return layer.out_shape[0] * math.prod(largest_piece(vol, parts))


def _outs(work: Workload, parts, b: int, nbytes: int) -> list[int]:
    """Bytes of each traced layer's output on this rank (a flatten is a view: none)."""
    return [0 if layer.kind == "flatten" else _local_out(layer, parts) * b * nbytes
            for layer in work.layers]


def estimate(work: Workload, grid: tuple[int, int, int, int], nbytes: int = 4) -> MemoryEstimate:
    """Predicted peak memory per rank, by part, of one training step of ``work`` on ``grid``
    ``(data, x, y, z)``; ``nbytes`` per activation element (2 under bf16)."""
    d, *parts = grid
    spatial = math.prod(parts)
    b = max(1, work.global_batch // d)
    layers = work.layers
    outs = _outs(work, parts, b, nbytes)
    saved, peak = activations(work, grid, nbytes)
    allocator = _ranks_allocator()
    kept = saved if FRAGMENTED[allocator] == "transient" else 0.0
    peak = kept + (peak - kept) * (1 + FRAGMENTATION[allocator])
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
                         transient=max(peak, step_tmp) - saved, startup=startup)
    if not work.checkpoints:
        return est
    held = opt * _held_whole(work, spatial) * 4
    if allocator == "system":   # the step's freed blocks stay in glibc's heap, beside it
        return dataclasses.replace(est, checkpoint=est.step + held)
    return dataclasses.replace(est, checkpoint=est.runtime + est.data + est.params + held)


def _ranks_allocator() -> str:
    """``jemalloc`` or ``system``: what :func:`hpcpar.launch.allocator.preload` gives ranks
    here (jemalloc hands the step's freed memory to the next requests; glibc keeps blocks
    it cannot reuse)."""
    choice = _env.get("HPCPAR_ALLOCATOR")
    if choice == "system" or (choice in ("auto", "jemalloc") and not _jemalloc_found()):
        return "system"
    return "jemalloc"


@functools.cache
def _jemalloc_found() -> bool:
    """Once per process: the search may ask ldconfig, and the planner's bisections estimate
    hundreds of times."""
    return find_jemalloc() is not None


def _held_whole(work: Workload, spatial: int) -> int:
    """Parameters whose optimizer state the ``trainer.pt`` writer holds whole in memory:
    all but a split head's that it gathers into a file (:mod:`hpcpar.nn.spill`)."""
    least = _env.get("HPCPAR_CHECKPOINT_SPILL")
    if spatial == 1 or least is None:
        return work.params
    return work.params - sum(math.prod(layer.split) * layer.out_shape[-1] for layer in
                             work.layers if layer.split
                             and math.prod(layer.split) * layer.out_shape[-1] * 4 >= least)


#: what a layer's backward keeps when the trace did not say (:attr:`Layer.keeps`): a
#: convolution's or dense layer's input (for the weight gradient), an activation's or norm's
#: input; hpcpar's max pool keeps its argmax indices instead (:data:`_INDEX_BYTES` an output
#: element), a concatenation or a gather nothing
_KEEPS_INPUT = frozenset({"conv", "convT", "pointwise", "bn", "linear"})
_INDEX_BYTES = 8


def _keeps(layer) -> tuple[set, float]:
    """({"in", "out"} subset kept for backward, bytes per output element of anything else)."""
    if layer.keeps:
        return set(layer.keeps.split(",")) - {"none"}, layer.extra
    if layer.kind == "pool":
        return set(), float(_INDEX_BYTES)
    return ({"in"} if layer.kind in _KEEPS_INPUT else set()), 0.0


def activations(work: Workload, grid: tuple[int, int, int, int],
                nbytes: int = 4) -> tuple[float, float]:
    """(kept at the end of forward, peak) bytes of one step's activations on one rank of
    ``grid``: live tensors only, before the allocator's share (:data:`FRAGMENTATION`)."""
    d, *parts = grid
    b = max(1, work.global_batch // d)
    outs = _outs(work, parts, b, nbytes)
    piece = math.prod(largest_piece(work.sample_shape[1:], parts))
    x_bytes = b * work.sample_shape[0] * piece * 4   # the loaded fp32 batch on this rank
    copies = [_onednn_copies(layer, b, parts, nbytes) for layer in work.layers]
    return _activations(work.layers, outs, x_bytes, work.input_copy, nbytes, copies)


def _onednn_copies(layer, b: int, parts, nbytes: int) -> bool:
    """Whether a convolution's backward runs on hpcpar's general path with oneDNN's copies
    of its operands (:func:`hpcpar.nn._conv_route.onednn`): where torch's CPU rule would pick
    its slow kernel for this rank's piece (fp32, batch 1, few channels or small planes)."""
    if layer.kind != "conv" or not layer.kernel or nbytes != 4 or len(layer.in_shape) != 4:
        return False
    from hpcpar.nn._conv_route import onednn_shape  # deferred: imports torch

    local = largest_piece(layer.in_shape[1:], parts)
    return onednn_shape((b, layer.in_shape[0], *local), *layer.kernel)


def _activations(layers: Sequence, outs: Sequence[float], x_bytes: float, x_owned: bool,
                 nbytes: int, copies: Sequence[bool] = ()) -> tuple[float, float]:
    """(kept at the end of forward, peak) bytes of the step's activations, following the
    traced dataflow (:attr:`Layer.inputs`) layer by layer through forward and then backward.

    A layer's output is kept while a layer that needs it for backward has not run its
    backward (a skip connection's from the encoder to the decoder's concatenation); an
    output nobody keeps lives until its last reader has run forward. In backward, layer
    ``i`` holds its output's gradient and its inputs' gradients; a gradient that a later
    reader has produced waits until its producer's backward (a skip's, through the levels
    below); a convolution's weight gradient reads a padded copy of its input. A layer inside
    an activation-checkpointing segment (not its last) keeps nothing in forward; while its
    segment's backward runs, the segment's kept outputs exist again (recomputed), and the
    segment's input is kept for the recomputation. ``flatten`` and pass-through layers make no
    memory. ``x_owned``: the step made its own copy of the input (``x_bytes`` on this rank,
    kept by the first layer); without it the input is the loaded batch, counted under
    ``data``. ``copies``: per layer, whether its backward makes oneDNN's copies of its
    operands (:func:`_onednn_copies`).
    """
    from hpcpar.nn._conv_route import CHUNK_BACKWARD_BYTES  # deferred: imports torch

    n = len(layers)
    alias = [layer.alias or layer.kind == "flatten" for layer in layers]

    def source(p: int) -> int:
        while p >= 0 and alias[p]:
            p = (layers[p].inputs or (p - 1,))[0]
        return p

    srcs = [tuple(source(p) for p in (layer.inputs or (i - 1,))) for i, layer in
            enumerate(layers)]
    size = [0.0 if alias[i] else float(outs[i]) for i in range(n)]
    seg = [layer.segment for layer in layers]
    ends = {i for i in range(n) if seg[i] < 0 or i + 1 == n or seg[i + 1] != seg[i]}
    starts = {i for i in range(n) if seg[i] >= 0 and (i == 0 or seg[i - 1] != seg[i])}
    keeps = [_keeps(layer) for layer in layers]
    own = [outs[i] / nbytes * keeps[i][1] for i in range(n)]
    first_keep: dict[int, int] = {}   # tensor -> the first layer keeping it for backward
    last_read: dict[int, int] = {}
    for i in range(n):
        what = keeps[i][0]
        if "out" in what:   # a pass-through (in-place) layer keeps its source's memory
            first_keep.setdefault(source(i) if alias[i] else i, i)
        if alias[i]:
            continue
        for p in srcs[i]:
            last_read[p] = max(last_read.get(p, -1), i)
            if "in" in what or i in starts:
                first_keep.setdefault(p, i)
    last_read.setdefault(source(n - 1), n)   # the model's output: read by the loss

    def bytes_of(p: int) -> float:
        return (x_bytes if x_owned else 0.0) if p < 0 else size[p]

    def interior(p: int) -> bool:   # recomputed in backward, not kept
        return p >= 0 and p not in ends

    producers = [-1, *range(n)]
    peak = 0.0
    for i in range(n):   # forward
        live = size[i] + own[i]
        for p in producers[:i + 1]:   # the input and layers before i
            kept = p in first_keep and not interior(p)
            if kept or last_read.get(p, -1) >= i:
                live += bytes_of(p)
            if p >= 0 and not interior(p):
                live += own[p]
        peak = max(peak, live)
    saved = sum(bytes_of(p) + (own[p] if p >= 0 else 0.0) for p in producers
                if p in first_keep and not interior(p))
    for i in reversed(range(n)):   # backward
        if alias[i]:
            continue
        live = 0.0
        for p in producers[:i + 2]:   # the input and layers 0..i
            mine = p >= 0 and seg[p] >= 0 and seg[p] == seg[i]
            if (not interior(p) or mine) and first_keep.get(p, n) <= i:
                live += bytes_of(p)
            if p >= 0 and (not interior(p) or mine):
                live += own[p]
            if p >= 0 and last_read.get(p, -1) >= i:   # a gradient in flight
                live += size[p]
        if layers[i].kind in ("conv", "convT"):
            ins = sum(size[p] if p >= 0 else x_bytes for p in srcs[i])
            if copies and copies[i]:   # the weight gradient's copies into oneDNN's layout
                # and oneDNN's own reorders (the extended input twice, the output gradient
                # three times: torch's allocation trace); a chunk at a time of a large output
                # gradient (hpcpar.nn.conv.ConvOp._chunked); the input gradient copies nothing
                parts = max(1, math.ceil(size[i] / CHUNK_BACKWARD_BYTES))
                live += (2 * ins + 3 * size[i]) / parts
            else:   # the padded input its weight gradient reads (the boundary path)
                live += ins
        peak = max(peak, live)
    return saved, peak


def largest_edge(fits: Callable[[int], bool], smallest: int, limit: int = 1 << 14) -> int | None:
    """The largest cubic edge ``s >= smallest`` with ``fits(s)``; None when not even the
    smallest fits. Memory grows with the edge, so ``fits`` holds up to some edge and not
    after it: doubling finds a bound, bisection the edge (never above ``limit``)."""
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
