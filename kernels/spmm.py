"""CSR sparse x dense products (SpMM) for graph aggregation: Numba CUDA kernels and their
parallel CPU twins.

``out[i, :] = sum_k data[k] * x[indices[k], :]`` for ``k`` in row ``i``. Both kernels are
row-parallel (one row per CPU iteration / one (row, column) per CUDA thread) and write each
output element once, so there are no atomics; the product with the transpose uses a
precomputed transposed CSR (:func:`transpose_csr`) instead of scattering. Within a row the sum
runs in the stored column order, so a row's result does not depend on how the other rows were
split across ranks (the distributed GCN relies on this for partition-independent results).

Torch tensors and numpy arrays are both accepted; CPU torch tensors are used zero-copy.
Under ``NUMBA_ENABLE_CUDASIM=1`` the CUDA kernel runs in Numba's simulator (tests).
"""

from __future__ import annotations

import os

import numba
import numpy as np
from numba import njit, prange

__all__ = ["spmm", "spmm_cpu", "spmm_cuda", "transpose_csr", "cuda_kernel_available",
           "cpu_threads"]


@njit(inline="always")
def _row(i, indptr, indices, data, x, h, out):
    """Row ``i`` of ``A @ [x; h]``, read in place: columns below ``len(x)`` are rows of
    ``x``, the rest rows of ``h`` (empty for a plain product). Terms in stored order."""
    f, n = x.shape[1], x.shape[0]
    for c in range(f):
        out[i, c] = 0
    for k in range(indptr[i], indptr[i + 1]):
        j = indices[k]
        w = data[k]
        if j < n:
            for c in range(f):
                out[i, c] += w * x[j, c]
        else:
            for c in range(f):
                out[i, c] += w * h[j - n, c]


@njit(parallel=True, cache=True)
def _spmm_rows(indptr, indices, data, x, h, out):
    for i in prange(out.shape[0]):
        _row(i, indptr, indices, data, x, h, out)


@njit(cache=True)
def _spmm_rows_serial(indptr, indices, data, x, h, out):
    """One-thread twin. Numba's and torch's OpenMP pools busy-wait after their parallel
    regions and steal each other's cores (measured here: nn.Linear 6x slower next to the
    parallel SpMM), so with one thread no pool is started at all."""
    for i in range(out.shape[0]):
        _row(i, indptr, indices, data, x, h, out)


def _as_numpy(a):
    return a.detach().numpy() if hasattr(a, "detach") else np.asarray(a)


def _check(indptr, indices, data, x, out):
    if x.ndim != 2 or out.ndim != 2 or out.shape[1] != x.shape[1]:
        raise ValueError(f"spmm: x {tuple(x.shape)} and out {tuple(out.shape)} must be 2-D "
                         "with the same number of columns")
    if indptr.shape[0] != out.shape[0] + 1 or indices.shape[0] != data.shape[0]:
        raise ValueError("spmm: CSR arrays do not match the output rows")


_THREADS: int | None = None


