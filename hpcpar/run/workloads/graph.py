"""``[model] kind = "gcn" | "sage" | "gat"``: full-graph node classification through
``hpcpar run``.

One step = one epoch = one forward/backward over the whole graph, split over the grid's
spatial ranks (``[grid] data = 1``, ``x = -1``). The loss on each rank is the sum over its
owned training vertices divided by the GLOBAL number of training vertices, so the default
gradient sync (SUM over the spatial group, average over ``data == 1``) gives exactly the
single-process gradient; no parameter tags are needed.

``[data] path`` is a graph file (hpcpar graph format) or a sharded graph directory (each
rank reads its own part; ``hpcpar data graph partition``); ``make = "cora"`` imports the bundled
Cora there if it is missing, ``make = "synthetic"`` generates a power-law community graph from
the ``nodes``/``avg_degree``/``communities``/``features``/``classes``/``seed`` keys.

``gat`` is Velickovic et al.'s GAT built from PyG's ``GATConv`` run on the distributed graph
(:func:`hpcpar.nn.graph.distributed`): exact, since each owned vertex's attention softmax runs
over its in-edges, which are all local. It needs ``torch_geometric`` (``hpcpar[gnn]``).
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

from hpcpar.errors import ConfigError, DataError
from hpcpar.run.workloads.base import SEED_MAX, Param, StepResult, Workload, register_workload

if TYPE_CHECKING:
    import torch

    from hpcpar.formats.jobspec import JobSpec
    from hpcpar.parallel.grid import ProcessGrid

__all__ = ["METHODS", "MODEL_PARAMS", "DATA_PARAMS", "make_graph_file", "GraphWorkload",
           "GCNWorkload"]

METHODS = ("metis", "block", "random")

MODEL_PARAMS = {
    "hidden": Param(int, 16, min=1, help="hidden width"),
    "layers": Param(int, 2, min=1, max=4096, help="graph convolutions"),
    "dropout": Param(float, 0.5, min=0.0, max=1.0, help="on the input of every layer"),
    "precompute": Param(bool, False, help="compute the first layer's A·X once"),
    "decay": Param(str, "first", choices=("first", "all"),
                   help="layers that get [train] weight_decay (Kipf & Welling: first)"),
    "boundary_sample": Param(float, 1.0, min=0.0, max=1.0,
                             help="fraction 0 < p <= 1 of the halo rows sent per training "
                                  "step (BNS-GCN boundary sampling); 1 = exact"),
}

DATA_PARAMS = {
    "path": Param(str, path=True, help="graph file (.h5, hpcpar graph format), or a sharded graph "
                            "directory (hpcpar data graph partition: partition is ignored)"),
    "make": Param(str, "", choices=("", "cora", "synthetic"),
                  help="create `path` first if it is missing"),
    "partition": Param(str, "metis", choices=METHODS, help="vertex partitioning"),
    "partition_seed": Param(int, 0, min=0, max=SEED_MAX),
    "normalize": Param(bool, True, help="divide each feature row by its L1 norm"),
    "backend": Param(str, "auto", choices=("auto", "numba", "torch"), help="SpMM backend"),
    "nodes": Param(int, 100000, min=2, help="make = synthetic"),
    "avg_degree": Param(float, 10.0, min=0.0, help="make = synthetic"),
    "communities": Param(int, 64, min=1, help="make = synthetic"),
    "features": Param(int, 128, min=1, help="make = synthetic"),
    "classes": Param(int, 8, min=2, help="make = synthetic"),
    "seed": Param(int, 0, min=0, max=SEED_MAX, help="make = synthetic"),
    "signal": Param(float, 0.25, min=0.0, help="make = synthetic: the class signal in the "
                                                 "features (lower: the graph matters more)"),
}


def _check_job(job) -> None:
    if job.grid.data != 1:
        raise ConfigError(f"[grid] data = {job.grid.data}: a graph is one sample, full-graph "
                          f"training ({job.model.kind}) needs data = 1 and x = -1")
    if job.model.params.get("boundary_sample", 1.0) <= 0.0:
        raise ConfigError("[model] boundary_sample: 0 is out of range (must be > 0 and <= 1; "
                          "1 = exact)")


def make_graph_file(path: str, d: dict) -> None:
    """Create the graph file ``path`` (and its folder) that ``[data] make`` asks for (rank 0
    only): "cora", the bundled Cora graph, or "synthetic" from the ``[data]`` keys ``d``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if d["make"] == "cora":
        from hpcpar.graph.format import bundled, import_npz  # deferred: loads numpy

        import_npz(bundled("cora"), path)
    else:
        from hpcpar.graph.format import write_graph  # deferred: loads numpy
        from hpcpar.graph.generate import power_law_community_graph  # deferred: loads numpy

        g = power_law_community_graph(d["nodes"], d["avg_degree"], d["communities"],
                                      d["features"], d["classes"], d["seed"],
                                      signal=d["signal"])
        write_graph(path, d["nodes"], g["x"], g["y"], g["masks"],
                    csr=(g["indptr"], g["indices"]), num_classes=d["classes"],
                    name="synthetic", source="hpcpar [data] make = synthetic")


