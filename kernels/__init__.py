"""Numba kernels (CUDA, with parallel CPU twins) for halo pack/unpack and sparse aggregation.

May import: no other hpcpar package (a leaf below everything).
"""

import numpy as _np

# numba-cuda (0.30.4 and before) registers an overload of ``np.row_stack``, an alias of
# ``np.vstack`` that numpy 2.5 removed: there, compiling any CUDA kernel failed with
# "module 'numpy' has no attribute 'row_stack'" (seen on the first GPU run). Restoring the
# alias changes nothing else: it names the same function numpy had named for years.
if not hasattr(_np, "row_stack"):
    _np.row_stack = _np.vstack
