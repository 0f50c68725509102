"""A zoo of 3D models written the way other people write them (not hpcpar's own): both
registration orders, functional ops, every norm, residual and concatenating skips, gates,
global means, interpolation, padding modes, dropout, mean losses, classification heads.

Each entry: name -> (factory, input channels, global spatial size, loss, expected outcome).
``loss(out, target)`` is the user's plain loss; ``target`` is the whole target (the test
hands the spatial run this rank's piece where the output is split, as a data loader does).
Used by tests/nn/test_model_zoo.py and benchmarks/third_party_models.py (``MONAI``).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcpar.nn.custom_functions import local_function


def mse(out, target):
    return F.mse_loss(out, target)


def ce(out, target):
    return F.cross_entropy(out, target)


def bce(out, target):
    return F.binary_cross_entropy_with_logits(out, target)


def dice(out, target):
    p = torch.sigmoid(out)
    inter = (p * target).sum(dim=(2, 3, 4))
    den = p.sum(dim=(2, 3, 4)) + target.sum(dim=(2, 3, 4))
    return 1 - (2 * inter + 1) / (den + 1)


def dice_mean(out, target):
    return dice(out, target).mean()


class PoolFirstClassifier(nn.Module):
    """Registers the head before the convolutions (the registration-order trap)."""

    def __init__(self, c=2, k=3):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.fc = nn.Linear(8, k)
        self.conv2 = nn.Conv3d(6, 8, 3, padding=1)
        self.conv1 = nn.Conv3d(c, 6, 3, padding=1)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return self.fc(torch.flatten(self.pool(x), 1))


class FunctionalPools(nn.Module):
    def __init__(self, c=2):
        super().__init__()
        self.conv = nn.Conv3d(c, 4, 3, padding=1)
        self.out = nn.Conv3d(4, 2, 1)

    def forward(self, x):
        h = F.max_pool3d(F.leaky_relu(self.conv(x), 0.1), 3, stride=1, padding=1)
        h = F.avg_pool3d(h, 2, stride=2, ceil_mode=True, count_include_pad=False)
        return self.out(h)


class MeanHead(nn.Module):
    def __init__(self, c=2):
        super().__init__()
        self.body = nn.Sequential(nn.Conv3d(c, 6, 3, padding=1), nn.GELU(),
                                  nn.Conv3d(6, 6, 3, stride=2, padding=1), nn.SiLU())
        self.head = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.head(self.body(x).mean(dim=(2, 3, 4)))


class SqueezeExcite(nn.Module):
    def __init__(self, c=2, ch=8, r=2):
        super().__init__()
        self.conv = nn.Conv3d(c, ch, 3, padding=1)
        self.squeeze = nn.AdaptiveAvgPool3d(1)
        self.fc1 = nn.Linear(ch, ch // r)
        self.fc2 = nn.Linear(ch // r, ch)
        self.out = nn.Conv3d(ch, 1, 3, padding=1)

    def forward(self, x):
        h = F.relu(self.conv(x))
        b, c = h.shape[:2]
        s = self.squeeze(h).view(b, c)
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(s)))).view(b, c, 1, 1, 1)
        return self.out(h * s)


class ResBlock(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.conv1 = nn.Conv3d(ch, ch, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm3d(ch)
        self.conv2 = nn.Conv3d(ch, ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm3d(ch)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + x)


class ResNet(nn.Module):
    def __init__(self, c=2, k=3):
        super().__init__()
        self.stem = nn.Conv3d(c, 6, 3, stride=2, padding=1)
        self.layers = nn.Sequential(ResBlock(6), ResBlock(6))
        self.fc = nn.Linear(6, k)

    def forward(self, x):
        x = self.layers(F.relu(self.stem(x)))
        x = F.adaptive_avg_pool3d(x, 1)
        return self.fc(x.flatten(1))


def _block(cin, cout, norm):
    return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1), norm(cout), nn.LeakyReLU(0.01),
                         nn.Conv3d(cout, cout, 3, padding=1), norm(cout), nn.LeakyReLU(0.01))


class UNetInstance(nn.Module):
    """nnU-Net style: instance norm, strided-conv down, transposed-conv up, cat skip."""

    def __init__(self, c=1, k=2):
        super().__init__()

        def norm(ch):
            return nn.InstanceNorm3d(ch, affine=True)

        self.enc1 = _block(c, 4, norm)
        self.down = nn.Conv3d(4, 8, 3, stride=2, padding=1)
        self.enc2 = _block(8, 8, norm)
        self.up = nn.ConvTranspose3d(8, 4, 2, stride=2)
        self.dec = _block(8, 4, norm)
        self.head = nn.Conv3d(4, k, 1)

    def forward(self, x):
        s = self.enc1(x)
        h = self.enc2(self.down(s))
        h = torch.cat([self.up(h), s], dim=1)
        return self.head(self.dec(h))


class UNetGroupTrilinear(nn.Module):
    """GroupNorm, max-pool down, trilinear upsampling to the skip's size, cat skip."""

    def __init__(self, c=1, k=2):
        super().__init__()

        def norm(ch):
            return nn.GroupNorm(2, ch)

        self.enc1 = _block(c, 4, norm)
        self.enc2 = _block(4, 8, norm)
        self.dec = _block(12, 4, norm)
        self.head = nn.Conv3d(4, k, 1)

    def forward(self, x):
        s = self.enc1(x)
        h = self.enc2(F.max_pool3d(s, 2))
        h = F.interpolate(h, size=s.shape[2:], mode="trilinear", align_corners=False)
        return self.head(self.dec(torch.cat((h, s), 1)))


