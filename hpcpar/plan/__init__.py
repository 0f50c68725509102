"""The performance model: alpha-beta planner, calibration runs and machine files.

May import: hpcpar.errors, hpcpar.parallel, hpcpar.formats, hpcpar.nn, hpcpar.models, hpcpar.graph,
hpcpar.data, hpcpar.run, hpcpar.analysis (finished runs as measured points), hpcpar.launch (the
allocator a launch preloads).
"""
