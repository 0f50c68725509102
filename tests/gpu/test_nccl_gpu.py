"""On CUDA devices: ``DistributedDataParallel(grad_sync="nccl")`` (a NCCL group bootstrapped
from MPI) trains exactly like the MPI path and single process; with fewer GPUs than ranks it
is one clear error on every rank (NCCL cannot put two ranks on one GPU)."""

import pytest
import torch

from hpcpar.testing import mpi_case
from hpcpar.testing.gpu import requires_gpu, skip_without_gpu

pytestmark = requires_gpu()


def _model(device, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.Tanh(), torch.nn.Linear(64, 300),
                               torch.nn.Tanh(), torch.nn.Linear(300, 4)).to(device)


def _grads(comm, device, grad_sync):
    """Gradients after a plain step, a no_sync-accumulated step, and a step where one layer
    has no gradient."""
    from hpcpar.sync.ddp import DistributedDataParallel

    rank = comm.Get_rank()
    model = _model(device)
    ddp = DistributedDataParallel(model, grad_sync=grad_sync, bucket_cap_mb=0.02,
                                  first_bucket_mb=0.001)
    assert len(ddp.bucket_layout) > 2
    out = []
    for step in range(3):
        model.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(3, 6, generator=g).to(device), torch.randn(3, 4, generator=g).to(device)
        if step == 1:
            with ddp.no_sync():
                ((ddp(x) - y) ** 2).mean().backward()
        for p in model[0].parameters():
            p.requires_grad_(step != 2)
        ((ddp(x) - y) ** 2).mean().backward()
        out.append([None if p.grad is None else p.grad.cpu() for p in model.parameters()])
    ddp.remove_hooks()
    return out


@mpi_case(nprocs=(1, 2), timeout=180)
def test_nccl_grad_sync_equals_mpi(comm):
    from hpcpar.errors import CommError

    skip_without_gpu()
    torch.backends.cuda.matmul.allow_tf32 = False
    size, rank = comm.Get_size(), comm.Get_rank()
    gpus = torch.cuda.device_count()
    if gpus < size:
        device = torch.device("cuda", 0)
        with pytest.raises(CommError, match="share one GPU"):
            _grads(comm, device, "nccl")
        return
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    want = _grads(comm, device, "mpi")
    got = _grads(comm, device, "nccl")
    for step, (gs, ws) in enumerate(zip(got, want)):
        for g, w in zip(gs, ws):
            assert (g is None) == (w is None), step
            if g is not None:  # 1-2 ranks: a + b is the same sum in any order
                assert torch.equal(g, w), step
