"""The MPI core: process grid, partition geometry, tensors through MPI, halo plans and
exchange, spatial scatter/gather, rank placement and per-process counters.

May import: hpcpar.errors, hpcpar.kernels (no torch.nn layers, no job files, no Slurm).
"""