class UNetNearestAlign(nn.Module):
    """nn.Upsample (nearest) and align_corners=True trilinear, residual add skip."""

    def __init__(self, c=1, k=1):
        super().__init__()
        self.inc = nn.Conv3d(c, 4, 3, padding=1)
        self.down = nn.MaxPool3d(2)
        self.mid = nn.Conv3d(4, 4, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.out = nn.Conv3d(4, k, 3, padding=1)

    def forward(self, x):
        s = F.relu(self.inc(x))
        h = self.up(F.relu(self.mid(self.down(s))))
        g = F.interpolate(s, scale_factor=0.5, mode="trilinear", align_corners=True)
        g = F.interpolate(g, size=s.shape[-3:], mode="trilinear", align_corners=True)
        return self.out(h + s + g)


class LayerNormVolume(nn.Module):
    """LayerNorm over (C, D, H, W) of a fixed-size input."""

    def __init__(self, c=2, size=(8, 9, 7)):
        super().__init__()
        self.conv = nn.Conv3d(c, 3, 3, padding=1)
        self.ln = nn.LayerNorm([3, *size])
        self.out = nn.Conv3d(3, 1, 1)

    def forward(self, x):
        return self.out(F.gelu(self.ln(self.conv(x))))


class DenseNet(nn.Module):
    def __init__(self, c=2, growth=3, k=3):
        super().__init__()
        self.layers = nn.ModuleList()
        ch = c
        for _ in range(3):
            self.layers.append(nn.Sequential(nn.BatchNorm3d(ch), nn.ReLU(inplace=True),
                                             nn.Conv3d(ch, growth, 3, padding=1)))
            ch += growth
        self.classifier = nn.Linear(ch, k)

    def forward(self, x):
        feats = [x]
        for layer in self.layers:
            feats.append(layer(torch.cat(feats, 1)))
        h = torch.cat(feats, 1)
        return self.classifier(F.adaptive_avg_pool3d(F.relu(h), (1, 1, 1)).view(h.size(0), -1))


class VNet(nn.Module):
    """V-Net style: PReLU, 5^3 convs, residual adds, stride-2 down and transposed up."""

    def __init__(self, c=1, k=2):
        super().__init__()
        self.inc = nn.Conv3d(c, 4, 5, padding=2)
        self.act = nn.PReLU(4)
        self.down = nn.Conv3d(4, 8, 2, stride=2)
        self.mid = nn.Sequential(nn.Conv3d(8, 8, 5, padding=2), nn.PReLU(8))
        self.up = nn.ConvTranspose3d(8, 4, 2, stride=2)
        self.out = nn.Conv3d(8, k, 1)

    def forward(self, x):
        s = self.act(self.inc(x) + x.repeat(1, 4, 1, 1, 1))
        d = self.down(s)
        h = self.mid(d) + d
        return self.out(torch.cat([self.up(h), s], 1))


class PadModes(nn.Module):
    def __init__(self, c=2):
        super().__init__()
        self.c1 = nn.Conv3d(c, 3, 3)
        self.c2 = nn.Conv3d(3, 3, 3)
        self.c3 = nn.Conv3d(3, 3, 3, padding=1, padding_mode="circular")
        self.c4 = nn.Conv3d(3, 1, 3, padding=1, padding_mode="reflect")

    def forward(self, x):
        h = self.c1(F.pad(x, (1, 1, 1, 1, 1, 1), mode="replicate"))
        h = self.c2(F.pad(torch.tanh(h), (2, 0, 1, 1, 0, 2), mode="constant", value=0.5))
        return self.c4(self.c3(h))


class ConvNeXtBlock(nn.Module):
    """Depthwise 7^3 conv, channels-last LayerNorm and MLP, layer scale, residual."""

    def __init__(self, c=2, dim=4):
        super().__init__()
        self.stem = nn.Conv3d(c, dim, 1)
        self.dw = nn.Conv3d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pw1 = nn.Linear(dim, 4 * dim)
        self.pw2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x):
        x = self.stem(x)
        h = self.dw(x).permute(0, 2, 3, 4, 1)
        h = self.gamma * self.pw2(F.gelu(self.pw1(self.norm(h))))
        return x + h.permute(0, 4, 1, 2, 3)


