"""Seeded synthetic graphs: power-law degrees, planted communities, learnable labels.

Degree-corrected stochastic block model, vectorised (200k vertices in about a second):
vertex ``v`` gets a community (uniformly at random, so vertex ids carry no locality and a
block partition cuts most edges while METIS finds the communities) and a Pareto propensity
``theta_v`` (power-law degrees with tail exponent ``exponent``). Each edge picks its source
with probability proportional to ``theta``; with probability ``p_in`` its destination is drawn
(again by ``theta``) inside the source's community, else from the whole graph.

Labels are ``community % classes``; features are a class centre times ``signal`` plus unit Gaussian
noise, so a feature-only model is weak and neighbourhood aggregation (which averages the noise away
inside communities) is what makes the labels learnable."""

from __future__ import annotations

import numpy as np

from hpcpar.errors import DataError
from hpcpar.graph._csr import edges_to_csr
from hpcpar.graph.stream_partition import available_memory

__all__ = ["power_law_community_graph"]


def _sample(cum: np.ndarray, u: np.ndarray) -> np.ndarray:
    return np.minimum(np.searchsorted(cum, u, side="right"), cum.shape[0] - 1)


#: peak bytes per edge of the generator: sampled endpoints, the undirected copy, and the CSR's
#: sort keys and their sorted copy (int64 each), measured with a margin
BYTES_PER_EDGE = 64


def generate_bytes(nodes: int, avg_degree: float, features: int, communities: int) -> int:
    """Upper bound of the generator's peak memory: the edges (both directions counted) and per
    vertex its features (twice: noise and result), community, degree propensity and masks."""
    return int(BYTES_PER_EDGE * nodes * avg_degree + nodes * (8 * features + 64)
               + 16 * communities)


def power_law_community_graph(nodes: int, avg_degree: float = 10.0, communities: int = 16,
                              features: int = 32, classes: int = 4, seed: int = 0,
                              directed: bool = False, p_in: float = 0.85,
                              exponent: float = 2.5, signal: float = 0.25,
                              split: tuple[float, float, float] = (0.1, 0.1, 0.2)) -> dict:
    """Generate a learnable synthetic graph (module docstring): ``indptr``, ``indices`` (in-edge
    CSR), ``x``, ``y``, ``masks`` and ``directed`` (what
    [write_graph][hpcpar.graph.format.write_graph] takes).

    ``avg_degree`` is the mean in-degree (undirected edges count both ways); ``p_in`` the
    probability that an edge stays inside its community; ``split`` the fractions of vertices in the
    train, validation and test masks. DataError: a parameter out of range (``nodes < 2``, more
    classes than communities, ...), or a graph larger than the available memory."""
    for name, v, least in (("nodes", nodes, 2), ("communities", communities, 1),
                        ("features", features, 1), ("classes", classes, 2)):
        if v < least:
            raise DataError(f"make graph: --{name} must be >= {least}, got {v}")
    if classes > communities:
        raise DataError(f"make graph: --classes {classes} exceeds --communities {communities}"
                        " (labels are community % classes)")
    if signal < 0:
        raise DataError(f"make graph: --signal must be >= 0, got {signal}")
    if not 0 < avg_degree < nodes:
        raise DataError(f"make graph: --avg-degree must be positive and below --nodes "
                        f"({nodes}: a vertex has at most {nodes - 1} neighbours), got "
                        f"{avg_degree}")
    if not 0 <= p_in <= 1:
        raise DataError(f"make graph: --p-in must be a fraction in [0, 1], got {p_in}")
    need = generate_bytes(nodes, avg_degree, features, communities)
    have = available_memory()
    if need > have:
        raise DataError(f"make graph: --nodes {nodes} --avg-degree {avg_degree:g} --features "
                        f"{features} needs about {need / 2**30:.1f} GiB of memory to generate, "
                        f"more than the {have / 2**30:.1f} GiB available; choose a smaller "
                        f"graph")
    rng = np.random.default_rng(seed)
    comm = rng.integers(0, communities, nodes)
    theta = rng.pareto(exponent - 1.0, nodes) + 1.0
    m = int(round(nodes * avg_degree / (1 if directed else 2)))

    cum = np.cumsum(theta)
    src = _sample(cum, np.sort(rng.random(m)) * cum[-1])  # sorted queries: cache-friendly
    dst = _sample(cum, rng.random(m) * cum[-1])
    # intra-community destinations: theta-weighted inside the source's community block
    order = np.argsort(comm, kind="stable")
    cum_c = np.cumsum(theta[order])
    end = np.cumsum(np.bincount(comm, minlength=communities))
    start = end - np.bincount(comm, minlength=communities)
    intra = np.flatnonzero(rng.random(m) < p_in)
    c = comm[src[intra]]
    lo = np.where(start[c] > 0, cum_c[np.maximum(start[c] - 1, 0)], 0.0)
    hi = cum_c[end[c] - 1]
    pos = np.searchsorted(cum_c, lo + rng.random(intra.shape[0]) * (hi - lo), side="right")
    dst[intra] = order[np.clip(pos, start[c], end[c] - 1)]

    keep = src != dst
    src, dst = src[keep], dst[keep]
    if not directed:
        src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
    indptr, indices = edges_to_csr(np.stack([src, dst]), nodes)

    y = (comm % classes).astype(np.int64)
    centres = rng.standard_normal((classes, features), dtype=np.float32)
    x = rng.standard_normal((nodes, features), dtype=np.float32)
    x += np.float32(signal) * centres[y]
    perm = rng.permutation(nodes)
    bounds = np.cumsum([0] + [int(round(f * nodes)) for f in split])
    masks = {}
    for name, a, b in zip(("train", "val", "test"), bounds[:-1], bounds[1:]):
        mask = np.zeros(nodes, bool)
        mask[perm[a:b]] = True
        masks[name] = mask
    return {"indptr": indptr, "indices": indices, "x": x, "y": y, "masks": masks,
            "directed": directed, "num_classes": classes}
