"""HDF5 sharded volume datasets: format, synthetic generator, per-rank hyperslab reader.

Names load lazily: ``hpcpar.data`` imports neither torch nor h5py until a name is used.

May import: hpcpar.errors, hpcpar.parallel."""

from .._lazy import lazy_getattr

_LAZY = {
    "ShardedVolumeDataset": "hpcpar.data.reader",
    "SyntheticVolumeDataset": "hpcpar.data.inmemory",
    "FORMAT_VERSION": "hpcpar.data.format",
    "Manifest": "hpcpar.data.format",
    "read_manifest": "hpcpar.data.format",
    "verify_dataset": "hpcpar.data.format",
    "write_dataset": "hpcpar.data.writer",
    "shard_counts": "hpcpar.data.writer",
    "H5Source": "hpcpar.data.writer",
    "CosmoflowSource": "hpcpar.data.synthetic",
    "cosmoflow_sample": "hpcpar.data.synthetic",
    "local_box": "hpcpar.data._schedule",
}


__getattr__ = lazy_getattr("hpcpar.data", _LAZY)


__all__ = sorted(_LAZY)
