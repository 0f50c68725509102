"""hpcpar.DistributedDataParallel against single-process torch on the same global batch."""

import os
import time

import pytest
import torch
from torch import nn

import hpcpar
from hpcpar.errors import CommError, ConfigError
from hpcpar.parallel.counters import COUNTERS
from hpcpar.sync._buckets import assign_buckets
from hpcpar.sync._compression import fold, wire_dtype_for
from hpcpar.sync.tags import tag_data_only
from hpcpar.testing import mpi_case

B = 3  # samples per rank


def mlp(dtype=torch.float32, seed=0, sizes=(6, 17, 9, 4)):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).to(dtype)


def batch(step, n, dtype=torch.float32, fin=6, fout=4):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(n, fin, generator=g, dtype=dtype),
            torch.randn(n, fout, generator=g, dtype=dtype))


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def same_everywhere(comm, tensors):
    """Bitwise equality across ranks of a list of tensors."""
    blob = b"".join(t.detach().contiguous().numpy().tobytes() for t in tensors)
    return len(set(comm.allgather(blob))) == 1


def step_both(ddp, opt, ref, ref_opt, x, y, mine: slice):
    """One step of the distributed model on this rank's rows ``mine`` and one of the
    single-process reference on the whole batch."""
    opt.zero_grad()
    loss_fn(ddp, x[mine], y[mine]).backward()
    opt.step()
    ref_opt.zero_grad()
    loss_fn(ref, x, y).backward()
    ref_opt.step()


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


# -------------------------------------------------------------------------------- serial ----
def test_fold_order_is_grouped_then_across_groups():
    rows = torch.tensor([[1e8], [1.0], [-1e8], [1.0]], dtype=torch.float32)
    out = torch.empty(1)
    fold(rows, [[0, 1, 2, 3]], out)          # ((1e8 + 1) - 1e8) + 1 = 1 in fp32
    assert out.item() == 1.0
    fold(rows, [[0, 1], [2, 3]], out)        # (1e8 + 1) + (-1e8 + 1) = 0 in fp32
    assert out.item() == 0.0
    fold(rows.to(torch.float16).clamp(-6e4, 6e4), [[0], [1], [2, 3]], out)
    assert out.dtype == torch.float32


def test_fold_in_place_on_own_row_matches_out_of_place():
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(64, generator=g) * 10.0 ** k for k in range(5)]
    for groups in ([[0, 1, 2, 3, 4]], [[0], [1], [2], [3], [4]], [[0, 1], [2, 3, 4]]):
        want = fold(base, groups, torch.empty(64))
        simple = len(groups) == 1 or all(len(x) == 1 for x in groups)
        for own in range(5) if simple else ():
            rows = [t.clone() for t in base]
            got = fold(rows, groups, rows[own])
            assert got is rows[own] and torch.equal(got, want), (groups, own)


def test_assign_buckets_caps_and_compression_names():
    ps = [torch.zeros(n) for n in (10, 10, 300, 5, 5)]
    sizes = [[p.numel() for p in b] for b in assign_buckets(ps, cap_bytes=400,
                                                             first_cap_bytes=50)]
    assert sizes == [[10], [10, 300], [5, 5]]
    sizes = [[p.numel() for p in b] for b in assign_buckets(ps, cap_bytes=40,
                                                             first_cap_bytes=1000)]
    assert sizes == [[10, 10], [300], [5, 5]]
    sizes = [[p.numel() for p in b] for b in assign_buckets(ps[2:] + ps[:2], cap_bytes=40,
                                                             first_cap_bytes=4)]
    assert sizes == [[300], [5, 5], [10], [10]]
    assert wire_dtype_for("bf16") == torch.bfloat16 and wire_dtype_for(None) is None
    with pytest.raises(ConfigError, match="compression='int8'"):
        wire_dtype_for("int8")


