"""The planner's model of one full-graph GNN step (``[model] kind = "gcn" | "sage"``).

A step is one forward and backward over the whole graph, split over the grid's spatial ranks
(``data = 1``) by the job's partitioner. Per rank and per layer ``F_in -> F_out``, from
:mod:`hpcpar.models.gcn` and :mod:`hpcpar.nn.graph`:

* dropout of the layer input (vertex-hash masks, calibrated per element; its backward only
  where the input needs a gradient, i.e. after the first layer), and ReLU after the first;
* the dense transform: ``2 V F_in F_out`` FLOPs forward, the weight gradient, and the input
  gradient after the first layer, at the GEMM rate of its narrowest side (SAGE: two);
* the sparse aggregation on the narrower side ``F = min(F_in, F_out)`` (the layers transform
  first when ``F_in > F_out``): nonzeros x ``F`` at the calibrated SpMM cost (forward +
  backward; forward only when it reads the input features, which need no gradient);
* the halo exchange before it: ``halo vertices x F x 4`` bytes from each neighbouring part,
  forward, and the same back in backward.

``V`` (owned vertices), the in-edges and the halo of every part come from the graph file
partitioned exactly as the run partitions it, or from a sharded graph's own parts, counted part
by part (:class:`GraphJob` ``parts``). The step is the slowest part's; the gradient allreduce
(tiny) and the optimizer follow the volume model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpcpar.plan.collectives import STEP_COLLECTIVES, allreduce_time
from hpcpar.plan.memory import RUNTIME_BYTES, MemoryEstimate, optimizer_states
from hpcpar.plan.types import Prediction

if TYPE_CHECKING:
    from hpcpar.plan.machine import Link, Machine
    from hpcpar.plan.types import Workload

__all__ = ["Part", "GraphJob", "predict_graph"]

#: share of the budget a graph job's estimate may use: 0.9, as the volume jobs' was before
#: their estimate counted the allocator's share (:data:`hpcpar.plan.memory.FRAGMENTATION`);
#: this one does not
_HEADROOM = 0.9


@dataclass(frozen=True)
class Part:
    """One rank's share of a partitioned graph."""

    owned: int   # vertices it owns
    edges: int   # in-edges of its owned vertices (rows of its aggregation operator)
    halo: int    # distinct vertices of other parts its in-edges read
    peers: int   # parts it exchanges halo rows with


@dataclass
class GraphJob:
    """What the planner needs of a full-graph job."""

    widths: tuple       # (features, hidden, ..., classes)
    conv: str           # "gcn" or "sage"
    dropout: float      # probability, on every layer input
    precompute: bool    # the first layer's A X is computed once (no first-layer aggregation)
    parts: Callable[[int], list]   # ranks -> [Part per rank]: the job's partitioner, its graph
    num_nodes: int
    #: parts of a sharded graph (partitioned ahead: a run needs exactly that many ranks, the
    #: parts are the file's), or None (the run partitions the graph file)
    sharded: int | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def params(self) -> int:
        """Weights and biases (SAGE: two weight matrices per layer)."""
        mats = 2 if self.conv == "sage" else 1
        return sum(mats * i * o + o for i, o in zip(self.widths[:-1], self.widths[1:]))

    def partition(self, ranks: int) -> list:
        """The parts for ``ranks`` ranks (computed once per rank count)."""
        if ranks not in self._cache:
            self._cache[ranks] = self.parts(ranks)
        return self._cache[ranks]


def layer_times(job: GraphJob, part: Part, machine: Machine, link: Link, ranks: int) -> dict:
    """Seconds of one rank's step by kind: ``dense``, ``sparse``, ``pointwise``, ``halo``,
    and the number of halo ``exchanges`` (compute before contention: the caller applies it)."""
    v = part.owned
    nnz = part.edges + (v if job.conv == "gcn" else 0)  # GCN adds self loops
    spmm = machine.graph_cost("spmm")
    if spmm is None:  # memory-bound: a gathered row of F floats + index and value per nonzero
        spmm = 2 * 12 / machine.mem_bw
    pw = machine.layer_cost("pointwise")      # per input byte, forward + backward
    if pw is None:
        pw = 3 * 2 / machine.mem_bw
    drop = machine.graph_cost("dropout")       # per element, forward
    if drop is None:
        drop = pw * 4
    mats = 2 if job.conv == "sage" else 1
    out = {"dense": 0.0, "sparse": 0.0, "pointwise": 0.0, "halo": 0.0, "exchanges": 0}
    for i, (fin, fout) in enumerate(zip(job.widths[:-1], job.widths[1:])):
        first = i == 0
        if job.dropout > 0:
            out["pointwise"] += (1 if first else 2) * drop * v * fin
        if not first:
            out["pointwise"] += pw * v * fin * 4   # ReLU
        gemms = 2 if first else 3                  # forward, weight grad (+ input grad)
        out["dense"] += mats * gemms * 2.0 * v * fin * fout / machine.gemm_rate(
            min(max(v, 1), fin, fout))
        out["pointwise"] += pw * v * fout * 4      # bias
        if first and job.precompute:
            continue
        width = min(fin, fout)
        # aggregating the raw features (first layer, F_in <= F_out) needs no backward
        passes = 0.5 if first and fin <= fout else 1.0
        out["sparse"] += passes * spmm * nnz * width
        if ranks > 1 and part.halo:
            out["halo"] += 2 * passes * link.time(part.halo * width * 4, max(1, part.peers))
            # each exchange's fixed cost (index, all-to-all, scatter-add, Python)
            out["halo"] += round(2 * passes) * machine.call_cost("graph_halo")
            out["exchanges"] += round(2 * passes)
    out["pointwise"] += pw * v * job.widths[-1] * 4   # loss
    return out


