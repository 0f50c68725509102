"""Every collective autograd Function in hpcpar has an adjoint test: its backward is the
adjoint of its forward, ``<A x, y> == <x, A* y>`` to 1e-12 in float64 (DESIGN section 2).

Inner products over the ranks follow hpcpar's conventions: a split tensor (and any per-rank
tensor: a piece with ghosts, graph rows) sums over every rank; a replicated tensor whose
gradient is complete on every rank counts once. For the nonlinear Functions (statistics,
extremes, norms) ``A`` is the derivative of the forward at the point, computed by forward-mode
autodiff of the plain op on one process, and ``A*`` is hpcpar's backward there.

Each Function is found in the autograd graph of its case (so a case cannot silently test
another route), and every ``torch.autograd.Function`` under hpcpar is either a case here or
listed as local (no message in forward or backward) with the reason."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch
import torch.nn.functional as F

from hpcpar.testing import mpi_case

TOL = 1e-12

#: Functions that send nothing (forward and backward are local to the rank): not collective
LOCAL = {
    "hpcpar.nn.dispatch._ReplicatedUse": "an identity whose gradient is scaled, no message",
    "hpcpar.nn.reduce._MaskedSqrt": "an elementwise sqrt",
    "hpcpar.nn.fused_halo._PaddedConv": "a valid convolution of a piece holding its margin "
                                        "(the margin came through HaloExchange)",
    "hpcpar.nn.dropout._SpatialDropout": "a mask drawn from global coordinates, no message",
    "hpcpar.graph._sparse._SpMM": "a local sparse product",
    "hpcpar.graph.dropout._Dropout": "a mask drawn from global vertex ids, no message",
}


def _functions() -> set[str]:
    """Every autograd Function class defined in hpcpar (every module imported)."""
    import hpcpar

    for info in pkgutil.walk_packages(hpcpar.__path__, "hpcpar."):
        if ".cli" in info.name or info.name.endswith(("__main__", "_node_init")):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:   # an optional dependency (CUDA, a browser): nothing to test
            continue
    seen, todo = set(), list(torch.autograd.Function.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("hpcpar."):
            seen.add(f"{cls.__module__}.{cls.__qualname__}")
    return seen


def _rand(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def _function(case: str) -> str:
    """The Function a case tests: its name less a ``[label]`` (a Function's second route)."""
    return case.split("[")[0]


def _found(out, name) -> bool:
    """Whether the Function ``name`` (module.qualname) is in ``out``'s autograd graph."""
    todo, seen = [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        cls = getattr(node, "_forward_cls", None)
        if cls is not None and f"{cls.__module__}.{cls.__qualname__}" == name:
            return True
        todo.extend(n for n, _ in node.next_functions)
    return False


# -- the cases: name[label] -> builder(grid) -------------------------------------------------
# A linear case returns (inputs, fn, out_kind): inputs [(tensor, kind)], kind "split"
# (per rank: summed) or "complete" (replicated: once); fn(*inputs) -> this rank's output.
# A nonlinear case returns (sample, shape): sample(x) a plain-torch op on a 5D volume, run
# spatialized on the pieces and by forward-mode autodiff on the whole volume.

SHAPE = (2, 4, 7, 5, 6)


def _spatial(grid, sample, shape=SHAPE, seed=1):
    """A sample run spatialized: the input is this rank's piece; the output this rank's
    piece (split) or the replicated value."""
    from hpcpar.nn import is_split, local, spatialize
    from hpcpar.parallel.spatial import local_slices

    class _Apply(torch.nn.Module):
        def forward(self, x):
            return sample(x)

    model = spatialize(_Apply(), grid)
    x = _rand(shape, seed)[local_slices(shape, grid)].clone().requires_grad_()
    kind = []

    def fn(xs):
        out = model(xs)
        kind.append("split" if is_split(out) else "complete")
        return local(out)
    return [(x, "split")], fn, kind


def _halo_exchange(grid):
    from hpcpar.parallel.halo import halo_exchange
    from hpcpar.parallel.partition import conv_axis_halo
    from hpcpar.parallel.spatial import local_slices

    halos = [conv_axis_halo(n, p, c, 3, 1, 1) for n, p, c in
             zip(SHAPE[2:], grid.spatial_shape, grid.spatial_coords)]
    x = _rand(SHAPE, 1)[local_slices(SHAPE, grid)].clone().requires_grad_()
    return [(x, "split")], lambda t: halo_exchange(t, grid, halos), "split"


def _conv(boundary):
    def build(grid):
        from hpcpar.nn import _boundary_conv

        w = _rand((3, 4, 3, 3, 3), 2)
        _boundary_conv.ENABLED = boundary
        return _spatial(grid, lambda x: F.conv3d(x, w, padding=1))
    return build


def _sum_grad(grid):
    from hpcpar.parallel.primitives import SumGrad

    r = _rand((4,), 3).requires_grad_()
    return [(r, "complete")], lambda t: SumGrad.apply(t, grid.spatial_comm) * 1, "split"


def _replicated_sum(grid):
    from hpcpar.parallel.primitives import ReplicatedSum

    t = _rand((2, 4), 4 + grid.rank).requires_grad_()
    return [(t, "split")], lambda u: ReplicatedSum.apply(u, grid.spatial_comm), "complete"


def _tp_linear(grid):
    from hpcpar.nn import TensorParallelLinear

    torch.manual_seed(5)
    layer = TensorParallelLinear(6, 5, False, grid=grid, dtype=torch.float64).requires_grad_(False)
    x = _rand((4, 6), 6).requires_grad_()
    return [(x, "complete")], layer, "complete"


def _graph(kind):
    def build(grid):
        import numpy as np

        from hpcpar.graph import DistGraph
        from hpcpar.graph._csr import csr_to_edges
        from hpcpar.graph.generate import power_law_community_graph

        g = power_law_community_graph(60, 4, communities=4, features=3, classes=2, seed=5,
                                      directed=True)
        e = csr_to_edges(g["indptr"], g["indices"])
        # the Numba backend: the aggregation reads [x; halo] in place (HaloAggregate)
        graph = DistGraph.from_global(np.asarray(e), 60, g["x"], grid.comm, method="random",
                                      seed=1, backend="numba")
        x = _rand((graph.num_owned, 3), 7 + grid.rank).requires_grad_()
        fn = graph.exchange if kind == "exchange" else graph.propagate
        return [(x, "split")], fn, "split"
    return build


def _global_mean(grid):
    from hpcpar.nn.resample import adaptive_avg_pool3d
    from hpcpar.parallel.spatial import local_slices

    x = _rand(SHAPE, 1)[local_slices(SHAPE, grid)].clone().requires_grad_()
    return [(x, "split")], \
        lambda t: adaptive_avg_pool3d(t, 1, grid=grid, gshape=SHAPE[2:])[0], "complete"


def _global_max(grid, x):
    from hpcpar.nn.resample import adaptive_max_pool3d

    return adaptive_max_pool3d(x, 1, grid=grid, gshape=SHAPE[2:])[0], "complete"


LINEAR = {
    "hpcpar.parallel.halo.HaloExchange": _halo_exchange,
    "hpcpar.parallel.halo.HaloStencil": _conv(False),
    "hpcpar.nn._boundary_conv.BoundaryConv": _conv(True),
    "hpcpar.parallel.primitives.AxisGather":
        lambda g: _spatial(g, lambda x: F.pad(x, (1, 2, 2, 1, 3, 2), mode="reflect")),
    # a volume shorter than its ranks is gathered whole before the next op
    "hpcpar.parallel.primitives.GatherVolume": lambda g: _spatial(
        g, lambda x: F.avg_pool3d(x, 4, 4) * 2, shape=(2, 4, 6, 6, 6)),
    "hpcpar.parallel.primitives.ReplicatedSum[global mean]": _global_mean,
    # dilation 4 on pieces of 2-4: a halo past the adjacent rank, the map gathered whole
    "hpcpar.nn.conv._WholeConv": lambda g: _spatial(
        g, lambda x: F.conv3d(x, _rand((3, 4, 3, 3, 3), 2), padding=4, dilation=4)),
    "hpcpar.parallel.primitives.ReplicatedSum": _replicated_sum,
    "hpcpar.parallel.primitives.SumGrad": _sum_grad,
    "hpcpar.nn.tensor_parallel._TPLinearFn": _tp_linear,
    "hpcpar.graph._vertex_halo.GraphHaloExchange": _graph("exchange"),
    "hpcpar.graph._vertex_halo.HaloAggregate": _graph("propagate"),
}

#: name -> the plain op, or (the plain op, hpcpar's twin(grid, piece) -> (out, kind)); the
#: plain op alone runs spatialized
NONLINEAR = {
    "hpcpar.parallel.primitives.SquaredDeviation": lambda x: x.var(dim=(2, 3, 4)),
    "hpcpar.parallel.primitives.GlobalExtreme": lambda x: x.amax(dim=(2, 3, 4)),
    "hpcpar.parallel.primitives.GlobalExtreme[first]":
        (lambda x: F.adaptive_max_pool3d(x, 1), _global_max),
    "hpcpar.nn.global_norm._GlobalNorm": lambda x: F.group_norm(x, 2),
    "hpcpar.nn.norm._GlobalBatchNorm": lambda x: F.batch_norm(x, None, None, training=True),
}


def test_every_collective_function_has_an_adjoint_case():
    found = _functions()
    listed = {_function(case) for case in (*LINEAR, *NONLINEAR, *LOCAL)}
    missing = found - listed
    assert not missing, f"autograd Functions with no adjoint case here: {sorted(missing)}"
    gone = listed - found
    assert not gone, f"listed here but not in hpcpar: {sorted(gone)}"


def _once(t, kind, grid):
    """This rank's share of an inner product term (see the module docstring)."""
    return t if kind == "split" else t / grid.size


def _linear(grid, name):
    from hpcpar.nn import _boundary_conv

    try:
        inputs, fn, out_kind = LINEAR[name](grid)
        out = fn(*[t for t, _ in inputs])
    finally:
        _boundary_conv.ENABLED = True
    out_kind = out_kind[0] if isinstance(out_kind, list) else out_kind
    assert grid.size == 1 or _found(out, _function(name)), \
        f"{name}: not in the case's autograd graph"
    # a replicated cotangent is the same on every rank; a per-rank one differs
    y = _rand(out.shape, 11 + (grid.rank if out_kind == "split" else 0))
    grads = torch.autograd.grad(out, [t for t, _ in inputs], y)
    lhs = _once((out.detach() * y).sum(), out_kind, grid)
    rhs = sum(_once((t.detach() * g).sum(), k, grid) for (t, k), g in zip(inputs, grads))
    return lhs, rhs


def _nonlinear(grid, name):
    from hpcpar.parallel.spatial import local_slices

    sample, twin = NONLINEAR[name] if isinstance(NONLINEAR[name], tuple) else \
        (NONLINEAR[name], None)
    a, v = _rand(SHAPE, 1), _rand(SHAPE, 2)
    _, tangent = torch.func.jvp(sample, (a,), (v,))       # A v, on one process
    y = _rand(tangent.shape, 3)
    lhs = (tangent * y).sum() / grid.size                 # computed whole on every rank
    inputs, fn, kind = _spatial(grid, sample)
    if twin is None:
        out = fn(inputs[0][0])
    else:
        out, k = twin(grid, inputs[0][0])
        kind.append(k)
    assert grid.size == 1 or _found(out, _function(name)), \
        f"{name}: not in the case's autograd graph"
    own = y if kind[0] == "complete" else y[local_slices(y.shape, grid)]
    (g,) = torch.autograd.grad(out, inputs[0][0], own)     # A* y, hpcpar's backward
    rhs = (v[local_slices(SHAPE, grid)] * g).sum()
    return lhs, rhs


def _check(grid, name):
    from hpcpar.parallel.comm import allreduce_

    lhs, rhs = (_linear if name in LINEAR else _nonlinear)(grid, name)
    both = allreduce_(torch.stack([lhs, rhs]).detach().double(), grid.comm)
    assert abs(both[0] - both[1]) <= TOL * max(1.0, abs(both[0])), \
        f"{name} on {grid.spec()}: <A x, y> {both[0].item()!r} != <x, A* y> {both[1].item()!r}"


@pytest.mark.parametrize("name", sorted(LINEAR) + sorted(NONLINEAR))
def test_adjoint_on_one_rank(name):
    """One rank: some routes skip their Function there (nothing to exchange)."""
    from hpcpar.testing.oracles import one_rank_grid

    _check(one_rank_grid(), name)


@mpi_case(nprocs=(4,), timeout=300)
def test_adjoints_on_split_grids(comm):
    """Each Function on a split of x, of x and y, and of x and y with uneven pieces."""
    from hpcpar.testing.oracles import on_grids

    def each(grid):
        for name in sorted(LINEAR) + sorted(NONLINEAR):
            _check(grid, name)

    on_grids(comm, [(1, 2, 1, 1), (1, 2, 2, 1), (1, 1, 2, 2)], each)
