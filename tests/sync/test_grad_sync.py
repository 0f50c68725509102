"""``grad_sync``: NCCL for gradient buckets, bootstrapped from MPI. On CPU: the clear error,
and the whole torch.distributed path (rendezvous over MPI, buckets, overlap, no_sync) run
with a Gloo group, which must give the MPI path's gradients bitwise. NCCL itself: tests/gpu."""

import pytest
import torch
from torch import nn

from hpcpar.errors import ConfigError
from hpcpar.sync._torchdist import check_grad_sync, rendezvous_host, shared_devices
from hpcpar.sync.ddp import DistributedDataParallel
from hpcpar.sync.tags import tag_data_only
from hpcpar.testing import mpi_case


def mlp(seed=0, sizes=(6, 40, 300, 4)):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def batch(step, rank, n=3):
    g = torch.Generator().manual_seed(1000 + 17 * step + rank)
    return torch.randn(n, 6, generator=g), torch.randn(n, 4, generator=g)


# -------------------------------------------------------------------------------- serial ----
def test_nccl_on_cpu_is_one_clear_config_error():
    with pytest.raises(ConfigError) as err:
        DistributedDataParallel(nn.Linear(3, 2), grad_sync="nccl")
    msg = str(err.value)
    assert "\n" not in msg and "grad_sync='nccl'" in msg and "on cpu" in msg \
        and "grad_sync='mpi'" in msg
    with pytest.raises(ConfigError, match="grad_sync='udp', expected 'mpi' or 'nccl'"):
        check_grad_sync("udp", {"cpu"})
    assert check_grad_sync("mpi", {"cpu"}) is None
    assert check_grad_sync("gloo", {"cpu"}) == "gloo"


def test_nccl_rank_pairs_sharing_a_gpu_are_named():
    assert shared_devices([("a", "u0"), ("a", "u1"), ("b", "u0")]) is None
    assert shared_devices([("a", "u0"), ("a", "u1"), ("a", "u0")]) == (0, 2)


def test_rendezvous_host_is_loopback_on_one_host():
    assert rendezvous_host(["n1", "n1"]) == "127.0.0.1"
    # across hosts: rank 0's first non-loopback address, its name where it has none
    assert rendezvous_host(["no-such-host.invalid", "b"]) == "no-such-host.invalid"
    assert rendezvous_host(["localhost", "b"]) == "localhost"


# ------------------------------------------------------------------------------ 1-2 ranks --
def _train(comm, grad_sync, bucket_cap_mb):
    """Three steps: a plain one, a no_sync accumulation + synced one, one where a layer gets
    no gradient; returns every step's gradients."""
    rank = comm.Get_rank()
    model = mlp()
    ddp = DistributedDataParallel(model, grad_sync=grad_sync, bucket_cap_mb=bucket_cap_mb,
                                  first_bucket_mb=0.001)
    out = []
    for step in range(3):
        model.zero_grad(set_to_none=True)
        if step == 1:
            with ddp.no_sync():
                x, y = batch(10 + step, rank)
                ((ddp(x) - y) ** 2).mean().backward()
        x, y = batch(step, rank)
        if step == 2:
            for p in model[0].parameters():
                p.requires_grad_(False)
        ((ddp(x) - y) ** 2).mean().backward()
        out.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        for p in model[0].parameters():
            p.requires_grad_(True)
    return ddp, out


@mpi_case(nprocs=(1, 2), timeout=120)
def test_gloo_group_bootstrapped_from_mpi_equals_mpi_path(comm):
    for cap in (0.01, 25):  # many buckets (overlap, ordered launches) and one bucket
        ddp_mpi, want = _train(comm, "mpi", cap)
        ddp_gloo, got = _train(comm, "gloo", cap)
        assert ddp_gloo.bucket_layout == ddp_mpi.bucket_layout
        assert len(ddp_gloo.bucket_layout) > (1 if cap < 1 else 0)
        for s, (g_step, w_step) in enumerate(zip(got, want)):
            for g, w in zip(g_step, w_step):
                assert (g is None) == (w is None), s
                if g is not None:
                    assert torch.equal(g, w), (cap, s)
        ddp_mpi.remove_hooks()
        ddp_gloo.remove_hooks()


@mpi_case(nprocs=(2,), timeout=120)
def test_gloo_data_only_group_over_the_data_axis(comm):
    """x=2 spatial ranks: a data-only parameter reduces over the (size-1) data group, a
    replicated one over both ranks; the Gloo groups are made on both communicators."""
    from hpcpar.parallel.grid import ProcessGrid

    grid = ProcessGrid(data=1, x=2, comm=comm)
    results = []
    for grad_sync in ("mpi", "gloo"):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        tag_data_only(model.bias)
        ddp = DistributedDataParallel(model, grid, grad_sync=grad_sync)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(comm.Get_rank()))
        ddp(x).pow(2).sum().backward()
        results.append([p.grad.clone() for p in model.parameters()])
        ddp.remove_hooks()
    for a, b in zip(*results):
        assert torch.equal(a, b)