def cpu_threads() -> int:
    """Threads for the CPU kernels: NUMBA_NUM_THREADS, else OMP_NUM_THREADS (what torch
    uses), else Numba's default. With 1 the serial twins run (no thread pool at all)."""
    global _THREADS
    if _THREADS is None:
        want = os.environ.get("NUMBA_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
        # numba.config sets its variables at import time, from the environment
        most = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
        _THREADS = max(1, min(int(want), most)) if want else most
        if _THREADS > 1:
            numba.set_num_threads(_THREADS)
    return _THREADS


def spmm_cpu(indptr, indices, data, x, out=None, h=None):
    """Parallel CPU CSR SpMM (row-parallel, no atomics). Returns ``out`` (allocated if None).

    Args:
        indptr: CSR row pointers (length rows + 1).
        indices: CSR column index of each stored entry.
        data: CSR value of each stored entry.
        x: Dense 2D input, one row per column of the sparse matrix (the first ``len(x)``
            when ``h`` is given).
        out: 2D output (rows x columns of ``x``), or None to allocate one.
        h: The input's remaining rows, read in place: the product is ``A @ [x; h]`` without
            concatenating them (a graph's owned and halo rows); the same bits as the
            concatenation. C-contiguous, the columns and dtype of ``x``.

    Returns:
        ``out``: a torch tensor when ``x`` is one, else a numpy array.

    Raises:
        ValueError: The shapes or dtypes of the arrays do not match.
    """
    is_torch = hasattr(x, "detach")
    if out is None:
        n = indptr.shape[0] - 1
        if is_torch:
            import torch

            out = torch.empty((n, x.shape[1]), dtype=x.dtype)
        else:
            out = np.empty((n, x.shape[1]), dtype=x.dtype)
    a = [_as_numpy(v) for v in (indptr, indices, data, x, out)]
    if not a[3].flags.c_contiguous:
        a[3] = np.ascontiguousarray(a[3])
    _check(*a)
    if h is None:
        rest = a[3][:0]
    else:
        rest = np.ascontiguousarray(_as_numpy(h))
        if rest.ndim != 2 or rest.shape[1] != a[3].shape[1] or rest.dtype != a[3].dtype:
            raise ValueError(f"spmm: h {rest.shape} {rest.dtype} must match x's columns and "
                             f"dtype ({a[3].shape} {a[3].dtype})")
    (_spmm_rows if cpu_threads() > 1 else _spmm_rows_serial)(*a[:4], rest, a[4])
    return out


# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------
_CUDA_KERNELS: dict = {}
cuda = None  # numba.cuda, imported on first use (importing it costs start-up time)


def _cuda_kernel(dtype):
    """Compile (once per dtype) the CUDA kernel: thread (c, i) computes out[i, c], summing in
    the data type (a typed zero keeps fp32 sums in fp32 registers)."""
    global cuda  # the kernel must see numba.cuda as a module global (the simulator patches it)
    key = np.dtype(dtype).name
    if key not in _CUDA_KERNELS:
        from numba import config, cuda  # deferred: numba.cuda is slow to import

        zero = np.dtype(dtype).type(0)
        mul = _mul_simulated if config.ENABLE_CUDASIM else _mul_rounded(key)

        @cuda.jit
        def kernel(indptr, indices, data, x, out):
            c, i = cuda.grid(2)
            if i < out.shape[0] and c < out.shape[1]:
                acc = zero
                for k in range(indptr[i], indptr[i + 1]):
                    acc += mul(data[k], x[indices[k], c])
                out[i, c] = acc

        _CUDA_KERNELS[key] = kernel
    return _CUDA_KERNELS[key]


def _mul_simulated(a, b):
    return a * b


def _mul_rounded(dtype_name: str):
    """A product NVVM cannot fuse with the following add: NVVM contracts ``a * b + c`` into
    one FMA by default (one rounding instead of two), which would make the device result
    differ in the last bit from the CPU twin; libdevice's round-to-nearest multiply is never
    contracted (CUDA C's ``__fmul_rn``)."""
    if dtype_name not in ("float32", "float64"):
        return _mul_simulated_device()
    from numba.cuda import libdevice  # deferred: numba.cuda is slow to import

    return libdevice.fmul_rn if dtype_name == "float32" else libdevice.dmul_rn


def _mul_simulated_device():
    """Plain product as a device function (integer types: exact anyway)."""
    from numba import cuda  # deferred: numba.cuda is slow to import

    return cuda.jit(device=True)(_mul_simulated)


def cuda_kernel_available() -> bool:
    """True when a CUDA device (or the simulator) can run the kernel."""
    try:
        from numba import cuda  # deferred: numba.cuda is slow to import

        return bool(cuda.is_available()) or os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
    except Exception:  # pragma: no cover - numba-cuda missing or broken driver
        return False


def spmm_cuda(indptr, indices, data, x, out=None, block=(32, 8)):
    """CUDA CSR SpMM. Accepts CUDA torch tensors (run on torch's current stream), Numba
    device arrays, or host numpy arrays (copied in and out; used by the simulator tests).

    Args:
        indptr: CSR row pointers (length rows + 1).
        indices: CSR column index of each stored entry.
        data: CSR value of each stored entry.
        x: Dense 2D input, one row per column of the sparse matrix.
        out: 2D output (rows x columns of ``x``), or None to allocate one.
        block: CUDA thread block ``(columns, rows)``.

    Returns:
        ``out`` when given, else a new CUDA tensor (CUDA ``x``) or numpy array (host ``x``).

    Raises:
        ValueError: The shapes of the arrays do not match.
    """
    from numba import cuda  # deferred: numba.cuda is slow to import

    n = indptr.shape[0] - 1
    f = x.shape[1]
    grid = ((f + block[0] - 1) // block[0], (n + block[1] - 1) // block[1])
    if hasattr(x, "is_cuda") and x.is_cuda:
        import torch

        if out is None:
            out = torch.empty((n, f), dtype=x.dtype, device=x.device)
        stream = cuda.external_stream(torch.cuda.current_stream(x.device).cuda_stream)
        args = [cuda.as_cuda_array(t.detach()) for t in (indptr, indices, data,
                                                         x.contiguous(), out)]
        _check(*args)
        _cuda_kernel(args[3].dtype)[grid, block, stream](*args)
        return out
    host = [_as_numpy(v) for v in (indptr, indices, data, x)]
    res = np.zeros((n, f), dtype=host[3].dtype)
    _check(*host, res)
    if n and f:
        dev = [cuda.to_device(np.ascontiguousarray(v)) for v in (*host, res)]
        _cuda_kernel(res.dtype)[grid, block](*dev)
        res = dev[-1].copy_to_host()
    if out is None:
        return res
    _as_numpy(out)[...] = res
    return out


def spmm(indptr, indices, data, x, out=None):
    """CSR SpMM on the device of ``x``: the CUDA kernel for CUDA tensors, else the CPU twin.

    Args:
        indptr: CSR row pointers (length rows + 1).
        indices: CSR column index of each stored entry.
        data: CSR value of each stored entry.
        x: Dense 2D input, one row per column of the sparse matrix.
        out: 2D output (rows x columns of ``x``), or None to allocate one.

    Returns:
        The product: ``out`` when given, else a new array on the device of ``x``.

    Raises:
        ValueError: The shapes of the arrays do not match.
    """
    if hasattr(x, "is_cuda") and x.is_cuda:
        return spmm_cuda(indptr, indices, data, x, out)
    return spmm_cpu(indptr, indices, data, x, out)


def transpose_csr(indptr, indices, data, num_cols: int):
    """CSR of the transpose (= CSC of the input) as numpy arrays ``(indptr, indices, data)``.

    Stable: within each transposed row, entries keep increasing original-row order.

    Args:
        indptr: CSR row pointers (length rows + 1).
        indices: CSR column index of each stored entry.
        data: CSR value of each stored entry.
        num_cols: Columns of the input matrix (rows of the transpose).

    Returns:
        ``(indptr, indices, data)`` of the transpose, as numpy arrays.
    """
    indptr = _as_numpy(indptr)
    indices = _as_numpy(indices)
    data = _as_numpy(data)
    rows = np.repeat(np.arange(indptr.shape[0] - 1, dtype=indices.dtype), np.diff(indptr))
    order = np.argsort(indices, kind="stable")
    t_indptr = np.zeros(num_cols + 1, dtype=indptr.dtype)
    np.cumsum(np.bincount(indices, minlength=num_cols), out=t_indptr[1:])
    return t_indptr, rows[order], data[order]
