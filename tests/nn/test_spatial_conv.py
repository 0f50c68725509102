"""SpatialConv3d / SpatialConvTranspose3d against torch on the full volume.

Every rank builds the same global data (seeded), runs the torch twin on the whole volume and
the spatial layer on its sub-volume, and compares the forward output, the input gradient and
the spatial-group sum of the weight/bias gradients. Cases are sampled (seeded) so every
listed value of each parameter appears at least once; all run inside a few MPI launches.
"""

from __future__ import annotations

import random

import pytest
import torch
from mpi4py import MPI
from torch import nn

from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import (
    FP32_TOL,
    FP64_TOL,
    SPATIAL_GRIDS,
    compare_with_twin,
    cover,
    on_subgrid,
    rel_err,
    spatial_slices,
)


# ---- cases -------------------------------------------------------------------------------
def conv_cases(world: int):
    """Sampled SpatialConv3d cases that fit ``world`` ranks."""
    rng = random.Random(3)
    usable = [(d, g) for g in SPATIAL_GRIDS for d in (1, 2) if d * g[0] * g[1] * g[2] <= world]
    n = max(12, len(usable))
    base = cover(rng, n, kernel=[1, 2, 3, 5], stride=[1, 2, 3],
                 padding=[0, 1, 2, "same", "valid"],
                 dilation=[1, 2], size=[17, 31, 64, 12], dtype=[torch.float32, torch.float64],
                 groups=[1, 2], bias=[True, False])
    out = []
    for i, c in enumerate(base):
        data, dims = usable[i % len(usable)]
        if c["padding"] == "same":
            c["stride"] = 1
        sizes = [12, 13, 14]
        axis = rng.randrange(3)
        sizes[axis] = c["size"]
        c.update(data=data, dims=dims, shape=tuple(sizes))
        out.append(c)
    return out


def transposed_cases(world: int):
    rng = random.Random(5)
    usable = [(d, g) for g in SPATIAL_GRIDS for d in (1, 2) if d * g[0] * g[1] * g[2] <= world]
    # (kernel, stride, padding, output_padding, dilation): k != s among them
    geoms = [(2, 2, 0, 0, 1), (3, 2, 1, 1, 1), (4, 2, 1, 0, 1), (1, 2, 0, 1, 1),
             (3, 3, 0, 2, 2), (5, 2, 2, 1, 1), (3, 1, 1, 0, 1), (2, 3, 1, 0, 2),
             (1, 3, 0, 0, 1)]  # the last one leaves outputs that receive no input
    cases = []
    for i, geom in enumerate(geoms):
        data, dims = usable[(2 * i + 1) % len(usable)]
        sizes = [rng.choice([5, 6, 7]) for _ in range(3)]
        sizes[i % 3] = [17, 9, 31][i % 3]
        cases.append(dict(geom=geom, data=data, dims=dims, shape=tuple(sizes),
                          dtype=[torch.float32, torch.float64][i % 2], groups=1 + i % 2,
                          bias=i % 3 != 2))
    return cases


def edge_cases():
    """Geometry corners: outputs reading only padding, ranks owning no output, strided trims."""
    base = dict(dilation=1, groups=1, bias=True, dtype=torch.float64, data=1, dims=(3, 1, 1))
    return [dict(base, kernel=1, stride=1, padding=3, shape=(4, 5, 5)),   # rank 2: pad only
            dict(base, kernel=2, stride=3, padding=0, shape=(7, 5, 5)),   # M=2 < 3 ranks
            dict(base, kernel=1, stride=3, padding=1, shape=(17, 4, 4)),  # trims owned items
            dict(base, kernel=5, stride=1, padding=4, dilation=2, shape=(5, 5, 12),
                 dims=(1, 1, 3))]


def _run_conv(comm, cases, batch=2):
    from hpcpar.nn import SpatialConv3d

    for c in cases:
        def check(grid, c=c):
            args = dict(kernel_size=c["kernel"], stride=c["stride"], padding=c["padding"],
                        dilation=c["dilation"], groups=c["groups"], bias=c["bias"])
            torch.manual_seed(7)
            twin = nn.Conv3d(2, 4, **args)
            spatial = SpatialConv3d(2, 4, **args, grid=grid)
            compare_with_twin(grid, twin, spatial, c["shape"], 2, c["dtype"], batch=batch,
                              what=f"conv {c} batch {batch}")
        on_subgrid(comm, c["data"], c["dims"], check)