# ----------------------------------------------------------------------------------- MPI ----
@mpi_case(nprocs=(1, 4), timeout=60)
def test_training_matches_single_process(comm):
    """N SGD steps on data=P ranks == one process on the concatenated batch; ranks stay
    bitwise identical after every step; parameters broadcast from rank 0 at construction."""
    r, P = comm.Get_rank(), comm.Get_size()
    grid = hpcpar.ProcessGrid(data=P)
    for dtype, tol, caps in [(torch.float32, 1e-6, {}),
                             (torch.float64, 1e-12, {"bucket_cap_mb": 1e-3,
                                                     "first_bucket_mb": 2e-4})]:
        model = mlp(dtype, seed=r)  # rank-dependent init: the broadcast must fix it
        ddp = hpcpar.DDP(model, grid, **caps)
        ref = mlp(dtype, seed=0)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        before = COUNTERS.snapshot()
        for step in range(3):
            x, y = batch(step, B * P, dtype)
            step_both(ddp, opt, ref, ref_opt, x, y, slice(r * B, (r + 1) * B))
            for p, q in zip(model.parameters(), ref.parameters()):
                assert rel_err(p, q) <= tol, (dtype, step, rel_err(p, q))
            assert same_everywhere(comm, list(model.parameters()))
        stats = COUNTERS.since(before)
        if P > 1:
            assert stats["bytes_allreduce"] > 0 and stats["t_allreduce_total"] > 0
        else:  # one rank communicates nothing: no bytes, no communication time
            assert stats["bytes_allreduce"] == 0 and stats["t_allreduce_total"] == 0
        assert ddp.sync_steps == 3
        if caps:
            assert len(ddp.bucket_layout) > 2
            assert ddp.bucket_layout[0] == ["4.bias"]  # reverse registration order


@mpi_case(nprocs=(1, 4), timeout=60)
def test_no_sync_accumulation_equals_big_batch(comm):
    r, P = comm.Get_rank(), comm.Get_size()
    grid = hpcpar.ProcessGrid(data=P)
    model, ref = mlp(), mlp()
    ddp = hpcpar.DDP(model, grid)
    micro = 2
    xs, ys = batch(7, micro * B * P)
    x, y = xs[:B * P], ys[:B * P]
    loss = loss_fn(ddp, x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]) / micro
    with ddp.no_sync():  # the context around backward decides
        loss.backward()
    assert ddp.sync_steps == 0
    local = grads(model)
    x, y = xs[B * P:], ys[B * P:]
    (loss_fn(ddp, x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]) / micro).backward()
    loss_fn(ref, xs, ys).backward()
    assert ddp.sync_steps == 1
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-6
    if P > 1:  # no communication happened inside no_sync: the local grads differed
        assert not same_everywhere(comm, local)
    assert same_everywhere(comm, grads(model))


def _fake_node_grid(P):
    os.environ["HPCPAR_FAKE_NODES"] = "2"
    try:
        return hpcpar.ProcessGrid(data=P)
    finally:
        del os.environ["HPCPAR_FAKE_NODES"]


