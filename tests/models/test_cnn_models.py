"""CosmoFlow and UNet3D: plain shapes for any (odd) input size, and ``spatialize(model)`` on 4
and 8 ranks equal to the single-process model: output and every parameter gradient (summed
over the spatial group for default-tagged parameters, data-only ones compared directly)."""

from __future__ import annotations

import pytest
import torch

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import check_spatial_model, on_grids, randn


@mpi_case(nprocs=(8,), timeout=300)
def test_spatialized_models_match(comm):
    from hpcpar.models import CosmoFlow, UNet3D

    def cosmoflow(grid):
        torch.manual_seed(1)
        model = CosmoFlow.small(input_size=16, n_conv_blocks=2, base_filters=3,
                                dense=(16, 8)).double()
        x = randn((2 * grid.data, 4, 16, 16, 16), 11, torch.float64)
        check_spatial_model(grid, model, x, 12, f"CosmoFlow on {grid.spec()}",
                            replicated_output=True)

    def unet(grid):
        torch.manual_seed(2)
        model = UNet3D(in_channels=1, out_channels=2, base_filters=2, depth=2).double()
        x = randn((2 * grid.data, 1, 17, 13, 11), 21, torch.float64)
        check_spatial_model(grid, model, x, 22, f"UNet3D on {grid.spec()}")

    def unet_fp32(grid):
        torch.manual_seed(3)
        model = UNet3D(in_channels=2, out_channels=1, base_filters=2, depth=1,
                       batch_norm=False)
        x = randn((2 * grid.data, 2, 9, 8, 7), 31, torch.float32)
        check_spatial_model(grid, model, x, 32, f"UNet3D fp32 on {grid.spec()}")

    on_grids(comm, [(1, 2, 2, 1), (1, 2, 2, 2)], cosmoflow)
    on_grids(comm, [(1, 1, 2, 2), (2, 2, 2, 1)], unet)
    on_grids(comm, [(1, 4, 2, 1)], unet_fp32)


def test_plain_models_any_size():
    from hpcpar.models import CosmoFlow, UNet3D

    unet = UNet3D(in_channels=2, out_channels=3, base_filters=2, depth=2)
    for shape in [(17, 17, 17), (16, 13, 9), (4, 5, 31)]:
        assert unet(torch.randn(1, 2, *shape)).shape == (1, 3, *shape)
    flow = CosmoFlow.small()
    assert flow(torch.randn(2, 4, 32, 32, 32)).shape == (2, 4)
    with pytest.raises(ValueError, match="too small"):
        CosmoFlow(input_size=16, n_conv_blocks=5)
    # MLPerf-shaped default on 128^3 x 4
    default = CosmoFlow()
    assert default.head[1].in_features == 256 * 4 ** 3
