"""On a CUDA device, 1-2 ranks sharing it: hpcpar.parallel.comm moves CUDA tensors of every
dtype through the staged path (pinned host memory) and, where the MPI is CUDA-aware, the
direct path, each forced, with the CPU path's results bitwise; stream safety: tensors
produced on a side stream behind a still-running kernel are exchanged correctly (halo
exchange, allreduce, bucket reduction)."""

import pytest
import torch

from hpcpar.testing import mpi_case
from hpcpar.testing.gpu import busy_stream, requires_gpu, skip_without_gpu

pytestmark = requires_gpu()

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.bool,
          torch.float16, torch.bfloat16, torch.int16, torch.int8]


def _value(rank, dtype, shape=(5, 7)):
    g = torch.Generator().manual_seed(100 + rank)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(0, 100, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def _every_helper(comm, device):
    """Results of every comm helper on tensors on ``device`` (moved to the CPU)."""
    from hpcpar.parallel import comm as hc

    size, rank = comm.Get_size(), comm.Get_rank()
    out = []
    for dtype in DTYPES:
        v = _value(rank, dtype).to(device)
        out.append(hc.allreduce_(v.clone(), comm))
        out.append(hc.iallreduce(v.clone(), comm, "max").wait())
        out.append(hc.bcast_(v.clone(), comm, root=size - 1))
        out.append(hc.allgather(v, comm))
        out.append(hc.allgatherv(v[: rank + 1], comm))
        out.append(hc.alltoallv(v[:size], [1] * size, comm))
        if dtype != torch.bool:
            out.append(hc.reduce_scatter(v[:size].clone(), [1] * size, comm))
        recv = torch.zeros_like(v)
        hc.sendrecv(v, (rank + 1) % size, recv, (rank - 1) % size, comm)
        out.append(recv)
        recv = torch.zeros_like(v)
        h = [hc.irecv(recv, (rank - 1) % size, comm, tag=3),
             hc.isend(v, (rank + 1) % size, comm, tag=3)]
        for x in h:
            x.wait()
        out.append(recv)
    for t in out:
        assert t.device.type == torch.device(device).type
    return [t.cpu() for t in out]


def _check_path(comm, aware):
    from hpcpar.parallel import comm as hc

    want = _every_helper(comm, "cpu")
    with hc.forced_cuda_path(aware):
        b = hc.as_buffer(torch.zeros(3, device="cuda"))
        assert b.staged is (not aware)
        b.finish()
        got = _every_helper(comm, "cuda")
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and torch.equal(g, w), f"result {i} ({g.dtype})"


@mpi_case(nprocs=(1, 2), timeout=180)
def test_staged_path_every_dtype(comm):
    skip_without_gpu()
    _check_path(comm, aware=False)


@mpi_case(nprocs=(1, 2), timeout=180)
def test_cuda_aware_path_every_dtype(comm):
    from hpcpar.parallel.cuda_aware import detect_cuda_aware

    skip_without_gpu()
    found = detect_cuda_aware({})  # the library itself, not HPCPAR_CUDA_AWARE
    if not found:
        pytest.skip(f"this MPI is not CUDA-aware, device pointers would crash it: "
                    f"{found.reason}")
    _check_path(comm, aware=True)


@mpi_case(nprocs=(2,), timeout=180)
def test_side_stream_producers_are_waited_for(comm):
    """Tensors written on a side stream behind a ~50 ms kernel, handed to MPI at once: MPI
    (or the staging copy) must not read them before the kernel ends. Every message waits for
    an event on the current stream, never for the whole device (torch's rule: the current
    stream must be, or wait for, the producer), so each case runs inside the side stream or
    after a ``wait_stream``, with no host synchronisation between the write and MPI."""
    from hpcpar.parallel import comm as hc
    from hpcpar.parallel.grid import ProcessGrid
    from hpcpar.parallel.halo import halo_exchange
    from hpcpar.parallel.partition import conv_axis_halo, part_range
    from hpcpar.sync._buckets import Bucket, Pending, ReduceGroup

    skip_without_gpu()
    rank, size = comm.Get_rank(), comm.Get_size()
    grid = ProcessGrid(data=1, x=size, comm=comm)
    shape = (12, 6, 5)
    X = torch.randn(2, 3, *shape, generator=torch.Generator().manual_seed(5),
                    dtype=torch.float64)
    lo, hi = part_range(shape[0], size, rank)
    halos = [conv_axis_halo(shape[0], size, rank, 3, pad_lo=1)] + \
        [conv_axis_halo(n, 1, 0, 3, pad_lo=1) for n in shape[1:]]
    want = halo_exchange(X[:, :, lo:hi].clone(), grid, halos)
    src = X[:, :, lo:hi].cuda()
    for aware in ((False, True) if hc.detect_cuda_aware({}) else (False,)):
        with hc.forced_cuda_path(aware):
            for inside in (True, False):
                x = torch.zeros_like(src)
                torch.cuda.synchronize()
                stream = busy_stream()
                with torch.cuda.stream(stream):
                    x.copy_(src)
                    if inside:
                        got = halo_exchange(x, grid, halos)
                if not inside:
                    torch.cuda.current_stream().wait_stream(stream)
                    got = halo_exchange(x, grid, halos)
                torch.cuda.synchronize()  # `got` may have been finished on the side stream
                assert torch.equal(got.cpu(), want), f"halo (aware={aware}, inside={inside})"
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                t = torch.zeros(1 << 16, dtype=dtype, device="cuda")
                stream = busy_stream()
                with torch.cuda.stream(stream):
                    t.fill_(rank + 1.0)
                torch.cuda.current_stream().wait_stream(stream)
                hc.allreduce_(t, comm)
                assert torch.all(t == size * (size + 1) / 2).item(), f"allreduce {dtype}"
            p = torch.nn.Parameter(torch.zeros(300_000, device="cuda"))
            bucket = Bucket(0, [p], ReduceGroup(comm, 0, size))
            p.grad = bucket.views[0]
            stream = busy_stream()
            with torch.cuda.stream(stream):
                bucket.views[0].fill_(float(rank + 1))
            torch.cuda.current_stream().wait_stream(stream)
            bucket.launch()
            Pending.wait(bucket.pending)
            bucket.finalize()
            assert torch.all(p.grad == (size + 1) / 2).item(), f"bucket (aware={aware})"
