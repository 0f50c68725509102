"""hpcpar: 4D-parallel training (data x x x y x z) of large-sample 3D CNNs and full-graph GNNs
over MPI and Slurm, with scaling analysis.

Heavy submodules (torch layers, data readers) load lazily so ``hpcpar --help`` stays fast.
"""

from ._lazy import lazy_getattr
from ._version import __version__
from .errors import CommError, GridError, HpcparError
from hpcpar.parallel.grid import ProcessGrid

_LAZY = {
    "DistributedDataParallel": ("hpcpar.sync.ddp", "DistributedDataParallel"),
    "DDP": ("hpcpar.sync.ddp", "DistributedDataParallel"),
}


__getattr__ = lazy_getattr("hpcpar", _LAZY)


__all__ = ["__version__", "ProcessGrid", "GridError", "HpcparError", "CommError",
           "DistributedDataParallel", "DDP"]