def _run_transposed(comm, cases):
    from hpcpar.nn import SpatialConvTranspose3d

    for c in cases:
        def check(grid, c=c):
            k, s, p, op, d = c["geom"]
            args = dict(kernel_size=k, stride=s, padding=p, output_padding=op, dilation=d,
                        groups=c["groups"], bias=c["bias"])
            torch.manual_seed(11)
            twin = nn.ConvTranspose3d(2, 4, **args)
            spatial = SpatialConvTranspose3d(2, 4, **args, grid=grid)
            compare_with_twin(grid, twin, spatial, c["shape"], 2, c["dtype"],
                              what=f"conv_transpose {c}")
        on_subgrid(comm, c["data"], c["dims"], check)


# ---- serial ------------------------------------------------------------------------------
def test_case_sampling_covers_every_value():
    cases = conv_cases(8)
    for key, vals in dict(kernel=[1, 2, 3, 5], dilation=[1, 2], size=[17, 31, 64]).items():
        assert {c[key] for c in cases} >= set(vals)
    assert {c["padding"] for c in cases} >= {0, 1, 2, "same"}
    assert {c["stride"] for c in cases} >= {1, 2, 3}
    assert {(c["data"], c["dims"]) for c in conv_cases(8) + conv_cases(6) + conv_cases(3)} >= \
        {(1, g) for g in SPATIAL_GRIDS}
    assert any(g[0] != g[3] for g in
               (c["geom"] for c in transposed_cases(4)))  # k != s is present


def test_batch_one_runs_on_onednn_and_matches_torch(monkeypatch):
    """Where torch's own rule picks its slow im2col kernel (fp32, batch 1, small C*D*H), the
    layer runs oneDNN instead, and still equals torch: output, input and parameter gradients,
    in both memory formats (the input gradient in the input's)."""
    from hpcpar import ProcessGrid
    from hpcpar.nn import SpatialConv3d, conv

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    calls = []
    real = torch.mkldnn_convolution
    monkeypatch.setattr(torch, "mkldnn_convolution",
                        lambda *a: calls.append(a[0].shape) or real(*a))
    grid = ProcessGrid(1, 1, 1, 1, comm=MPI.COMM_SELF)
    for fmt in (torch.contiguous_format, torch.channels_last_3d):
        torch.manual_seed(2)
        twin = nn.Conv3d(16, 8, 3, padding=1)
        spatial = SpatialConv3d(16, 8, 3, padding=1, grid=grid)
        spatial.load_state_dict(twin.state_dict())
        X = torch.randn(1, 16, 9, 10, 11).contiguous(memory_format=fmt).requires_grad_()
        x = X.detach().clone().requires_grad_()
        assert conv._torch_picks_slow_conv((1, 16, 11, 12, 13), (3, 3, 3), (1, 1, 1),
                                           (1, 1, 1), 1)
        Y, y = twin(X), spatial(x)
        G = torch.randn(Y.shape)
        (Y * G).sum().backward()
        (y * G).sum().backward()
        assert rel_err(y.detach(), Y.detach()) <= FP32_TOL
        assert rel_err(x.grad, X.grad) <= FP32_TOL
        assert x.grad.is_contiguous(memory_format=fmt)
        for p, q in zip(spatial.parameters(), twin.parameters()):
            assert rel_err(p.grad, q.grad) <= FP32_TOL
    assert len(calls) == 4   # per format, the forward and the input gradient's convolution
    grid.free()