@mpi_case(nprocs=(4,), timeout=60)
def test_hierarchical_is_bitwise_flat_and_compression_is_close(comm):
    r, P = comm.Get_rank(), comm.Get_size()
    grid = _fake_node_grid(P)
    assert grid.num_nodes == 2
    sizes = (6, 37, 23, 4)  # odd sizes: padding to a multiple of the ranks

    def run(**kw):
        model = mlp(sizes=sizes)
        ddp = hpcpar.DDP(model, grid, bucket_cap_mb=2e-3, first_bucket_mb=5e-4, **kw)
        # rank-scaled inputs spread the magnitudes, so summation order shows in the bits
        x, y = batch(3, B * P)
        x = x * (1 + 1000 * (torch.arange(B * P) // B)[:, None])
        loss_fn(ddp, x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]).backward()
        return ddp, grads(model)

    flat_ddp, flat = run(hierarchical=False)
    hier_ddp, hier = run(hierarchical=True)
    auto_ddp, auto = run()
    assert not flat_ddp.hierarchical and hier_ddp.hierarchical and auto_ddp.hierarchical
    for a, b, c in zip(flat, hier, auto):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert same_everywhere(comm, hier)
    for name, tol in [("fp16", 2e-3), ("bf16", 1.6e-2)]:
        for hierarchical in (False, True):
            _, low = run(compression=name, hierarchical=hierarchical)
            assert same_everywhere(comm, low)
            for a, b in zip(low, flat):
                assert a.dtype == torch.float32 and rel_err(a, b) <= tol, (name, rel_err(a, b))


@mpi_case(nprocs=(2, 4), timeout=90)
def test_shared_memory_buckets_are_bitwise_the_flat_path(comm):
    """On one node, big full-precision CPU buckets live in an MPI shared-memory window and
    are reduced by direct loads: bitwise the message path's results, every step, on every
    rank, and the single-process model on the whole batch; unused parameters stay None."""
    r, P = comm.Get_rank(), comm.Get_size()
    grid = hpcpar.ProcessGrid(data=P)
    sizes = (64, 515, 257, 4)  # buckets far above the one-round threshold, odd lengths

    def inputs(step, scale):
        x, y = batch(step, B * P, fin=64)
        return x * (1 + scale * (torch.arange(B * P) // B)[:, None]), y  # order shows in bits

    def run(shm: str, scale: float, steps: int = 3):
        os.environ["HPCPAR_DDP_SHM"] = shm
        try:
            model = mlp(sizes=sizes)
            ddp = hpcpar.DDP(model, grid, bucket_cap_mb=0.25, first_bucket_mb=0.01)
        finally:
            del os.environ["HPCPAR_DDP_SHM"]
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(steps):
            x, y = inputs(step, scale)
            opt.zero_grad(set_to_none=step % 2 == 0)
            loss_fn(ddp, x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]).backward()
            assert same_everywhere(comm, grads(model))
            opt.step()
        return {b.plan for b in ddp._buckets}, grads(model), [p.detach() for p in
                                                              model.parameters()]

    plans, g_shm, p_shm = run("1", 1000, steps=1)
    flat_plans, g_flat, p_flat = run("0", 1000, steps=1)
    assert "shared" in plans and "shared" not in flat_plans and "flat" in flat_plans
    for a, b in zip(g_shm + p_shm, g_flat + p_flat):
        assert torch.equal(a, b)
    _, _, p_shm = run("1", 0)
    ref = mlp(sizes=sizes)  # one process, the whole batch, same steps
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(3):
        x, y = inputs(step, 0)
        opt.zero_grad()
        loss_fn(ref, x, y).backward()
        opt.step()
    for a, b in zip(p_shm, ref.parameters()):
        assert rel_err(a, b) <= 1e-6


@mpi_case(nprocs=(4,), timeout=60)
def test_data_only_parameters_reduce_over_data_axis(comm):
    """data=2 x x=2: default params SUM over the spatial pair and AVERAGE over data; a tagged
    parameter AVERAGES over data only (and is broadcast along data only)."""
    r = comm.Get_rank()
    grid = hpcpar.ProcessGrid(data=2, x=2)
    i = grid.coords[1]
    model = mlp(seed=0)
    with torch.no_grad():  # tensor-parallel-like shard: differs along x
        model[2].weight.add_(i)
    tag_data_only(model[2].weight)
    plain = mlp(seed=0)
    plain.load_state_dict(model.state_dict())
    ddp = hpcpar.DDP(model, grid)
    x, y = batch(5, 4 * B)
    part = slice(r * B, (r + 1) * B)  # every rank its own samples: grads all differ
    loss_fn(ddp, x[part], y[part]).backward()
    loss_fn(plain, x[part], y[part]).backward()
    everyone = comm.allgather([p.grad for p in plain.parameters()])
    same_x = [rank for rank in range(4) if rank % 2 == i]
    for k, p in enumerate(model.parameters()):
        if p is model[2].weight:
            want = sum(everyone[q][k] for q in same_x) / 2
        else:
            want = sum(everyone[q][k] for q in range(4)) / 2
        assert rel_err(p.grad, want) <= 1e-6, k
    assert torch.equal(model[2].weight, plain[2].weight)  # own shard kept (data rank 0 = same x)


@mpi_case(nprocs=(4,), timeout=60)
def test_different_model_is_the_same_clear_error_everywhere(comm):
    r, P = comm.Get_rank(), comm.Get_size()
    grid = hpcpar.ProcessGrid(data=P)
    normal = (6, 17, 9, 4)
    for sizes, needle in [(normal if r != 2 else (6, 17, 8, 4), "'2.weight' has shape"),
                          (normal if r != 3 else normal + (4,), "rank 3 has 8 parameters")]:
        with pytest.raises(CommError) as info:
            hpcpar.DDP(mlp(sizes=sizes), grid)
        msg = str(info.value)
        assert needle in msg and "rank 0" in msg, msg
        assert len(set(comm.allgather(msg))) == 1


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(6, 4)   # used on even ranks only
        self.c = nn.Linear(6, 4)   # never used
        self.d = nn.Linear(4, 4)

    def forward(self, x, use_b):
        h = self.a(x) + (self.b(x) if use_b else 0)
        return self.d(torch.tanh(h))


@mpi_case(nprocs=(1, 4), timeout=60)
def test_unused_parameters_do_not_hang(comm):
    r, P = comm.Get_rank(), comm.Get_size()
    grid = hpcpar.ProcessGrid(data=P)
    model, plain = Branchy(), Branchy()
    ddp = hpcpar.DDP(model, grid, bucket_cap_mb=1e-4, first_bucket_mb=1e-4)
    x, y = batch(9, B * P)
    part = slice(r * B, (r + 1) * B)
    for _ in range(2):  # second step: grads set to None by zero_grad, same result
        ddp.zero_grad()
        loss_fn(lambda z: ddp(z, r % 2 == 0), x[part], y[part]).backward()
    loss_fn(lambda z: plain(z, r % 2 == 0), x[part], y[part]).backward()
    everyone = comm.allgather({n: p.grad for n, p in plain.named_parameters()})
    for n, p in model.named_parameters():
        if n.startswith("c."):
            assert p.grad is None
            continue
        want = sum(e[n] if e[n] is not None else 0 for e in everyone) / P
        assert rel_err(p.grad, want) <= 1e-6, n
    assert same_everywhere(comm, [p.grad for n, p in model.named_parameters()
                                  if not n.startswith("c.")])


@mpi_case(nprocs=(1,), timeout=30)
def test_state_dict_is_the_modules():
    grid = hpcpar.ProcessGrid()
    model = mlp()
    ddp = hpcpar.DDP(model, grid)
    assert ddp.module is model
    assert list(ddp.state_dict()) == list(model.state_dict())
    other = mlp(seed=1)
    ddp.load_state_dict({"module." + k: v for k, v in other.state_dict().items()})
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters()))
    with pytest.raises(hpcpar.HpcparError, match="hierarchical"):
        hpcpar.DDP(model, grid, hierarchical="yes")