class AttentionGate(nn.Module):
    def __init__(self, c=2):
        super().__init__()
        self.feat = nn.Conv3d(c, 4, 3, padding=2, dilation=2)
        self.gate = nn.Conv3d(4, 1, 1)
        self.out = nn.Conv3d(4, 3, 3, padding=1)

    def forward(self, x):
        h = F.elu(self.feat(x))
        a = torch.sigmoid(self.gate(h))
        return torch.log_softmax(self.out(h * a), dim=1)


class GlobalStats(nn.Module):
    """Normalises by global statistics written by hand (mean, std, amax) and keeps going."""

    def __init__(self, c=2):
        super().__init__()
        self.conv = nn.Conv3d(c, 3, 3, padding=1)
        self.out = nn.Conv3d(3, 1, 1)

    def forward(self, x):
        h = self.conv(x)
        m = h.mean(dim=(2, 3, 4), keepdim=True)
        s = h.std(dim=(2, 3, 4), keepdim=True)
        h = (h - m) / (s + 1e-5)
        return self.out(h / h.abs().amax(dim=(1, 2, 3, 4), keepdim=True))


class CosmoFlowLike(nn.Module):
    def __init__(self, c=2):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv3d(c, 4, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2),
            nn.Conv3d(4, 8, 3, padding=1), nn.LeakyReLU(0.3), nn.AdaptiveAvgPool3d(1))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8, 8), nn.LeakyReLU(0.3),
                                  nn.Linear(8, 4), nn.Tanh())

    def forward(self, x):
        return self.head(self.features(x))


class InstanceNoAffine(nn.Module):
    """InstanceNorm without affine but with running statistics, and BatchNorm at the end."""

    def __init__(self, c=2):
        super().__init__()
        self.conv = nn.Conv3d(c, 4, 3, padding=1)
        self.inorm = nn.InstanceNorm3d(4, track_running_stats=True)
        self.bn = nn.BatchNorm3d(4)
        self.out = nn.Conv3d(4, 2, 1)

    def forward(self, x):
        return self.out(self.bn(F.relu(self.inorm(self.conv(x)))))


class ChannelPad(nn.Module):
    """Channel padding (a ResNet shortcut) and channel slicing."""

    def __init__(self, c=2):
        super().__init__()
        self.conv = nn.Conv3d(c, 4, 3, stride=2, padding=1)

    def forward(self, x):
        short = F.pad(F.avg_pool3d(x, 2, ceil_mode=True), (0, 0, 0, 0, 0, 0, 1, 1))
        h = self.conv(x) + short
        return h[:, :3] * h[:, 3:]


