"""CSR SpMM kernels: CPU twin and CUDA kernel (Numba simulator) against scipy, the stored
transpose, and the autograd operator's adjoint."""

import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from hpcpar.kernels.spmm import spmm_cpu, transpose_csr


def random_csr(rows, cols, density, dtype, seed):
    a = sp.random(rows, cols, density=density, format="csr", dtype=dtype, random_state=seed)
    a.indptr = a.indptr.astype(np.int64)
    a.indices = a.indices.astype(np.int64)
    return a


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cpu_twin_and_transpose_match_scipy(dtype):
    for rows, cols, f, density in [(37, 23, 5, 0.2), (8, 8, 1, 0.0), (1, 50, 7, 0.5)]:
        a = random_csr(rows, cols, density, dtype, seed=rows)
        x = np.random.default_rng(0).standard_normal((cols, f)).astype(dtype)
        y = spmm_cpu(a.indptr, a.indices, a.data, x)
        np.testing.assert_allclose(y, a @ x, rtol=1e-6 if dtype == np.float32 else 1e-12)
        ti, tj, tv = transpose_csr(a.indptr, a.indices, a.data, cols)
        g = np.random.default_rng(1).standard_normal((rows, f)).astype(dtype)
        np.testing.assert_allclose(spmm_cpu(ti, tj, tv, g), a.T @ g,
                                   rtol=1e-6 if dtype == np.float32 else 1e-12, atol=1e-12)
        assert np.all(np.diff(ti) >= 0) and ti[-1] == a.nnz


def test_torch_tensors_zero_copy_and_operator_adjoint():
    from hpcpar.graph._sparse import SparseOperator

    a = random_csr(30, 20, 0.15, np.float64, seed=3)
    for backend in ("numba", "torch"):
        op = SparseOperator(a.indptr, a.indices, a.data, 20, backend=backend)
        x = torch.randn(20, 4, dtype=torch.float64, requires_grad=True)
        y = op(x)
        torch.testing.assert_close(y, torch.from_numpy(a @ x.detach().numpy()))
        g = torch.randn(30, 4, dtype=torch.float64)
        y.backward(g)
        # adjoint: <A x, g> == <x, A^T g>
        torch.testing.assert_close((y * g).sum(), (x * x.grad).sum())
        x32 = x.detach().float()
        torch.testing.assert_close(op.apply(x32), torch.from_numpy(a @ x32.numpy()).float())


@pytest.mark.parametrize("threads", ["1", "2"])
def test_split_input_gives_the_bits_of_the_concatenation(threads):
    """``spmm_cpu(x, h=h)`` == ``spmm_cpu([x; h])`` bit for bit (owned rows and halo rows
    of a graph), numpy and torch, serial and parallel kernels, halo empty or not; a halo of
    other columns or dtype is one ValueError."""
    code = """
import numpy as np, scipy.sparse as sp, torch
from hpcpar.kernels.spmm import spmm_cpu
for n, m in [(20, 17), (37, 0), (1, 40)]:
    a = sp.random(25, n + m, density=0.3, format="csr", dtype=np.float32, random_state=n)
    ip, ix = a.indptr.astype(np.int64), a.indices.astype(np.int64)
    full = np.random.default_rng(m).standard_normal((n + m, 6)).astype(np.float32)
    want = spmm_cpu(ip, ix, a.data, full)
    assert np.array_equal(spmm_cpu(ip, ix, a.data, full[:n], h=full[n:]), want)
    t = torch.from_numpy(full)
    got = spmm_cpu(torch.from_numpy(ip), torch.from_numpy(ix), torch.from_numpy(a.data),
                   t[:n], h=t[n:])
    assert isinstance(got, torch.Tensor) and np.array_equal(got.numpy(), want)
for bad in (np.zeros((3, 5), np.float32), np.zeros((3, 6), np.float64)):
    try:
        spmm_cpu(ip, ix, a.data, full[:n], h=bad)
    except ValueError as e:
        assert "must match x's columns and dtype" in str(e)
    else:
        raise AssertionError("no error")
print("ok")
"""
    env = {**os.environ, "NUMBA_NUM_THREADS": threads}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


SIM_SCRIPT = r"""
import numpy as np, scipy.sparse as sp
from hpcpar.kernels.spmm import spmm_cuda, transpose_csr, cuda_kernel_available
assert cuda_kernel_available()
for dtype, rows, cols, f in [(np.float32, 6, 5, 3), (np.float64, 4, 7, 2)]:
    a = sp.random(rows, cols, density=0.4, format="csr", dtype=dtype, random_state=1)
    ip, ix = a.indptr.astype(np.int64), a.indices.astype(np.int64)
    x = np.random.default_rng(0).standard_normal((cols, f)).astype(dtype)
    y = spmm_cuda(ip, ix, a.data, x, block=(4, 4))
    assert y.dtype == dtype
    np.testing.assert_allclose(y, a @ x, rtol=1e-6)
    g = np.random.default_rng(2).standard_normal((rows, f)).astype(dtype)
    np.testing.assert_allclose(spmm_cuda(*transpose_csr(ip, ix, a.data, cols), g, block=(4, 4)),
                               a.T @ g, rtol=1e-6, atol=1e-7)
print("ok")
"""


def test_cuda_kernel_under_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    res = subprocess.run([sys.executable, "-c", SIM_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]