def small_cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.ReLU(),
                         nn.Conv3d(4, 4, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(4, 2))


@mpi_case(nprocs=(4,), timeout=60)
def test_spatial_cnn_data2_x2_matches_single_process(comm):
    """Spatialized CNN on data=2 x x=2: convs sum over x and average over data, the head
    (data-only after the global pool) averages over data; == one process, whole batch
    (fp64: every tensor to 1e-12; fp32: the parameter vector to 1e-6)."""
    from hpcpar.nn import spatialize
    from hpcpar.parallel.spatial import local_slices

    grid = hpcpar.ProcessGrid(data=2, x=2)
    d = grid.coords[0]
    for dtype, tol in [(torch.float64, 1e-12), (torch.float32, 1e-6)]:
        ref = small_cnn().to(dtype)
        model = spatialize(small_cnn().to(dtype), grid)
        ddp = hpcpar.DDP(model, grid, bucket_cap_mb=1e-3, first_bucket_mb=1e-4)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        g = torch.Generator().manual_seed(4)
        for step in range(3):
            x = torch.randn(2 * B, 1, 7, 5, 4, generator=g, dtype=dtype)
            y = torch.randn(2 * B, 2, generator=g, dtype=dtype)
            mine = slice(d * B, (d + 1) * B)
            opt.zero_grad()
            loss_fn(ddp, x[mine][local_slices(x[mine].shape, grid)], y[mine]).backward()
            opt.step()
            ref_opt.zero_grad()
            loss_fn(ref, x, y).backward()
            ref_opt.step()
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                assert dtype == torch.float32 or rel_err(p, q) <= tol, (step, n, rel_err(p, q))
            # fp32: a 2-element bias alone can drift ~1e-6 from reordered sums; the whole
            # parameter vector is what "the same parameters" means
            flat = torch.cat([p.reshape(-1) for p in model.parameters()])
            want = torch.cat([q.reshape(-1) for q in ref.parameters()])
            assert rel_err(flat, want) <= tol, (step, rel_err(flat, want))
            assert same_everywhere(comm, list(model.parameters()))


