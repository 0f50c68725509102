"""hpcpar: 4D-parallel training (data x x x y x z) of large-sample 3D CNNs and full-graph GNNs over
MPI and Slurm, with scaling analysis.

The public face: the names below are what a user's script imports (``hpcpar.ProcessGrid``,
``hpcpar.DDP``, ``hpcpar.spatialize`` ...). Heavy ones (torch layers, data readers) load lazily so
``import hpcpar`` and ``hpcpar --help`` stay fast."""

from ._checkout import install as _install_checkout_finder

_install_checkout_finder()  # hpcpar.kernels/analysis/slurm_files from THIS checkout (_checkout)

from hpcpar.parallel.grid import ProcessGrid  # noqa: E402

from ._lazy import lazy_getattr  # noqa: E402
from ._version import __version__  # noqa: E402
from .errors import (  # noqa: E402
    CommError,
    ConfigError,
    DataError,
    DivergedError,
    GridError,
    HpcparError,
    LaunchError,
    LayerError,
    RunDirError,
)

_LAZY = {
    "DistributedDataParallel": ("hpcpar.sync.ddp", "DistributedDataParallel"),
    "DDP": ("hpcpar.sync.ddp", "DistributedDataParallel"),
    "spatialize": ("hpcpar.nn.spatializer", "spatialize"),
    "ShardedVolumeDataset": ("hpcpar.data.reader", "ShardedVolumeDataset"),
    "DistGraph": ("hpcpar.graph.distgraph", "DistGraph"),
    "RunRecorder": ("hpcpar.formats.records", "RunRecorder"),
    "Workload": ("hpcpar.run.workloads.base", "Workload"),
    "register_workload": ("hpcpar.run.workloads.base", "register_workload"),
    "load_job": ("hpcpar.formats.jobspec", "load_job"),
    "train": ("hpcpar.run.trainer", "train"),
    "predict": ("hpcpar.run.predict", "predict"),
}

__getattr__ = lazy_getattr("hpcpar", _LAZY)

__all__ = ["__version__", "ProcessGrid", "DistributedDataParallel", "DDP", "spatialize",
           "ShardedVolumeDataset", "DistGraph", "RunRecorder", "Workload", "register_workload",
           "load_job", "train", "predict", "HpcparError", "ConfigError", "GridError",
           "LayerError", "CommError", "DataError", "RunDirError", "DivergedError", "LaunchError"]
