"""On a CUDA device: the halo exchange, its adjoint and the spatial collectives over every halo
transport this machine offers for CUDA tensors (``staged`` always, ``mpi`` with a
CUDA-aware MPI, ``nccl`` with a GPU per rank) equal the CPU MPI path bitwise, and ``auto``
picks what the guide says."""

import torch

from hpcpar.testing import mpi_case
from hpcpar.testing.gpu import requires_gpu, skip_without_gpu
from hpcpar.testing.oracles import randn, spatial_slices

pytestmark = requires_gpu()

GSHAPE = (9, 7, 6)


def _results(grid, device):
    """Halo exchange forward and adjoint, and a few spatial collectives, on ``device``
    (moved to the CPU)."""
    from hpcpar.parallel.comm import allgather, allreduce_
    from hpcpar.parallel.halo import halo_exchange
    from hpcpar.parallel.partition import conv_axis_halo

    comm, r = grid.spatial_comm, grid.spatial_comm.Get_rank()
    halos = [conv_axis_halo(n, grid.spatial_shape[a], grid.spatial_coords[a], 3, 1, 1)
             for a, n in enumerate(GSHAPE)]
    x = randn((2, 3, *GSHAPE), 1, torch.float64)[spatial_slices(GSHAPE, grid)]
    x = x.contiguous().to(device).requires_grad_()
    y = halo_exchange(x, grid, halos)
    (gx,) = torch.autograd.grad(y, [x], randn(y.shape, 2, torch.float64).to(device))
    v = randn((300,), 3 + r, torch.float64).to(device)
    out = [y.detach(), gx, allreduce_(v.clone(), comm), allreduce_(v.clone(), comm, "max"),
           allgather(v, comm), allreduce_(v.half(), comm)]
    for t in out:
        assert t.device.type == torch.device(device).type
    return [t.cpu() for t in out]


@mpi_case(nprocs=(2,), timeout=180)
def test_every_cuda_transport_equals_the_cpu_path(comm):
    import torch.distributed as dist

    from hpcpar.parallel.cuda_aware import cuda_aware
    from hpcpar.parallel.grid import ProcessGrid
    from hpcpar.parallel.torchdist import device_ident, shared_devices
    from hpcpar.parallel.transport import use_transport

    skip_without_gpu()
    device = torch.device("cuda", comm.Get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    grid = ProcessGrid(data=1, x=comm.Get_size(), comm=comm)
    want = _results(grid, "cpu")
    shared = shared_devices(comm.allgather(device_ident(device))) is not None
    names = ["staged"] + (["mpi"] if cuda_aware() else []) + \
        (["nccl"] if dist.is_nccl_available() and not shared else [])
    for name in names:
        transport = use_transport(grid, name, device)
        try:
            got = _results(grid, device)
        finally:
            transport.close()
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), f"{name}: result {i}"
    auto = use_transport(grid, "auto", device)
    auto.close()
    assert auto.name == ("nccl" if "nccl" in names else "mpi" if cuda_aware() else "staged")
    grid.free()
