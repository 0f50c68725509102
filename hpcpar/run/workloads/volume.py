"""The volume model kinds, ``cosmoflow`` and ``unet3d``, as
:class:`hpcpar.run.workloads.base.Workload` subclasses.

Data (``[data]``): an HDF5 dataset directory (``path``; made on first use with
``generate = true``, by all ranks in parallel) or in-memory synthetic CosmoFlow-like volumes
(``source = "synthetic"``), both yielding this rank's sub-volume of its data group's samples.
Validation uses ``val_path`` or ``val_samples`` synthetic samples of another seed.

* ``cosmoflow`` regresses the 4 targets (MSE); the first dense layer takes the flattened
  volume split (each rank holds its voxels' weight columns: :mod:`hpcpar.nn.split_head`) and
  the rest of the head runs replicated, so the per-rank loss is the replica's mean loss.
  With ``[model] tensor_parallel = true`` the volume is gathered instead and the head's
  ``nn.Linear`` layers at least ``tp_min_features`` wide on both sides become
  ``TensorParallelLinear`` over the grid's spatial group (weights sharded, so each rank holds
  and updates 1/spatial of the head).
* ``unet3d`` segments voxels: inputs are all channels but the last, the label is
  ``last channel > 0`` (a nonlinear function of the same field; learnable from the others).
  The loss is torch's plain mean cross-entropy on the split output: the spatialized model's
  dispatch makes it the global mean on every rank, and each rank's gradient its exact piece.

No torch import at module import (job validation runs in the launcher).
"""

from __future__ import annotations

import os

from hpcpar.errors import ConfigError, DataError
from hpcpar.parallel.partition import box
from hpcpar.run.workloads.base import (
    MAX_POOLINGS,
    SEED_MAX,
    Param,
    StepResult,
    Workload,
    register_workload,
)

__all__ = ["VOLUME_DATA", "VolumeWorkload", "CosmoFlowWorkload", "UNet3DWorkload"]

VOLUME_DATA = {
    "source": Param(str, "hdf5", choices=("hdf5", "synthetic"),
                    help="hdf5: read `path`; synthetic: generate in memory"),
    "path": Param(str, None, path=True, help="HDF5 dataset directory (or single .h5 file)"),
    "generate": Param(bool, False, help="make `path` (synthetic cosmoflow) if it is missing"),
    "size": Param(int, None, min=2, help="synthetic/generate: volume edge; hdf5: checked "
                                         "against the dataset when given"),
    "channels": Param(int, None, min=1, help="synthetic/generate: channels (default 4); hdf5: "
                                             "checked against the dataset when given"),
    "samples": Param(int, 64, min=1, help="synthetic/generate: training samples"),
    "shards": Param(int, 4, min=1, help="generate: shard files"),
    "seed": Param(int, 0, min=0, max=SEED_MAX,
                  help="data seed (sample i depends on (seed, i) only)"),
    "shuffle": Param(bool, True),
    "prefetch": Param(int, 2, min=0, help="HDF5: batches read ahead"),
    "stage_to": Param(str, None, path=True, help="HDF5: copy shards to node-local storage first"),
    "verify": Param(bool, True, help="HDF5: compare every shard's sha256 with the manifest "
                    "before training (split over the ranks)"),
    "val_path": Param(str, None, path=True, help="HDF5 validation dataset"),
    "val_samples": Param(int, 0, min=0, help="synthetic validation samples (another seed)"),
    "transform": Param(str, "auto", choices=("auto", "log1p", "none"),
                       help="input transform; auto: the dataset manifest's (none unless the "
                            "dataset asks; log1p for CosmoFlow data and source = 'synthetic')"),
}


DEFAULT_CHANNELS = 4

TP_PARAMS = {
    "tensor_parallel": Param(bool, False, help="split the dense head's Linear layers over the "
                                               "grid's spatial ranks (AxoNN-style tensor "
                                               "parallelism; same function, sharded weights)"),
    "tp_min_features": Param(int, 256, min=1, help="tensor_parallel: only Linear layers at "
                                                   "least this wide on both sides are split"),
}