class UNetValidCrop(nn.Module):
    """The original U-Net: unpadded convs, and the skip centre-cropped by slicing with
    sizes read from ``.shape``."""

    def __init__(self, c=1, k=2):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv3d(c, 4, 3), nn.ReLU(), nn.Conv3d(4, 4, 3), nn.ReLU())
        self.mid = nn.Sequential(nn.Conv3d(4, 8, 3), nn.ReLU())
        self.up = nn.ConvTranspose3d(8, 4, 2, stride=2)
        self.out = nn.Conv3d(8, k, 1)

    def forward(self, x):
        s = self.enc(x)
        h = self.up(self.mid(F.max_pool3d(s, 2)))
        d, hh, w = (a - b for a, b in zip(s.shape[2:], h.shape[2:]))
        s = s[:, :, d // 2:d // 2 + h.shape[2], hh // 2:hh // 2 + h.shape[3],
              w // 2:w // 2 + h.shape[4]]
        return self.out(torch.cat([s, h], dim=1))


class AdaptiveGrid(nn.Module):
    """Adaptive pools to sizes other than 1 (a coarse grid of cells), kept split."""

    def __init__(self, c=2):
        super().__init__()
        self.conv = nn.Conv3d(c, 3, 3, padding=1)
        self.out = nn.Conv3d(3, 1, 1)

    def forward(self, x):
        h = F.relu(self.conv(x))
        return self.out(F.adaptive_avg_pool3d(h, (4, 3, None)) +
                        F.adaptive_max_pool3d(h, (4, 3, None)))


class FlattenHead(nn.Module):
    """A dense layer on the flattened split volume with no global reduction: the split head
    (each rank multiplies its voxels' weight columns; hpcpar.nn.split_head)."""

    def __init__(self, c=2, size=(8, 9, 7)):
        super().__init__()
        self.conv = nn.Conv3d(c, 2, 3, padding=1)
        self.fc = nn.Linear(2 * size[0] * size[1] * size[2], 3)

    def forward(self, x):
        return self.fc(torch.flatten(F.relu(self.conv(x)), 1))


class Rolled(nn.Module):
    """torch.roll along a spatial dim: mixes voxels across ranks; refused."""

    def __init__(self, c=2):
        super().__init__()
        self.conv = nn.Conv3d(c, 1, 3, padding=1)

    def forward(self, x):
        return self.conv(torch.roll(x, 1, dims=2))


class ViewMerge(nn.Module):
    """Squeeze-excitation written with view(b, c, -1).mean(-1): the split dims merged into one
    (hpcpar.nn.tokens); refused before."""

    def __init__(self, c=2):
        super().__init__()
        self.conv = nn.Conv3d(c, 4, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)
        b, c = h.shape[:2]
        return h * h.view(b, c, -1).mean(-1).view(b, c, 1, 1, 1)


class SoftArgmax(nn.Module):
    """Landmark heat maps read out by a spatial soft-argmax: softmax over the flattened
    voxels, the expected coordinate along each axis, and the heat map viewed back as a
    volume for a second term."""

    def __init__(self, c=2):
        super().__init__()
        self.conv = nn.Conv3d(c, 4, 3, padding=1)
        self.heat = nn.Conv3d(4, 3, 1)

    def forward(self, x):
        t = self.heat(F.relu(self.conv(x))).flatten(2)    # (N, K, D*H*W)
        d, h, w = x.shape[2:]
        p = F.softmax(t * 4.0, dim=-1)
        axes = torch.meshgrid(torch.linspace(-1, 1, d, dtype=x.dtype),
                              torch.linspace(-1, 1, h, dtype=x.dtype),
                              torch.linspace(-1, 1, w, dtype=x.dtype), indexing="ij")
        coords = torch.stack([(p * a.reshape(1, 1, -1)).sum(-1) for a in axes], -1)
        sharp = p.view(*p.shape[:2], d, h, w).amax(dim=(2, 3, 4))
        return torch.cat([coords.flatten(1), sharp, t.logsumexp(-1)], 1)


class TokenAttention(nn.Module):
    """A non-local block: attention among all voxels (tokens-first, then a product of the
    tokens with themselves) needs every voxel of every rank: refused in one line."""

    def __init__(self, c=2):
        super().__init__()
        self.conv = nn.Conv3d(c, 4, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)
        q = h.flatten(2).transpose(1, 2)                  # (N, L, C)
        attn = torch.softmax(q @ q.transpose(1, 2), -1)   # (N, L, L)
        return (attn @ q).transpose(1, 2).reshape(h.shape) + h


class DropoutNet(nn.Module):
    def __init__(self, c=2):
        super().__init__()
        self.conv = nn.Conv3d(c, 4, 3, padding=1)
        self.drop3 = nn.Dropout3d(0.3)
        self.drop = nn.Dropout(0.4)
        self.out = nn.Conv3d(4, 1, 3, padding=1)
        self.fc = nn.Linear(4, 2)
        self.hdrop = nn.Dropout(0.5)

    def forward(self, x):
        h = self.drop(self.drop3(F.relu(self.conv(x))))
        g = self.fc(self.hdrop(h.mean(dim=(2, 3, 4))))
        return self.out(h) * g[:, :1, None, None, None]


class PlainFCN(nn.Module):
    """No norms: 3^3 convs with activations in a row (functional and module forms), PReLU,
    a residual add, a "same" 5^3 conv feeding a 1x1x1 head (what fused halos can run)."""

    def __init__(self, c=2):
        super().__init__()
        self.conv1 = nn.Conv3d(c, 6, 3, padding=1)
        self.conv2 = nn.Conv3d(6, 6, 3, padding=1)
        self.act = nn.GELU()
        self.prelu = nn.PReLU(6)
        self.conv3 = nn.Conv3d(6, 6, 5, padding="same")
        self.conv4 = nn.Conv3d(6, 6, 3, padding=1)
        self.head = nn.Conv3d(6, 3, 1)

    def forward(self, x):
        h = F.relu(self.conv1(x))
        h = h + self.act(self.conv2(h))
        h = self.prelu(self.conv4(F.leaky_relu(self.conv3(h), 0.2)))
        return self.head(torch.tanh(h) * 2.0)


class PoolByKernel(nn.Module):
    """Global average pooling written as a pool whose window is the whole volume (Keras and
    older torch code); a rank holding none of its one output voxel crashed in backward while
    the others waited."""

    def __init__(self, c=2):
        super().__init__()
        self.conv = nn.Conv3d(c, 3, 3, padding=1)
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        h = F.relu(self.conv(x))
        p = F.avg_pool3d(h, kernel_size=h.shape[2:])
        return self.fc(p.view(p.size(0), -1))


class NormThenInplace(nn.Module):
    """Norms followed by in-place ops, as MONAI's SegResNet (GroupNorm, ReLU(inplace=True),
    ``x += identity``) and DynUNet (InstanceNorm, LeakyReLU(inplace=True)) write them: a
    norm's output that autograd saw as a view made inside the norm could not be changed in
    place (a crash on every split grid)."""

    def __init__(self, c=2):
        super().__init__()
        self.conv0 = nn.Conv3d(c, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.act = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv3d(4, 4, 3, padding=1)
        self.inorm = nn.InstanceNorm3d(4, affine=True)
        self.lrelu = nn.LeakyReLU(0.01, inplace=True)
        self.conv2 = nn.Conv3d(4, 4, 3, padding=1)
        self.gn2 = nn.GroupNorm(1, 4)
        self.head = nn.Conv3d(4, 2, 1)

    def forward(self, x):
        x = self.conv0(x)
        identity = x
        h = self.act(self.gn(x))
        h = self.lrelu(self.inorm(self.conv1(h)))
        h = self.gn2(self.conv2(h))
        h += identity
        return self.head(h)


class DeepSupervision(nn.Module):
    """DynUNet-style deep supervision: the main head and an upsampled coarse head stacked on a
    new dim 1, (N, heads, C, D, H, W)."""

    def __init__(self, c=2):
        super().__init__()
        self.enc = nn.Conv3d(c, 4, 3, padding=1)
        self.down = nn.Conv3d(4, 4, 3, stride=2, padding=1)
        self.main = nn.Conv3d(4, 2, 1)
        self.aux = nn.Conv3d(4, 2, 1)

    def forward(self, x):
        h = F.relu(self.enc(x))
        aux = F.interpolate(self.aux(F.relu(self.down(h))), size=h.shape[2:], mode="nearest")
        return torch.stack([self.main(h), aux], dim=1)


_PRIOR = torch.linspace(-1, 1, 9 * 8 * 10, dtype=torch.float64).reshape(9, 8, 10)


def deep_supervision_loss(out, target):
    """Each head against the target, then two broadcasting terms torch allows: a head against
    a stack of targets, (K, N, C, D, H, W) (several annotators' labels), and against a
    replicated (D, H, W) prior. The first gave a mean of the wrong denominator (0.8 off);
    the second was refused or crashed."""
    heads = torch.unbind(out, dim=1)
    loss = F.mse_loss(heads[0], target[:, 0]) + 0.5 * F.mse_loss(heads[1], target[:, 0])
    with warnings.catch_warnings():  # torch warns of the broadcast, and computes it
        warnings.simplefilter("ignore", UserWarning)
        loss = loss + 0.1 * F.mse_loss(heads[0], target.transpose(0, 1))
        prior = F.l1_loss(heads[1], _PRIOR.to(out.dtype), reduction="sum")
    return loss + 0.1 * prior / out.numel()


class ShrinksToOneVoxel(nn.Module):
    """A classifier whose strided convolutions shrink a small volume to one voxel, shorter
    than the ranks on a split axis (MONAI's ResNet, SENet, EfficientNet at 16-32 cubed):
    the volume is gathered whole where it gets too short, and the rest runs replicated."""

    def __init__(self, c=2):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv3d(c if i == 0 else 4, 4, 3, stride=2, padding=1)
                                   for i in range(4))
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        for conv in self.convs:
            x = F.relu(conv(x))
        return self.fc(F.adaptive_avg_pool3d(x, 1).flatten(1))


class VideoHead(nn.Module):
    """pytorchvideo's way (X3D, ResNet, R(2+1)D heads): squeeze-excitation from a mean over
    a list of dims into convolutions with zero bias (their means of a batch-normed volume are
    rounding only: spatialize's check once refused the model there); an average pool whose
    kernel is the whole remaining volume (one voxel, fewer than the ranks: gathered); batch
    norm on that replicated voxel (with ``bn_include_data``, the global batch's statistics);
    a Linear applied channels-last between two permutes; an adaptive pool."""

    def __init__(self, c=2):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(c, 6, 3, padding=1), nn.BatchNorm3d(6))
        self.se = nn.Sequential(nn.Conv3d(6, 3, 1), nn.ReLU(), nn.Conv3d(3, 6, 1), nn.Sigmoid())
        for conv in self.se[::2]:
            nn.init.zeros_(conv.bias)
        self.down = nn.Conv3d(6, 8, 3, stride=2, padding=1)
        self.norm = nn.BatchNorm3d(8)
        self.proj = nn.Linear(8, 3)

    def forward(self, x):
        x = self.stem(x)
        x = x * self.se(x.mean(dim=[2, 3, 4], keepdim=True))
        x = F.relu(self.down(x))
        x = F.avg_pool3d(x, kernel_size=x.shape[2:])
        x = self.proj(self.norm(x).permute(0, 2, 3, 4, 1)).permute(0, 4, 1, 2, 3)
        return F.adaptive_avg_pool3d(x, 1).flatten(1)


