"""``hpcpar plan``: an alpha-beta model of one training step for every 4D grid.

For a job and a rank count N it enumerates every grid (data, x, y, z) with product N and
predicts, per rank: compute (FLOPs of each convolution and dense layer at the machine's rate;
pools, pointwise layers and batch norms at their calibrated cost per input byte, else at the
memory bandwidth; each class slowed by its measured contention and by time slicing; plus each
spatial layer's calibrated fixed cost per call), halo exchange (face bytes per split axis, one
message per side, forward and backward), gradient allreduce (ring cost per hierarchy level,
overlapped with backward except the last bucket), the gather feeding a replicated head (or a
split head's allreduce of its partial products: each rank multiplies its own voxels' weight
columns, :mod:`hpcpar.nn.split_head`, and holds only those), tensor-parallel dense layers
(their GEMM shard and the activation/weight collectives of :mod:`hpcpar.nn.tensor_parallel`;
their gradients are reduced over the data axis only), I/O (overlapped by prefetch) and memory
(runtime, activations kept for backward, the backward's transient, parameters, gradients,
optimizer state). On oversubscribed cores each synchronisation (halo exchange, gather,
collective) also waits for descheduled partners: the machine's calibrated ``sync_wait`` per
extra rank on a core. Grids that cannot run (too many ranks for a layer's extent, batch not
divisible, out of memory: :mod:`hpcpar.plan.memory`'s estimate over the machine's
``mem_per_rank``) are marked infeasible with the reason and never recommended.

Full-graph GNN jobs (``Workload.graph``) are modelled per layer by :mod:`hpcpar.plan.gnn`.

The layer list comes from tracing the job's plain model on torch's ``meta`` device, so a
512³ CosmoFlow costs no memory and plans in well under a second per grid.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from hpcpar.parallel.partition import (
    conv_axis_halo,
    conv_pads,
    largest_piece,
    split_sizes,
    transposed_axis_halo,
)
from hpcpar.plan.collectives import (
    BUCKET_BYTES,
    STEP_COLLECTIVES,
    allreduce_time,
    ring_allreduce,
    ring_gather,
)
from hpcpar.plan.gnn import predict_graph
from hpcpar.plan.machine import Link, Machine
from hpcpar.plan.memory import HEADROOM
from hpcpar.plan.memory import estimate as estimate_memory
from hpcpar.plan.types import BYTES, Layer, Prediction, Workload

if TYPE_CHECKING:
    import torch

__all__ = ["BYTES", "BUCKET_BYTES", "Layer", "trace_layers", "Workload", "Prediction", "grids",
           "allreduce_time", "tp_linear_time", "mark_tensor_parallel", "layer_cost", "predict",
           "plan", "TIE", "tie_groups", "oversubscription"]


def _tup(v) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v, v)


def _stencil_halos(kernel, stride, padding, dilation=1, ceil_mode=False,
                   output_padding=None) -> tuple:
    """Per-axis halo functions of a conv / transposed conv (``output_padding`` given) / pool,
    from hpcpar.parallel.partition (the same geometry the spatial layers use)."""
    k, d = _tup(kernel), _tup(dilation)
    s = _tup(stride or kernel)
    if output_padding is not None:
        p, op = _tup(padding), _tup(output_padding)
        return tuple(partial(transposed_axis_halo, kernel=k[a], stride=s[a], padding=p[a],
                             output_padding=op[a], dilation=d[a]) for a in range(3))
    pads = [conv_pads(padding, a, k[a], d[a]) for a in range(3)]
    return tuple(partial(conv_axis_halo, kernel=k[a], stride=s[a], pad_lo=pads[a][0],
                         pad_hi=pads[a][1], dilation=d[a], ceil_mode=ceil_mode)
                 for a in range(3))


def _halo_width(axis_halo, n: int, parts: int) -> int:
    """Widest one-sided halo along an axis (the first, an interior and the last rank)."""
    widths = [0]
    for i in {0, min(1, parts - 1), parts // 2, parts - 1}:
        h = axis_halo(n, parts, i)
        widths += [h.halo_lo, h.halo_hi]
    return max(widths)


def trace_layers(model: torch.nn.Module, sample_shape: Sequence[int],
                 checkpointing: bool | int | str = False) -> list[Layer]:
    """The layers of a plain model in call order, traced on torch's ``meta`` device.

    A layer is a torch call on the data flowing from the input, classified by
    :mod:`hpcpar.nn.optable` as ``spatialize``'s dispatcher classifies it (a torch function
    mode sees every call: a module's, a functional one, a tensor method), so a model and its
    twin written with ``F.conv3d``/``F.max_pool3d`` plan alike. Views pass their input's
    producer on; hpcpar's ``GatherPoint`` (a marker that makes no call) is a gather.

    ``sample_shape`` is one sample's, e.g. ``(C, D, H, W)``. With ``checkpointing`` (``[train]
    activation_checkpointing``) the layers of each segment
    (:func:`hpcpar.nn.checkpointing.plan_segments`) get its index. The layers come with
    per-sample shapes, parameters, FLOPs and halo functions.
    """
    import torch

    flow = _flow_mode()()
    flow.segment_of = _segment_index(model, checkpointing)
    hooks = []
    for mod in model.modules():
        hooks.append(mod.register_forward_pre_hook(flow.enter_module))
        hooks.append(mod.register_forward_hook(flow.leave_module))
    try:
        model = model.to("meta")
        x = torch.empty((1, *sample_shape), device="meta")
        flow.made(x, -1)
        with torch.autograd.graph.saved_tensors_hooks(flow.pack, lambda t: t), flow:
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return flow.layers


def _flow_mode():
    """The torch function mode class of :func:`trace_layers` (torch imported on first use)."""
    import torch
    from torch.overrides import TorchFunctionMode

    from hpcpar.nn import optable  # deferred: the dispatcher's table loads torch
    from hpcpar.nn import rules as r  # deferred: loads torch
    from hpcpar.nn import spatial_ops as s  # deferred: loads torch
    from hpcpar.nn.view_maps import by_name  # deferred: loads torch

    stencil = {s.conv3d: "conv", s.conv_transpose3d: "convT"}   # pools: s.PoolRule
    flattens = (r.shape_op, r.reshape)

    class Dataflow(TorchFunctionMode):
        """Which traced layer made each tensor, so each layer knows its inputs' producers,
        and the layers themselves: every call on flowing data that computes (a
        convolution, a pool, an activation, a residual sum, a concatenation) is a layer;
        views pass their first input's producer on."""

        def __init__(self):
            super().__init__()
            self.depth, self.by_id, self.alive = 0, {}, []
            self.layers: list = []
            self.saved: list = []
            self.state: dict = {"spatial": True}
            self.modules: list = []
            self.segment_of: dict = {}

        def pack(self, t):
            """autograd's saved-tensor hook: what the running layer keeps for backward."""
            if self.depth:
                self.saved.append(t)
            return t

        def enter_module(self, mod, inputs):
            self.modules.append(mod)

        def leave_module(self, mod, inputs, output):
            self.modules.pop()
            if hasattr(mod, "spatial_twin") and getattr(mod, "replicates", False):
                # a marker (GatherPoint): gathered here, no call of its own
                if self.state["spatial"]:
                    shape = tuple(output.shape[1:])
                    self._add(Layer("gather", True, shape, shape, 0), inputs, output)
                self.state["spatial"] = False

        def kept(self, inputs, out) -> tuple[str, float]:
            """(which of its inputs and output the layer just traced keeps, bytes per output
            element of anything else it keeps: indices, masks; not weights or statistics)."""
            names, extra = [], 0.0
            if any(any(t is x for x in inputs) for t in self.saved):
                names.append("in")
            if any(t is out for t in self.saved):
                names.append("out")
            for t in self.saved:
                weight = isinstance(t, torch.nn.Parameter) or isinstance(t._base,
                                                                         torch.nn.Parameter)
                if not weight and t.dim() == out.dim() \
                        and all(t is not x for x in (*inputs, out)):
                    extra += t.numel() * t.element_size() / max(1, out.numel())
            self.saved = []
            return ",".join(names) or "none", extra

        def sources(self, tensors) -> tuple:
            return tuple(self.by_id.get(id(t), -1) for t in tensors
                         if isinstance(t, torch.Tensor))

        def made(self, out, index: int) -> None:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    self.by_id[id(t)] = index
                    self.alive.append(t)   # ids stay unique while the trace runs

        def _add(self, layer, inputs, out) -> None:
            n = len(self.layers)
            layer.segment = next((self.segment_of[id(m)] for m in reversed(self.modules)
                                  if id(m) in self.segment_of), -1)
            layer.inputs = self.sources(inputs)
            if layer.kind != "cat":
                layer.keeps, layer.extra = self.kept(inputs, out)
            self.layers.append(layer)
            if any(out is x for x in inputs):   # in place, or passed through
                layer.alias = True
            else:
                self.made(out, n)

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            flowing = [t for t in _tensors(args, kwargs) if id(t) in self.by_id]
            if self.depth or not flowing:
                return func(*args, **kwargs)
            self.saved = []
            self.depth += 1
            try:
                out = func(*args, **kwargs)
            finally:
                self.depth -= 1
            layer = self._layer(func, args, kwargs, flowing, out)
            if layer is not None:
                self._add(layer, flowing, out)
                keeps = getattr(optable.rule_for(func), "keeps", None)
                if keeps is not None:   # hpcpar's max pool: indices only
                    layer.keeps = keeps
            elif isinstance(out, (torch.Tensor, tuple, list)):
                self.made(out, self.by_id[id(flowing[0])])
            self.saved = []
            return out

        def _layer(self, func, args, kwargs, flowing, out):
            """The layer a call is (None: a view, metadata, a loss), as the dispatcher
            classifies the call (hpcpar.nn.optable)."""
            if not isinstance(out, torch.Tensor) or out.dtype == torch.bool:
                return None
            kind = optable.kind_of(func)
            rule = optable.rule_for(func)
            if kind is None and rule is not r.pointwise:
                return None
            x, spatial = flowing[0], self.state["spatial"]
            ins, outs = tuple(x.shape[1:]), tuple(out.shape[1:])
            params = sum(t.numel() for t in _tensors(args, kwargs)
                         if isinstance(t, torch.nn.Parameter))
            if rule in stencil:
                return self._stencil(stencil[rule], by_name(func, args, kwargs), spatial, ins,
                                     outs, params)
            if isinstance(rule, s.PoolRule):
                b = r.bind_args(rule.names, rule.defaults, args, kwargs)
                k = b["kernel_size"]
                return Layer("pool", spatial, ins, outs, 0, halo=_stencil_halos(
                    k, b.get("stride") or k, b.get("padding", 0), b.get("dilation", 1),
                    b.get("ceil_mode", False)))
            if rule is s.adaptive_pool or (kind == "reduction" and x.dim() == 5 and
                                           out.dim() in (2, 5) and out.shape[2:] in
                                           ((), (1, 1, 1))):
                if out.shape[2:] not in ((), (1, 1, 1)):
                    return Layer("pointwise", spatial, ins, outs, params)
                self.state["spatial"] = False
                return Layer("gather", True, ins, outs, 0) if spatial else None
            if rule is s.batch_norm:
                return Layer("bn", spatial, ins, outs, params)
            if rule is r.linear and out.dim() == 2:
                self.state["spatial"] = False
                w = by_name(func, args, kwargs)["weight"]
                return Layer("linear", False, ins, outs, params, flops=2.0 * w.numel(),
                             split=self.state.pop("flat", ()))
            if rule in flattens and x.dim() == 5 and out.dim() == 2:
                if not spatial:
                    return None
                # the next dense layer takes the volume split (hpcpar.nn.split_head)
                self.state["spatial"], self.state["flat"] = False, ins
                return Layer("flatten", True, ins, outs, 0)
            if rule is r.cat:
                if out.dim() != 5:
                    return None
                return Layer("cat", spatial, outs, outs, 0)
            if kind in ("shape", "metadata", "loss", "random", "refused"):
                return None
            return Layer("pointwise", spatial, ins, outs, params)

        def _stencil(self, kind, b, spatial, ins, outs, params):
            w, stride, dil = b["weight"], _tup(b["stride"]), _tup(b["dilation"])
            k = tuple(w.shape[2:])
            halo = _stencil_halos(k, stride, b["padding"], dil,
                                  output_padding=b.get("output_padding"))
            flops = 2.0 * math.prod(outs if kind == "conv" else ins) * w.shape[1] * math.prod(k)
            return Layer(kind, spatial, ins, outs, params, flops, halo,
                         kernel=(k, stride, dil, b["groups"]))

    return Dataflow


