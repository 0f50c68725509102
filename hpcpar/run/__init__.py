"""The training runtime: job spec, workloads, the training loop, checkpoints, signals, records
and optimizers; what every rank runs.

May import: hpcpar.errors, hpcpar.parallel, hpcpar.sync, hpcpar.data, hpcpar.graph, hpcpar.nn,
hpcpar.models, hpcpar.kernels.
"""
