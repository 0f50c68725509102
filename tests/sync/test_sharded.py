"""``[train] shard_optimizer``: hpcpar.sync.sharded.ShardedOptimizer against the unsharded
optimizer on the same grid, model and data (exact up to fp32 rounding), its per-rank state
size, the global gradient norm over shards and the single-process state it consolidates."""

import torch
from torch import nn

import hpcpar
from hpcpar.run.grad_clip import norm_share, spatial_share, squared_norm
from hpcpar.sync.sharded import ShardedOptimizer
from hpcpar.testing import mpi_case

B = 2  # samples per data rank


def odd_cnn():
    """Parameter sizes 81, 3, 135, 5, 15, 3: none divisible by 2 or 4."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(1, 3, 3, padding=1), nn.ReLU(),
                         nn.Conv3d(3, 5, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(5, 3))


def adam(groups):
    return torch.optim.Adam(groups, lr=1e-2, weight_decay=1e-3, fused=True)


def _train(grid, shard: bool, steps: int = 20, layout=torch.contiguous_format):
    """``steps`` Adam steps of a spatialized CNN (every 5th step accumulates two
    micro-batches under no_sync) with its weights and inputs in ``layout``; returns the
    model, its optimizer and the global gradient norm of the last step as the trainer
    computes it."""
    from hpcpar.nn import spatialize
    from hpcpar.parallel.spatial import local_slices

    model = spatialize(odd_cnn(), grid).to(memory_format=layout)
    ddp = hpcpar.DDP(model, grid, bucket_cap_mb=1e-3, first_bucket_mb=1e-4)
    opt = ShardedOptimizer(ddp, adam, model.parameters()) if shard else adam(model.parameters())
    d = grid.coords[0]
    g = torch.Generator().manual_seed(4)
    norm = None
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for micro in range(2 if step % 5 == 4 else 1):
            x = torch.randn(grid.data * B, 1, 7, 6, 5, generator=g)
            y = torch.randn(grid.data * B, 3, generator=g)
            mine = slice(d * B, (d + 1) * B)
            xs = x[mine][local_slices(x[mine].shape, grid)].contiguous(memory_format=layout)
            context = ddp.no_sync() if micro == 0 and step % 5 == 4 else _nothing()
            with context:
                ((ddp(xs) - y[mine]) ** 2).mean().backward()
        share = (opt.norm_params(spatial_share(model, grid)) if shard
                 else norm_share(model, grid))
        norm = grid.comm.allreduce(squared_norm(share)) ** 0.5
        opt.step()
    return model, opt, norm


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _check_grid(comm, shape, layout=torch.contiguous_format):
    grid = hpcpar.ProcessGrid(*shape, comm=comm)
    plain, plain_opt, plain_norm = _train(grid, shard=False, layout=layout)
    sharded, sharded_opt, sharded_norm = _train(grid, shard=True, layout=layout)
    a, b = _flat(sharded), _flat(plain)
    assert ((a - b).norm() / b.norm()).item() <= 1e-6, shape
    for (n, p), q in zip(sharded.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"{shape} {n}")
    assert abs(sharded_norm - plain_norm) <= 1e-6 * plain_norm, (shape, sharded_norm, plain_norm)
    # every rank holds the same parameters (the all-gather reached everyone)
    blobs = comm.allgather(a.numpy().tobytes())
    assert len(set(blobs)) == 1
    # the consolidated state is the single-process optimizer's, and loads back exactly
    full, want = sharded_opt.state_dict(), plain_opt.state_dict()
    assert full["state"].keys() == want["state"].keys()
    for i, st in want["state"].items():
        for key, value in st.items():
            torch.testing.assert_close(full["state"][i][key], value, rtol=1e-4, atol=1e-7,
                                       msg=f"{shape} param {i} {key}")
    before = {id(t): {k: v.clone() for k, v in s.items()} for t, s in sharded_opt.state.items()}
    sharded_opt.load_state_dict(full)
    for t, st in sharded_opt.state.items():
        for k, v in st.items():
            assert torch.equal(v, before[id(t)][k]), (shape, k)


@mpi_case(nprocs=(2,), timeout=240)
def test_sharded_equals_unsharded_on_1x2x1x1(comm):
    _check_grid(comm, (1, 2, 1, 1))


@mpi_case(nprocs=(2,), timeout=240)
def test_sharded_channels_last_weights_and_resume_in_the_other_layout(comm):
    """Weights in channels_last_3d: the shards are cut in each parameter's memory order, so
    sharded equals unsharded there too; its consolidated state (channels-last tensors) loads
    into a sharded optimizer over the same model in NCDHW order and consolidates back to the
    same values."""
    cl = torch.channels_last_3d
    _check_grid(comm, (1, 2, 1, 1), layout=cl)
    grid = hpcpar.ProcessGrid(1, 2, 1, 1, comm=comm)
    _, opt, _ = _train(grid, shard=True, steps=3, layout=cl)
    _, other, _ = _train(grid, shard=True, steps=1)
    full = opt.state_dict()
    other.load_state_dict(full)
    back = other.state_dict()
    for i, st in full["state"].items():
        for key, value in st.items():
            assert torch.equal(back["state"][i][key], value), (i, key)


@mpi_case(nprocs=(4,), timeout=300)
def test_sharded_equals_unsharded_on_1x2x2x1_and_2x2x1x1(comm):
    for shape in ((1, 2, 2, 1), (2, 2, 1, 1)):
        _check_grid(comm, shape)


def _state_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values()
               for v in st.values() if torch.is_tensor(v) and v.dim() > 0)


@mpi_case(nprocs=(2, 4), timeout=120)
def test_adam_state_per_rank_is_one_over_r(comm):
    """R data replicas of an MLP with odd layer sizes (21 k parameters): each rank's Adam
    moments are at most 1/R + 5% of the unsharded optimizer's."""
    r = comm.Get_size()
    sizes = (6, 101, 203, 7)
    state = {}
    for shard in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:])])
        ddp = hpcpar.DDP(model, bucket_cap_mb=0.02, first_bucket_mb=0.005)
        opt = ShardedOptimizer(ddp, adam, model.parameters()) if shard \
            else adam(model.parameters())
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(comm.Get_rank()))
        ddp(x).square().mean().backward()
        opt.step()
        state[shard] = _state_bytes(opt)
    assert max(comm.allgather(state[True])) <= (1 / r + 0.05) * state[False], state
    assert sum(comm.allgather(state[True])) >= state[False]   # every element has its owner
