"""Halo face pack / unpack / add-unpack: strided 3D face of a (N, C, D, H, W) buffer <->
contiguous message buffer.

Dispatch only (imports no numba until a Numba path is used). CUDA: one Numba ``cuda.jit``
kernel (kernels/halo_pack_cuda.py), one thread per element,
tested under ``NUMBA_ENABLE_CUDASIM=1``; used for CUDA tensors when numba-cuda sees a device.
CPU: ``njit(parallel=True, cache=True)`` twins (kernels/halo_pack_cpu.py). The CPU default is torch's strided copy,
chosen by measurement (benchmarks/spatial.py, 1 thread): on 128^3 x 16 faces torch copies x
and y faces at 15-22 GB/s (numpy contiguous copy: ~23 GB/s) and beats the Numba loops on
every face, including the fused add; the z face (rows of 1-2 items) is bound by touching one
cache line per item on any path. ``HPCPAR_HALO_KERNELS=torch|numba`` forces a path.
"""

from __future__ import annotations

import os

import numpy as np
import torch

THREADS = 256


def launch(dst, src, add: bool = False, stream=0):
    """``dst[...] = src`` (or ``+=`` with ``add``) on the device: the CUDA face kernel
    (kernels/halo_pack_cuda.py, needs numba-cuda) over the elements of two device arrays of
    one 4D shape, either strided."""
    from .halo_pack_cuda import copy_face

    n = int(np.prod(dst.shape))
    if n:
        copy_face[(n + THREADS - 1) // THREADS, THREADS, stream](dst, src, add)


def _torch_stream(t: torch.Tensor):
    """Numba view of torch's current stream, so kernels order with torch's work."""
    from numba import cuda

    return cuda.external_stream(torch.cuda.current_stream(t.device).cuda_stream)


# --------------------------------------------------------------------------------------------
# torch-facing dispatch
# --------------------------------------------------------------------------------------------
_NUMPY_OK = (torch.float32, torch.float64, torch.int32, torch.int64, torch.int16, torch.int8,
             torch.uint8)
_AS_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16}  # copies only: bits


def _mode() -> str:
    return os.environ.get("HPCPAR_HALO_KERNELS", "auto")


def _as4d(t: torch.Tensor) -> torch.Tensor:
    """Merge batch and channels (a view: regions slice spatial dims only)."""
    t = t.view(_AS_INT[t.dtype]) if t.dtype in _AS_INT else t
    return t.flatten(0, 1) if t.dim() == 5 else t


def _use_numba_cpu(view: torch.Tensor, add: bool) -> bool:
    mode = _mode()
    if mode == "torch" or view.device.type != "cpu":
        return False
    if view.dtype not in _NUMPY_OK and (add or view.dtype not in _AS_INT):
        return False
    return mode == "numba"  # auto: torch measured faster on CPU (see the module docstring)


def _use_cuda(view: torch.Tensor) -> bool:
    if view.device.type != "cuda" or _mode() == "torch":
        return False
    try:
        from numba import cuda

        return cuda.is_available()
    except Exception:  # pragma: no cover - numba-cuda missing
        return False


def cpu_kernels():
    """(pack, unpack, add_unpack) Numba CPU twins (kernels/halo_pack_cpu.py)."""
    from . import halo_pack_cpu as kc

    return kc.pack_cpu, kc.unpack_cpu, kc.add_unpack_cpu


def pack(view: torch.Tensor) -> torch.Tensor:
    """Contiguous copy of the strided face ``view``."""
    if view.is_contiguous():
        return view.clone()
    out = torch.empty(view.shape, dtype=view.dtype, device=view.device)
    if _use_numba_cpu(view, False):
        cpu_kernels()[0](_as4d(view).numpy(), _as4d(out).numpy())
    elif _use_cuda(view):
        from numba import cuda

        launch(cuda.as_cuda_array(_as4d(out)), cuda.as_cuda_array(_as4d(view)),
               stream=_torch_stream(view))
    else:
        out.copy_(view)
    return out


def unpack(view: torch.Tensor, buf: torch.Tensor, add: bool = False) -> None:
    """``view[...] = buf`` (or ``+=`` with ``add``); ``buf`` contiguous, same shape."""
    buf = buf.view(view.shape)
    if _use_numba_cpu(view, add):
        cpu_kernels()[2 if add else 1](_as4d(view).numpy(), _as4d(buf).numpy())
    elif _use_cuda(view):
        from numba import cuda

        launch(cuda.as_cuda_array(_as4d(view)), cuda.as_cuda_array(_as4d(buf)), add,
               _torch_stream(view))
    elif add:
        view.add_(buf)
    else:
        view.copy_(buf)


__all__ = ["pack", "unpack", "cpu_kernels", "launch"]
