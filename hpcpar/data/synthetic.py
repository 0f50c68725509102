"""Learnable synthetic CosmoFlow-like volumes: Gaussian random fields with known parameters.

Sample ``i`` of seed ``s`` is a function of ``(s, i)`` only (its own random stream), so any
number of ranks generates identical datasets. Four targets, uniform in [-1, 1], set the
field's power spectrum P(k) ∝ k^n exp(-(k/k_c)^2) and a log-normal transform:

- ``amplitude``    u0: standard deviation σ = 0.5 · 2^u0 of the Gaussian field δ
- ``slope``        u1: spectral index n = -2 + u1
- ``cutoff``       u2: k_c = 0.35 · 2^(0.75 u2) · k_Nyquist (smoothing scale)
- ``nonlinearity`` u3: g = 1 + 0.5 u3

Channel c (of C, like CosmoFlow's redshift slices) is the log-normal overdensity
exp(g D_c δ − (g D_c σ)²/2) − 1 with growth D_c = (c+1)/C, so amplitude and nonlinearity show in
how channels differ and slope/cutoff in spatial correlations: a 3D CNN can learn all four. numpy
only (used by the writer and the in-memory dataset)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from hpcpar.errors import DataError

__all__ = ["TARGETS", "check_params", "cosmoflow_sample", "CosmoflowSource"]

TARGETS = ("amplitude", "slope", "cutoff", "nonlinearity")

#: Smallest volume edge: a 1^3 field has only its mean mode, which is zero, so the spectrum's
#: normalisation (unit variance) would divide by zero and every value would be NaN.
MIN_SIZE = 2


def check_params(size: int, channels: int, seed: int, samples: int | None = None) -> None:
    """Check the generator's options (``size`` >= ``MIN_SIZE``, ``channels`` and ``samples`` >=
    1, ``seed`` >= 0): DataError naming the option the generator cannot work with."""
    checks = [("--size", size, MIN_SIZE, "a 1-voxel field has no fluctuation modes"),
              ("--channels", channels, 1, None), ("--seed", seed, 0, "a numpy seed")]
    if samples is not None:
        checks.append(("--samples", samples, 1, None))
    for name, value, low, why in checks:
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
            because = f" ({why})" if why else ""
            raise DataError(f"{name}: must be an integer >= {low}{because}, got {value!r}")


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
    if not var > 0:  # size < MIN_SIZE: only the (zeroed) mean mode; would be 0/0 = NaN
        check_params(size, 1, 0)
    return np.sqrt(p / var).astype(np.float32)


def cosmoflow_params(u: np.ndarray) -> dict:
    """Physical parameters from the four targets ``u`` in ``[-1, 1]`` (module docstring);
    ``cutoff`` in units of the Nyquist wavenumber."""
    return {"sigma": 0.5 * 2.0 ** u[0], "slope": -2.0 + u[1],
            "cutoff": 0.35 * 2.0 ** (0.75 * u[2]), "nonlinearity": 1.0 + 0.5 * u[3]}


def cosmoflow_sample(seed: int, index: int, size: int,
                     channels: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """One synthetic CosmoFlow-like sample, a pure function of ``(seed, index)``.

    A Gaussian random field with power spectrum ``P(k) ∝ k^n exp(-(k/k_c)²)``; channel c is its
    log-normal overdensity with growth ``(c + 1) / C`` (see ``docs/guides/data.md``). Returns
    float32 ``x`` ``(channels, size, size, size)`` and ``y``, the four targets."""
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
    """Sample source for the shard writer: ``read(start, stop) -> (x, y)`` blocks (DataError
    for an option the generator cannot work with)."""

    def __init__(self, samples: int, size: int, channels: int = 4, seed: int = 0):
        check_params(size, channels, seed, samples)
        self.name = f"cosmoflow generator (size {size}, seed {seed})"
        self.samples, self.size, self.channels, self.seed = samples, size, channels, seed
        self.x_shape = (channels, size, size, size)
        self.y_shape = (len(TARGETS),)
        self.x_dtype = self.y_dtype = "float32"
        self.target_names = list(TARGETS)
        self.transform = "log1p"  # log-normal fields: readers apply log1p (as CosmoFlow does)
        self.attrs = {"generator": "cosmoflow", "seed": seed, "size": size,
                      "channels": channels, "targets": list(TARGETS)}

    def __len__(self) -> int:
        return self.samples

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Samples ``[start, stop)`` as stacked ``(x, y)`` arrays."""
        xs, ys = zip(*(cosmoflow_sample(self.seed, i, self.size, self.channels)
                       for i in range(start, stop)))
        return np.stack(xs), np.stack(ys)
