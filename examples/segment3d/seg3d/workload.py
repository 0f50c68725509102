"""``[model] kind = "seg3d"``: how hpcpar trains TinySegNet on the user's HDF5 volumes.

hpcpar's loop owns steps, optimizer, checkpoints, signals and records; this class owns the
model, which voxels each rank reads, and the loss. Every rank reads only its sub-volume
(``hpcpar.parallel.spatial.local_slices``) of its data group's samples.
"""

from __future__ import annotations

import numpy as np

from hpcpar.errors import ConfigError, DataError
from hpcpar.run.workloads.base import Param, StepResult, Workload


class Seg3DWorkload(Workload):
    """Voxel segmentation with cross-entropy; validation reports val_loss, val_accuracy."""

    kind = "seg3d"
    model_params = {
        "width": Param(int, 8, min=1, help="feature channels"),
        "classes": Param(int, 2, min=2, help="segmentation classes"),
    }
    data_params = {
        "path": Param(str, help="HDF5 file with 'image' and 'label', both (N, D, H, W)"),
        "val_path": Param(str, None, help="HDF5 validation file, same layout"),
        "shuffle": Param(bool, True),
    }

    @staticmethod
    def check_job(job) -> None:
        """Cross-field checks, run by ``hpcpar run`` before any rank starts."""
        if job.data.params["val_path"] == job.data.params["path"]:
            raise ConfigError("[data] val_path: the same file as [data] path")

    def __init__(self, job, grid, device):
        super().__init__(job, grid, device)
        import h5py

        d = job.data.params
        self.files = {"train": h5py.File(d["path"], "r")}
        if d["val_path"]:
            self.files["val"] = h5py.File(d["val_path"], "r")
        shape = self.files["train"]["image"].shape
        if len(shape) != 4:
            raise DataError(f"{d['path']}: 'image' is {shape}, expected (N, D, H, W)")
        self.n, self.size = shape[0], shape[1:]
        self.epoch, self.position = 0, 0

    # -- data: each rank reads its hyperslab of its data group's samples -------------------------
    def _samples(self, order: np.ndarray, step: int) -> np.ndarray:
        from hpcpar.parallel.partition import part_range

        batch = order[step * self.job.train.global_batch:][:self.job.train.global_batch]
        a, b = part_range(len(batch), self.grid.shape[0], self.grid.coords[0])
        return np.sort(batch[a:b])

    def _read(self, which: str, samples) -> tuple:
        import torch

        from hpcpar.parallel.spatial import local_slices

        f = self.files[which]
        box = local_slices(f["image"].shape[1:], self.grid)
        image = np.stack([f["image"][(i, *box)] for i in samples])[:, None]
        label = np.stack([f["label"][(i, *box)] for i in samples])
        return (torch.from_numpy(image).to(self.device),
                torch.from_numpy(label.astype(np.int64)).to(self.device))

    def steps_per_epoch(self) -> int:
        return self.n // self.job.train.global_batch

    def batches(self, epoch: int):
        shuffle = self.job.data.params["shuffle"]
        order = (np.random.default_rng([self.job.train.seed, epoch]).permutation(self.n)
                 if shuffle else np.arange(self.n))
        start = self.position if epoch == self.epoch else 0
        self.epoch = epoch
        for step in range(start, self.steps_per_epoch()):
            self.position = step + 1
            yield self._read("train", self._samples(order, step))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    # -- model and loss --------------------------------------------------------------------------
    def reference_model(self):
        import torch

        from seg3d.net import TinySegNet

        torch.manual_seed(self.job.train.seed)   # identical initial weights on every rank
        return TinySegNet(1, **self.job.model.params)

    def build_model(self):
        from hpcpar.nn import spatialize

        return spatialize(self.reference_model(), self.grid).to(self.device)

    def _loss(self, model, batch) -> tuple:
        import torch.nn.functional as F

        from hpcpar.nn import split_like

        image, label = batch
        logits = model(image)
        # the label is this rank's piece: marked split like the logits, the plain mean loss
        # and accuracy are the whole sample's, on every rank
        label = split_like(label, logits)
        loss = F.cross_entropy(logits, label)
        accuracy = (logits.argmax(1) == label).float().mean()
        return loss, len(image), np.array([float(loss.detach()), float(accuracy)])

    def forward_loss(self, model, batch) -> StepResult:
        loss, n, (value, acc) = self._loss(model, batch)
        return StepResult(loss=loss, samples=n, loss_value=value, extra={"accuracy": acc})

    def evaluate(self, model) -> dict:
        from mpi4py import MPI

        if "val" not in self.files:
            return {}
        n = self.files["val"]["image"].shape[0]
        sums = np.zeros(3)
        for step in range(n // self.job.train.global_batch):
            _, k, both = self._loss(model, self._read("val", self._samples(np.arange(n), step)))
            sums += [both[0] * k, both[1] * k, k]
        sums = self.grid.data_comm.allreduce(sums, op=MPI.SUM)
        return {"val_loss": sums[0] / max(sums[2], 1), "val_accuracy": sums[1] / max(sums[2], 1)}
