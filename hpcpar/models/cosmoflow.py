"""CosmoFlow (MLPerf HPC): regress 4 cosmological parameters from a 4-channel dark-matter
density cube. Plain torch; ``hpcpar.nn.spatialize(CosmoFlow(), grid)`` runs it spatially
partitioned: the first dense layer takes the flattened volume split as it is (each rank holds
the weight columns of its own voxels, :mod:`hpcpar.nn.split_head`), so nothing is gathered
and that layer's weights, gradients and optimizer state divide by the spatial ranks; the rest
of the head runs replicated. ``gather=True`` gathers the final volume first instead (the whole
first dense layer on every rank: what ``TensorParallelLinear`` needs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from ..errors import LayerError
from ..nn.gather import GatherPoint

__all__ = ["CosmoFlow"]


class CosmoFlow(nn.Module):
    """``n_conv_blocks`` x [Conv3d(``kernel_size``, 'same') + LeakyReLU(``negative_slope``) +
    MaxPool3d(2)] with ``base_filters * 2**i`` filters, then Flatten + dense layers (``dense``
    widths, LeakyReLU, dropout of probability ``dropout`` after each, 0: none) to ``n_targets``
    regression outputs.

    Defaults follow the MLPerf reference on 128³ x 4 cubes; ``CosmoFlow.small()`` is a 32³ demo
    configuration. ``input_size``, the edge of the cubic input, fixes the width of the first dense
    layer; one smaller than ``2**n_conv_blocks`` is a LayerError. ``gather`` puts a gather point
    before the head (spatialized: the whole volume gathered and the first dense layer replicated)
    instead of the split head."""

    def __init__(self, input_size: int = 128, in_channels: int = 4, n_conv_blocks: int = 5,
                 base_filters: int = 16, kernel_size: int = 3, dense: Sequence[int] = (128, 64),
                 n_targets: int = 4, dropout: float = 0.0, negative_slope: float = 0.3,
                 gather: bool = False):
        super().__init__()
        final = input_size // 2 ** n_conv_blocks
        if final < 1:
            raise LayerError(f"CosmoFlow: input_size {input_size} is too small for "
                             f"{n_conv_blocks} pooling blocks (need >= {2 ** n_conv_blocks})")
        layers, channels = [], in_channels
        for i in range(n_conv_blocks):
            out = base_filters * 2 ** i
            layers += [nn.Conv3d(channels, out, kernel_size, padding="same"),
                       nn.LeakyReLU(negative_slope), nn.MaxPool3d(2)]
            channels = out
        self.features = nn.Sequential(*layers)
        self.gather = GatherPoint() if gather else None
        head: list[nn.Module] = [nn.Flatten()]
        width = channels * final ** 3
        for w in dense:
            head += [nn.Linear(width, w), nn.LeakyReLU(negative_slope)]
            if dropout:
                head.append(nn.Dropout(dropout))
            width = w
        head.append(nn.Linear(width, n_targets))
        self.head = nn.Sequential(*head)

    @classmethod
    def small(cls, input_size: int = 32, **kw: Any) -> CosmoFlow:
        """A demo configuration: 3 blocks from 8 filters, dense (64, 32); ``kw``: any other
        constructor argument, overriding the demo's."""
        kw = {"n_conv_blocks": 3, "base_filters": 8, "dense": (64, 32), **kw}
        return cls(input_size=input_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, C, D, H, W)`` -> ``(N, n_targets)``."""
        x = self.features(x)
        return self.head(x if self.gather is None else self.gather(x))
