"""The built-in workload for a user's own model: ``[model] kind = "net.py:UNet"`` (or
``"mypkg.net:UNet"``) names any ``nn.Module`` class or factory function, ``[model] args`` its
keyword arguments; the user's file holds only the model.

``hpcpar run`` builds it on every rank with ``[train] seed``, spatializes it
(:func:`hpcpar.nn.spatializer.spatialize`), reads the ``[data]`` set as the volume kinds do
(samples over the data axis, each sample's voxels over the spatial axes, resumable mid-epoch)
and trains it with ``[train] loss`` (:mod:`hpcpar.run.workloads.objectives`). Targets come from
the data set: a label volume ``y (N, D, H, W)`` is read and split like the input (segmentation);
per-sample targets ``y (N, K)`` are whole on every rank (regression, classification). The loss
logged and recorded is the global one (the single-process value) on every rank; the
``[train] metrics`` are evaluated on the validation set, as single-process values over it.
"""

from __future__ import annotations

from hpcpar.errors import ConfigError
from hpcpar.run.workloads.base import Param, StepResult
from hpcpar.run.workloads.graphmodel import GraphModelWorkload, is_graph_model
from hpcpar.run.workloads.objectives import MetricSums, check_loss, check_metrics, make_loss
from hpcpar.run.workloads.volume import VOLUME_DATA, VolumeWorkload, _check_volume_job

#: keeps the intensity draws apart from every other use of the data seed
_INTENSITY_STREAM = 0x1A7

__all__ = ["MODEL_PARAMS", "ModelWorkload", "model_workload"]

MODEL_PARAMS = {
    "args": Param(dict, {}, help="keyword arguments of the model class or factory"),
    "bn_include_data": Param(bool, True, help="batch-norm statistics over the whole global "
                                              "batch (as one process would)"),
}

AUGMENT_PARAMS = {
    "flip": Param(bool, False, help="training samples flipped along D, H, W at random (the "
                                    "whole sample, the same on every grid)"),
    "rot90": Param(bool, False, help="training samples turned by random quarter turns in "
                                     "the (H, W) plane (needs H == W)"),
    "intensity_scale": Param(float, 0.0, min=0.0, help="each training sample multiplied by "
                             "1 + s*u, u uniform in [-1, 1] per sample"),
    "noise_std": Param(float, 0.0, min=0.0, help="Gaussian noise of this std added to every "
                       "training voxel, drawn from the voxel's global position"),
}

TRAIN_PARAMS = {
    "loss": Param(str, "ce", help="ce, dice, dice+ce, mse, l1, bce, or 'module:callable' "
                                  "(output, target) -> loss"),
    "metrics": Param(list, [], help="validation metrics: dice, accuracy, mae, mse"),
    "class_weights": Param(list, None, help="ce: a weight per class; bce: pos_weight per "
                                            "output channel"),
    "ignore_index": Param(int, None, help="ce, dice and the metrics: labels to ignore"),
}


def _check_job(job) -> None:
    _check_volume_job(job)
    d = job.data.params
    if d["source"] == "synthetic" and (d["flip"] or d["rot90"]):
        raise ConfigError("[data] flip/rot90: applied as an HDF5 data set is read; not with "
                          "source = 'synthetic'")
    t = job.train.params
    check_loss(t["loss"])
    if not all(isinstance(m, str) for m in t["metrics"]):
        raise ConfigError(f"[train] metrics: expected a list of names, got {t['metrics']!r}")
    check_metrics(t["metrics"])
    w = t["class_weights"]
    if w is not None and not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                 and v >= 0 for v in w):
        raise ConfigError(f"[train] class_weights: expected a list of numbers >= 0, got {w!r}")
    if w is not None and t["loss"] not in ("ce", "dice+ce", "bce"):
        raise ConfigError(f"[train] class_weights: loss {t['loss']!r} takes none (ce, dice+ce "
                          f"and bce do)")
    if not all(isinstance(k, str) for k in job.model.params["args"]):
        raise ConfigError("[model] args: expected a table of keyword arguments")