class ResponseNormCritic(nn.Module):
    """MedNeXt's global response norm (``torch.norm(x, p=2, dim=(-3, -2, -1), keepdim=True)``,
    divided by its mean over channels) and other vector norms over the spatial dims (order 1
    by ``torch.linalg.vector_norm``, order inf by the method), then a WGAN critic's score:
    ``flatten(1)`` and ``mean(1)`` (MONAI's ``Critic``). All were refused."""

    def __init__(self, c=2):
        super().__init__()
        self.conv = nn.Conv3d(c, 4, 3, padding=1)
        self.gamma = nn.Parameter(torch.full((1, 4, 1, 1, 1), 0.5))
        self.beta = nn.Parameter(torch.full((1, 4, 1, 1, 1), 0.1))
        self.out = nn.Conv3d(4, 3, 3, padding=1)

    def forward(self, x):
        x = F.gelu(self.conv(x))
        gx = torch.norm(x, p=2, dim=(-3, -2, -1), keepdim=True)
        nx = gx / (gx.mean(dim=1, keepdim=True) + 1e-6)
        x = self.out(self.gamma * (x * nx) + self.beta + x)
        spread = torch.linalg.vector_norm(x, ord=1, dim=(2, 3, 4)) / x[0, 0].numel()
        peak = x.norm(float("inf"), dim=(2, 3, 4))
        return nn.Flatten()(x).mean(1, keepdim=True) + 0.1 * (spread + peak)


