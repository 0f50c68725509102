"""3D U-Net for any input size, odd ones included. Plain torch;
``hpcpar.nn.spatialize(UNet3D(), grid)`` runs it spatially partitioned, exactly.

Down: MaxPool3d(2) floors odd sizes; up: ConvTranspose3d(2, stride 2) doubles, so an odd level comes
back one short. :class:`~hpcpar.nn.upsample.MatchSize` zero-pads (or crops) the up-sampled tensor to
the skip's size, a rule stated in global sizes (the skip's ``shape``), so under ``spatialize``
(where a split tensor's ``shape`` is global) its plain forward is exact as it is.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..nn.upsample import MatchSize

__all__ = ["UNet3D"]


def conv_block(cin: int, cout: int, batch_norm: bool, kernel_size: int = 3) -> nn.Sequential:
    """Two [Conv3d(k, 'same') (+ BatchNorm3d, then no conv bias) + ReLU] layers."""
    layers: list[nn.Module] = []
    for c in (cin, cout):
        layers.append(nn.Conv3d(c, cout, kernel_size, padding="same", bias=not batch_norm))
        if batch_norm:
            layers.append(nn.BatchNorm3d(cout))
        layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class UNet3D(nn.Module):
    """Encoder/decoder with ``depth`` poolings and skip connections (concatenation).

    Level i has ``base_filters * 2**i`` channels; the decoder up-samples with ConvTranspose3d(kernel
    2, stride 2); a 1x1x1 conv maps to ``out_channels`` (logits). The input needs at least
    ``2**depth`` voxels per axis; odd sizes are fine. ``batch_norm`` puts a BatchNorm3d after each
    convolution."""

    def __init__(self, in_channels: int = 1, out_channels: int = 2, base_filters: int = 16,
                 depth: int = 3, batch_norm: bool = True, kernel_size: int = 3):
        super().__init__()
        widths = [base_filters * 2 ** i for i in range(depth + 1)]
        self.encoders, self.pools = nn.ModuleList(), nn.ModuleList()
        cin = in_channels
        for w in widths[:-1]:
            self.encoders.append(conv_block(cin, w, batch_norm, kernel_size))
            self.pools.append(nn.MaxPool3d(2))
            cin = w
        self.bottom = conv_block(cin, widths[-1], batch_norm, kernel_size)
        self.ups, self.matches, self.decoders = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        for w_lo, w_hi in reversed(list(zip(widths[:-1], widths[1:]))):
            self.ups.append(nn.ConvTranspose3d(w_hi, w_lo, 2, stride=2))
            self.matches.append(MatchSize())
            self.decoders.append(conv_block(2 * w_lo, w_lo, batch_norm, kernel_size))
        self.head = nn.Conv3d(widths[0], out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, in_channels, D, H, W)`` -> logits ``(N, out_channels, D, H, W)``."""
        skips = []
        for enc, pool in zip(self.encoders, self.pools):
            x = enc(x)
            skips.append(x)
            x = pool(x)
        x = self.bottom(x)
        for up, match, dec, skip in zip(self.ups, self.matches, self.decoders,
                                        reversed(skips)):
            x = dec(torch.cat([skip, match(up(x), skip)], dim=1))
        return self.head(x)
