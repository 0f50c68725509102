"""``SyntheticVolumeDataset``: the ``hpcpar data make cosmoflow`` samples, made in memory.

Same interface and schedule as :class:`~hpcpar.data.ShardedVolumeDataset`, and the same batches as
reading a dataset made with the same ``seed`` (the data seed doubles as the shuffle seed), without
files: for quick jobs and tests. Each rank generates whole samples and keeps only its sub-volume
(cached when it fits ``cache_bytes``)."""

from __future__ import annotations

import numpy as np

from hpcpar.data._schedule import VolumeDatasetBase
from hpcpar.parallel.grid import ProcessGrid

from .synthetic import TARGETS, cosmoflow_sample

__all__ = ["SyntheticVolumeDataset"]

CACHE_BYTES = 1 << 30


class SyntheticVolumeDataset(VolumeDatasetBase):
    """The synthetic CosmoFlow samples, generated in memory; iterates like the file reader.

    Yields ``(x_local, y)``: this rank's sub-volume of its data group's samples and their targets,
    the same batches as reading a dataset made with the same ``seed`` (which seeds the shuffle too).
    ``batch_size`` is the GLOBAL batch; the local sub-volumes stay in memory when they fit in
    ``cache_bytes``. DataError: a batch larger than the dataset or smaller than the number of data
    groups, or a volume smaller than the grid."""

    def __init__(self, grid: ProcessGrid, batch_size: int, *, size: int, channels: int = 4,
                 samples: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True,
                 cache_bytes: int = CACHE_BYTES):
        super().__init__(grid, batch_size, samples, (size, size, size), shuffle=shuffle,
                         seed=seed, drop_last=drop_last,
                         name=f"synthetic cosmoflow ({samples} samples of {size}^3)")
        self.size, self.channels, self.seed = size, channels, seed
        per_sample = channels * int(np.prod(self.local_shape)) * 4
        self._cache: dict | None = {} if per_sample * samples <= cache_bytes else None
        self.bytes_read = 0  # nothing comes from storage

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(x_local, y)`` of global sample ``index``: this rank's ``(C, d, h, w)`` sub-volume
        and the ``(K,)`` targets."""
        if self._cache is not None and index in self._cache:
            return self._cache[index]
        x, y = cosmoflow_sample(self.seed, index, self.size, self.channels)
        sel = tuple(slice(a, b) for a, b in self.box)
        item = (np.ascontiguousarray(x[(slice(None), *sel)]), y)
        if self._cache is not None:
            self._cache[index] = item
        return item

    def _batches(self, epoch: int, start: int):
        import torch

        for samples in self.schedule.local_steps(epoch, start):
            xs, ys = zip(*(self.sample(int(i)) for i in samples))
            yield torch.from_numpy(np.stack(xs)), torch.from_numpy(np.stack(ys))

    @property
    def targets(self) -> tuple:
        """Names of the regression targets."""
        return TARGETS

    def close(self) -> None:
        """Nothing to release (same interface as the file reader)."""