@mpi_case(nprocs=(1, 2), timeout=60)
def test_channels_last_weights_train_like_one_process(comm):
    """Convolution weights in channels_last_3d (``[train] channels_last``): each gradient's
    bucket view takes its parameter's strides, so torch's fused and foreach Adam, which walk
    a parameter and its gradient as raw memory, update exactly as on one process (a dense
    NCDHW view put those weights 1e-2 off in three steps)."""
    r, P = comm.Get_rank(), comm.Get_size()
    grid = hpcpar.ProcessGrid(data=P)
    cl = torch.channels_last_3d
    for kind in ("fused", "foreach"):
        model, ref = small_cnn().to(memory_format=cl), small_cnn().to(memory_format=cl)
        ddp = hpcpar.DDP(model, grid, bucket_cap_mb=1e-3, first_bucket_mb=2e-4)
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-2, **{kind: True})
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, **{kind: True})
        g = torch.Generator().manual_seed(4)
        for _ in range(3):
            x = torch.randn(P * B, 1, 6, 5, 4, generator=g).to(memory_format=cl)
            y = torch.randn(P * B, 2, generator=g)
            step_both(ddp, opt, ref, ref_opt, x, y, slice(r * B, (r + 1) * B))
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.stride() == q.stride(), (kind, n)
            assert rel_err(p, q) <= 1e-5, (kind, n, rel_err(p, q))
            assert p.grad.stride() == p.stride(), (kind, n)


class _Delay(torch.autograd.Function):
    """Identity whose backward sleeps: ranks reach their gradient hooks at different times."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


@mpi_case(nprocs=(4,), timeout=60)
def test_ranks_at_different_speeds(comm):
    """Bucket stages start whenever each rank notices the previous one finished, so they
    interleave differently on every rank; the result must not depend on it (MPI requires the
    same collective order per communicator: a bucket-private one makes that true)."""
    r, P = comm.Get_rank(), comm.Get_size()
    grid = hpcpar.ProcessGrid(data=P)
    model, ref = mlp(sizes=(6, 40, 40, 40, 4)), mlp(sizes=(6, 40, 40, 40, 4))
    ddp = hpcpar.DDP(model, grid, bucket_cap_mb=2e-3, first_bucket_mb=1e-4)
    assert len(ddp.bucket_layout) >= 4
    x, y = batch(11, B * P)

    def slow(z):
        for k, layer in enumerate(model):
            z = layer(z)
            if isinstance(layer, nn.Linear):
                z = _Delay.apply(z, 0.01 * ((r + k) % 3))
        return z

    for _ in range(2):
        ddp.zero_grad()
        loss_fn(slow, x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]).backward()
    loss_fn(ref, x, y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-6
    assert same_everywhere(comm, grads(model))


def _shared_memory_kib() -> int:
    """This process's resident shared memory (MPI shared-memory windows live there)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))


