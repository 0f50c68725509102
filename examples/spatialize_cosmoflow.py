"""CosmoFlow split over the ranks' x, y, z axes, trained a few steps, checked against the
single-process model on the same data.

    mpiexec -n 4 python examples/spatialize_cosmoflow.py [--size 32] [--steps 3]

Every rank holds 1/N of each 4-channel cube; convolutions and pools exchange halos, the
small final tensor is gathered and the dense head runs replicated. The gradient sync here is
written out by hand (sum over the spatial group unless a parameter is tagged data-only);
hpcpar's DDP does the same in buckets, overlapped with the backward pass.
"""

from __future__ import annotations

import argparse

import torch
from mpi4py import MPI

import hpcpar
from hpcpar.models import CosmoFlow
from hpcpar.nn import spatialize
from hpcpar.parallel import spatial
from hpcpar.parallel.comm import allreduce_
from hpcpar.sync.tags import reduce_scope


def split3(n: int) -> tuple[int, int, int]:
    """Spread n ranks over (x, y, z) as evenly as possible (prime factors, largest first)."""
    dims, p, factors = [1, 1, 1], 2, []
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    for f in sorted(factors, reverse=True):
        dims[dims.index(min(dims))] *= f
    return tuple(dims)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=32, help="cube edge (default 32)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)

    grid = hpcpar.ProcessGrid(1, *split3(MPI.COMM_WORLD.Get_size()))
    torch.manual_seed(0)  # identical initial weights on every rank
    plain = CosmoFlow.small(input_size=args.size)
    model = spatialize(plain, grid)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    root = grid.spatial_comm.Get_rank() == 0
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.01) if root else None
    if root:
        print(f"grid {grid.spec()} (data x X x Y x Z), cube {args.size}^3 x 4, "
              f"local piece {spatial.local_shape((args.batch, 4, *[args.size] * 3), grid)}")

    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        cube = torch.randn(args.batch, 4, *[args.size] * 3, generator=g)
        target = torch.randn(args.batch, 4, generator=g)
        x = spatial.scatter(cube if root else None, grid)  # root's cube, split over the group
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        for p in model.parameters():  # gradient sync over the spatial group
            if reduce_scope(p) == "spatial+data":
                allreduce_(p.grad, grid.spatial_comm)
        opt.step()
        opt.zero_grad()
        if root:  # the single-process model on the whole cube, for comparison
            ref = torch.nn.functional.mse_loss(plain(cube), target)
            ref.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            print(f"step {step}: loss {loss.item():.6f}  single-process {ref.item():.6f}  "
                  f"|diff| {abs(loss.item() - ref.item()):.1e}")


if __name__ == "__main__":
    main()
