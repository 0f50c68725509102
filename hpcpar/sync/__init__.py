"""Gradient synchronisation: DistributedDataParallel, buckets, wire compression, the stall
detector and parameter reduction tags.

May import: hpcpar.errors, hpcpar.parallel.
"""
