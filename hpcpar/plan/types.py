"""What the planner reasons about: a job's traced layers (:class:`Layer`), the job itself
(:class:`Workload`) and one grid's predicted step (:class:`Prediction`). Shared by the volume
model (:mod:`.planner`), the graph model (:mod:`.gnn`), the memory model (:mod:`.memory`) and
the fit (:mod:`.fit`), so none of them imports another for its types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hpcpar.parallel.partition import largest_piece

__all__ = ["BYTES", "Layer", "Workload", "Prediction"]

#: bytes per element of each training precision
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class Layer:
    """One traced leaf layer.

    Attributes:
        kind: ``conv``, ``convT``, ``pool``, ``bn``, ``pointwise``, ``linear`` or ``gather``.
        spatial: Runs on partitioned volumes (before the gather point).
        in_shape: Input shape per sample, ``(C, D, H, W)`` or ``(F,)``.
        out_shape: Output shape per sample.
        params: Parameter count.
        flops: Forward FLOPs per sample (dense layers).
        halo: Per spatial axis, ``(n_in, parts, index) -> AxisHalo``.
        tp: A ``TensorParallelLinear`` over the grid's spatial group.
        split: A split head (:mod:`hpcpar.nn.split_head`): the ``(C, D, H, W)`` of the
            flattened split volume it takes, whose voxels' weight columns each rank holds.
        segment: The checkpointed segment ([train] activation_checkpointing) the layer is
            in, -1 for none: its output is recomputed in backward, not kept.
        inputs: The layers whose outputs it takes (indices into the traced list; -1 the
            model's input); empty: the layer before it. What the memory model follows to
            know which outputs backward keeps and for how long.
        alias: The layer returned one of its inputs (no new memory).
        keeps: What its backward keeps, as torch's autograd reported it in the trace:
            ``"in"``, ``"out"``, ``"in,out"`` or ``"none"``; empty: by ``kind``.
        extra: Bytes per output element of the other tensors it keeps (a max pool's int64
            indices, a dropout's mask).
        kernel: A convolution's ``(kernel_size, stride, dilation, groups)``: which of
            torch's CPU kernels runs it on a piece decides the copies its backward makes.
    """

    kind: str            # conv, convT, pool, bn, pointwise, linear, gather
    spatial: bool        # runs on partitioned volumes (before the gather point)
    in_shape: tuple      # per sample (C, D, H, W) or (F,)
    out_shape: tuple
    params: int
    flops: float = 0.0   # forward FLOPs per sample (dense layers)
    halo: tuple = ()     # per spatial axis: (n_in, parts, index) -> partition.AxisHalo
    tp: bool = False     # a tensor-parallel Linear (weights split over the spatial group)
    split: tuple = ()    # a split head: the (C, D, H, W) whose voxels' columns a rank holds
    segment: int = -1    # checkpointed segment (activation_checkpointing), -1: none
    inputs: tuple = ()   # producing layers (-1: the model's input); (): the previous layer
    alias: bool = False  # returned one of its inputs
    keeps: str = ""      # kept for backward: "in", "out", "in,out", "none"; "": by kind
    extra: float = 0.0   # bytes per output element of other kept tensors (pool indices)
    kernel: tuple = ()   # a convolution's (kernel, stride, dilation, groups)

    def head_share(self, parts) -> int:
        """Weights one rank holds of a split head (the largest piece of ``parts`` = (x, y,
        z)); 0 for any other layer."""
        if not self.split:
            return 0
        c, *vol = self.split
        cols = c * math.prod(largest_piece(vol, parts))
        return self.out_shape[-1] * cols


@dataclass
class Workload:
    """What the planner needs to know about a job.

    Attributes:
        name: The job's name.
        layers: The traced layers (``trace_layers``).
        sample_shape: Shape of one sample.
        global_batch: Samples per step.
        precision: ``"fp32"`` or ``"bf16"``.
        optimizer: The optimizer (its state counts in memory).
        params: Parameter count (summed from the layers).
        graph: A full-graph GNN job (:class:`hpcpar.plan.gnn.GraphJob`); ``layers`` is then
            empty.
        checkpoints: The run writes checkpoints (their writer's memory counts).
        shard_optimizer: ``[train] shard_optimizer``: optimizer state split over each
            parameter's replicas.
        fuse_halos: ``[model] fuse_halos``: the longest run of convolutions sharing one halo
            exchange (:mod:`hpcpar.nn.fused_halo`).
        input_copy: The step makes its own copy of the input piece (an input transform or
            channels-last order), which the first layer keeps for backward.
    """

    name: str
    layers: list
    sample_shape: tuple
    global_batch: int
    precision: str = "fp32"
    optimizer: str = "adam"
    params: int = 0
    graph: object = None
    checkpoints: bool = True
    shard_optimizer: bool = False
    fuse_halos: int = 1
    input_copy: bool = True

    def __post_init__(self):
        if self.layers or not self.params:
            self.params = sum(layer.params for layer in self.layers)

    @property
    def tp_params(self) -> int:
        """Parameters of the tensor-parallel layers (split over the spatial group)."""
        return sum(layer.params for layer in self.layers if layer.tp)

    @property
    def replicated_params(self) -> int:
        """Parameters every rank of the grid holds whole (neither tensor-parallel nor a split
        head): their replicas are all ranks, the others' the data axis."""
        return self.params - self.tp_params - self.head_params

    @property
    def head_params(self) -> int:
        """Weights of the split heads (their columns split over the spatial group)."""
        return sum(math.prod(layer.split) * layer.out_shape[-1] for layer in self.layers
                   if layer.split)

    def local_params(self, spatial: int, parts: tuple | None = None) -> int:
        """Parameters one rank holds: tensor-parallel layers hold 1/spatial of theirs, a
        split head the columns of the largest piece of ``parts`` (x, y, z; default: an even
        1/spatial)."""
        heads = (sum(layer.head_share(parts) for layer in self.layers) if parts is not None
                 else math.ceil(self.head_params / max(1, spatial)))
        return (self.params - self.tp_params - self.head_params
                + math.ceil(self.tp_params / max(1, spatial)) + heads)


@dataclass
class Prediction:
    """The predicted step of one grid; times are seconds per step, per rank.

    Attributes:
        grid: ``(data, x, y, z)``.
        feasible: False when the grid cannot run.
        reason: Why not (a layer's extent, the batch, memory).
        t_compute: Compute time.
        t_halo: Halo exchange time.
        t_gather: Time of the gather feeding a replicated head.
        t_allreduce: Gradient allreduce time.
        t_allreduce_exposed: The part of it not hidden behind backward.
        t_io: Exposed I/O time.
        t_tp: Collectives of tensor-parallel layers (GNN jobs: the halo exchange is
            ``t_halo``).
        t_step: The whole step.
        mem_bytes: Peak memory per rank.
        extra: Further facts.
    """

    grid: tuple
    feasible: bool
    reason: str = ""
    t_compute: float = 0.0
    t_halo: float = 0.0
    t_gather: float = 0.0
    t_allreduce: float = 0.0
    t_allreduce_exposed: float = 0.0
    t_io: float = 0.0
    t_tp: float = 0.0
    t_step: float = 0.0
    mem_bytes: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def spec(self) -> str:
        """The grid as ``"DxXxYxZ"``."""
        return "x".join(map(str, self.grid))
