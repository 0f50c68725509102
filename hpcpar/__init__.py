"""hpcpar: 4D-parallel training (data x x x y x z) of large-sample 3D CNNs and full-graph GNNs
over MPI and Slurm, with scaling analysis.

Heavy submodules (torch layers, data readers) load lazily so ``hpcpar --help`` stays fast.
"""

from ._version import __version__
from .errors import CommError, GridError, HpcparError
from .grid import ProcessGrid

_LAZY = {
    "DistributedDataParallel": ("hpcpar.allreduce", "DistributedDataParallel"),
    "DDP": ("hpcpar.allreduce", "DistributedDataParallel"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'hpcpar' has no attribute {name!r}")


__all__ = ["__version__", "ProcessGrid", "GridError", "HpcparError", "CommError",
           "DistributedDataParallel", "DDP"]
