"""Halo pack / unpack / add-unpack kernels: CPU twins and the torch path against plain
slicing for strided faces of every axis and dtype; the CUDA kernels under the Numba CUDA
simulator (in a subprocess: the simulator must be chosen before numba.cuda is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hpcpar.kernels import halo_pack as K

FACES = [  # (D, H, W) slices of a (2, 3, 9, 10, 11) buffer: x, y, z faces and an edge
    (slice(0, 2), slice(1, 9), slice(1, 10)),
    (slice(1, 8), slice(7, 10), slice(0, 11)),
    (slice(0, 9), slice(0, 10), slice(9, 11)),
    (slice(0, 3), slice(0, 10), slice(0, 2)),
]


@pytest.mark.parametrize("mode", ["numba", "torch", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.bfloat16, torch.int64])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last_3d])
def test_pack_unpack_add(monkeypatch, mode, dtype, fmt):
    """Channels-last buffers with batch 2 cannot merge (batch, channels) for the Numba and
    CUDA kernels: they must take torch's path, not unpack into a temporary copy."""
    monkeypatch.setenv("HPCPAR_HALO_KERNELS", mode)
    gen = torch.Generator().manual_seed(0)
    buf = (torch.randn(2, 3, 9, 10, 11, generator=gen) * 10).to(dtype)
    buf = buf.contiguous(memory_format=fmt)
    for face in FACES:
        view = buf[(slice(None), slice(None), *face)]
        packed = K.pack(view)
        assert packed.is_contiguous() and torch.equal(packed, view)
        into = torch.empty_like(view)  # a message in the face's own memory order
        assert K.pack(view, into) is into and torch.equal(into, view)
        other = buf.clone()
        msg = (torch.randn(view.shape, generator=gen) * 10).to(dtype)
        K.unpack(other[(slice(None), slice(None), *face)], msg)
        ref = buf.clone()
        ref[(slice(None), slice(None), *face)] = msg
        assert torch.equal(other, ref)
        K.unpack(other[(slice(None), slice(None), *face)], msg, add=True)
        ref[(slice(None), slice(None), *face)] += msg
        assert torch.equal(other, ref)


def test_cpu_twins_direct():
    import numpy as np

    a = np.arange(2 * 5 * 6 * 7, dtype=np.float64).reshape(2, 5, 6, 7)
    view = a[:, 1:4, :, 5:7]
    out = np.empty(view.shape)
    K.cpu_kernels()[0](view, out)
    assert np.array_equal(out, view)
    K.cpu_kernels()[2](view, out)
    assert np.array_equal(a[:, 1:4, :, 5:7], 2 * out)


SIM = textwrap.dedent("""
    import numpy as np
    from numba import cuda
    from hpcpar.kernels import halo_pack as K
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        buf = rng.standard_normal((2, 8, 7, 6)).astype(dtype)   # batch*channels, 8x7x6 volume
        for face in [(slice(0, 2), slice(None), slice(None)),
                     (slice(None), slice(5, 7), slice(1, 5)),
                     (slice(None), slice(None), slice(4, 6))]:
            sl = (slice(None), *face)
            dbuf = cuda.to_device(buf)                  # strided face views of a device buffer
            out = cuda.device_array(buf[sl].shape, dtype)
            K.launch(out, dbuf[sl])
            assert np.array_equal(out.copy_to_host(), buf[sl]), "pack"
            msg = rng.standard_normal(buf[sl].shape).astype(dtype)
            K.launch(dbuf[sl], cuda.to_device(msg))
            ref = buf.copy(); ref[sl] = msg
            assert np.array_equal(dbuf.copy_to_host(), ref), "unpack"
            K.launch(dbuf[sl], cuda.to_device(msg), add=True)
            ref[sl] += msg
            assert np.allclose(dbuf.copy_to_host(), ref), "add_unpack"
    print("SIM-OK")
""")


def test_cuda_kernels_in_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    res = subprocess.run([sys.executable, "-c", SIM], env=env, capture_output=True, text=True,
                         timeout=300)
    assert "SIM-OK" in res.stdout, res.stdout + res.stderr
