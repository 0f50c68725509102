"""Plain-torch-looking model definitions; run them distributed with ``hpcpar.nn.spatialize``.

May import: hpcpar.errors, hpcpar.parallel, hpcpar.sync, hpcpar.nn, hpcpar.graph.
"""

from .._lazy import lazy_getattr

_LAZY = {"CosmoFlow": "hpcpar.models.cosmoflow", "UNet3D": "hpcpar.models.unet3d",
         "GCN": "hpcpar.models.gcn"}

__getattr__ = lazy_getattr("hpcpar.models", _LAZY)

__all__ = sorted(_LAZY)
