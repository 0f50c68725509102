"""CosmoFlow (MLPerf HPC): regress 4 cosmological parameters from a 4-channel dark-matter
density cube. Plain torch; ``hpcpar.nn.spatialize(CosmoFlow(), grid)`` runs it spatially
partitioned, with the small final tensor gathered and the dense head run replicated.
"""

from __future__ import annotations

import torch.nn as nn

from ..nn.gather import GatherPoint


class CosmoFlow(nn.Module):
    """``n_conv_blocks`` x [Conv3d(k, 'same') + LeakyReLU + MaxPool3d(2)] with
    ``base_filters * 2**i`` filters, a gather point, then Flatten + dense layers
    (``dense`` widths, LeakyReLU, optional dropout) to ``n_targets`` outputs.

    Defaults follow the MLPerf reference on 128³ x 4 cubes; ``CosmoFlow.small()`` is a
    32³ demo configuration. ``input_size`` fixes the width of the first dense layer.
    """

    def __init__(self, input_size: int = 128, in_channels: int = 4, n_conv_blocks: int = 5,
                 base_filters: int = 16, kernel_size: int = 3, dense=(128, 64),
                 n_targets: int = 4, dropout: float = 0.0, negative_slope: float = 0.3):
        super().__init__()
        final = input_size // 2 ** n_conv_blocks
        if final < 1:
            raise ValueError(f"CosmoFlow: input_size {input_size} is too small for "
                             f"{n_conv_blocks} pooling blocks (need >= {2 ** n_conv_blocks})")
        layers, channels = [], in_channels
        for i in range(n_conv_blocks):
            out = base_filters * 2 ** i
            layers += [nn.Conv3d(channels, out, kernel_size, padding="same"),
                       nn.LeakyReLU(negative_slope), nn.MaxPool3d(2)]
            channels = out
        self.features = nn.Sequential(*layers)
        self.gather = GatherPoint()
        head, width = [nn.Flatten()], channels * final ** 3
        for w in dense:
            head += [nn.Linear(width, w), nn.LeakyReLU(negative_slope)]
            if dropout:
                head.append(nn.Dropout(dropout))
            width = w
        head.append(nn.Linear(width, n_targets))
        self.head = nn.Sequential(*head)

    @classmethod
    def small(cls, input_size: int = 32, **kw) -> "CosmoFlow":
        """A demo configuration: 3 blocks from 8 filters, dense (64, 32)."""
        kw = {"n_conv_blocks": 3, "base_filters": 8, "dense": (64, 32), **kw}
        return cls(input_size=input_size, **kw)

    def forward(self, x):
        return self.head(self.gather(self.features(x)))


__all__ = ["CosmoFlow"]