def _tensors(args, kwargs) -> list:
    """The tensors among a call's arguments (one level into lists: ``torch.cat``'s)."""
    import torch

    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def _segment_index(model, checkpointing) -> dict[int, int]:
    """id(leaf module) -> index of the checkpointed segment holding it."""
    if checkpointing is False or checkpointing is None:
        return {}
    from hpcpar.nn.checkpointing import plan_segments  # deferred: imports torch

    out: dict[int, int] = {}
    k = 0
    for chain, sizes in plan_segments(model, checkpointing):
        layers = list(chain)
        start = 0
        for n in sizes:
            for layer in layers[start:start + n]:
                out.update((id(m), k) for m in layer.modules())
            start, k = start + n, k + 1
    return out


def mark_tensor_parallel(layers: list[Layer], min_features: int) -> list[Layer]:
    """Mark the dense layers ``tensor_parallelize(model, grid, min_features)`` would split
    (both sides at least ``min_features``); returns ``layers``."""
    for layer in layers:
        if layer.kind == "linear" and min(layer.in_shape[-1], layer.out_shape[-1]) >= \
                min_features:
            layer.tp = True
    return layers


def grids(n: int) -> Iterator[tuple[int, int, int, int]]:
    """Every grid ``(data, x, y, z)`` of ``n`` ranks (product ``n``)."""
    for d in _divisors(n):
        rest = n // d
        for x in _divisors(rest):
            for y in _divisors(rest // x):
                yield (d, x, y, rest // (x * y))


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending, in O(sqrt(n)): the grids are the ordered products of
    divisors (969 for 65536 ranks), never a scan over every pair of counts up to ``n``."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def tp_linear_time(layer: Layer, rows: int, grid: tuple, machine: Machine,
                   link: Link) -> tuple[float, float]:
    """(GEMM seconds, collective seconds) of one ``TensorParallelLinear`` step, forward +
    backward, as :mod:`hpcpar.nn.tensor_parallel` runs it on a (data, X, Y, Z) grid.

    The rank multiplies its batch rows over z by its in-feature block over x and out-feature
    block over y (three GEMMs of that size: forward, input and weight gradients). Forward:
    all-gather of the weight block over z, all-reduce of the partial output over x,
    all-gather of output columns over y and of rows over z. Backward: all-reduce of the input
    gradient over y, all-gather of its columns over x and rows over z, reduce-scatter of the
    weight gradient over z, all-reduce of the bias gradient over z. ``layer``: a traced
    ``linear`` layer with ``tp`` set; ``rows``: the data replica's batch rows; ``link``: between
    the spatial group's ranks.
    """
    _, X, Y, Z = grid
    fin, fout = layer.in_shape[-1], layer.out_shape[-1]
    rz, ix, oy = largest_piece((rows, fin, fout), (Z, X, Y))
    t_gemm = 3 * 2.0 * rz * ix * oy / machine.gemm_rate(min(rz, ix, oy))
    f = 4  # fp32 activations and weights
    comm = (ring_gather(oy * ix * f, Z, link) + ring_allreduce(rz * oy * f, X, link)
            + ring_gather(rz * fout * f, Y, link) + ring_gather(rows * fout * f, Z, link)
            + ring_allreduce(rz * ix * f, Y, link) + ring_gather(rz * fin * f, X, link)
            + ring_gather(rows * fin * f, Z, link) + ring_gather(oy * ix * f, Z, link)
            + ring_allreduce(oy * f, Z, link))
    return t_gemm, comm


@dataclass
class LayerCost:
    """One layer's share of a step on one grid, forward + backward, per rank: seconds of
    FLOP-bound compute (``dense``), of memory-bound compute (``mem``), of hpcpar's fixed cost
    per call (``calls``), of halo exchange, of the gather feeding a replicated head and of
    tensor-parallel collectives; and how many exchanges each waits in (``*_syncs``)."""

    dense: float = 0.0
    mem: float = 0.0
    calls: float = 0.0
    halo: float = 0.0
    gather: float = 0.0
    tp: float = 0.0
    halo_syncs: int = 0
    gather_syncs: int = 0


def layer_cost(layer: Layer, b: int, grid: tuple, machine: Machine, link: Link,
               nbytes: int) -> LayerCost | str:
    """The cost of one traced layer for ``b`` samples per data replica on ``grid``; a string
    (why) when the grid cannot run it (more ranks on an axis than the layer has voxels).

    Spatial layers run on this rank's largest piece and exchange faces along split axes (widths
    from the layer's own halo geometry, one message per side, forward and backward);
    tensor-parallel dense layers cost their GEMM shard and collectives
    (:func:`tp_linear_time`); any other layer runs whole on every rank. Convolutions run at
    the machine's conv rate, dense layers at its GEMM rate, layers with a calibrated cost per
    input byte at that cost, the rest at FLOP rate and memory bandwidth (backward ~2x forward).
    """
    _, X, Y, Z = grid
    parts, spatial = (X, Y, Z), X * Y * Z
    cost = LayerCost()
    if layer.tp and not layer.spatial:
        cost.dense, cost.tp = tp_linear_time(layer, b, grid, machine, link)
        return cost
    if layer.kind == "flatten":   # a view; every rank must hold some of the volume
        for a, n in enumerate(layer.in_shape[1:]):
            if parts[a] > n:
                return f"axis {'xyz'[a]} has {n} voxels for {parts[a]} ranks"
        return cost
    if layer.split and spatial > 1:   # a split head: its columns, one allreduce of the output
        share = layer.head_share(parts) / (math.prod(layer.split) * layer.out_shape[-1])
        out = layer.out_shape[-1]
        cost.dense = 3 * layer.flops * share * b / machine.gemm_rate(min(b, out))
        cost.gather = ring_allreduce(b * out * nbytes, spatial, link)
        cost.gather_syncs = 1
        return cost
    in_elems = math.prod(layer.in_shape)
    if layer.spatial:   # hpcpar's own layer: a fixed cost per call no FLOP or byte carries
        cost.calls = machine.call_cost(layer.kind)
        vol_in, vol_out = layer.in_shape[1:], layer.out_shape[1:]
        for a in range(3):
            if len(vol_in) == 3 and parts[a] > vol_in[a]:
                return f"axis {'xyz'[a]} has {vol_in[a]} voxels for {parts[a]} ranks"
        out_local = largest_piece(vol_out, parts) if len(vol_out) == 3 else ()
        in_local = largest_piece(vol_in, parts) if len(vol_in) == 3 else ()
        share = math.prod(out_local) / max(1, math.prod(vol_out)) if out_local else 1
        out_elems = layer.out_shape[0] * math.prod(out_local) if out_local else 0
        in_elems = layer.in_shape[0] * math.prod(in_local) if in_local else 0
        if layer.halo and len(vol_in) == 3:
            for a in range(3):
                width = _halo_width(layer.halo[a], vol_in[a], parts[a]) if parts[a] > 1 else 0
                if width <= 0:
                    continue
                face = layer.in_shape[0] * b * math.prod(
                    in_local[j] for j in range(3) if j != a)
                cost.halo += 2 * link.time(face * width * nbytes, 2)   # sides overlap
                cost.halo_syncs += 2
        if layer.kind == "gather" and spatial > 1:
            full = math.prod(layer.in_shape) * b * nbytes
            cost.gather = 2 * link.time(full * (spatial - 1) / spatial, spatial - 1)
            cost.gather_syncs = 2
        flops = layer.flops * share * b
        mem = (in_elems + out_elems) * b * nbytes
    else:
        flops = layer.flops * b
        mem = (in_elems + math.prod(layer.out_shape)) * b * nbytes
    per_byte = machine.layer_cost(layer.kind)
    if layer.kind in ("conv", "convT"):
        cost.dense = 3 * flops / machine.conv_rate(layer.in_shape[0], layer.out_shape[0])
    elif layer.kind == "linear" and machine.gemm_rates:
        cost.dense = 3 * flops / machine.gemm_rate(min(b, *layer.in_shape[-1:],
                                                       *layer.out_shape[-1:]))
        cost.mem = 3 * mem / machine.mem_bw
    elif per_byte is not None:
        cost.mem = per_byte * in_elems * b * nbytes
    else:
        cost.dense = 3 * flops / machine.flops
        cost.mem = 3 * mem / machine.mem_bw
    return cost


def _widths(layer: Layer, parts) -> list[int]:
    """The layer's one-sided halo width on each split axis (0 elsewhere)."""
    vol = layer.in_shape[1:]
    return [_halo_width(layer.halo[a], vol[a], parts[a]) if parts[a] > 1 else 0
            for a in range(3)]


def fused_runs(layers: Sequence[Layer], k: int, parts) -> dict[int, tuple[int, int]]:
    """Which convolutions share one exchange under ``[model] fuse_halos = k``
    (:mod:`hpcpar.nn.fused_halo`): layer index -> (its place in its run from 1, the run's
    convolutions). A run is split, size-keeping convolutions with only pointwise layers and
    batch norms between them, at most ``k``, and no wider than the thinnest piece holds."""
    out: dict[int, tuple[int, int]] = {}
    if k < 2 or math.prod(parts) == 1:
        return out
    run: list[int] = []

    def close():
        while len(run) >= 2:
            take = min(k, len(run))
            while take >= 2 and not all(
                    parts[a] == 1 or min(split_sizes(layers[run[0]].in_shape[1 + a],
                                                     parts[a])) >= take * max(
                        _widths(layers[j], parts)[a] for j in run[:take])
                    for a in range(3)):
                take -= 1
            if take < 2:
                break
            out.update((j, (n + 1, take)) for n, j in enumerate(run[:take]))
            del run[:take]
        run.clear()

    for i, layer in enumerate(layers):
        if layer.kind == "conv" and layer.spatial and layer.halo and \
                layer.in_shape[1:] == layer.out_shape[1:] and any(_widths(layer, parts)):
            run.append(i)
        elif layer.kind not in ("pointwise", "bn"):
            close()
    close()
    return out


def _fuse(cost: LayerCost, layer: Layer, place: int, length: int, parts, link: Link) -> None:
    """A convolution's cost in a fused run: after the first, its faces come with the run's
    one exchange (their bytes stay, their messages and waits go); before the last, it also
    computes the margin it leaves to the rest of the run (a rank with neighbours on both
    sides: the planner's largest piece)."""
    if place > 1:
        cost.halo = max(0.0, cost.halo - 2 * link.alpha * cost.halo_syncs)
        cost.halo_syncs = 0
    if place < length:
        local = largest_piece(layer.in_shape[1:], parts)
        cost.dense *= _margin_growth(local, _widths(layer, parts), length - place)


def _margin_growth(local, widths, ahead: int) -> float:
    """How much more a convolution of a run computes than unfused: the margin of the ``ahead``
    convolutions after it, ``widths`` each, on both sides of every split axis."""
    return math.prod((n + 2 * ahead * w) / n for n, w in zip(local, widths))


def redundant_fraction(local, widths, convs: int) -> float:
    """Extra voxels a fused run of ``convs`` alike convolutions (halo ``widths`` per split
    axis, a rank with neighbours on both sides, pieces ``local``) computes, as a fraction of
    the unfused run's: what :func:`fused_runs`' runs are charged."""
    return sum(_margin_growth(local, widths, convs - j) - 1 for j in range(1, convs)) / convs


def predict(work: Workload, grid: tuple, machine: Machine) -> Prediction:
    """Predict one training step of a job on one grid ``(data, x, y, z)`` (the model is the
    module docstring); infeasible with a reason when the grid cannot run."""
    if work.graph is not None:
        return predict_graph(work, grid, machine)
    d, X, Y, Z = grid
    pred = Prediction(grid, True)
    nbytes = BYTES.get(work.precision, 4)
    if work.global_batch % d:
        return Prediction(grid, False, f"global batch {work.global_batch} not divisible by "
                                       f"data={d}")
    b = work.global_batch // d
    spatial = X * Y * Z
    link = machine.intra if spatial <= machine.ranks_per_node else machine.inter
    t_dense = t_mem = t_calls = 0.0
    halo_syncs = gather_syncs = 0   # exchanges per step (forward + backward)
    runs = fused_runs(work.layers, work.fuse_halos, (X, Y, Z))
    for i, layer in enumerate(work.layers):
        cost = layer_cost(layer, b, grid, machine, link, nbytes)
        if isinstance(cost, str):
            return Prediction(grid, False, f"layer {i} ({layer.kind}): {cost}")
        if i in runs:
            _fuse(cost, layer, *runs[i], (X, Y, Z), link)
        t_dense += cost.dense
        t_mem += cost.mem
        t_calls += cost.calls
        pred.t_halo += cost.halo
        pred.t_gather += cost.gather
        pred.t_tp += cost.tp
        halo_syncs += cost.halo_syncs
        gather_syncs += cost.gather_syncs
    # ranks sharing cores (oversubscribed test machines) compute proportionally slower, and
    # shared memory bandwidth slows memory-bound layers more than convolutions
    # (and a rank alone on its cores runs that many threads: faster than the one-thread rates)
    on_node = min(d * spatial, machine.ranks_per_node)
    dense_factor, mem_factor = machine.compute_factors(on_node, ranks=d * spatial)
    # the calls' fixed cost is serial (threads do not share it) but time-sliced all the same
    t_calls *= machine.slowdown(on_node, ranks=d * spatial)
    pred.t_compute = t_dense * dense_factor + t_mem * mem_factor + t_calls
    pred.extra["t_calls"] = t_calls
    # tensor-parallel shards and split heads' columns are complete per rank: the sync
    # averages them over data only
    local = work.local_params(spatial, (X, Y, Z))
    grad_bytes = (work.params - work.tp_params - work.head_params) * 4
    tp_bytes = (local - work.params + work.tp_params + work.head_params) * 4
    pred.t_allreduce = allreduce_time(grad_bytes, d * spatial, machine) + \
        allreduce_time(tp_bytes, d, machine)
    t_bwd = pred.t_compute * 2 / 3
    last_bucket = allreduce_time(min(grad_bytes + tp_bytes, BUCKET_BYTES), d * spatial,
                                 machine)
    pred.t_allreduce_exposed = max(last_bucket, pred.t_allreduce - t_bwd)
    # time slicing: on oversubscribed cores every synchronisation waits for descheduled
    # partners, sync_wait (calibrated at two processes per core) per extra rank on a core
    wait = machine.sync_delay(on_node, ranks=d * spatial)
    if wait > 0:
        pred.t_halo += halo_syncs * wait
        pred.t_gather += gather_syncs * wait
        pred.t_allreduce_exposed += (STEP_COLLECTIVES if d * spatial > 1 else 0) * wait
        pred.extra["sync_wait"] = wait
    sample_bytes = math.prod(work.sample_shape) * 4
    pred.t_io = b * sample_bytes / spatial / machine.io_bw
    io_exposed = max(0.0, pred.t_io - pred.t_compute)
    pred.extra["memory"] = estimate_memory(work, grid, nbytes)   # the parts: plan.memory
    pred.mem_bytes = pred.extra["memory"].total
    t_opt = machine.optimizer_time(work.optimizer, local, mem_factor)
    pred.t_step = (pred.t_compute + pred.t_halo + pred.t_gather + pred.t_allreduce_exposed
                   + io_exposed + t_opt + pred.t_tp)
    pred.extra["io_exposed"] = io_exposed
    pred.extra["t_opt"] = t_opt
    if pred.mem_bytes > HEADROOM * machine.mem_per_rank:
        pred.feasible = False
        pred.reason = (f"needs {pred.mem_bytes / 1e9:.1f} GB per rank, machine has "
                       f"{machine.mem_per_rank / 1e9:.1f} GB")
    return pred


def plan(work: Workload, ranks: int, machine: Machine) -> list[Prediction]:
    """One prediction per grid of ``ranks`` ranks: feasible ones first, fastest first (ties,
    :data:`TIE`, by communication, then memory)."""
    preds = sorted((predict(work, g, machine) for g in grids(ranks)),
                   key=lambda p: (not p.feasible, p.t_step if p.feasible else 0.0, p.grid))
    feasible = [p for p in preds if p.feasible]
    ordered: list[Prediction] = []
    for group in tie_groups(feasible):
        ordered += sorted(group, key=lambda p: (_communication(p), p.mem_bytes, p.grid))
    return ordered + [p for p in preds if not p.feasible]


#: Predicted step times within this fraction of a group's fastest are a tie: the model does
#: not tell them apart, so the machine's measured communication costs decide, then memory.
TIE = 0.01


def _communication(p: Prediction) -> float:
    return p.t_halo + p.t_gather + p.t_allreduce_exposed + p.t_tp


def tie_groups(preds: list[Prediction]) -> list[list[Prediction]]:
    """Consecutive runs of ``preds`` (sorted by step time) whose step time lies within
    :data:`TIE` of the run's first: each run is one tie (a single prediction is its own)."""
    groups: list[list[Prediction]] = []
    for p in preds:
        if groups and p.t_step <= groups[-1][0].t_step * (1 + TIE):
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups


def oversubscription(ranks: int, machine: Machine) -> str | None:
    """One line when ``ranks`` put more ranks on a node than it has cores: they time-slice
    the cores, so a step can be slower than on fewer ranks whatever the grid; None when not.
    """
    on_node = min(ranks, machine.ranks_per_node)
    busy, cores = machine._sharing(on_node, ranks)
    if not machine.cores and not machine.host_cores or busy <= cores:
        return None
    return (f"{ranks} ranks put {busy} ranks on {cores} cores ({machine.name}): they "
            f"oversubscribe the cores and time-slice them, so every grid's step may be slower "
            f"than on {cores} rank(s); use -n {min(ranks, cores * max(1, ranks // busy))} or "
            f"fewer ranks per node")
