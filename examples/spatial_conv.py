"""Spatial parallelism in 40 lines: one sample's volume split over a 2x2 grid of ranks.

    mpiexec -n 4 python examples/spatial_conv.py

Each rank holds a quarter of a 1x4x33x30x16 volume, runs conv -> max-pool (ceil_mode) ->
transposed conv with halo exchanges, and checks its piece of the output and of the input
gradient against plain torch on the whole volume (same weights via state_dict).
"""

import torch
from torch import nn

from hpcpar import ProcessGrid
from hpcpar.nn import SpatialConv3d, SpatialConvTranspose3d, SpatialMaxPool3d
from hpcpar.parallel.comm import allreduce_
from hpcpar.parallel.partition import part_range

grid = ProcessGrid(data=1, x=2, y=2)             # 4 ranks: the volume is split on x and y


def mine(t):
    """This rank's block of a global (N, C, X, Y, Z) tensor (the partition rule)."""
    return t[(slice(None), slice(None), *(slice(*part_range(n, p, i)) for n, p, i in
              zip(t.shape[2:], grid.spatial_shape, grid.spatial_coords)))]


torch.manual_seed(0)                             # same weights and data on every rank
ref = nn.Sequential(nn.Conv3d(4, 8, 3, padding=1), nn.ReLU(),
                    nn.MaxPool3d(2, ceil_mode=True),
                    nn.ConvTranspose3d(8, 4, 3, stride=2, padding=1, output_padding=1))
model = nn.Sequential(SpatialConv3d(4, 8, 3, padding=1, grid=grid), nn.ReLU(),
                      SpatialMaxPool3d(2, ceil_mode=True, grid=grid),
                      SpatialConvTranspose3d(8, 4, 3, stride=2, padding=1, output_padding=1,
                                             grid=grid))
model.load_state_dict(ref.state_dict())          # same keys and shapes as the torch model

X = torch.randn(1, 4, 33, 30, 16, requires_grad=True)
Y = ref(X)
Y.square().sum().backward()

x = mine(X.detach()).clone().requires_grad_()    # this rank's sub-volume
y = model(x)                                     # halo exchanges happen inside
y.square().sum().backward()                      # local part of the same loss

w_grad = allreduce_(model[0].weight.grad.clone(), grid.spatial_comm)  # the gradient sync's job

def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


errors = [rel(y, mine(Y)), rel(x.grad, mine(X.grad)), rel(w_grad, ref[0].weight.grad)]
print(f"rank {grid.rank} coords {grid.spatial_coords}: local in {tuple(x.shape[2:])} "
      f"out {tuple(y.shape[2:])}; relative error: output {errors[0]:.1e}, input grad "
      f"{errors[1]:.1e}, weight grad {errors[2]:.1e}")
assert max(errors) < 1e-5
