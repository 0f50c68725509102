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
    """One traced leaf layer (the fields' comments say what each holds).

    A layer in a checkpointed ``segment`` has its output recomputed in backward, not kept.
    ``inputs`` (indices into the traced list) is what the memory model follows to know which
    outputs backward keeps and for how long; ``keeps`` is as torch's autograd reported it in
    the trace. A split head (:mod:`hpcpar.nn.split_head`) takes the flattened split volume
    ``split``. A convolution's ``kernel`` decides which of torch's CPU kernels runs it on a
    piece, and so the copies its backward makes.
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
    extra: float = 0.0   # bytes per output element of other kept tensors (pool indices, masks)
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
    """What the planner needs to know about a job: its traced ``layers`` (``trace_layers``;
    ``params`` is summed from them), or a full-graph GNN job's ``graph``
    (:class:`hpcpar.plan.gnn.GraphJob`, ``layers`` empty), and the settings that change a
    step's time or memory: ``checkpoints`` (the run writes some: their writer's memory counts),
    ``[train] shard_optimizer``, ``[model] fuse_halos`` (:mod:`hpcpar.nn.fused_halo`) and
    ``input_copy`` (the step makes its own copy of the input piece, an input transform or
    channels-last order, which the first layer keeps for backward).
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
    """The predicted step of one grid ``(data, x, y, z)``; times are seconds per step, per
    rank, ``mem_bytes`` the peak memory per rank. A grid that cannot run is not ``feasible``,
    with the ``reason`` (a layer's extent, the batch, memory). ``t_gather`` is the gather
    feeding a replicated head, ``t_allreduce_exposed`` the part of the gradient allreduce not
    hidden behind backward, ``t_tp`` the collectives of tensor-parallel layers (a GNN job's halo
    exchange is ``t_halo``).
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
