"""The built-in graph workload for a user's own PyG model: ``[model] kind = "mygnn.py:Net"``
names an ``nn.Module`` whose ``forward(x, edge_index)`` uses any PyG message-passing layers
(``GATConv`` with heads, your own ``MessagePassing`` ...); ``[model] args`` are its keyword
arguments (``in_channels``/``out_channels`` default to the graph's features and classes when
the model takes them). No hpcpar import in the user's file, no method to override.

On every rank the model is built with ``[train] seed`` and runs on this rank's part of the
graph (``[data]`` as for ``gcn``): each ``MessagePassing`` layer is called with the
partitioned graph as its ``edge_index`` and runs as :meth:`DistGraph.apply
<hpcpar.graph.distgraph.DistGraph.apply>` (halo rows in, owned rows out: exact for layers whose
output at a vertex needs only its in-neighbours' rows), and ``F.dropout`` on vertex rows draws
its mask from the vertices' global ids (:func:`hpcpar.graph.dropout.vertex_dropout`), so every
partition trains the single-process model. The forward may use ``edge_index`` only to pass
it to its layers. The loss is cross entropy over the training vertices; what is logged and
recorded is the global loss on every rank.
"""

from __future__ import annotations

import inspect

from hpcpar.errors import ConfigError
from hpcpar.run.workloads.base import Param, Workload
from hpcpar.run.workloads.graph import DATA_PARAMS, GraphWorkload, _check_job

__all__ = ["is_graph_model", "GraphModelWorkload"]

#: message-passing calls under way: dropout inside a layer (GATConv's attention dropout, over
#: edges) is the layer's own, not a vertex dropout
_IN_LAYER = [0]


def is_graph_model(model) -> bool:
    """A PyG-style model: an ``nn.Module`` class whose ``forward`` takes ``edge_index``."""
    forward = getattr(model, "forward", None) if isinstance(model, type) else None
    return forward is not None and "edge_index" in inspect.signature(forward).parameters


def _check_graph_job(job) -> None:
    _check_job(job)
    if not all(isinstance(k, str) for k in job.model.params["args"]):
        raise ConfigError("[model] args: expected a table of keyword arguments")


class _Partitioned:
    """While a forward runs: message-passing layers called with the partitioned graph run
    on it (:meth:`DistGraph.apply`), and dropout of vertex rows takes partition-independent
    masks. A ``TorchFunctionMode`` for the dropout, so ``F.dropout`` and ``nn.Dropout`` in
    the user's code are both seen."""

    def __init__(self, graph, seed: int, call: int):
        import torch
        import torch.nn.functional as F
        from torch.overrides import TorchFunctionMode

        from hpcpar.graph.dropout import vertex_dropout  # deferred: loads torch, numba

        outer = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is F.dropout and not _IN_LAYER[0] and args \
                        and isinstance(args[0], torch.Tensor) \
                        and args[0].dim() == 2 and args[0].shape[0] == graph.num_owned:
                    b = inspect.signature(F.dropout).bind(*args, **kwargs).arguments
                    outer.layer += 1
                    return vertex_dropout(b["input"], b.get("p", 0.5), graph.global_ids, seed,
                                          call, 1000 + outer.layer, b.get("training", True))
                return func(*args, **kwargs)

        self.layer = 0
        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _on_graph(conv, forward):
    """``conv``'s forward, running on the partitioned graph when called with one."""
    from hpcpar.graph.distgraph import DistGraph  # deferred: loads torch, numba

    def run(x, edge_index, *args, **kwargs):
        _IN_LAYER[0] += 1
        try:
            if isinstance(edge_index, DistGraph):
                return edge_index.apply(forward, x, *args, **kwargs)
            return forward(x, edge_index, *args, **kwargs)
        finally:
            _IN_LAYER[0] -= 1

    return run


class GraphModelWorkload(GraphWorkload):
    """A user's PyG model on the partitioned graph (the module docstring); subclassed per
    model by :func:`hpcpar.run.workloads.usermodel.model_workload`."""

    model_factory: object = None
    model_params = {"args": Param(dict, {}, help="keyword arguments of the model class")}
    data_params = DATA_PARAMS
    check_job = staticmethod(_check_graph_job)

    def _make(self):
        import torch

        factory = self.model_factory
        assert callable(factory)
        args = dict(self.job.model.params["args"])
        takes = inspect.signature(factory).parameters
        for name, value in (("in_channels", self.graph.num_features),
                            ("out_channels", self.graph.num_classes)):
            if name in takes and name not in args:
                args[name] = value
        torch.manual_seed(self.job.train.seed)
        try:
            return factory(**args)
        except TypeError as exc:
            raise ConfigError(f"[model] args: {self.job.model.kind} does not take them "
                              f"({exc})") from None

    def build_model(self):
        from torch_geometric.nn import MessagePassing

        model = self._make().to(self.device)
        for conv in model.modules():   # same modules, same state_dict keys as the plain model
            if isinstance(conv, MessagePassing):
                conv.forward = _on_graph(conv, conv.forward)
        forward = model.forward

        def partitioned(x, edge_index, *args, **kwargs):
            call = self.calls
            self.calls += int(model.training)
            with _Partitioned(self.graph, self.job.train.seed, call):
                return forward(x, edge_index, *args, **kwargs)

        model.forward = partitioned
        return model

    calls = 0  # training forward passes so far: they key the dropout masks

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = int(state.get("calls", 0))

    def param_groups(self, model):
        return Workload.param_groups(self, model)
