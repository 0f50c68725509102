"""Numba kernels (CUDA, with parallel CPU twins) for halo pack/unpack and sparse aggregation.

May import: no other hpcpar package (a leaf below everything).
"""