def test_onednn_backward_equals_torchs_for_every_geometry():
    """The oneDNN route's gradients (the input's from a flipped-kernel convolution where the
    stride is 1, the one call otherwise) equal torch's convolution backward in float64 on the
    same operands: paddings from 0 to the full kernel, dilations, groups, strides, both memory
    formats, any subset of the gradients; the input gradient in the input's memory format."""
    from hpcpar.nn._conv_route import onednn_backward

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    bwd = torch.ops.aten.convolution_backward
    cases = [((3, 3, 3), (0, 0, 0), (1, 1, 1), (1, 1, 1), 1),
             ((3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1),
             ((3, 5, 1), (2, 0, 0), (1, 1, 1), (1, 1, 1), 2),
             ((3, 3, 3), (1, 2, 0), (1, 1, 1), (2, 1, 2), 1),
             ((3, 3, 3), (1, 1, 1), (2, 1, 2), (1, 1, 1), 2)]
    for kernel, pad, stride, dil, groups in cases:
        for fmt in (torch.contiguous_format, torch.channels_last_3d):
            torch.manual_seed(1)
            x = torch.randn(1, 4, 9, 10, 7).contiguous(memory_format=fmt)
            w = torch.randn(6, 4 // groups, *kernel)
            y = torch.mkldnn_convolution(x, w, None, list(pad), list(stride), list(dil),
                                         groups)
            g = torch.randn(y.shape).contiguous(memory_format=fmt)
            want = bwd(g.double(), x.double(), w.double(), [6], list(stride), list(pad),
                       list(dil), False, [0, 0, 0], groups, [True, True, True])
            for mask in ([True, True, True], [True, False, False], [False, True, True]):
                got = onednn_backward(g, x, w, pad, stride, dil, groups, mask)
                for m, a, b in zip(mask, got, want):
                    what = (kernel, pad, stride, dil, groups, fmt, mask)
                    assert (a is not None) is m, what
                    if m:
                        assert rel_err(a.double(), b) <= FP32_TOL, what
                if mask[0]:
                    assert got[0].is_contiguous(memory_format=fmt), what
            # the output gradient of a sum: one value expanded, every stride 0
            ones = torch.ones(1, 1, 1, 1, 1).expand(y.shape)
            want = bwd(ones.double().contiguous(), x.double(), w.double(), [6], list(stride),
                       list(pad), list(dil), False, [0, 0, 0], groups, [True, True, True])
            got = onednn_backward(ones, x, w, pad, stride, dil, groups, [True, True, True])
            assert all(rel_err(a.double(), b) <= FP32_TOL for a, b in zip(got, want)), what


def test_pointwise_convolutions_are_products_equal_to_torchs():
    """A CPU 1x1x1 convolution of stride 1 runs as matrix products (no aten convolution,
    forward or backward) and equals torch: output and every gradient, float64 and float32,
    both memory formats of the input, an output gradient in either format or in neither,
    batch 1 and 2, with and without bias; the output and input gradient in the input's
    memory format (a one-channel input is dense in both: NCDHW, as torch suggests)."""
    import itertools

    from torch.utils._python_dispatch import TorchDispatchMode

    from hpcpar import ProcessGrid
    from hpcpar.nn import SpatialConv3d

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    grid = ProcessGrid(1, 1, 1, 1, comm=MPI.COMM_SELF)
    cl, dense = torch.channels_last_3d, torch.contiguous_format
    for dt, fmt, gfmt, bias, n, (ci, co) in itertools.product(
            (torch.float64, torch.float32), (dense, cl), (dense, cl, None), (True, False),
            (1, 2), ((4, 2), (3, 7), (1, 5))):
        torch.manual_seed(0)
        twin = nn.Conv3d(ci, co, 1, bias=bias).to(dt)
        spatial = SpatialConv3d(ci, co, 1, bias=bias, grid=grid).to(dt)
        spatial.load_state_dict(twin.state_dict())
        X = torch.randn(n, ci, 5, 6, 7, dtype=dt).contiguous(memory_format=fmt)
        X.requires_grad_()
        x = X.detach().clone().requires_grad_()
        Y = twin(X)
        G = torch.randn(Y.shape, dtype=dt)
        G = G.contiguous(memory_format=gfmt) if gfmt else G.transpose(2, 4).contiguous() \
            .transpose(2, 4)
        with Ops() as ops:
            y = spatial(x)
            y.backward(G)
        assert not ops.names & {"convolution", "convolution_backward"}, ops.names
        Y.backward(G)
        tol = FP64_TOL if dt == torch.float64 else FP32_TOL
        assert rel_err(y.detach(), Y.detach()) <= tol
        assert rel_err(x.grad, X.grad) <= tol
        for p, q in zip(spatial.parameters(), twin.parameters()):
            assert rel_err(p.grad, q.grad) <= tol
        assert ci == 1 or (y.is_contiguous(memory_format=fmt)
                           and x.grad.is_contiguous(memory_format=fmt))
    grid.free()


def test_a_pointwise_backward_allocates_only_the_input_gradient(tmp_path):
    """torch's CPU backward of a channels-last 1x1x1 convolution allocated 2.5-3x the input
    gradient (copies to NCDHW); the products allocate the input gradient and the small
    weight and bias gradients (torch's allocation trace)."""
    import json

    from hpcpar import ProcessGrid
    from hpcpar.nn import SpatialConv3d

    grid = ProcessGrid(1, 1, 1, 1, comm=MPI.COMM_SELF)
    cl = torch.channels_last_3d
    conv = SpatialConv3d(8, 2, 1, grid=grid).to(memory_format=cl)
    x = torch.randn(1, 8, 24, 24, 24).contiguous(memory_format=cl).requires_grad_()
    peaks = []
    for _ in range(2):   # the first: one-off buffers
        y = conv(x)
        g = torch.randn_like(y)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof:
            y.backward(g)
        prof.export_chrome_trace(str(tmp_path / "trace.json"))
        events = sorted((e for e in json.loads((tmp_path / "trace.json").read_text())
                         ["traceEvents"] if e.get("name") == "[memory]"),
                        key=lambda e: e["ts"])
        live = peak = 0
        for e in events:
            live += e["args"]["Bytes"]
            peak = max(peak, live)
        peaks.append(peak)
        x.grad = None
    assert peaks[-1] <= x.numel() * 4 + 4096, (peaks, x.numel() * 4)
    grid.free()


def test_chunks_only_where_one_pass_copies_the_output_gradient(monkeypatch):
    """The chunked backward exists to cut the copies a pass makes of the whole output
    gradient (oneDNN's route: batch 1 here). Where torch's own call takes the volume as it
    is (batch 2), chunks would only add copies (each falls to oneDNN's route): one pass."""
    from hpcpar import ProcessGrid
    from hpcpar.nn import SpatialConv3d, _boundary_conv, conv

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    chunked, whole = [], conv.ConvOp._chunked
    monkeypatch.setattr(conv.ConvOp, "_chunked",
                        lambda self, *a: chunked.append(1) or whole(self, *a))
    monkeypatch.setattr(conv, "CHUNK_BACKWARD_BYTES", 1)
    monkeypatch.setattr(_boundary_conv, "ENABLED", False)   # the general path
    grid = ProcessGrid(1, 1, 1, 1, comm=MPI.COMM_SELF)
    for batch, expect in ((2, False), (1, True)):
        chunked.clear()
        torch.manual_seed(3)
        twin = nn.Conv3d(8, 8, 3, padding=1)
        spatial = SpatialConv3d(8, 8, 3, padding=1, grid=grid)
        spatial.load_state_dict(twin.state_dict())
        X = torch.randn(batch, 8, 9, 10, 11).contiguous(memory_format=torch.channels_last_3d)
        X.requires_grad_()
        x = X.detach().clone().requires_grad_()
        G = torch.randn(batch, 8, 9, 10, 11)
        (twin(X) * G).sum().backward()
        (spatial(x) * G).sum().backward()
        assert bool(chunked) is expect, batch
        assert rel_err(x.grad, X.grad) <= FP32_TOL
        for p, q in zip(spatial.parameters(), twin.parameters()):
            assert rel_err(p.grad, q.grad) <= FP32_TOL
    grid.free()


def test_prepadded_weight_gradient_follows_the_hosts_instruction_set(monkeypatch):
    """The pre-padded weight gradient is the faster form only where oneDNN lacks AVX-512
    kernels (measured both ways on one host): a channels-last 16 -> 16 layer takes it when
    oneDNN is capped at AVX2, and on an AVX-512 host left alone it does not."""
    from hpcpar.nn import _conv_route

    x = torch.zeros(1, 16, 48, 48, 48).contiguous(memory_format=torch.channels_last_3d)
    w = torch.zeros(16, 16, 3, 3, 3)
    for cap, expect in (("AVX2", False), ("avx2_vnni", False), ("", None)):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        _conv_route.onednn_avx512.cache_clear()
        try:
            has = _conv_route.onednn_avx512()
            if expect is not None:
                assert has is expect, cap
            assert _conv_route.prepadded_weight_grad(x, w, 1) is (
                torch.backends.mkldnn.is_available() and not has)
        finally:
            _conv_route.onednn_avx512.cache_clear()
    if _conv_route.onednn_avx512():
        assert not _conv_route.prepadded_weight_grad(x, w, 1)


# ---- MPI ---------------------------------------------------------------------------------
@mpi_case(nprocs=(4, 8), timeout=240)
def test_conv_matches_torch(comm):
    world = comm.Get_size()
    if world == 8:  # the 8-rank launch covers what 4 ranks cannot: (2,2,2), (1,3,2), data 2
        cases = [c for c in conv_cases(8) if c["data"] * c["dims"][0] * c["dims"][1] *
                 c["dims"][2] > 4]
    else:
        cases = conv_cases(4) + edge_cases()
    _run_conv(comm, cases)
    if world == 4:  # these volumes are small (one conv backward call); the large-volume
        from hpcpar.nn import conv  # path (input freed before its gradient) on the same cases

        conv.SPLIT_BACKWARD_BYTES, saved = 0, conv.SPLIT_BACKWARD_BYTES
        try:
            _run_conv(comm, cases)
        finally:
            conv.SPLIT_BACKWARD_BYTES = saved
        _run_conv(comm, cases, batch=1)  # fp32 pieces of batch 1 take the oneDNN route
        # the chunked backward (large output gradients), forced to one output row a chunk:
        # strides, dilations and paddings put every chunk boundary somewhere different. It
        # serves the backwards that copy the whole output gradient (the permuted order, or
        # oneDNN's: batch 1 here), and no other
        chunked, whole = [], conv.ConvOp._chunked
        conv.ConvOp._chunked = lambda self, *a: chunked.append(1) or whole(self, *a)
        conv.CHUNK_BACKWARD_BYTES, saved = 1, conv.CHUNK_BACKWARD_BYTES
        try:
            _run_conv(comm, cases)
            _run_conv(comm, cases, batch=1)
        finally:
            conv.CHUNK_BACKWARD_BYTES = saved
            conv.ConvOp._chunked = whole
        assert chunked


@mpi_case(nprocs=(4,), timeout=240)
def test_conv_transpose_matches_torch(comm):
    _run_transposed(comm, transposed_cases(comm.Get_size()))


@mpi_case(nprocs=(4,), timeout=120)
def test_state_dict_16bit_and_permuted_layout(comm):
    from hpcpar.nn import SpatialConv3d, SpatialConvTranspose3d

    def check(grid):
        # batch 1, thin x/y pieces: torch would pick its slow kernel; the layer permutes
        torch.manual_seed(2)
        twin = nn.Conv3d(16, 4, 3, padding=1)
        spatial = SpatialConv3d(16, 4, 3, padding=1, grid=grid)
        compare_with_twin(grid, twin, spatial, (18, 18, 128), 16, torch.float32, batch=1,
                          what="permuted layout")
        op = next(iter(spatial._spatial_plans.values())).extra
        assert op.layout((1, 16, 11, 11, 130), torch.float32, torch.device("cpu")) == (2, 0, 1)

        for twin_cls, cls in ((nn.Conv3d, SpatialConv3d),
                              (nn.ConvTranspose3d, SpatialConvTranspose3d)):
            sp = cls(3, 5, 3, padding=1, grid=grid)
            twin = twin_cls(3, 5, 3, padding=1)
            twin.load_state_dict(sp.state_dict())  # and the other way round
            assert list(twin.state_dict()) == list(sp.state_dict())
            for dt in (torch.bfloat16, torch.float16):
                torch.manual_seed(0)
                X = torch.randn(1, 3, 8, 9, 6)
                ref = twin.to(dt)(X.to(dt))
                y = sp.to(dt)(X[spatial_slices((8, 9, 6), grid)].to(dt))
                assert y.dtype == dt
                assert rel_err(y.float(),
                               ref.float()[spatial_slices(tuple(ref.shape[2:]), grid)]) < 2e-2
    on_subgrid(comm, 1, (2, 2, 1), check)


if __name__ == "__main__":  # pragma: no cover - manual debugging: mpiexec -n 4 python ...
    from mpi4py import MPI

    _run_conv(MPI.COMM_WORLD, conv_cases(MPI.COMM_WORLD.Get_size()) + edge_cases())
    _run_transposed(MPI.COMM_WORLD, transposed_cases(MPI.COMM_WORLD.Get_size()))
    print("ok")


@mpi_case(nprocs=(4,), timeout=120)
def test_bf16_autocast_matches_torch(comm):
    """Under bf16 autocast a spatial conv runs in bf16 like torch's, forward and backward."""
    from hpcpar.nn import SpatialConv3d, SpatialConvTranspose3d
    from hpcpar.parallel.comm import allreduce_

    def check(grid):
        for twin_cls, cls in ((nn.Conv3d, SpatialConv3d),
                              (nn.ConvTranspose3d, SpatialConvTranspose3d)):
            torch.manual_seed(5)
            twin = twin_cls(3, 4, 3, padding=1)
            sp = cls(3, 4, 3, padding=1, grid=grid)
            sp.load_state_dict(twin.state_dict())
            xg = torch.randn(2, 3, 12, 10, 9)
            sl = spatial_slices(xg.shape[2:], grid)
            x = xg[sl].clone().requires_grad_()
            xr = xg.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y, yr = sp(x), twin(xr)
            assert y.dtype == yr.dtype == torch.bfloat16
            assert rel_err(y.float(), yr[sl].float()) < 2e-2
            y.float().square().sum().backward()
            yr.float().square().sum().backward()
            assert x.grad.dtype == torch.float32 and sp.weight.grad.dtype == torch.float32
            assert rel_err(x.grad, xr.grad[sl]) < 5e-2
            gw = allreduce_(sp.weight.grad.clone(), grid.spatial_comm)
            assert rel_err(gw, twin.weight.grad) < 5e-2

    on_subgrid(comm, 1, (2, 2, 1), check)



class _Twice(nn.Module):
    """One conv applied twice (tied weights): its halo plan serves two exchanges before any
    backward, so reused message buffers must not leak into the faces kept for backward."""

    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, x):
        return self.conv(torch.relu(self.conv(x)))


@mpi_case(nprocs=(4,), timeout=120)
def test_tied_conv_reuses_plan_exactly(comm):
    from hpcpar.nn import SpatialConv3d

    def check(grid):
        # dilated: the general halo path and its reused message buffers; "same": the
        # boundary fast path (its ghosts are fresh per call, saved for backward)
        for dilation, fast in ((2, False), (1, True)):
            torch.manual_seed(7)
            twin = _Twice(nn.Conv3d(3, 3, 3, padding=dilation, dilation=dilation))
            spatial = _Twice(SpatialConv3d(3, 3, 3, padding=dilation, dilation=dilation,
                                           grid=grid))
            for step in range(2):  # the second step reuses the first step's message buffers
                spatial.zero_grad()
                twin.zero_grad()
                compare_with_twin(grid, twin, spatial, (11, 10, 9), 3, torch.float64,
                                  seed=step, what=f"tied conv {grid.spatial_shape} "
                                                  f"dilation {dilation} step {step}")
            plans = list(spatial.conv._spatial_plans.values())
            assert len(plans) == 1
            assert (plans[0].extra.boundary is not None) == fast
            assert (plans[0].halo.message_nbytes > 0) == (not fast)
    for dims in ((2, 2, 1), (1, 1, 2)):
        on_subgrid(comm, 1, dims, check)


@mpi_case(nprocs=(8,), timeout=300)
def test_boundary_fast_path_matches_torch(comm):
    """Stride 1, odd kernel, "same" padding: SpatialConv3d convolves the local piece with
    torch's padding and adds thin corrections from the neighbours' ghosts (faces, edges and
    corners, no extended copy). Equal to torch on the whole volume for one, two and three
    split axes, uneven splits, p = 1 and 2 (and per-axis p, 0 on a split axis), groups, no
    bias, fp32/fp64 and channels-last; a padding other than "same" takes the general path,
    and a piece thinner than p (its halo buffer more than the map) the whole-map route."""
    from hpcpar.nn import SpatialConv3d

    CL = torch.channels_last_3d
    cases = [  # (dims, kernel, padding, shape, groups, bias, dtype, fast)
        ((3, 1, 1), 3, 1, (17, 9, 8), 1, True, torch.float64, True),
        ((1, 3, 1), 5, 2, (9, 20, 7), 2, False, torch.float64, True),
        ((1, 1, 3), 3, "same", (6, 7, 31), 1, True, torch.float32, True),
        ((2, 1, 1), (3, 5, 1), (1, 2, 0), (11, 9, 6), 1, True, torch.float64, True),
        ((3, 1, 1), 5, 2, (5, 8, 8), 1, True, torch.float64, None),  # 1 plane < p = 2
        ((1, 1, 1), 5, 2, (9, 8, 7), 1, True, torch.float64, True),  # nothing split
        ((2, 1, 1), 3, 1, (9, 8, 7), 1, True, torch.float64, True),
        ((1, 2, 1), 3, 2, (9, 8, 7), 1, True, torch.float64, False),  # not "same": k != 2p+1
        ((2, 2, 1), 3, 1, (9, 8, 7), 1, True, torch.float64, True),
        ((1, 2, 3), 5, 2, (5, 9, 13), 2, False, torch.float64, True),
        ((2, 1, 3), (3, 1, 5), (1, 0, 2), (7, 5, 11), 1, True, torch.float64, True),
        ((2, 3, 1), (1, 3, 3), (0, 1, 1), (6, 7, 5), 1, True, torch.float32, True),  # x: p 0
        ((2, 2, 2), 3, 1, (7, 6, 9), 1, True, torch.float64, True),
        ((2, 2, 2), 5, 2, (8, 9, 7), 1, False, torch.float32, True),
        ((2, 2, 2), 5, 2, (8, 3, 7), 1, True, torch.float64, None),  # a piece of 1 < p
    ]
    for dims, k, pad, shape, groups, bias, dtype, fast in cases:
        def check(grid, k=k, pad=pad, shape=shape, groups=groups, bias=bias, dtype=dtype,
                  fast=fast):
            for fmt in (torch.contiguous_format, CL):
                torch.manual_seed(7)
                twin = nn.Conv3d(4, 4, k, padding=pad, groups=groups, bias=bias)
                spatial = SpatialConv3d(4, 4, k, padding=pad, groups=groups, bias=bias,
                                        grid=grid)
                what = f"fast path {grid.spatial_shape} k={k} p={pad} {shape} {fmt}"
                compare_with_twin(grid, twin, spatial, shape, 4, dtype, seed=5, what=what,
                                  memory_format=fmt)
                if fast is None:   # halo longer than a piece, its buffer more than the map
                    assert not spatial._spatial_plans and spatial.__dict__["_whole_routes"]
                    continue
                [entry] = spatial._spatial_plans.values()
                took = entry.extra.boundary is not None and entry.extra.boundary.fast(2)
                assert took == fast, what
        on_subgrid(comm, 1, dims, check)
    # the weight gradient from a zero-padded copy of the piece (channels-last fp32, few
    # channels, a host without AVX-512; forced on these small volumes, and on any host):
    # the same gradients, and the path is taken
    from hpcpar.nn import _boundary_conv, _conv_route

    taken, chooser = [], _boundary_conv.prepadded_weight_grad

    def counted(*args):
        taken.append(chooser(*args))
        return taken[-1]

    _conv_route.SPLIT_BACKWARD_BYTES, saved = 0, _conv_route.SPLIT_BACKWARD_BYTES
    isa, _conv_route.onednn_avx512 = _conv_route.onednn_avx512, lambda: False
    _boundary_conv.prepadded_weight_grad = counted
    try:
        for dims, k, pad, shape, bias in [((3, 1, 1), 3, 1, (17, 9, 8), True),
                                          ((1, 1, 3), 3, "same", (6, 7, 31), False),
                                          ((2, 1, 1), (3, 5, 1), (1, 2, 0), (11, 9, 6), True),
                                          ((1, 1, 1), 5, 2, (9, 8, 7), True),
                                          ((2, 2, 2), 3, 1, (9, 8, 7), False)]:
            def check_prepadded(grid, k=k, pad=pad, shape=shape, bias=bias):
                torch.manual_seed(7)
                twin = nn.Conv3d(4, 8, k, padding=pad, bias=bias)
                spatial = SpatialConv3d(4, 8, k, padding=pad, bias=bias, grid=grid)
                compare_with_twin(grid, twin, spatial, shape, 4, torch.float32, seed=5,
                                  what=f"pre-padded weight gradient {grid.spatial_shape} "
                                       f"k={k} p={pad} {shape}", memory_format=CL)
            on_subgrid(comm, 1, dims, check_prepadded)
    finally:
        _conv_route.SPLIT_BACKWARD_BYTES = saved
        _conv_route.onednn_avx512 = isa
        _boundary_conv.prepadded_weight_grad = chooser
    assert taken and all(taken), taken
    # batch 1, fp32, pieces large enough for torch's fast kernel: the thin slabs fall under
    # its slow-kernel rule and go to oneDNN (forward and backward), with the same gradients
    routed, router = [], _boundary_conv.onednn

    def counted_route(*args):
        routed.append(router(*args))
        return routed[-1]

    _boundary_conv.onednn = counted_route
    try:
        for dims in ((2, 1, 1), (2, 2, 1), (2, 2, 2)):
            def check_onednn(grid):
                torch.manual_seed(7)
                spatial = SpatialConv3d(16, 8, 3, padding=1, grid=grid)
                compare_with_twin(grid, nn.Conv3d(16, 8, 3, padding=1), spatial, (64, 96, 6),
                                  16, torch.float32, seed=5, batch=1,
                                  what=f"slabs on oneDNN {grid.spatial_shape}")
                [entry] = spatial._spatial_plans.values()
                assert entry.extra.boundary.fast(1), grid.spatial_shape
            on_subgrid(comm, 1, dims, check_onednn)
    finally:
        _boundary_conv.onednn = router
    assert any(routed), routed   # a z slab of 32 x 48 planes is fast in torch's own rule


@mpi_case(nprocs=(4,), timeout=180)
def test_channels_last_matches_torch(comm):
    """A channels_last_3d input runs channels-last through the spatial layers (halo buffers,
    messages and conv outputs in that memory order, like torch's own conv) and still equals
    torch; ranks that disagree on the memory format get an error, not garbled messages."""
    from hpcpar.errors import LayerError
    from hpcpar.nn import local, spatialize
    from hpcpar.parallel.comm import allreduce_

    CL = torch.channels_last_3d

    def check(grid):
        for dtype in (torch.float32, torch.float64):
            torch.manual_seed(11)
            model = nn.Sequential(
                nn.Conv3d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool3d(2, ceil_mode=True),
                nn.Conv3d(4, 4, 3, padding=1), nn.ConvTranspose3d(4, 2, 3, 2, 1, 1),
                nn.AvgPool3d(3, 1, 1), nn.Upsample(scale_factor=2, mode="trilinear")).to(dtype)
            spatial = spatialize(model, grid)
            shape = (13, 12, 11)
            gen = torch.Generator().manual_seed(3)
            X = torch.randn(2, 3, *shape, generator=gen, dtype=dtype)
            X = X.contiguous(memory_format=CL).requires_grad_()
            Y = model(X)
            G = torch.randn(Y.shape, generator=gen, dtype=dtype)
            (Y * G).sum().backward()
            x = X.detach()[spatial_slices(shape, grid)].contiguous(memory_format=CL)
            x.requires_grad_()
            y = spatial(x)
            oslc = spatial_slices(tuple(Y.shape[2:]), grid)
            tol = FP32_TOL if dtype == torch.float32 else FP64_TOL
            what = f"channels-last {grid.spatial_shape} {dtype}"
            assert rel_err(y.detach(), Y.detach()[oslc]) <= tol, what
            (y * G).sum().backward()  # the whole G: its piece is taken, the sum is global
            assert rel_err(x.grad, X.grad[spatial_slices(shape, grid)]) <= tol, what
            for (name, p), (_, q) in zip(spatial.named_parameters(), model.named_parameters()):
                g = allreduce_(p.grad.clone(), grid.spatial_comm)
                assert rel_err(g, q.grad) <= tol, f"{what}: {name}"
            # the output keeps torch's memory format
            assert local(y).is_contiguous(memory_format=CL) == \
                Y.is_contiguous(memory_format=CL)
        # one rank channels-last, the others not: every rank raises
        x = torch.randn(1, 3, *(n // p for n, p in zip((8, 8, 8), grid.spatial_shape)))
        if grid.rank == 0:
            x = x.contiguous(memory_format=CL)
        try:
            spatial(x.to(dtype))
        except LayerError as e:
            assert "memory format" in str(e)
        else:
            raise AssertionError("mixed memory formats were not refused")
    for dims in ((2, 2, 1), (1, 1, 2)):
        on_subgrid(comm, 1, dims, check)
