"""Halo face pack / unpack / add-unpack: strided 3D face of a (N, C, D, H, W) buffer <->
contiguous message buffer.

Dispatch only (imports no numba until a Numba path is used). CUDA: one Numba ``cuda.jit``
kernel (kernels/halo_pack_cuda.py), one thread per element, tested under
``NUMBA_ENABLE_CUDASIM=1`` and bitwise against the CPU twins on a device. It is not the GPU
default: on an H200 (benchmarks/device_check.sh) it packed a 1.2 MB face at 3.3 GB/s, each
call paying ~0.35 ms of Numba's launch from Python, against 71-94 GB/s for torch's strided
copy (0.5-0.75 of a device memcpy), which is the default there as on the CPU.
CPU: ``njit(parallel=True, cache=True)`` twins (kernels/halo_pack_cpu.py). The CPU default
is torch's strided copy, chosen by measurement (benchmarks/spatial.py, 1 thread): on 128^3 x
16 faces torch packs x faces at copy speed and beats the Numba loops on every face,
including the fused add. y faces (512-byte rows pages apart) reach ~0.6 of a contiguous copy
and z faces (rows of 1-2 items) ~0.1, bound by touching one cache line per item, on torch,
Numba and numpy alike. In channels-last buffers (hpcpar.parallel.halo_buffers.CHANNELS_LAST) x and y
faces are runs of whole rows of channels and pack at copy speed; z faces are runs of C items
(64 bytes for 16 fp32 channels) 8 KB apart, ~0.4. ``HPCPAR_HALO_KERNELS=torch|numba`` forces
a path (``numba``: the CPU twins or, on a GPU, the CUDA kernel).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from hpcpar import _env

__all__ = ["pack", "unpack", "cpu_kernels", "launch"]

THREADS = 256


def launch(dst, src, add: bool = False, stream=0):
    """``dst[...] = src`` (or ``+=`` with ``add``) on the device: the CUDA face kernel
    (kernels/halo_pack_cuda.py, needs numba-cuda) over the elements of two device arrays of
    one 4D shape, either strided.

    Args:
        dst: Destination device array (4D); written in place.
        src: Source device array of the same shape.
        add: Add ``src`` into ``dst`` instead of copying.
        stream: Numba CUDA stream to launch on (0: the default stream).
    """
    from .halo_pack_cuda import copy_face  # deferred: loads numba

    n = int(np.prod(dst.shape))
    if n:
        copy_face[(n + THREADS - 1) // THREADS, THREADS, stream](dst, src, add)


def _torch_stream(t: torch.Tensor):
    """Numba view of torch's current stream, so kernels order with torch's work."""
    from numba import cuda  # deferred: numba.cuda is slow to import

    return cuda.external_stream(torch.cuda.current_stream(t.device).cuda_stream)


# --------------------------------------------------------------------------------------------
# torch-facing dispatch
# --------------------------------------------------------------------------------------------
_NUMPY_OK = (torch.float32, torch.float64, torch.int32, torch.int64, torch.int16, torch.int8,
             torch.uint8)
_AS_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16}  # copies only: bits


def _path(view: torch.Tensor, add: bool) -> str:
    """'torch', 'numba' (CPU twin) or 'cuda' for this face. Kept cheap: a 512 KiB face packs
    in ~20 us, so a few microseconds of dispatch show in its bandwidth."""
    mode = _env.get("HPCPAR_HALO_KERNELS")
    if mode == "torch" or (view.dim() == 5 and view.shape[0] > 1 and
                           view.stride(0) != view.shape[1] * view.stride(1)):
        return "torch"  # (batch, channels) not mergeable into one dim (channels-last)
    if view.is_cuda:   # auto: torch's strided copy, measured faster (module docstring)
        return "cuda" if mode == "numba" and _cuda_available() else "torch"
    if mode != "numba" or (view.dtype not in _NUMPY_OK and (add or view.dtype not in _AS_INT)):
        return "torch"  # auto: torch measured faster on CPU (see the module docstring)
    return "numba"


@functools.cache
def _cuda_available() -> bool:
    try:
        from numba import cuda  # deferred: numba.cuda is slow to import

        return cuda.is_available()
    except Exception:  # pragma: no cover - numba-cuda missing
        return False


def _as4d(t: torch.Tensor) -> torch.Tensor:
    """Merge batch and channels: a view (raises rather than copy, or an unpack would be lost;
    :func:`_path` sends unmergeable faces to torch)."""
    t = t.view(_AS_INT[t.dtype]) if t.dtype in _AS_INT else t
    return t.view(t.shape[0] * t.shape[1], *t.shape[2:]) if t.dim() == 5 else t


def cpu_kernels():
    """(pack, unpack, add_unpack) Numba CPU twins (kernels/halo_pack_cpu.py)."""
    from . import halo_pack_cpu as kc  # deferred: loads numba

    return kc.pack_cpu, kc.unpack_cpu, kc.add_unpack_cpu


def pack(view: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense copy of the strided face ``view``: into ``out`` if given (a reused message buffer
    of the same shape and dtype, dense in the buffer's memory order), else a new contiguous
    tensor.

    Args:
        view: The (possibly strided) halo face to send.
        out: Message buffer to fill, or None to allocate one.

    Returns:
        The message buffer (``out`` when given).
    """
    if out is None:
        out = torch.empty(view.shape, dtype=view.dtype, device=view.device)
    path = "torch" if view.is_contiguous() else _path(view, False)
    if path == "numba":
        cpu_kernels()[0](_as4d(view).numpy(), _as4d(out).numpy())
    elif path == "cuda":
        from numba import cuda  # deferred: numba.cuda is slow to import

        launch(cuda.as_cuda_array(_as4d(out)), cuda.as_cuda_array(_as4d(view)),
               stream=_torch_stream(view))
    else:
        out.copy_(view)
    return out


def unpack(view: torch.Tensor, buf: torch.Tensor, add: bool = False) -> None:
    """Write a received message into a halo face: ``view[...] = buf`` (``+=`` with ``add``).

    Args:
        view: The (possibly strided) halo face; written in place.
        buf: The dense message, same shape as ``view`` (or viewable as it).
        add: Add ``buf`` into ``view`` (backward: ghost gradients) instead of copying.
    """
    if buf.shape != view.shape:
        buf = buf.view(view.shape)
    path = _path(view, add)
    if path == "numba":
        cpu_kernels()[2 if add else 1](_as4d(view).numpy(), _as4d(buf).numpy())
    elif path == "cuda":
        from numba import cuda  # deferred: numba.cuda is slow to import

        launch(cuda.as_cuda_array(_as4d(view)), cuda.as_cuda_array(_as4d(buf)), add,
               _torch_stream(view))
    elif add:
        view.add_(buf)
    else:
        view.copy_(buf)