@mpi_case(nprocs=(2,), timeout=90)
def test_close_returns_the_windows_and_keeps_the_gradients(comm):
    """close() frees every bucket window, communicator and the stall detector's window now,
    not at exit: twelve wrappers of a 4 MB model in a row leave the shared memory and the
    exit list where one wrapper left them; ``.grad`` survives its window; a closed wrapper
    refuses to run (its gradients would silently stop being synchronised)."""
    from hpcpar.parallel import buffers

    r = comm.Get_rank()
    grid = hpcpar.ProcessGrid(data=2)
    sizes = (64, 1024, 960, 4)   # ~4.2 MB of fp32 gradients: shared-memory buckets

    def one_step():
        model = mlp(sizes=sizes)
        ddp = hpcpar.DDP(model, grid, bucket_cap_mb=1, first_bucket_mb=0.05)
        assert "shared" in {b.plan for b in ddp._buckets}
        x, y = batch(0, 2 * B, fin=64)
        loss_fn(ddp, x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]).backward()
        return model, ddp

    exits = len(buffers._AT_EXIT)
    model, ddp = one_step()
    assert len(buffers._AT_EXIT) > exits
    before = grads(model)
    ddp.close()
    ddp.close()   # twice: nothing more happens
    assert len(buffers._AT_EXIT) == exits and ddp._stall.win is None
    for p, g in zip(model.parameters(), before):
        assert torch.equal(p.grad, g)
        p.grad.add_(1)   # its own memory now, not a freed window
    with pytest.raises(CommError, match="after close"):
        ddp(torch.zeros(1, 64))
    comm.Barrier()
    base = _shared_memory_kib()
    for _ in range(12):
        with one_step()[1]:
            pass
    comm.Barrier()
    grown = _shared_memory_kib() - base
    assert len(buffers._AT_EXIT) == exits
    assert grown < 4 * 1024, f"{grown} KiB of shared memory kept by closed wrappers"
    with hpcpar.DDP(mlp(), grid, grad_sync="gloo") as gloo:   # a torch.distributed group
        loss_fn(gloo, *batch(1, B)).backward()
        assert len(buffers._AT_EXIT) > exits
    assert len(buffers._AT_EXIT) == exits


@mpi_case(nprocs=(2,), timeout=120)
def test_a_replan_releases_the_buckets_it_replaces(comm):
    """A spatialized model wrapped before its first forward re-plans its buckets after it
    (the head turns out data-only): the old buckets' windows and communicators are freed
    then (with a sharded optimizer: once it has moved its state), so a wrapper holds
    exactly the resources of its current plan."""
    from hpcpar.nn import spatialize
    from hpcpar.parallel import buffers
    from hpcpar.parallel.spatial import local_slices
    from hpcpar.sync.sharded import ShardedOptimizer

    grid = hpcpar.ProcessGrid(x=2)
    x = torch.randn(B, 1, 8, 6, 5, generator=torch.Generator().manual_seed(1))
    y = torch.randn(B, 2, generator=torch.Generator().manual_seed(2))
    for sharded in (False, True):
        exits = len(buffers._AT_EXIT)
        ddp = hpcpar.DDP(spatialize(small_cnn(), grid), grid, bucket_cap_mb=1e-3,
                         first_bucket_mb=1e-4)
        old = list(ddp._buckets)
        def adam(params):
            return torch.optim.Adam(params, lr=1e-2)

        opt = ShardedOptimizer(ddp, adam, ddp.parameters()) if sharded else adam(ddp.parameters())
        loss = loss_fn(ddp, x[local_slices(x.shape, grid)], y)
        assert ddp._buckets != old
        assert bool(ddp._retired) == sharded   # kept until the optimizer moved its state
        loss.backward()
        opt.step()
        assert not ddp._retired and all(b.channel == () for b in old)
        planned = len(buffers._AT_EXIT) - exits
        ddp.close()
        assert len(buffers._AT_EXIT) == exits
        fresh = hpcpar.DDP(spatialize(small_cnn(), grid), grid, bucket_cap_mb=1e-3,
                           first_bucket_mb=1e-4)
        fresh(x[local_slices(x.shape, grid)])   # plans once from the tags it learns
        assert len(buffers._AT_EXIT) - exits == planned
        fresh.close()