def _channels(d: dict) -> int:
    """[data] channels, or the generator's default when the job leaves it to the dataset."""
    return d["channels"] if d["channels"] is not None else DEFAULT_CHANNELS


def _dataset_dir(path: str, field: str) -> str:
    """``path`` (a job field), or a one-line error naming the field when it is missing."""
    if not os.path.exists(path):
        raise DataError(f"[data] {field}: {path!r}: dataset not found (working directory "
                        f"{os.getcwd()})")
    return path


def _check_volume_job(job) -> None:
    d = job.data.params
    if d["channels"] is None and (d["source"] == "synthetic" or d["generate"]):
        d["channels"] = DEFAULT_CHANNELS  # what will be generated: resolved in job.json
    if d["source"] == "synthetic":
        if d["size"] is None:
            raise ConfigError("[data] size: required for source = 'synthetic'")
        if d["path"] is not None:
            raise ConfigError("[data] path: not used with source = 'synthetic' (drop one)")
    else:
        if d["path"] is None:
            raise ConfigError("[data] path: required (or set source = 'synthetic')")
        if d["generate"] and d["size"] is None:
            raise ConfigError("[data] size: required with generate = true")
    for key in ("path", "val_path"):
        if d[key] is not None and not str(d[key]).strip():
            raise ConfigError(f"[data] {key}: empty; give the dataset directory (or a .h5 "
                              f"file)")
    if d["val_path"] and d["val_samples"]:
        raise ConfigError("[data] give val_path or val_samples, not both")
    if d["val_samples"] and d["val_samples"] < job.train.global_batch:
        raise ConfigError(f"[data] val_samples: {d['val_samples']} is out of range (must be "
                          f">= [train] global_batch = {job.train.global_batch})")
    _check_split_fits(job)


def _check_split_fits(job) -> None:
    """The grid's spatial split against a known sample size, before any rank starts: the
    ranks would each refuse it (:func:`hpcpar.data._schedule.local_box`), after a rerun on
    another grid had already been announced."""
    size = job.data.params["size"]
    for axis, parts in zip("xyz", job.grid_shape[1:]):
        if size is not None and parts > size:
            raise ConfigError(f"[grid] {axis} = {parts}: more parts than the sample has voxels "
                              f"on that axis ([data] size = {size}); use {axis} <= {size}")


def _check_model_fits(cls, job) -> None:
    """The model of workload ``cls`` against the job's [data] size, when given."""
    size = job.data.params["size"]
    if size is not None:
        try:
            cls.check_sample_shape(job, None, (size,) * 3)
        except ConfigError as exc:
            raise ConfigError(f"{exc}, [data] size is {size}") from None


