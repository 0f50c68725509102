"""Tensor <-> MPI buffers: every dtype through every helper, against numpy/torch references,
on the zero-copy path and the forced host-staging path; CUDA-aware detection decisions."""

import os

import numpy as np
import pytest
import torch

from hpcpar.errors import CommError, ConfigError
from hpcpar.parallel import comm as hc
from hpcpar.testing import mpi_case

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.bool,
          torch.float16, torch.bfloat16]


def _value(rank, dtype, shape=(3, 5)):
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.uint8:
        return torch.randint(0, 50, shape, generator=g, dtype=torch.uint8)
    if dtype in (torch.int32, torch.int64):
        return torch.randint(-1000, 1000, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def _reference_sum(values, dtype):
    if dtype == torch.bool:
        return torch.stack(values).any(0)
    if dtype in (torch.float16, torch.bfloat16):
        return torch.stack([v.float() for v in values]).sum(0).to(dtype)
    if dtype == torch.uint8:
        return torch.stack([v.long() for v in values]).sum(0).to(torch.uint8)  # wraps like MPI
    return torch.stack(values).sum(0)


def _close(a, b, dtype):
    """Exact for integers; float sums may differ in association order across ranks."""
    if not dtype.is_floating_point:
        return torch.equal(a, b)
    tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3}.get(dtype, 1e-6)
    return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)


def _all_paths(comm, body):
    for staged in ("0", "1"):
        os.environ["HPCPAR_FORCE_STAGING"] = staged
        try:
            body(staged == "1")
        finally:
            os.environ.pop("HPCPAR_FORCE_STAGING", None)


@mpi_case(nprocs=(1, 2, 3, 4), timeout=120)
def test_collectives_every_dtype(comm):
    size, rank = comm.Get_size(), comm.Get_rank()

    def body(staged):
        for dtype in DTYPES:
            values = [_value(r, dtype) for r in range(size)]
            # sum (16-bit reduced in fp32, rounded once)
            t = values[rank].clone()
            hc.allreduce_(t, comm, "sum")
            assert t.dtype == dtype and _close(t, _reference_sum(values, dtype), dtype), \
                (dtype, staged)
            # max
            if dtype != torch.bool:
                t = values[rank].clone()
                hc.allreduce_(t, comm, "max")
                ref = torch.stack([v.float() if v.is_floating_point() else v
                                   for v in values]).amax(0).to(dtype)
                assert torch.equal(t, ref), (dtype, staged)
            # non-blocking
            t = values[rank].clone()
            h = hc.iallreduce(t, comm, "sum")
            assert h.wait() is t and _close(t, _reference_sum(values, dtype), dtype)
            # allgather / allgatherv
            g = hc.allgather(values[rank], comm)
            assert torch.equal(g, torch.stack(values))
            rows = values[rank][: rank % 3 + 1]
            gv = hc.allgatherv(rows, comm)
            assert torch.equal(gv, torch.cat([values[r][: r % 3 + 1] for r in range(size)]))
            # bcast
            t = values[rank].clone()
            hc.bcast_(t, comm, root=size - 1)
            assert torch.equal(t, values[size - 1])
            # sendrecv around a ring
            dest, src = (rank + 1) % size, (rank - 1) % size
            out = torch.empty_like(values[rank])
            hc.sendrecv(values[rank], dest, out, src, comm, sendtag=7)
            assert torch.equal(out, values[src])
            # alltoallv: rank r sends (r + d) % 3 rows to rank d
            send_rows = [(rank + d) % 3 for d in range(size)]
            base = _value(rank, dtype, (sum(send_rows), 4))
            got = hc.alltoallv(base, send_rows, comm)
            expect = []
            for s in range(size):
                rows_s = [(s + d) % 3 for d in range(size)]
                off = sum(rows_s[:rank])
                expect.append(_value(s, dtype, (sum(rows_s), 4))[off: off + rows_s[rank]])
            assert torch.equal(got, torch.cat(expect)), (dtype, staged)
            # ... received in place, into the tail of a larger tensor (the graph halo)
            full = torch.cat([_value(size, dtype, (2, 4)), torch.zeros_like(got)])
            head = full[:2].clone()
            same = hc.alltoallv(base, send_rows, comm, out=full[2:])
            assert same.data_ptr() == full[2:].data_ptr() and torch.equal(full[2:], got)
            assert torch.equal(full[:2], head)
            with pytest.raises(CommError, match="alltoallv: out is"):
                hc.alltoallv(base, send_rows, comm, out=full)

    _all_paths(comm, body)