class ComposedReductions(nn.Module):
    """A hand-written instance norm with ``torch.var_mean``, a scale taken channels-last
    (``permute(0, 2, 3, 4, 1)``, then a maximum over the spatial dims), a branch on
    ``torch.all`` and a ``count_nonzero`` fraction, log-sum-exp pooling (weakly supervised
    segmentation) and a NaN-masked mean (``nanmean``, ``nansum``)."""

    def __init__(self, c=2, k=3):
        super().__init__()
        self.conv = nn.Conv3d(c, 4, 3, padding=1)
        self.fc = nn.Linear(4, k)

    def forward(self, x):
        h = self.conv(x)
        var, mean = torch.var_mean(h, dim=(2, 3, 4), keepdim=True, correction=0)
        h = F.relu((h - mean) / torch.sqrt(var + 1e-5))
        last = h.permute(0, 2, 3, 4, 1)
        h = (last / (1 + last.amax(dim=(1, 2, 3), keepdim=True))).permute(0, 4, 1, 2, 3)
        if torch.all(h < 1e6):   # a branch on a global check: every rank takes the same one
            share = torch.count_nonzero(h > 0.5, dim=(1, 2, 3, 4)).to(h.dtype) / h[0].numel()
            h = h * (1 + share.view(-1, 1, 1, 1, 1))   # per sample: replicas hold their own
        h = h - 0.5 * h.mean(dim=(1, 2, 3, 4), keepdim=True).expand_as(h)   # plain, as split
        pooled = torch.logsumexp(2.0 * h, dim=(2, 3, 4)) / 2.0          # (N, 4)
        masked = torch.where(h > 1.5, torch.nan, h)
        shift = masked.nanmean(dim=(2, 3, 4)) + 0.01 * masked.nansum(dim=(2, 3, 4))
        return self.fc(pooled - shift)


class VAELatent(nn.Module):
    """A variational bottleneck: the latent is sampled with ``torch.randn_like`` on a
    replicated tensor (MONAI's VarAutoEncoder, SegResNetVAE). check=True's probe drew other
    random numbers than the plain model it compares with and refused it (0.59 off). Not in
    ZOO: with data replicas each draws for its own samples (as under torch's DDP), which a
    one-process reference on the whole batch cannot match; its test runs spatial grids."""

    def __init__(self, c=2, z=3):
        super().__init__()
        self.enc = nn.Conv3d(c, 4, 3, padding=1)
        self.mu, self.logvar = nn.Linear(4, z), nn.Linear(4, z)
        self.dec = nn.Linear(z, 4)
        self.head = nn.Conv3d(4, 2, 1)

    def forward(self, x):
        h = F.relu(self.enc(x))
        pooled = h.mean(dim=(2, 3, 4))
        mu, logvar = self.mu(pooled), self.logvar(pooled)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        return self.head(h + self.dec(z)[:, :, None, None, None])


