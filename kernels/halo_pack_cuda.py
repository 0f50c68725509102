"""CUDA halo face kernel (pack / unpack / add-unpack in one), one thread per face element.

A separate module so importing :mod:`hpcpar.kernels.halo_pack` never needs numba-cuda, and
so the Numba CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) can swap the module-level ``cuda``.
Arrays are 4D: batch*channels merged, then the face's three spatial extents; the face view
may be strided, the message buffer is contiguous.
"""

from numba import cuda

__all__ = ["face_index", "copy_face"]


@cuda.jit(device=True)
def face_index(t, shape):
    """Flat message index -> 4D face index (row-major).

    Args:
        t: Flat index into the message.
        shape: The 4D face shape.

    Returns:
        The ``(i, j, k, m)`` face index.
    """
    m = t % shape[3]
    t //= shape[3]
    k = t % shape[2]
    t //= shape[2]
    return t // shape[1], t % shape[1], k, m


@cuda.jit
def copy_face(dst, src, add):
    """dst[...] = src[...] (or += with ``add``): one thread per element of the common shape.

    Args:
        dst: Destination 4D device array; written in place.
        src: Source 4D device array of the same shape.
        add: Add ``src`` into ``dst`` instead of copying.
    """
    t = cuda.grid(1)
    if t < dst.size:
        i, j, k, m = face_index(t, dst.shape)
        if add:
            dst[i, j, k, m] += src[i, j, k, m]
        else:
            dst[i, j, k, m] = src[i, j, k, m]
