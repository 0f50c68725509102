"""Numba CPU twins of the halo face kernels: ``njit(parallel=True, cache=True)``.

4D arrays: batch*channels merged, then the face's three spatial extents; the face view may
be strided (numpy view of the halo buffer), the message buffer is contiguous. ``cache=True``
so MPI ranks reuse one compilation. One loop serves all three (``add`` is loop-invariant).
"""

from numba import njit, prange

__all__ = ["copy_face", "pack_cpu", "unpack_cpu", "add_unpack_cpu"]


@njit(parallel=True, cache=True)
def copy_face(dst, src, add):
    """dst[...] = src[...] (or += with ``add``); same 4D shape, either side strided.

    Args:
        dst: Destination 4D array; written in place.
        src: Source 4D array of the same shape.
        add: Add ``src`` into ``dst`` instead of copying.
    """
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
    """Pack a halo face for sending: strided face ``src`` -> contiguous message ``out``.

    Args:
        src: The (possibly strided) 4D face.
        out: The contiguous 4D message buffer, same shape; written in place.
    """
    copy_face(out, src, False)


def unpack_cpu(dst, buf):
    """Unpack a received halo: message ``buf`` -> strided face ``dst``.

    Args:
        dst: The (possibly strided) 4D face; written in place.
        buf: The contiguous 4D message, same shape.
    """
    copy_face(dst, buf, False)


def add_unpack_cpu(dst, buf):
    """Backward: ghost gradients in ``buf`` added into the owner's face ``dst``.

    Args:
        dst: The owner's (possibly strided) 4D face; added into in place.
        buf: The contiguous 4D message of ghost gradients, same shape.
    """
    copy_face(dst, buf, True)
