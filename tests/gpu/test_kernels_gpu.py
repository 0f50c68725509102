"""On a CUDA device: the Numba CUDA halo pack/unpack/add-unpack kernel and the CSR SpMM
kernel equal their CPU twins bitwise (float32/float64, every face, channels-last too)."""

import itertools

import numpy as np
import pytest
import torch

from hpcpar.testing.gpu import requires_gpu

pytestmark = requires_gpu()

SHAPE = (2, 3, 9, 8, 7)  # N, C, D, H, W
WIDTH = 2


def faces(x):
    """(name, view) of every face of width WIDTH: 3 axes x 2 sides."""
    for axis, side in itertools.product((2, 3, 4), (0, 1)):
        start = 0 if side == 0 else x.shape[axis] - WIDTH
        yield f"axis {axis} side {side}", x.narrow(axis, start, WIDTH)


def volumes(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE, generator=g, dtype=torch.float64).to(dtype)
    yield "contiguous", x
    # channels-last with batch 1 (mergeable (N, C): the CUDA kernel runs on it)
    yield "channels-last", x[:1].contiguous(memory_format=torch.channels_last_3d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_halo_kernels_equal_cpu_twins_bitwise(dtype, monkeypatch):
    from hpcpar.kernels import halo_pack as hp

    monkeypatch.setenv("HPCPAR_HALO_KERNELS", "numba")   # the kernel, not torch's default

    assert hp._cuda_available(), "numba-cuda does not see the device (pip install numba-cuda)"
    pack_cpu, unpack_cpu, add_cpu = hp.cpu_kernels()
    for layout, x in volumes(dtype):
        xd = x.cuda()
        for (name, view), (_, dview) in zip(faces(x), faces(xd)):
            what = f"{layout} {name} {dtype}"
            assert hp._path(dview, False) == "cuda", what
            out_cpu = torch.empty(view.shape, dtype=dtype)
            pack_cpu(hp._as4d(view).numpy(), hp._as4d(out_cpu).numpy())
            out_gpu = hp.pack(dview)
            torch.cuda.synchronize()
            assert torch.equal(out_gpu.cpu(), out_cpu), f"pack {what}"
            assert torch.equal(out_cpu, view.contiguous()), f"pack vs torch {what}"
            msg = torch.randn(view.shape, dtype=torch.float64).to(dtype)
            for add, twin in ((False, unpack_cpu), (True, add_cpu)):
                host, dev = x.clone(), xd.clone()
                hview = host.narrow(*_narrow_args(view, x))
                dv = dev.narrow(*_narrow_args(view, x))
                twin(hp._as4d(hview).numpy(), hp._as4d(msg.contiguous()).numpy())
                hp.unpack(dv, msg.cuda(), add=add)
                torch.cuda.synchronize()
                assert torch.equal(dev.cpu(), host), f"{'add-' if add else ''}unpack {what}"


def _narrow_args(view, base):
    """(axis, start, length) of a face ``view`` of ``base`` (differs in one spatial axis)."""
    for axis in (2, 3, 4):
        if view.shape[axis] != base.shape[axis]:
            offset = (view.storage_offset() - base.storage_offset()) // base.stride(axis)
            return axis, offset, view.shape[axis]
    raise AssertionError("not a face")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_spmm_kernel_equals_cpu_twin_bitwise(dtype):
    import scipy.sparse as sp

    from hpcpar.kernels.spmm import spmm, spmm_cpu

    for rows, cols, f, density in [(300, 200, 16, 0.05), (37, 23, 5, 0.3), (8, 8, 1, 0.0)]:
        a = sp.random(rows, cols, density=density, format="csr", dtype=dtype, random_state=rows)
        ip, ix = (torch.from_numpy(v.astype(np.int64)) for v in (a.indptr, a.indices))
        data = torch.from_numpy(a.data)
        x = torch.from_numpy(np.random.default_rng(0).standard_normal((cols, f)).astype(dtype))
        want = spmm_cpu(ip, ix, data, x)
        got = spmm(ip.cuda(), ix.cuda(), data.cuda(), x.cuda())
        torch.cuda.synchronize()
        assert got.is_cuda and torch.equal(got.cpu(), want), (rows, cols, f, dtype)
