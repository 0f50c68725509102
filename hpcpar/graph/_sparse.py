"""A fixed sparse operator ``A`` (local rows x local columns) with autograd: ``y = A @ x``,
``dx = A^T @ dy`` through the stored transposed CSR (so the backward is a row-parallel SpMM,
no atomics, and directed graphs get their true transpose).

Backends: ``"numba"`` (hpcpar.kernels.spmm: the CPU twin or the CUDA kernel) and ``"torch"``
(``torch.sparse`` CSR). ``"auto"``: Numba's serial CPU kernel when the process computes on one
thread (the usual MPI-rank setting) and ``x`` has at least ``NUMBA_MIN_COLS`` columns (measured
on power-law graphs of 20k/100k vertices: Numba 0.6-0.9x torch.sparse's time at 32-64 columns,
1.0-1.7x at 4-16), torch.sparse otherwise (on CUDA: cuSPARSE; on several CPU threads a Numba
pool would fight torch's OpenMP pool). Both sum each row in stored (global-id) order.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from hpcpar.kernels.spmm import cpu_threads, spmm, spmm_cpu, transpose_csr

BACKENDS = ("auto", "numba", "torch")
NUMBA_MIN_COLS = 32


class SparseOperator:
    def __init__(self, indptr, indices, data, num_cols: int, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"sparse backend {backend!r}: expected one of {BACKENDS}")
        self.shape = (int(indptr.shape[0]) - 1, int(num_cols))
        self.backend = backend
        t = transpose_csr(indptr, indices, data, num_cols)
        self.fwd = tuple(torch.from_numpy(np.ascontiguousarray(a))
                         for a in (indptr, indices, data))
        self.bwd = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in t)
        self._torch: dict = {}
        self._dtype_cache: dict = {}

    def to(self, device=None, dtype=None) -> SparseOperator:
        """Move the CSR arrays (values to ``dtype`` if given)."""
        def mv(a):
            a = a.to(device) if device is not None else a
            return a.to(dtype) if dtype is not None and a.is_floating_point() else a
        self.fwd = tuple(mv(a) for a in self.fwd)
        self.bwd = tuple(mv(a) for a in self.bwd)
        self._torch.clear()
        self._dtype_cache.clear()
        return self

    def _arrays(self, which: str, dtype: torch.dtype):
        """CSR arrays with values in ``dtype`` (cached per dtype)."""
        arrs = self.fwd if which == "fwd" else self.bwd
        if arrs[2].dtype == dtype:
            return arrs
        key = (which, dtype)
        if key not in self._dtype_cache:
            self._dtype_cache[key] = (arrs[0], arrs[1], arrs[2].to(dtype))
        return self._dtype_cache[key]

    def _use_torch(self, x: torch.Tensor) -> bool:
        if self.backend == "auto":
            return x.is_cuda or cpu_threads() > 1 or x.shape[1] < NUMBA_MIN_COLS
        return self.backend == "torch"

    def apply(self, x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        """``A @ x`` (or ``A^T @ x``) without autograd."""
        which = "bwd" if transpose else "fwd"
        indptr, indices, data = self._arrays(which, x.dtype)
        rows = self.shape[1] if transpose else self.shape[0]
        if x.shape[0] != (self.shape[0] if transpose else self.shape[1]):
            raise ValueError(f"sparse operator {self.shape}{'^T' if transpose else ''} applied "
                             f"to {x.shape[0]} rows")
        if self._use_torch(x):
            key = (which, x.dtype, x.device)
            if key not in self._torch:
                cols = self.shape[0] if transpose else self.shape[1]
                with warnings.catch_warnings():  # "sparse CSR support is in beta"
                    warnings.simplefilter("ignore", UserWarning)
                    self._torch[key] = torch.sparse_csr_tensor(indptr, indices, data,
                                                               (rows, cols))
            return self._torch[key] @ x
        return spmm(indptr, indices, data, x.contiguous())

    def reads_split(self, x: torch.Tensor) -> bool:
        """Whether :meth:`apply_split` reads ``[x; h]`` in place (the CPU Numba kernel) rather
        than concatenating them first."""
        return not (x.is_cuda or self._use_torch(x))

    def apply_split(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``A @ [x; h]`` without autograd, without the concatenation when
        :meth:`reads_split`; bit-identical to :meth:`apply` of the concatenation."""
        if x.shape[0] + h.shape[0] != self.shape[1]:
            raise ValueError(f"sparse operator {self.shape} applied to {x.shape[0]} + "
                             f"{h.shape[0]} rows")
        if not self.reads_split(x):
            return self.apply(torch.cat([x, h]))
        indptr, indices, data = self._arrays("fwd", x.dtype)
        return spmm_cpu(indptr, indices, data, x.contiguous(), h=h.contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _SpMM.apply(x, self)


class _SpMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op: SparseOperator):
        ctx.op = op
        return op.apply(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.op.apply(g.contiguous(), transpose=True), None
