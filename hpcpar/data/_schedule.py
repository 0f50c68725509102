"""Which samples, and which sub-volume of them, a rank gets at each step of each epoch.

Shared by every volume dataset (files or in memory). Rules:

- The epoch order is ``permutation(N)`` from ``numpy.random.default_rng([seed, epoch])``
  (identity without shuffle): every rank computes it alone, so all ranks agree with no
  communication and the spatial group sees the same samples.
- Step ``s`` takes the global batch ``order[s*B:(s+1)*B]``; data group ``d`` gets its piece
  ``part_range(len(batch), D, d)`` (the partition rule), all ranks of the group the same.
- ``drop_last=True``: ``N // B`` steps; the last ``N % B`` samples of each epoch's order are
  skipped (different ones every epoch when shuffled). ``drop_last=False``: ``ceil(N / B)``
  steps, every sample exactly once; the last step is short.
- The sub-volume: grid axis x splits D, y splits H, z splits W, by the partition rule.
"""

from __future__ import annotations

import numpy as np

from hpcpar.errors import DataError
from hpcpar.parallel.partition import box, part_range


def local_box(volume_shape, spatial_shape, spatial_coords) -> tuple:
    """This rank's ``[start, stop)`` along (D, H, W): x splits D, y splits H, z splits W."""
    for axis, n, parts in zip("xyz", volume_shape, spatial_shape):
        if parts > n:
            raise DataError(f"grid axis {axis} has {parts} ranks but the volume is only {n} "
                            f"long on that axis (shape {tuple(volume_shape)})")
    return box(volume_shape, spatial_shape, spatial_coords)


class EpochSchedule:
    """The per-step sample lists of one rank (see module docstring for the rules)."""

    def __init__(self, num_samples: int, batch_size: int, data_size: int, data_index: int,
                 *, shuffle: bool, seed: int, drop_last: bool, name: str):
        if batch_size > num_samples:
            raise DataError(f"{name}: batch_size {batch_size} is larger than the dataset "
                            f"({num_samples} samples)")
        if batch_size < data_size:
            raise DataError(f"{name}: batch_size {batch_size} is smaller than the {data_size} "
                            "data-parallel groups (each needs a sample per step)")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.data_size, self.data_index = data_size, data_index
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        full, rest = divmod(num_samples, batch_size)
        self.steps = full + (1 if rest and not drop_last else 0)
        self.max_local = -(-batch_size // data_size)

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def global_batch(self, order: np.ndarray, step: int) -> np.ndarray:
        return order[step * self.batch_size:(step + 1) * self.batch_size]

    def local(self, order: np.ndarray, step: int) -> np.ndarray:
        """Global sample indices this rank's data group takes at ``step``."""
        batch = self.global_batch(order, step)
        a, b = part_range(len(batch), self.data_size, self.data_index)
        return batch[a:b]

    def local_steps(self, epoch: int, start: int = 0) -> list:
        order = self.order(epoch)
        return [self.local(order, s) for s in range(start, self.steps)]


class VolumeDatasetBase:
    """Epoch bookkeeping shared by the volume datasets: ``len``, ``set_epoch``, resumable
    ``state_dict``, multi-epoch iteration. Subclasses implement ``_batches(epoch, start)``,
    a generator of ``(x_local, y)`` for steps ``start..len-1``."""

    def __init__(self, grid, batch_size: int, num_samples: int, volume_shape, *,
                 shuffle: bool, seed: int, drop_last: bool, name: str):
        self.grid = grid
        self.name = name
        self.schedule = EpochSchedule(num_samples, batch_size, grid.shape[0], grid.coords[0],
                                      shuffle=shuffle, seed=seed, drop_last=drop_last,
                                      name=name)
        self.box = local_box(volume_shape, grid.spatial_shape, grid.spatial_coords)
        self.epoch, self.position = 0, 0
        self._resume = False  # load_state_dict: the next __iter__ starts at self.position
        self._active = None

    # -- epoch bookkeeping -------------------------------------------------------------------
    def __len__(self) -> int:
        """Steps per epoch (same on every rank)."""
        return self.schedule.steps

    @property
    def local_shape(self) -> tuple:
        """(d, h, w) of this rank's sub-volume."""
        return tuple(b - a for a, b in self.box)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (its shuffle). Setting the epoch a ``load_state_dict`` restored
        keeps the restored position, so resume code can call it unconditionally."""
        if epoch != self.epoch:
            self.epoch, self.position, self._resume = int(epoch), 0, False

    def state_dict(self) -> dict:
        """Epoch and steps already consumed in it: ``load_state_dict`` of this makes the next
        ``__iter__`` continue exactly there (bit-identical batches)."""
        epoch, position = self.epoch, self.position
        if position >= len(self):
            epoch, position = epoch + 1, 0
        s = self.schedule
        return {"epoch": epoch, "position": position, "seed": s.seed, "shuffle": s.shuffle,
                "batch_size": s.batch_size, "num_samples": s.num_samples,
                "drop_last": s.drop_last}

    def load_state_dict(self, state: dict) -> None:
        s = self.schedule
        for key in ("seed", "shuffle", "batch_size", "num_samples", "drop_last"):
            if key in state and state[key] != getattr(s, key):
                raise DataError(f"{self.name}: state_dict field '{key}' is {state[key]!r}, "
                                f"this dataset has {getattr(s, key)!r}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._resume = True

    def __iter__(self):
        if self._active is not None:
            self._active.close()
        self._active = self._epoch_iter()
        return self._active

    def _epoch_iter(self):
        """One epoch from step 0 (or from a restored position); a finished epoch advances
        ``epoch``, so plain re-iteration walks through epochs; a loop left early replays."""
        epoch, start = self.epoch, self.position if self._resume else 0
        self._resume, self.position = False, start
        step = start
        for x, y in self._batches(epoch, start):
            step += 1
            self.position = step
            yield x, y
        self.epoch, self.position = epoch + 1, 0

    def _batches(self, epoch: int, start: int):  # pragma: no cover - abstract
        raise NotImplementedError