class LatentVolumeNoise(nn.Module):
    """A variational bottleneck over a latent VOLUME (MONAI's AutoencoderKL, diffusion
    models' noising): ``torch.randn_like`` of a split tensor and ``normal_`` of a fresh one,
    refused before; hpcpar draws numbers that do not depend on the split, on data grids too
    (the reference is hpcpar's one-rank run, as for dropout)."""

    def __init__(self, c=2):
        super().__init__()
        self.enc = nn.Conv3d(c, 4, 3, padding=1)
        self.mu, self.logvar = nn.Conv3d(4, 3, 1), nn.Conv3d(4, 3, 1)
        self.dec = nn.Conv3d(3, 2, 3, padding=1)

    def forward(self, x):
        h = F.silu(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h).clamp(-5, 5)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        jitter = torch.empty_like(z).normal_(0.0, 0.01)
        return self.dec(z + jitter)


class SharedDecoder(nn.Module):
    """MONAI SegResNetVAE's pattern: one decoder block runs on the split volume and on a small
    replicated volume decoded from a dense latent, so its parameters get partial gradients
    (split uses) and complete ones (replicated uses) in one step. Refused before."""

    def __init__(self, c=2):
        super().__init__()
        self.enc = nn.Conv3d(c, 4, 3, padding=1)
        self.fc = nn.Linear(4, 4 * 8)
        self.block = nn.Sequential(nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv3d(4, 4, 3, padding=1))
        self.head = nn.Conv3d(4, 2, 1)

    def forward(self, x):
        h = self.enc(x)
        seg = self.head(self.block(h))
        z = self.fc(h.mean(dim=(2, 3, 4))).view(-1, 4, 2, 2, 2)
        rec = self.block(z)   # the same block on a replicated volume
        return seg + rec.mean(dim=(1, 2, 3, 4))[:, None, None, None, None]


# name -> (factory, channels, size, loss, target kind, expected)
#   target kind: "like" (same shape as the output), "class" (class indices per voxel or per
#   sample), "binary" (0/1 like the output)
ZOO = {
    "pool_first_classifier": (PoolFirstClassifier, 2, (7, 9, 5), ce, "class", "exact"),
    "functional_pools": (FunctionalPools, 2, (9, 7, 6), mse, "like", "exact"),
    "mean_head": (MeanHead, 2, (8, 9, 7), mse, "like", "exact"),
    "squeeze_excite": (SqueezeExcite, 2, (7, 6, 9), mse, "like", "exact"),
    "resnet": (ResNet, 2, (9, 8, 7), ce, "class", "exact"),
    "unet_instance": (UNetInstance, 1, (8, 10, 6), ce, "class", "exact"),
    "unet_group_trilinear": (UNetGroupTrilinear, 1, (9, 7, 8), ce, "class", "exact"),
    "unet_nearest_align": (UNetNearestAlign, 1, (8, 10, 6), dice_mean, "binary", "exact"),
    "layernorm_volume": (LayerNormVolume, 2, (8, 9, 7), mse, "like", "exact"),
    "densenet": (DenseNet, 2, (7, 8, 9), ce, "class", "exact"),
    "vnet": (VNet, 1, (8, 6, 10), ce, "class", "exact"),
    "pad_modes": (PadModes, 2, (9, 8, 7), mse, "like", "exact"),
    "convnext_block": (ConvNeXtBlock, 2, (9, 8, 10), mse, "like", "exact"),
    "attention_gate": (AttentionGate, 2, (8, 7, 9), mse, "like", "exact"),
    "global_stats": (GlobalStats, 2, (9, 7, 8), mse, "like", "exact"),
    "cosmoflow_like": (CosmoFlowLike, 2, (8, 10, 6), mse, "like", "exact"),
    "instance_no_affine": (InstanceNoAffine, 2, (7, 8, 9), bce, "binary", "exact"),
    "channel_pad": (ChannelPad, 2, (9, 7, 8), mse, "like", "exact"),
    "unet_valid_crop": (UNetValidCrop, 1, (16, 14, 15), ce, "class", "exact"),
    "adaptive_grid": (AdaptiveGrid, 2, (9, 8, 7), mse, "like", "exact"),
    "flatten_head": (FlattenHead, 2, (8, 9, 7), ce, "class", "exact"),
    "rolled": (Rolled, 2, (8, 9, 7), mse, "like", "refused"),
    "view_merge": (ViewMerge, 2, (8, 9, 7), mse, "like", "exact"),
    "soft_argmax": (SoftArgmax, 2, (9, 7, 8), mse, "like", "exact"),
    "token_attention": (TokenAttention, 2, (6, 5, 7), mse, "like", "refused"),
    "dropout_net": (DropoutNet, 2, (8, 9, 7), mse, "like", "exact"),
    "plain_fcn": (PlainFCN, 2, (12, 9, 10), mse, "like", "exact"),
    "pool_by_kernel": (PoolByKernel, 2, (9, 7, 8), ce, "class", "exact"),
    "norm_then_inplace": (NormThenInplace, 2, (9, 8, 7), mse, "like", "exact"),
    "deep_supervision": (DeepSupervision, 2, (9, 8, 10), deep_supervision_loss, "like", "exact"),
    "shrinks_to_one_voxel": (ShrinksToOneVoxel, 2, (8, 8, 8), ce, "class", "exact"),
    "video_head": (VideoHead, 2, (4, 6, 5), ce, "class", "exact"),
    "response_norm_critic": (ResponseNormCritic, 2, (7, 6, 5), mse, "like", "exact"),
    "composed_reductions": (ComposedReductions, 2, (9, 7, 8), ce, "class", "exact"),
    "latent_volume_noise": (LatentVolumeNoise, 2, (7, 8, 6), mse, "like", "exact"),
    "shared_decoder": (SharedDecoder, 2, (8, 7, 9), mse, "like", "exact"),
}



