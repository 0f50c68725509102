"""Numba kernels (CUDA, with parallel CPU twins) for halo pack/unpack and sparse aggregation."""