class GraphWorkload(Workload):
    """Full-graph node classification with a GCN on a vertex-partitioned graph.

    Every rank holds its part of the graph (created first with ``[data] make`` when asked);
    ``conv`` chooses the graph convolution. The job's grid must have data = 1."""

    conv = "gcn"
    model_params = MODEL_PARAMS
    data_params = DATA_PARAMS
    splits_global_batch = False
    check_job = staticmethod(_check_job)

    def __init__(self, job: JobSpec, grid: ProcessGrid, device: torch.device):
        super().__init__(job, grid, device)
        from hpcpar.graph.distgraph import DistGraph, graph_comm  # deferred: loads torch, numba

        d = job.data.params
        comm = graph_comm(grid)
        path = d["path"]
        if d["make"] and comm.Get_rank() == 0 and not os.path.exists(path):
            make_graph_file(path, d)
        comm.Barrier()
        from hpcpar.graph.shards import is_sharded_graph  # deferred: loads numpy

        if is_sharded_graph(path):  # partitioned ahead: each rank reads its own part
            self.graph = DistGraph.from_shards(path, grid, row_normalize=d["normalize"],
                                               backend=d["backend"]).to(device)
        else:
            self.graph = DistGraph.from_hdf5(path, grid, method=d["partition"],
                                             seed=d["partition_seed"],
                                             row_normalize=d["normalize"],
                                             backend=d["backend"]).to(device)
        if self.graph.num_train == 0:       # a global count: every rank raises alike
            exc = DataError(f"{path}: no training vertex (/masks/train is all false): the "
                            f"loss would be 0 and nothing trained; give the graph training "
                            f"vertices (train_idx or train_mask) and import it again")
            exc.collective = True
            raise exc

    def _make(self):
        from hpcpar.models.gcn import GCN  # deferred: loads torch, numba

        m = self.job.model.params
        g = self.graph
        return GCN(g.num_features, m["hidden"], g.num_classes, num_layers=m["layers"],
                   dropout=m["dropout"], conv=self.conv, precompute=m["precompute"],
                   seed=self.job.train.seed, boundary_sample=m["boundary_sample"])

    def build_model(self):
        return self._make().to(self.device)

    def reference_model(self):
        return self._make()

    def param_groups(self, model):
        if self.job.model.params["decay"] == "all":
            return super().param_groups(model)
        first = list(model.convs[0].parameters())
        rest = [p for c in model.convs[1:] for p in c.parameters()]
        return [{"params": first}, {"params": rest, "weight_decay": 0.0}]

    def steps_per_epoch(self) -> int:
        return 1

    def batches(self, epoch: int):
        yield self.graph

    def forward_loss(self, model, batch) -> StepResult:
        from hpcpar.graph.metrics import masked_loss  # deferred: loads torch, numpy

        loss = masked_loss(model(batch.x, batch), batch)  # global, the same on every rank
        return StepResult(loss=loss, samples=batch.num_nodes)

    def _metrics(self, model, splits) -> dict:
        from hpcpar.graph.metrics import split_metrics  # deferred: loads torch, numpy

        out = model(self.graph.x, self.graph)
        return {k: v for s in splits for k, v in split_metrics(out, self.graph, s).items()}

    def evaluate(self, model) -> dict:
        return self._metrics(model, ("val",))

    def final_metrics(self, model) -> dict:
        return self._metrics(model, ("train", "val", "test"))