@mpi_case(nprocs=(2,), timeout=60)
def test_point_to_point_and_checks(comm):
    from mpi4py import MPI

    rank = comm.Get_rank()
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * rank
    peer = 1 - rank
    recv = torch.zeros_like(x)
    reqs = [hc.irecv(recv, peer, comm, tag=3), hc.isend(x, peer, comm, tag=3)]
    for r in reqs:
        r.wait()
    assert torch.equal(recv, torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * peer)
    # PROC_NULL is a no-op
    untouched = torch.full((2,), 5.0)
    hc.sendrecv(x[0], MPI.PROC_NULL, untouched, MPI.PROC_NULL, comm)
    assert torch.equal(untouched, torch.full((2,), 5.0))
    # mismatched values -> the same error on every rank, not a hang
    with pytest.raises(CommError, match="shape differs across ranks: rank 0 has"):
        hc.check_same(comm, (3, rank), "shape")
    hc.check_same(comm, (3, 4), "shape")


def test_zero_copy_on_cpu():
    t = torch.zeros(8)
    buf = hc.as_buffer(t)
    buf.mpi[3] = 7.0
    assert t[3] == 7.0 and not buf.staged
    with pytest.raises(CommError, match="contiguous"):
        hc.as_buffer(torch.zeros(4, 4).t())
    with pytest.raises(CommError, match="cannot be sent"):
        hc.wire_dtype(torch.complex64)


def test_cuda_aware_decisions():
    d = hc.detect_cuda_aware
    assert d({"HPCPAR_CUDA_AWARE": "1"}).aware is True
    assert d({"HPCPAR_CUDA_AWARE": "0"}).aware is False
    with pytest.raises(ConfigError, match="HPCPAR_CUDA_AWARE='yes': expected 0 or 1"):
        d({"HPCPAR_CUDA_AWARE": "yes"})
    cray = "CRAY MPICH version 8.1.28\n"
    assert d({"MPICH_GPU_SUPPORT_ENABLED": "1"}, library_version=cray).aware
    assert not d({}, library_version=cray).aware
    assert d({"MV2_USE_CUDA": "1"}, library_version="MVAPICH2 Version 2.3.7").aware
    ompi = "Open MPI v4.1.5, package: Open MPI"
    assert d({}, library_version=ompi,
             ompi_info="mpi_built_with_cuda_support:value:true\n").aware
    res = d({}, library_version=ompi, ompi_info="mpi_built_with_cuda_support:value:false\n")
    assert not res.aware and "ompi_info" in res.reason
    res = d({}, library_version="MPICH Version: 5.0.2")
    assert not res.aware and "staging" in res.reason


def test_staging_pool_reuses_buffers():
    os.environ["HPCPAR_FORCE_STAGING"] = "1"
    try:
        t = torch.arange(4, dtype=torch.bfloat16)
        b = hc.as_buffer(t)
        assert b.staged and b.mpi.dtype == np.int16
        host = b.host
        b.mpi[:] = torch.tensor([1, 2, 3, 4], dtype=torch.bfloat16).view(torch.int16).numpy()
        b.finish()
        assert torch.equal(t, torch.tensor([1, 2, 3, 4], dtype=torch.bfloat16))
        b2 = hc.as_buffer(torch.zeros(4, dtype=torch.float16))
        assert b2.host is host  # same byte size -> same pinned buffer reused
        b2.finish()
    finally:
        del os.environ["HPCPAR_FORCE_STAGING"]
