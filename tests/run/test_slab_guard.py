"""``hpcpar predict --max-slab`` tiles a volume into slabs along D; a model with an op that
reaches along D beyond the layers the margin counts would be silently wrong at the seams, so
its tiling is refused in one line naming the op and the model's line (hpcpar.run.slab_guard),
and a model of ordinary local layers still tiles, exactly."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpcpar.errors import ConfigError
from hpcpar.models import UNet3D
from hpcpar.run.slabs import Reach, model_reach, slab_plan


def tiled(model, x, reach, max_slab):
    """The slab-by-slab forward (each slab's central outputs), as predict computes it."""
    parts = []
    for s in slab_plan(x.shape[2], max_slab, reach):
        out = model(x[:, :, s.lo:s.hi])
        parts.append(out[:, :, s.start - s.lo:s.stop - s.lo])
    return torch.cat(parts, 2)


class Conv(nn.Module):
    def __init__(self, mode="zeros"):
        super().__init__()
        self.c = nn.Conv3d(1, 4, 3, padding=1, padding_mode=mode)


class GroupNormNet(Conv):
    def __init__(self):
        super().__init__()
        self.n = nn.GroupNorm(2, 4)

    def forward(self, x):
        return self.n(self.c(x))


class InstanceNormNet(Conv):
    def __init__(self):
        super().__init__()
        self.n = nn.InstanceNorm3d(4)

    def forward(self, x):
        return self.n(self.c(x))


class SqueezeExcite(Conv):
    def forward(self, x):
        h = self.c(x)
        return h * torch.sigmoid(h.mean(dim=(2, 3, 4), keepdim=True))


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 1, 3, 3, 3))

    def forward(self, x):
        return F.conv3d(x, self.w, padding=1)


class Circular(Conv):
    def __init__(self):
        super().__init__("circular")

    def forward(self, x):
        return self.c(x)


class SoftmaxOverD(Conv):
    def forward(self, x):
        return torch.softmax(self.c(x), dim=2)


class VoxelAttention(Conv):
    def forward(self, x):
        h = self.c(x)
        t = h.flatten(2).transpose(1, 2)
        return (torch.softmax(t @ t.transpose(1, 2), -1) @ t).transpose(1, 2).reshape(h.shape)


class Local(nn.Module):
    """Layers the margin counts and ops that keep D's voxels apart."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv3d(1, 4, 3, padding=1), nn.BatchNorm3d(4)
        self.drop, self.pool, self.up = nn.Dropout3d(0.3), nn.MaxPool3d(2), nn.Upsample(
            scale_factor=2, mode="trilinear")

    def forward(self, x):
        h = self.drop(F.relu(self.b(self.a(x))))
        h = torch.cat([h, self.up(self.pool(h))], 1) + 1
        return h.softmax(1)[:, :3] * 2


@pytest.mark.parametrize("net, op, seams", [
    (GroupNormNet, "group_norm", True), (InstanceNormNet, "instance_norm", True),
    (SqueezeExcite, "mean", True), (Circular, "pad", True), (SoftmaxOverD, "softmax", True),
    (VoxelAttention, "flatten", True),
    (Functional, "conv3d", False)])   # a window the margin cannot know, not a wrong one here
def test_an_op_reaching_along_d_refuses_tiling(net, op, seams):
    torch.manual_seed(0)
    model = net().double().eval()
    with pytest.raises(ConfigError, match=rf"^--max-slab: {op} at .*test_slab_guard\.py:\d+ "
                                          r".*drop --max-slab") as err:
        model_reach(model, 1, (6, 5))
    assert "\n" not in str(err.value)
    # what the refusal prevents: tiled with the convolution's margin, the output is wrong
    x = torch.randn(1, 1, 24, 6, 5, dtype=torch.float64)
    with torch.no_grad():
        wrong = not torch.allclose(tiled(model, x, Reach(4, 1), 8), model(x), atol=1e-6)
    assert wrong == seams


@pytest.mark.parametrize("net, size", [
    (Local, 38), (lambda: UNet3D(1, 2, base_filters=4, depth=2), 37)])
def test_local_layers_still_tile_exactly(net, size):
    torch.manual_seed(1)
    model = net().double().eval()
    reach = model_reach(model, 1, (8, 6))
    x = torch.randn(1, 1, size, 8, 6, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(tiled(model, x, reach, 8), model(x), rtol=0, atol=1e-12)