@register_workload("gcn")
class GCNWorkload(GraphWorkload):
    """Graph workload with GCN convolutions (model kind "gcn")."""

    conv = "gcn"


@register_workload("sage")
class SAGEWorkload(GraphWorkload):
    """Graph workload with GraphSAGE convolutions (model kind "sage")."""

    conv = "sage"


GAT_PARAMS = {
    "hidden": Param(int, 8, min=1, help="hidden width per attention head"),
    "heads": Param(int, 8, min=1, max=1024, help="attention heads of the hidden layers"),
    "layers": Param(int, 2, min=1, max=4096, help="attention layers"),
    "dropout": Param(float, 0.6, min=0.0, max=1.0,
                     help="on the input of every layer (same masks at every rank count)"),
    "attention_dropout": Param(float, 0.0, min=0.0, max=1.0,
                               help="on the attention weights (per edge, drawn per rank)"),
    "decay": Param(str, "all", choices=("first", "all"),
                   help="layers that get [train] weight_decay (Velickovic et al.: all)"),
}


def _check_gat_job(job) -> None:
    _check_job(job)
    if importlib.util.find_spec("torch_geometric") is None:
        raise ConfigError("[model] kind = \"gat\" needs torch_geometric (pip install "
                          "'hpcpar[gnn]')")


def _gat(in_channels: int, hidden: int, out_channels: int, heads: int, layers: int,
         dropout: float, attention_dropout: float, seed: int):
    """Velickovic et al.'s GAT: ``layers`` GATConv, ``heads`` concatenated heads of ``hidden``
    in the hidden layers, one averaged head out, ELU between, dropout on every input."""
    from torch import nn
    from torch_geometric.nn import GATConv

    from hpcpar.graph.dropout import vertex_dropout  # deferred: loads torch, numba
    from hpcpar.nn.graph import distributed  # deferred: loads torch

    class GAT(nn.Module):  # defined here: only GAT jobs import torch_geometric
        def __init__(self):
            super().__init__()
            widths = [in_channels] + [hidden * heads] * (layers - 1)
            self.convs = nn.ModuleList(
                distributed(GATConv(w, hidden, heads=heads, dropout=attention_dropout))
                for w in widths[:-1])
            self.convs.append(distributed(GATConv(widths[-1], out_channels, heads=1,
                                                  concat=False, dropout=attention_dropout)))
            self.calls = 0  # training forward passes so far (drives the dropout masks)

        def forward(self, x, graph):
            call = self.calls
            self.calls += int(self.training)
            for layer, conv in enumerate(self.convs):
                x = vertex_dropout(x, dropout, graph.source_ids, seed, call, layer,
                                   self.training)
                x = conv(x, graph)
                if layer < len(self.convs) - 1:
                    x = nn.functional.elu(x)
            return x

        def get_extra_state(self) -> dict:
            return {"calls": self.calls}

        def set_extra_state(self, state: dict) -> None:
            self.calls = int(state.get("calls", 0))

    return GAT()


@register_workload("gat")
class GATWorkload(GraphWorkload):
    """Graph workload with graph attention (model kind "gat", PyG's ``GATConv``)."""

    conv = "gat"
    model_params = GAT_PARAMS
    check_job = staticmethod(_check_gat_job)

    def _make(self):
        m = self.job.model.params
        g = self.graph
        return _gat(g.num_features, m["hidden"], g.num_classes, m["heads"], m["layers"],
                    m["dropout"], m["attention_dropout"], self.job.train.seed)