class ModelWorkload(VolumeWorkload):
    """A plain volume model trained with a loss and metrics by name (the module docstring);
    subclassed per model by :func:`model_workload`, which sets ``model_factory``."""

    model_factory: object = None
    model_params = MODEL_PARAMS
    data_params = {**VOLUME_DATA, **AUGMENT_PARAMS}
    train_params = TRAIN_PARAMS
    check_job = staticmethod(_check_job)

    def __init__(self, job, grid, device):
        super().__init__(job, grid, device)
        t = job.train.params
        self.loss_fn = make_loss(t["loss"], t["class_weights"], t["ignore_index"])
        self.metric_names = tuple(t["metrics"])

    @classmethod
    def build_plain(cls, job, channels, size, n_targets):
        factory = cls.model_factory
        assert callable(factory)
        try:
            return factory(**job.model.params["args"])
        except TypeError as exc:
            raise ConfigError(f"[model] args: {job.model.kind} does not take them "
                              f"({exc})") from None

    def spatialize_kwargs(self) -> dict:
        return {"bn_include_data": self.job.model.params["bn_include_data"]}

    def _target(self, y, out):
        """The target on the device: a label volume marked split like the output, so the
        loss and metrics computed from it are the global ones."""
        y = y.to(self.device, non_blocking=True)
        if y.dim() == 4:
            from hpcpar.nn import split_like  # deferred: loads torch

            return split_like(y, out)
        return y

    def _global_mean(self, value: float) -> float:
        """The mean of the data-parallel replicas' losses (each the mean over as many
        samples): the single-process loss, the same on every rank."""
        comm = self.grid.data_comm
        if comm.Get_size() == 1:
            return value
        from mpi4py import MPI

        return comm.allreduce(value, op=MPI.SUM) / comm.Get_size()

    def augment_kwargs(self) -> dict:
        return {"flip": self.d["flip"], "rot90": self.d["rot90"]}

    def _intensity(self, x):
        """``[data] intensity_scale`` and ``noise_std`` on this rank's piece of the batch:
        one scale per sample from (seed, epoch, step, global sample), and noise from each
        voxel's global position (:func:`hpcpar.nn.noise.spatial_noise`), so every grid
        sees the same augmented sample; keyed by the data position, so a resumed run draws
        what the uninterrupted one did."""
        d = self.d
        if not (d["intensity_scale"] or d["noise_std"]):
            return x
        import numpy as np
        import torch

        key = [_INTENSITY_STREAM, d["seed"], self.train_set.epoch, self.train_set.position]
        n = x.shape[0]
        if d["intensity_scale"]:
            first = self.grid.coords[0] * n
            u = [np.random.default_rng([*key, first + j]).uniform(-1.0, 1.0) for j in range(n)]
            scale = 1.0 + d["intensity_scale"] * torch.tensor(u, dtype=x.dtype)
            x = x * scale.to(x.device).view(n, *[1] * (x.dim() - 1))
        if d["noise_std"]:
            from hpcpar.nn.noise import spatial_noise  # deferred: loads torch

            seed = int(np.random.default_rng(key).integers(0, 2**62))
            x = x + d["noise_std"] * spatial_noise(x, "normal", grid=self.grid,
                                                   sdims=(2, 3, 4), gshape=self.size, seed=seed)
        return x

    def forward_loss(self, model, batch) -> StepResult:
        x, y = batch
        out = model(self._intensity(self._inputs(x)))
        target = self._target(y, out)
        loss = self.loss_fn(out, target)
        return StepResult(loss=loss, samples=int(x.shape[0]),
                          loss_value=self._global_mean(float(loss.detach())))

    def evaluate(self, model) -> dict:
        """``val_loss`` and ``val_<metric>`` over every full validation batch: the
        single-process values over the set, on every rank."""
        if self.val_set is None:
            return {}
        sums = MetricSums(self.metric_names, self.job.train.params["ignore_index"])
        total, batches = 0.0, 0
        self.val_set.set_epoch(0)
        self.val_set.load_state_dict({"epoch": 0, "position": 0})
        for x, y in self.val_set:
            out = model(self._inputs(x))
            target = self._target(y, out)
            total += float(self.loss_fn(out, target))
            batches += 1
            sums.update(out, target)
        return {"val_loss": self._global_mean(total / max(batches, 1)),
                **{f"val_{k}": v for k, v in sums.values(self.grid.data_comm).items()}}


def model_workload(kind: str, model) -> type:
    """The workload class of a plain model (``[model] kind`` names ``model``, an
    ``nn.Module`` class or a factory function): :class:`GraphModelWorkload` for a PyG model
    (its forward takes ``edge_index``), else :class:`ModelWorkload`."""
    name = getattr(model, "__name__", "Model")
    base = GraphModelWorkload if is_graph_model(model) else ModelWorkload
    return type(f"{name}Workload", (base,),
                {"kind": kind, "model_factory": staticmethod(model),
                 "__doc__": f"The built-in workload of the user's model {kind}."})
