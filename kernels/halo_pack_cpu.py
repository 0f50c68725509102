"""Numba CPU twins of the halo face kernels: ``njit(parallel=True, cache=True)``.

4D arrays: batch*channels merged, then the face's three spatial extents; the face view may
be strided (numpy view of the halo buffer), the message buffer is contiguous. ``cache=True``
so MPI ranks reuse one compilation. One loop serves all three (``add`` is loop-invariant).
"""

from numba import njit, prange

__all__ = ["copy_face", "pack_cpu", "unpack_cpu", "add_unpack_cpu"]


@njit(parallel=True, cache=True)
def copy_face(dst, src, add):
    """dst[...] = src[...] (or += with ``add``); same 4D shape, either side strided."""
    n0, n1, n2, n3 = dst.shape
    for p in prange(n0 * n1):
        i, j = p // n1, p % n1
        for k in range(n2):
            for m in range(n3):
                if add:
                    dst[i, j, k, m] += src[i, j, k, m]
                else:
                    dst[i, j, k, m] = src[i, j, k, m]


def pack_cpu(src, out):
    """Strided face ``src`` -> contiguous message ``out``."""
    copy_face(out, src, False)


def unpack_cpu(dst, buf):
    """Message ``buf`` -> strided face ``dst``."""
    copy_face(dst, buf, False)


def add_unpack_cpu(dst, buf):
    """Backward: ghost gradients in ``buf`` added into the owner's face ``dst``."""
    copy_face(dst, buf, True)
