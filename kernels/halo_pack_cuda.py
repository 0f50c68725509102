"""CUDA halo face kernels (pack / unpack / add-unpack), one thread per face element.

A separate module so importing :mod:`hpcpar.kernels.halo_pack` never needs numba-cuda, and
so the Numba CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) can swap the module-level ``cuda``.
Arrays are 4D: batch*channels merged, then the face's three spatial extents; the face view
may be strided, the message buffer is contiguous.
"""

from numba import cuda


@cuda.jit(device=True)
def face_index(t, shape):
    """Flat message index -> 4D face index (row-major)."""
    m = t % shape[3]
    t //= shape[3]
    k = t % shape[2]
    t //= shape[2]
    return t // shape[1], t % shape[1], k, m


@cuda.jit
def pack(src, out):
    t = cuda.grid(1)
    if t < out.size:
        i, j, k, m = face_index(t, src.shape)
        out[i, j, k, m] = src[i, j, k, m]


@cuda.jit
def unpack(dst, buf):
    t = cuda.grid(1)
    if t < buf.size:
        i, j, k, m = face_index(t, dst.shape)
        dst[i, j, k, m] = buf[i, j, k, m]


@cuda.jit
def add_unpack(dst, buf):
    t = cuda.grid(1)
    if t < buf.size:
        i, j, k, m = face_index(t, dst.shape)
        dst[i, j, k, m] += buf[i, j, k, m]
