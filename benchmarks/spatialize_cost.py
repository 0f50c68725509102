"""What conversion by dataflow costs: ``spatialize`` of a 100-layer model, and the dispatch's
per-step cost beside the plain torch model on one rank (alternating rounds, medians).

    python benchmarks/spatialize_cost.py [--layers 100] [--size 24] [--rounds 7]

The step comparison runs the same model (a plain 3D conv net of ``--layers`` layers: convs,
norms, activations, pools) plain and spatialized on a one-rank grid, forward + backward, so
the difference is the dispatch alone (no halo: one rank). The job-level check against the
previous implementation is ``benchmarks/job_ab.py --a-rev <commit> -n 1`` (see the models
guide). One process, one thread (``OMP_NUM_THREADS=1``): the dispatch is Python work.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Deep(nn.Module):
    """``layers`` layers in ordinary style: conv / norm / activation triples, a pool every
    so often, functional calls in forward, a global-mean head."""

    def __init__(self, layers: int, ch: int = 8):
        super().__init__()
        self.inc = nn.Conv3d(1, ch, 3, padding=1)
        self.blocks = nn.ModuleList()
        for _ in range(max(1, -(-(layers - 2) // 3))):
            self.blocks.append(nn.ModuleList([nn.Conv3d(ch, ch, 3, padding=1),
                                              nn.GroupNorm(2, ch), nn.SiLU()]))
        self.head = nn.Linear(ch, 4)

    def forward(self, x):
        h = self.inc(x)
        for i, (conv, norm, act) in enumerate(self.blocks):
            h = h + act(norm(conv(h)))
            if i % 16 == 15 and min(h.shape[2:]) >= 4:
                h = F.max_pool3d(h, 2)
        return self.head(h.mean(dim=(2, 3, 4)))


def n_layers(model: nn.Module) -> int:
    return sum(1 for m in model.modules() if not list(m.children()))


def step(model, x) -> float:
    t0 = time.perf_counter()
    out = model(x)
    out.square().mean().backward()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=100)
    ap.add_argument("--size", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from hpcpar.nn import spatialize
    from hpcpar.testing.oracles import one_rank_grid

    grid = one_rank_grid()
    torch.manual_seed(0)
    plain = Deep(args.layers)
    t0 = time.perf_counter()
    sp = spatialize(plain, grid)
    convert = time.perf_counter() - t0
    # batch 2: torch itself then picks oneDNN, as hpcpar's conv does (at batch 1 hpcpar routes
    # to oneDNN where torch would not, which is a speedup, not the dispatch's cost)
    x = torch.randn(2, 1, args.size, args.size, args.size)
    t0 = time.perf_counter()
    step(sp, x)
    first = time.perf_counter() - t0
    print(f"model: {n_layers(plain)} layers; spatialize: {convert:.3f} s; first spatial step "
          f"(tags learned, twins built): {first:.3f} s")
    times = {"plain": [], "spatialized": []}
    for r in range(args.rounds):
        order = ("plain", "spatialized") if r % 2 == 0 else ("spatialized", "plain")
        for name in order:
            times[name].append(step(plain if name == "plain" else sp, x))
    med = {k: statistics.median(v) for k, v in times.items()}
    spread = {k: (min(v), max(v)) for k, v in times.items()}
    for k in med:
        print(f"  {k:12s} step median {med[k] * 1e3:8.2f} ms  (min {spread[k][0] * 1e3:.2f}, "
              f"max {spread[k][1] * 1e3:.2f})")
    print(f"spatialized / plain step: {med['spatialized'] / med['plain']:.3f}x "
          f"({args.rounds} alternating rounds, 1 rank, 1 thread, {args.size}^3)")


if __name__ == "__main__":
    main()
