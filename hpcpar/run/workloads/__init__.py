"""Workloads: how a model kind (CosmoFlow, UNet3D, GCN, SAGE, or a user's) plugs into the loop.

The base class and registry live in :mod:`hpcpar.run.workloads.base`.
"""
