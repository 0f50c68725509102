"""spatialize(): which layers are swapped, weights shared with the copy, data-only tags after
the gather / global pool, rank-consistent dropout, and errors naming the layer. Multi-rank
equality of whole models is in tests/models/test_cnn_models.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hpcpar.sync.tags import reduce_scope
from hpcpar.testing.oracles import one_rank_grid


@pytest.fixture(scope="module")
def grid():
    return one_rank_grid()


def test_cosmoflow_swaps_and_tags(grid):
    import hpcpar.nn
    from hpcpar.models import CosmoFlow
    from hpcpar.nn import SpatialConv3d, SpatialGather, SpatialMaxPool3d

    plain = CosmoFlow.small(input_size=16, n_conv_blocks=2, base_filters=2, dense=(8,))
    sp = hpcpar.nn.spatialize(plain, grid)
    assert isinstance(sp.features[0], SpatialConv3d)
    assert isinstance(sp.features[2], SpatialMaxPool3d)
    assert isinstance(sp.gather, SpatialGather)
    assert isinstance(plain.features[0], nn.Conv3d) and not hasattr(plain.features[0], "grid")
    assert sp.state_dict().keys() == plain.state_dict().keys()
    for name, p in sp.named_parameters():
        want = "data" if name.startswith("head.") else "spatial+data"
        assert reduce_scope(p) == want, name
        assert p is not dict(plain.named_parameters())[name]  # a copy, not the original
    x = torch.randn(2, 4, 16, 16, 16)
    assert torch.allclose(sp(x), plain(x), atol=1e-6)
    # the twin really uses the copy's Parameter objects (optimisers bound to them work)
    with torch.no_grad():
        sp.features[0].weight.zero_()
    assert sp.features[0].weight.abs().sum() == 0


def test_global_pool_route_and_dropout(grid):
    from hpcpar.nn import SpatialAdaptiveAvgPool3d, SpatialBatchNorm3d, spatialize
    from hpcpar.nn.gather import ReplicatedDropout

    model = nn.Sequential(
        nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4), nn.Dropout3d(0.2), nn.ReLU(),
        nn.Sequential(nn.AdaptiveAvgPool3d(1), nn.Flatten()),
        nn.Linear(4, 3), nn.Dropout(0.5), nn.Softmax(dim=1))
    sp = spatialize(model, grid, bn_include_data=True)
    assert isinstance(sp[1], SpatialBatchNorm3d) and sp[1].include_data
    assert isinstance(sp[2], ReplicatedDropout) and sp[2].feature
    assert isinstance(sp[4][0], SpatialAdaptiveAvgPool3d)
    assert isinstance(sp[6], ReplicatedDropout) and not sp[6].feature
    assert reduce_scope(sp[5].weight) == "data" and reduce_scope(sp[0].weight) == "spatial+data"
    model.eval()
    sp.eval()
    x = torch.randn(3, 2, 5, 6, 7)
    assert torch.allclose(sp(x), model(x), atol=1e-6)


def test_unet_all_layers_swap(grid):
    from hpcpar.models import UNet3D
    from hpcpar.nn import spatialize
    from hpcpar.nn._base import SpatialModule

    plain = UNet3D(in_channels=1, out_channels=2, base_filters=2, depth=2)
    sp = spatialize(plain, grid)
    kinds = (nn.Conv3d, nn.ConvTranspose3d, nn.MaxPool3d, nn.BatchNorm3d)
    for name, m in sp.named_modules():
        if isinstance(m, kinds) or type(m).__name__ == "MatchSize":
            assert isinstance(m, SpatialModule), name
    assert all(reduce_scope(p) == "spatial+data" for p in sp.parameters())
    x = torch.randn(2, 1, 9, 7, 5)
    assert torch.allclose(sp(x), plain(x), atol=1e-5)


class _Custom(nn.Module):
    """Custom forward calling its children in registration order."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(1, 2, 3)
        self.flat = nn.Flatten()

    def forward(self, x):
        return self.flat(self.conv(x))


class _OwnConv(nn.Conv3d):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize("model, name, why", [
    (nn.Sequential(nn.Conv3d(1, 2, 3), nn.Flatten(), nn.Linear(8, 1)), "'1' (Flatten)",
     "needs the whole volume"),
    (nn.Sequential(nn.ReLU(), _Custom()), "'1.flat' (Flatten)", "needs the whole volume"),
    (nn.Sequential(nn.Conv3d(1, 2, 3), nn.AdaptiveAvgPool3d(2)), "'1' (AdaptiveAvgPool3d)",
     "output size 2"),
    (nn.Sequential(nn.GroupNorm(1, 1)), "'0' (GroupNorm)", "needs the whole volume"),
    (nn.Sequential(_OwnConv(1, 1, 3)), "'0' (_OwnConv)", "its own forward"),
    (nn.Linear(3, 3), "'<model>' (Linear)", "needs the whole volume"),
])
def test_errors_name_the_layer_and_the_fix(grid, model, name, why):
    from hpcpar.errors import HpcparError
    from hpcpar.nn import spatialize

    with pytest.raises(HpcparError) as info:
        spatialize(model, grid)
    msg = str(info.value)
    assert name in msg and why in msg
    assert "GatherPoint" in msg and "AdaptiveAvgPool3d(1)" in msg and "\n" not in msg
