"""Learnable synthetic CosmoFlow-like volumes: Gaussian random fields with known parameters.

Sample ``i`` of seed ``s`` is a function of ``(s, i)`` only (its own random stream), so any
number of ranks generates identical datasets. Four targets, uniform in [-1, 1], set the
field's power spectrum P(k) ∝ k^n exp(-(k/k_c)^2) and a log-normal transform:

- ``amplitude``    u0: standard deviation σ = 0.5 · 2^u0 of the Gaussian field δ
- ``slope``        u1: spectral index n = -2 + u1
- ``cutoff``       u2: k_c = 0.35 · 2^(0.75 u2) · k_Nyquist (smoothing scale)
- ``nonlinearity`` u3: g = 1 + 0.5 u3

Channel c (of C, like CosmoFlow's redshift slices) is the log-normal overdensity
exp(g D_c δ − (g D_c σ)²/2) − 1 with growth D_c = (c+1)/C, so amplitude and nonlinearity show
in how channels differ and slope/cutoff in spatial correlations: a 3D CNN can learn all four.
numpy only (used by the writer and the in-memory dataset).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

TARGETS = ("amplitude", "slope", "cutoff", "nonlinearity")


@lru_cache(maxsize=4)
def _wavenumbers(size: int) -> np.ndarray:
    """|k| (in fundamental modes) on the rfft grid of a size^3 cube; 1 at k = 0."""
    k1 = np.fft.fftfreq(size) * size
    kr = np.fft.rfftfreq(size) * size
    k2 = k1[:, None, None] ** 2 + k1[None, :, None] ** 2 + kr[None, None, :] ** 2
    k = np.sqrt(k2).astype(np.float32)
    k[0, 0, 0] = 1.0
    k.setflags(write=False)
    return k


def _spectrum_sqrt(size: int, slope: float, cutoff: float) -> np.ndarray:
    """sqrt(P(|k|)) on the rfft grid of a size^3 cube, normalised to unit field variance."""
    k = _wavenumbers(size)
    kc = cutoff * size / 2
    p = k ** slope * np.exp(-((k / kc) ** 2))
    p[0, 0, 0] = 0.0
    # Parseval on the rfft half-grid: weight 2 for the modes whose mirror is not stored.
    weight = np.full(p.shape[-1], 2.0, dtype=np.float32)
    weight[0] = 1.0
    if size % 2 == 0:
        weight[-1] = 1.0
    var = float((p * weight).sum()) / size**3
    return np.sqrt(p / var).astype(np.float32)


def cosmoflow_params(u: np.ndarray) -> dict:
    """Physical parameters from normalised targets u in [-1, 1]^4."""
    return {"sigma": 0.5 * 2.0 ** u[0], "slope": -2.0 + u[1],
            "cutoff": 0.35 * 2.0 ** (0.75 * u[2]), "nonlinearity": 1.0 + 0.5 * u[3]}


def cosmoflow_sample(seed: int, index: int, size: int, channels: int = 4):
    """(x (C, size, size, size) float32, y (4,) float32) of sample ``index``."""
    rng = np.random.default_rng([int(seed), int(index)])
    u = rng.uniform(-1.0, 1.0, size=len(TARGETS)).astype(np.float32)
    p = cosmoflow_params(u)
    noise = rng.standard_normal((size, size, size), dtype=np.float32)
    modes = np.fft.rfftn(noise) * _spectrum_sqrt(size, p["slope"], p["cutoff"])
    delta = np.fft.irfftn(modes, s=noise.shape, axes=(0, 1, 2)).astype(np.float32)
    delta *= np.float32(p["sigma"])
    x = np.empty((channels, size, size, size), dtype=np.float32)
    for c in range(channels):
        a = np.float32(p["nonlinearity"] * (c + 1) / channels)
        np.exp(a * delta - np.float32(0.5) * (a * np.float32(p["sigma"])) ** 2, out=x[c])
        x[c] -= 1.0
    return x, u


class CosmoflowSource:
    """Sample source for the shard writer: ``read(start, stop) -> (x, y)`` blocks."""

    def __init__(self, samples: int, size: int, channels: int = 4, seed: int = 0):
        self.samples, self.size, self.channels, self.seed = samples, size, channels, seed
        self.x_shape = (channels, size, size, size)
        self.y_shape = (len(TARGETS),)
        self.x_dtype = self.y_dtype = "float32"
        self.target_names = list(TARGETS)
        self.attrs = {"generator": "cosmoflow", "seed": seed, "size": size,
                      "channels": channels, "targets": list(TARGETS)}

    def __len__(self) -> int:
        return self.samples

    def read(self, start: int, stop: int):
        xs, ys = zip(*(cosmoflow_sample(self.seed, i, self.size, self.channels)
                       for i in range(start, stop)))
        return np.stack(xs), np.stack(ys)