def _nets():
    from monai.networks import nets  # deferred: MONAI is a test dependency, not hpcpar's

    return nets


def _segresnet(c=1):
    return _nets().SegResNet(3, init_filters=8, in_channels=c, out_channels=2,
                             blocks_down=(1, 2), blocks_up=(1,),
                             norm=("group", {"num_groups": 4}))


def _dynunet(c=1):
    return _nets().DynUNet(3, c, 2, [3, 3, 3], [1, 2, 2], [2, 2], norm_name="instance")


def _monai_unet(c=1):
    return _nets().UNet(3, c, 2, (4, 8, 16), (2, 2), num_res_units=2)


def _attention_unet(c=1):
    return _nets().AttentionUnet(3, c, 2, (4, 8, 16), (2, 2))


def _highresnet(c=1):
    layers = ({"name": "conv_0", "n_features": 4, "kernel_size": 3},
              {"name": "res_1", "n_features": 4, "kernels": (3, 3), "repeat": 1},
              {"name": "res_2", "n_features": 8, "kernels": (3, 3), "repeat": 1},
              {"name": "conv_1", "n_features": 8, "kernel_size": 1},
              {"name": "conv_2", "kernel_size": 1})
    return _nets().HighResNet(3, c, 2, layer_params=layers)   # dilations 1, 2, 4


def _regressor(c=1):
    return _nets().Regressor((c, 12, 10, 14), (3,), (4, 8), (2, 2))


# MONAI's own networks (other people's code, as released): name -> a ZOO entry. They were
# chosen from a wider trial (23 networks, each on four grids) for what they exercise: a
# residual UNet with batch norm, GroupNorm and InstanceNorm followed by in-place activations
# (SegResNet, DynUNet: these crashed), attention gates, dilated convolutions, a dense head.
MONAI = {
    "monai_unet": (_monai_unet, 1, (16, 12, 20), mse, "like", "exact"),
    "monai_segresnet": (_segresnet, 1, (16, 12, 20), mse, "like", "exact"),
    "monai_dynunet": (_dynunet, 1, (16, 12, 20), mse, "like", "exact"),
    "monai_attention_unet": (_attention_unet, 1, (16, 12, 20), mse, "like", "exact"),
    "monai_highresnet": (_highresnet, 1, (16, 12, 20), mse, "like", "exact"),
    "monai_regressor": (_regressor, 1, (12, 10, 14), mse, "like", "exact"),
}

@local_function
class _RawFlip(torch.autograd.Function):
    """Flips along D with torch-function handling switched off: escapes the dispatch. Marked
    local, wrongly (as a user might), so the custom-function refusal lets it through."""

    @staticmethod
    def forward(ctx, x):
        with torch._C.DisableTorchFunction():
            return x.flip(2)

    @staticmethod
    def backward(ctx, grad):
        with torch._C.DisableTorchFunction():
            return grad.flip(2)


class Escaping(nn.Module):
    """Deliberately escapes the conversion: only the first-step check can catch it."""

    def __init__(self, c=2):
        super().__init__()
        self.conv1 = nn.Conv3d(c, 3, 3, padding=1)
        self.conv2 = nn.Conv3d(3, 1, 3, padding=1)

    def forward(self, x):
        return self.conv2(_RawFlip.apply(self.conv1(x)))