def predict_graph(work: Workload, grid: tuple, machine: Machine) -> Prediction:
    """Predict one full-graph step (``work.graph``) on ``grid`` (the model is the module
    docstring): the slowest part's; a grid with data > 1 is infeasible."""
    d, X, Y, Z = grid
    job = work.graph
    assert isinstance(job, GraphJob), "predict_graph needs work.graph"
    if d != 1:
        return Prediction(grid, False, f"data={d}: a graph is one sample (full-graph training "
                                       "needs data = 1)")
    ranks = X * Y * Z
    if ranks > job.num_nodes:
        return Prediction(grid, False, f"{ranks} ranks for a graph of {job.num_nodes} vertices")
    if job.sharded is not None and ranks != job.sharded:
        return Prediction(grid, False, f"the sharded graph has {job.sharded} parts, a run "
                                       f"needs {job.sharded} ranks (or partition it again "
                                       f"with --parts {ranks})")
    pred = Prediction(grid, True)
    link = machine.intra if ranks <= machine.ranks_per_node else machine.inter
    on_node = min(ranks, machine.ranks_per_node)
    slow, slow_mem = machine.compute_factors(on_node, ranks=ranks)
    # on oversubscribed cores each exchange and collective waits for descheduled partners
    wait = machine.sync_delay(on_node, ranks=ranks)
    worst: tuple[float, float, Any] | None = None
    for part in job.partition(ranks):
        t = layer_times(job, part, machine, link, ranks)
        compute = t["dense"] * slow + (t["sparse"] + t["pointwise"]) * slow_mem
        halo = t["halo"] + t["exchanges"] * wait
        if worst is None or compute + halo > worst[0] + worst[1]:
            worst = (compute, halo, part)
    assert worst is not None, "a partition has at least one part"
    pred.t_compute, pred.t_halo, part = worst
    grad_bytes = work.params * 4
    # the gradient sync and the loss's one-number allreduce
    pred.t_allreduce = allreduce_time(grad_bytes, ranks, machine) + allreduce_time(8, ranks,
                                                                                    machine)
    pred.t_allreduce_exposed = pred.t_allreduce + (STEP_COLLECTIVES * wait if ranks > 1
                                                   else 0.0)
    t_opt = machine.optimizer_time(work.optimizer, work.params, slow_mem)
    pred.t_step = pred.t_compute + pred.t_halo + pred.t_allreduce_exposed + t_opt
    pred.extra.update(t_opt=t_opt, io_exposed=0.0, part=part)
    rows = part.owned + part.halo
    widest = max(job.widths)
    # features (and their dropout copy), every layer's input and output kept for backward,
    # the aggregation operator and its transpose (index + value per nonzero)
    saved = 4 * (2 * part.owned * job.widths[0] + 3 * rows * sum(job.widths[1:]))
    opt = optimizer_states(work.optimizer)
    mem = MemoryEstimate(runtime=RUNTIME_BYTES, params=work.params * 4 * (4 + opt),
                         data=2 * 16 * (part.edges + part.owned), saved=float(saved),
                         transient=2.0 * 4 * rows * widest)
    pred.extra["memory"], pred.mem_bytes = mem, mem.total
    if pred.mem_bytes > _HEADROOM * machine.mem_per_rank:
        pred.feasible = False
        pred.reason = (f"needs {pred.mem_bytes / 1e9:.1f} GB per rank, machine has "
                       f"{machine.mem_per_rank / 1e9:.1f} GB")
    return pred
