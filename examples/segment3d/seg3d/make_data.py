"""Write example volumes in the user's own layout: one HDF5 file with ``image`` (N, D, H, W)
float32 and ``label`` (N, D, H, W) uint8 (a random ball per sample, plus noise).

    python -m seg3d.make_data volumes.h5 --samples 8 --size 16
"""

from __future__ import annotations

import argparse

import h5py
import numpy as np


def make(path: str, samples: int = 8, size: int = 16, seed: int = 0) -> None:
    """Write ``samples`` volumes of ``size``^3 to ``path``."""
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.arange(size)] * 3, indexing="ij"), -1)
    label = np.empty((samples, size, size, size), np.uint8)
    for i in range(samples):
        centre = rng.uniform(size * 0.3, size * 0.7, 3)
        radius = rng.uniform(size * 0.15, size * 0.3)
        label[i] = np.linalg.norm(grid - centre, axis=-1) < radius
    image = (label + rng.normal(0.0, 0.5, label.shape)).astype(np.float32)
    with h5py.File(path, "w") as f:
        f.create_dataset("image", data=image, chunks=(1, size, size, size))
        f.create_dataset("label", data=label, chunks=(1, size, size, size))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    make(a.path, a.samples, a.size, a.seed)
