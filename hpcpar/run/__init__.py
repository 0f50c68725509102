"""The training runtime: workloads, the training loop, checkpoints, signals, records
and optimizers; what every rank runs.

May import: hpcpar.errors, hpcpar.parallel, hpcpar.formats, hpcpar.sync, hpcpar.data,
hpcpar.graph, hpcpar.nn, hpcpar.models, hpcpar.kernels.
"""
