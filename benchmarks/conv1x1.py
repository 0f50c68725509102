"""1x1x1 convolutions as matrix products (``hpcpar.nn._conv_route.pointwise``) against torch's
fastest form of the same network, one rank, one thread, same run.

    python benchmarks/conv1x1.py [--size 48] [--batch 2] [--rounds 5]

The network is ResNet-style, written in plain torch: a stem, three bottleneck blocks (32->8
1x1x1, 8->8 3x3x3, 8->32 1x1x1, batch norms, residual adds) and a 1x1x1 head. Timed per
forward + backward step, alternating rounds, medians:

* torch in NCDHW and in channels-last (the plain model; torch's 1x1x1 kernel is the slow form
  in channels-last, so NCDHW is usually its fastest);
* hpcpar: the same model spatialized on a one-rank grid (no halo), in both memory formats.

The ratio line compares hpcpar's fastest form with torch's fastest form. One thread
(``OMP_NUM_THREADS=1``): both sides get the same core.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn


class Bottleneck(nn.Module):
    def __init__(self, ch: int = 32, mid: int = 8):
        super().__init__()
        self.reduce = nn.Sequential(nn.Conv3d(ch, mid, 1, bias=False), nn.BatchNorm3d(mid),
                                    nn.ReLU())
        self.conv = nn.Sequential(nn.Conv3d(mid, mid, 3, padding=1, bias=False),
                                  nn.BatchNorm3d(mid), nn.ReLU())
        self.expand = nn.Sequential(nn.Conv3d(mid, ch, 1, bias=False), nn.BatchNorm3d(ch))

    def forward(self, x):
        return torch.relu(x + self.expand(self.conv(self.reduce(x))))


class ResNetish(nn.Module):
    def __init__(self, ch: int = 32, classes: int = 4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(1, ch, 3, padding=1), nn.BatchNorm3d(ch), nn.ReLU())
        self.blocks = nn.Sequential(*(Bottleneck(ch) for _ in range(3)))
        self.head = nn.Conv3d(ch, classes, 1)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def step(model, x) -> float:
    t0 = time.perf_counter()
    model(x).square().mean().backward()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=48)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from hpcpar.nn import spatialize
    from hpcpar.testing.oracles import one_rank_grid

    grid = one_rank_grid()
    torch.manual_seed(0)
    x = torch.randn(args.batch, 1, args.size, args.size, args.size)
    forms = {}
    for fmt, name in ((torch.contiguous_format, "NCDHW"),
                      (torch.channels_last_3d, "channels-last")):
        plain = ResNetish().to(memory_format=fmt)
        xf = x.contiguous(memory_format=fmt)
        forms[f"torch {name}"] = (plain, xf)
        forms[f"hpcpar {name}"] = (spatialize(ResNetish().to(memory_format=fmt), grid), xf)
    for model, xf in forms.values():   # warm-up: kernels chosen, hpcpar's tags learned
        step(model, xf)
    times: dict[str, list[float]] = {k: [] for k in forms}
    names = list(forms)
    for r in range(args.rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            times[k].append(step(*forms[k]))
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"  {k:22s} step median {med[k] * 1e3:8.1f} ms  (min {min(v) * 1e3:.1f}, "
              f"max {max(v) * 1e3:.1f})")
    torch_best = min((k for k in med if k.startswith("torch")), key=med.__getitem__)
    ours_best = min((k for k in med if k.startswith("hpcpar")), key=med.__getitem__)
    print(f"torch's fastest form ({torch_best}) / hpcpar's ({ours_best}): "
          f"{med[torch_best] / med[ours_best]:.2f}x ({args.rounds} alternating rounds, "
          f"{args.size}^3, batch {args.batch}, 1 rank, 1 thread)")


if __name__ == "__main__":
    main()
