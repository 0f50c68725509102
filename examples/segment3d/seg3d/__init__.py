"""Example user package: a small 3D segmentation net trained by ``hpcpar run`` on HDF5
volumes in the user's own layout (see docs/guides/custom-workloads.md)."""