class VolumeWorkload(Workload):
    """Shared data handling of the volume kinds; subclasses build the model and the loss."""

    data_params = VOLUME_DATA
    check_job = staticmethod(_check_volume_job)

    def __init__(self, job, grid, device):
        super().__init__(job, grid, device)
        self.d = d = job.data.params
        batch = job.train.global_batch
        if d["source"] == "synthetic":
            self.train_set = self._synthetic(d["samples"], d["seed"], d["shuffle"])
            self.val_set = (self._synthetic(d["val_samples"], d["seed"] + 1_000_003, False)
                            if d["val_samples"] else None)
        else:
            if d["generate"]:
                self._generate(d["path"], d["samples"], d["seed"])
            from hpcpar.data import ShardedVolumeDataset  # deferred: loads torch

            self.train_set = ShardedVolumeDataset(_dataset_dir(d["path"], "path"), grid, batch,
                                                  shuffle=d["shuffle"], seed=d["seed"],
                                                  prefetch=d["prefetch"], stage_to=d["stage_to"],
                                                  verify=d["verify"], **self.augment_kwargs())
            self.check_dataset(job, d["path"], "path", self._sample_shape(self.train_set))
            self.val_set = None
            val, field = d["val_path"], "val_path"
            if d["val_samples"]:
                val, field = d["path"].rstrip("/") + "-val", "val_samples"
                if d["generate"]:
                    self._generate(val, d["val_samples"], d["seed"] + 1_000_003)
                elif not os.path.exists(val):
                    raise DataError(f"[data] val_samples = {d['val_samples']}: the validation "
                                    f"set {val!r} ([data] path + '-val', made by generate = "
                                    f"true) is missing: set generate = true, or give [data] "
                                    f"val_path instead")
            if val:
                self.val_set = ShardedVolumeDataset(_dataset_dir(val, field), grid, batch,
                                                    shuffle=False, prefetch=0,
                                                    verify=d["verify"])
                self.check_dataset(job, val, field, self._sample_shape(self.val_set),
                                   self._sample_shape(self.train_set))
        x_shape = self._sample_shape(self.train_set)
        self.channels, self.size = x_shape[0], x_shape[1:]
        self.transform = self.resolve_transform(d, getattr(self.train_set, "manifest", None))
        val_manifest = getattr(self.val_set, "manifest", None)
        if d["transform"] == "auto" and val_manifest is not None \
                and val_manifest.transform != self.transform:
            raise DataError(f"[data] transform = 'auto': the training set asks for "
                            f"{self.transform!r}, the validation set for "
                            f"{val_manifest.transform!r} (manifest field 'transform'); set "
                            f"[data] transform explicitly")

    def augment_kwargs(self) -> dict:
        """Read-time augmentation of the training set (``ShardedVolumeDataset``'s flip and
        rot90); none for the built-in kinds."""
        return {}

    @staticmethod
    def resolve_transform(d: dict, manifest) -> str:
        """The input transform applied at run time: ``[data] transform`` unless ``auto``,
        then the dataset manifest's (in-memory synthetic CosmoFlow data: ``log1p``)."""
        if d["transform"] != "auto":
            return d["transform"]
        return manifest.transform if manifest is not None else "log1p"

    def run_meta(self) -> dict:
        return {"transform": self.transform}

    @classmethod
    def check_dataset(cls, job, path: str, field: str, shape: tuple, train_shape=None) -> None:
        """One-line error naming the manifest field and the job field when the dataset at
        ``path`` (job field ``[data] field``) has samples of another ``shape`` (C, D, H, W)
        than the job says ([data] size/channels, the model's needs, the training set's)."""
        d = job.data.params
        manifest = os.path.join(path, "manifest.json") if os.path.isdir(path) else path
        where = f"{manifest} ([data] {field})"
        shown = "x".join(map(str, shape))
        if train_shape is not None and tuple(shape) != tuple(train_shape):
            raise DataError(f"{where}: field 'x.shape' is {shown}, the training set "
                            f"([data] path) has {'x'.join(map(str, train_shape))}")
        if d["channels"] is not None and shape[0] != d["channels"]:
            raise DataError(f"{where}: field 'x.shape' is {shown} ({shape[0]} channels), but "
                            f"the job's [data] channels = {d['channels']}")
        if d["size"] is not None and tuple(shape[1:]) != (d["size"],) * 3:
            raise DataError(f"{where}: field 'x.shape' is {shown} (volume "
                            f"{'x'.join(map(str, shape[1:]))}), but the job's [data] size = "
                            f"{d['size']} ({d['size']}^3)")
        try:
            cls.check_sample_shape(job, shape[0], tuple(shape[1:]))
        except ConfigError as exc:
            raise DataError(f"{where}: field 'x.shape' is {shown}: {exc}") from None

    @classmethod
    def check_sample_shape(cls, job, channels: int, size: tuple) -> None:
        """ConfigError (naming the [model] field) when the model cannot take samples of
        ``channels`` x ``size``; checked against [data] at validation and against the
        dataset's manifest when it is opened."""

    def _synthetic(self, samples, seed, shuffle):
        from hpcpar.data import SyntheticVolumeDataset  # deferred: loads torch

        return SyntheticVolumeDataset(self.grid, self.job.train.global_batch,
                                      size=self.d["size"], channels=_channels(self.d),
                                      samples=samples, seed=seed, shuffle=shuffle)

    def _generate(self, path, samples, seed) -> None:
        """Collective: write the synthetic dataset at ``path`` unless it exists."""
        exists = None
        if self.grid.rank == 0:
            exists = os.path.exists(path)
            if not exists:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if self.grid.comm.bcast(exists):
            return

        from hpcpar.data import (  # deferred: loads torch, numpy
            CosmoflowSource,
            shard_counts,
            write_dataset,
        )

        src = CosmoflowSource(samples, self.d["size"], _channels(self.d), seed)
        try:
            write_dataset(path, src, shard_counts(samples, shards=min(self.d["shards"], samples)),
                          comm=self.grid.comm, progress=False)
        except DataError:  # the same error on every rank
            if not os.path.exists(path):
                raise
            # another job (a sweep's points start together) published it first: a dataset
            # appears only complete, and the same seed makes the same data, so use that one

    @staticmethod
    def _sample_shape(ds) -> tuple:
        m = getattr(ds, "manifest", None)
        return tuple(m.x.shape) if m is not None else (ds.channels, ds.size, ds.size, ds.size)

    # -- data --------------------------------------------------------------------------------
    def steps_per_epoch(self) -> int:
        return len(self.train_set)

    def batches(self, epoch: int):
        self.train_set.set_epoch(epoch)
        return iter(self.train_set)

    def state_dict(self) -> dict:
        return {"train": self.train_set.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.train_set.load_state_dict(state["train"])

    def close(self) -> None:
        for ds in (self.train_set, self.val_set):
            if ds is not None:
                ds.close()

    def _inputs(self, x):
        x = x.to(self.device, non_blocking=True)
        x = x.log1p() if self.transform == "log1p" else x
        if self.job.train.channels_last:  # every spatial layer then runs in that order
            import torch

            x = x.contiguous(memory_format=torch.channels_last_3d)
        return x

    # -- model -------------------------------------------------------------------------------
    label_channels = 0  # trailing sample channels that hold labels, not model input

    @classmethod
    def build_plain(cls, job, channels: int, size: tuple, n_targets: int):
        """The plain single-process model of ``job`` for samples of ``channels`` x ``size``
        (no data needed: the planner builds it on the meta device)."""
        raise NotImplementedError

    def plain_model(self):
        return self.build_plain(self.job, self.channels, self.size, self._targets())

    def _targets(self) -> int:
        m = getattr(self.train_set, "manifest", None)
        return int(m.y.shape[0]) if m is not None else len(self.train_set.targets)

    def reference_model(self):
        import torch

        torch.manual_seed(self.job.train.seed)
        return self.plain_model()

    def build_model(self):
        from torch import nn

        from hpcpar.nn.spatializer import spatialize  # deferred: loads torch, numpy

        # inplace: the reference model is not needed after, so its weights (a full-size dense
        # head on every rank until settle cuts it) are not copied
        model = spatialize(self.reference_model(), self.grid, check=self.job.model.check,
                           inplace=True, fuse_halos=self.job.model.fuse_halos,
                           **self.spatialize_kwargs())
        p = self.job.model.params
        if p.get("tensor_parallel"):
            from hpcpar.nn.tensor_parallel import tensor_parallelize  # deferred: loads torch, numpy

            # after spatialize: the head's Linear layers are replicated there; the swap keeps
            # their weights, so the model computes the same function
            model = tensor_parallelize(model, self.grid, p["tp_min_features"])
            return self._in_order(model.to(self.device))
        model = self._in_order(model.to(self.device))
        if any(isinstance(m, nn.Linear) for m in model.modules()):
            self._settle(model)
        return model

    def _in_order(self, model):
        """With ``[train] channels_last``, the convolutions' weights in channels_last_3d too:
        torch's convolution runs in channels-last order when its input *or* its weight is in
        it, and a one-channel input (dense in both orders) or a layer returning NCDHW (a
        transposed convolution on torch's own kernel) would put every later layer with NCDHW
        weights on oneDNN's slow path (1.6x the UNet3D demo's step at 96³)."""
        if self.job.train.channels_last:
            import torch

            for param in model.parameters():
                if param.dim() == 5:
                    param.data = param.data.contiguous(memory_format=torch.channels_last_3d)
        return model

    def _settle(self, model) -> None:
        """One forward of zeros of this rank's piece (:func:`hpcpar.nn.spatializer.settle`): a
        split head is cut to this rank's columns before the gradient sync, the optimizer or a
        resumed checkpoint's state see its weight."""
        import torch

        from hpcpar.nn.spatializer import settle  # deferred: loads torch, numpy

        piece = [b - a for a, b in box(self.size, self.grid.spatial_shape,
                                       self.grid.spatial_coords)]
        x = torch.zeros(1, self.channels, *piece)
        settle(model, self._inputs(x)[:, :self.channels - self.label_channels])

    def spatialize_kwargs(self) -> dict:
        return {}

    # -- evaluation ----------------------------------------------------------------------------
    def evaluate(self, model) -> dict:
        """Mean validation loss (and kind metrics) over every full validation batch."""
        import numpy as np
        from mpi4py import MPI

        if self.val_set is None:
            return {}
        sums = np.zeros(1 + len(self.metric_names), dtype=np.float64)
        count = 0
        self.val_set.set_epoch(0)
        self.val_set.load_state_dict({"epoch": 0, "position": 0})
        for x, y in self.val_set:
            res = self.forward_loss(model, (x, y))
            n = res.samples
            value = res.loss.item() if res.loss_value is None else res.loss_value
            sums[0] += value * n
            sums[1:] += np.asarray(res.extra.get("metrics", []), dtype=np.float64) * n
            count += n
        # one replica per data group: sum over the data axis only
        data_comm = self.grid.data_comm
        sums = data_comm.allreduce(sums, op=MPI.SUM)
        count = max(data_comm.allreduce(count, op=MPI.SUM), 1)
        return {"val_loss": sums[0] / count,
                **{f"val_{k}": v / count for k, v in zip(self.metric_names, sums[1:])}}

    metric_names: tuple = ()


@register_workload("cosmoflow")
class CosmoFlowWorkload(VolumeWorkload):
    """CosmoFlow regression of the 4 targets, MSE loss; validation reports val_loss, val_mae."""

    kind = "cosmoflow"
    model_params = {
        "n_conv_blocks": Param(int, 5, min=1, max=MAX_POOLINGS, help="conv + pool blocks"),
        "base_filters": Param(int, 16, min=1, help="filters of block 0 (doubling)"),
        "kernel_size": Param(int, 3, min=1),
        "dense": Param(list, [128, 64], help="widths of the dense layers"),
        "dropout": Param(float, 0.0, min=0.0, max=1.0),
        "negative_slope": Param(float, 0.3, min=0.0),
        **TP_PARAMS,
    }
    metric_names = ("mae",)

    @staticmethod
    def check_job(job) -> None:
        _check_volume_job(job)
        p = job.model.params
        if not all(isinstance(w, int) and not isinstance(w, bool) and w > 0
                   for w in p["dense"]):
            raise ConfigError(f"[model] dense: expected a list of positive integers, got "
                              f"{p['dense']!r}")
        _check_model_fits(CosmoFlowWorkload, job)

    @classmethod
    def check_sample_shape(cls, job, channels, size) -> None:
        n = job.model.params["n_conv_blocks"]
        if min(size) < 2 ** n:
            raise ConfigError(f"[model] n_conv_blocks: {n} pooling blocks need a volume of at "
                              f"least {2 ** n}")

    @classmethod
    def build_plain(cls, job, channels, size, n_targets):
        from hpcpar.models.cosmoflow import CosmoFlow  # deferred: loads torch, numpy

        p = {k: v for k, v in job.model.params.items() if k not in TP_PARAMS}
        p["dense"] = tuple(p["dense"])
        # tensor-parallel dense layers take a replicated input: the volume is gathered first
        return CosmoFlow(input_size=size[0], in_channels=channels, n_targets=n_targets,
                         gather=bool(job.model.params.get("tensor_parallel")), **p)

    def forward_loss(self, model, batch) -> StepResult:
        import torch.nn.functional as F

        x, y = batch
        y = y.to(self.device, non_blocking=True)
        out = model(self._inputs(x))
        loss = F.mse_loss(out.float(), y.float())
        mae = float((out.detach().float() - y).abs().mean())
        return StepResult(loss=loss, samples=int(y.shape[0]), loss_value=float(loss.detach()),
                          extra={"metrics": [mae]})


@register_workload("unet3d")
class UNet3DWorkload(VolumeWorkload):
    """3D U-Net voxel segmentation (label: last channel > 0) with cross-entropy; validation
    reports val_loss and val_accuracy (voxel accuracy)."""

    kind = "unet3d"
    model_params = {
        "base_filters": Param(int, 16, min=1),
        "depth": Param(int, 3, min=1, max=MAX_POOLINGS, help="poolings"),
        "batch_norm": Param(bool, True),
        "kernel_size": Param(int, 3, min=1),
        "bn_include_data": Param(bool, True, help="batch-norm statistics over the whole "
                                                  "global batch (as one process would)"),
    }
    metric_names = ("accuracy",)
    label_channels = 1  # the last channel is the segmentation label

    @staticmethod
    def check_job(job) -> None:
        _check_volume_job(job)
        channels = job.data.params["channels"]
        if channels is not None and channels < 2:
            raise ConfigError("[data] channels: unet3d needs >= 2 (inputs + label channel)")
        _check_model_fits(UNet3DWorkload, job)

    @classmethod
    def check_sample_shape(cls, job, channels, size) -> None:
        depth = job.model.params["depth"]
        if channels is not None and channels < 2:
            raise ConfigError("unet3d needs >= 2 channels (inputs + label channel)")
        if min(size) < 2 ** depth:
            raise ConfigError(f"[model] depth: {depth} poolings need a volume of at least "
                              f"{2 ** depth}")

    @classmethod
    def build_plain(cls, job, channels, size, n_targets):
        from hpcpar.models.unet3d import UNet3D  # deferred: loads torch, numpy

        p = {k: v for k, v in job.model.params.items() if k != "bn_include_data"}
        return UNet3D(in_channels=channels - cls.label_channels, out_channels=2, **p)

    def spatialize_kwargs(self) -> dict:
        return {"bn_include_data": self.job.model.params["bn_include_data"]}

    def forward_loss(self, model, batch) -> StepResult:
        import torch.nn.functional as F

        x, _ = batch
        x = self._inputs(x)
        logits = model(x[:, :-1])
        # this rank's piece of the labels, marked split like the output: the plain mean loss
        # and accuracy below are then the global ones (hpcpar.nn dispatch), on every rank
        from hpcpar.nn import split_like  # deferred: loads torch

        labels = split_like((x[:, -1] > 0).long(), logits)
        loss = F.cross_entropy(logits.float(), labels)
        # max(1).indices, not argmax(1): the same first-maximum index, but torch's CPU
        # argmax over a non-last dimension took 14-25 ms of a 200 ms UNet3D step
        accuracy = (logits.detach().max(1).indices == labels).float().mean()
        return StepResult(loss=loss, samples=int(x.shape[0]), loss_value=float(loss.detach()),
                          extra={"metrics": [float(accuracy)]})
