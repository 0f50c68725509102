"""The user's model: a plain torch module that knows nothing about MPI."""

from __future__ import annotations

from torch import nn


class TinySegNet(nn.Module):
    """Two 3x3x3 conv blocks and a 1x1x1 classifier: voxel logits ``(N, classes, D, H, W)``.

    Args:
        in_channels: Image channels.
        width: Feature channels of the conv blocks.
        classes: Segmentation classes.
    """

    def __init__(self, in_channels: int = 1, width: int = 8, classes: int = 2):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv3d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm3d(width),
            nn.ReLU(),
            nn.Conv3d(width, width, 3, padding=1), nn.ReLU(),
            nn.Conv3d(width, classes, 1),
        )

    def forward(self, x):
        return self.body(x)
