"""Plain-torch-looking model definitions; run them distributed with ``hpcpar.nn.spatialize``."""

import importlib

_LAZY = {
    "CosmoFlow": "hpcpar.models.cosmoflow",
    "UNet3D": "hpcpar.models.unet3d",
    "GCN": "hpcpar.models.gcn",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpcpar.models' has no attribute {name!r}")


__all__ = sorted(_LAZY)
