"""The zoo (hpcpar/testing/zoo.py): every model written in ordinary torch style is, on
every grid, either exact against single-process torch (output, loss value, every parameter
gradient after hpcpar.DDP and every buffer: BN's running statistics, float64) or refused on
every rank with one line naming the op and the source line. The outcome of each model is
declared; none may be silently wrong. Dropout modules are compared with plain torch at p = 0;
a model whose dropout has p > 0 is also compared, at its p, with hpcpar's one-rank run (masks
that do not depend on the split)."""

from __future__ import annotations

import torch

from hpcpar.testing import mpi_case
from hpcpar.testing.model_check import check_model
from hpcpar.testing.oracles import on_grids, randn
from tests.support.zoo import MONAI, ZOO

GRIDS = [(1, 2, 1, 1), (1, 2, 2, 1), (1, 2, 2, 2), (2, 2, 1, 1)]


def _run(grid, name, seed=0, fuse=1, zoo=ZOO):
    return check_model(grid, zoo[name], name, seed, fuse)


def _has_dropout(entry):
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0
               for m in entry[0](c=entry[1]).modules())


#: models whose dropout masks are compared too (with hpcpar's one-rank run)
MASKED = [name for name, entry in ZOO.items() if _has_dropout(entry)]


@mpi_case(nprocs=(8,), timeout=900)
def test_zoo_is_exact_or_refused(comm):
    outcomes, counts = {}, {"exact": 0, "refused": 0}

    def each(grid):
        for name in ZOO:
            got, msg = _run(grid, name)
            outcomes.setdefault(name, set()).add(got)
            counts[got] += 1
            if msg and grid.rank == 0:
                print(f"{name} on {grid.spec()}: {msg}")
        for name in MASKED:
            got, msg = check_model(grid, ZOO[name], name, masks=True)
            assert got == ZOO[name][-1], f"{name} with its dropout on {grid.spec()}: {msg}"

    on_grids(comm, GRIDS, each)
    on_grids(comm, [(1, 2, 1, 1), (1, 1, 2, 2)], _escape_is_caught)
    on_grids(comm, [(1, 2, 2, 2)], _float32_rounding_is_not_an_escape)
    if comm.rank == 0:
        print(f"zoo: {len(outcomes)} models on {len(GRIDS)} grids: {counts['exact']} exact, "
              f"{counts['refused']} refused, 0 silently wrong")
        wrong = {n: g for n, g in outcomes.items() if g != {ZOO[n][-1]}}
        assert not wrong, f"unexpected outcomes: {wrong}"


@mpi_case(nprocs=(8,), timeout=900)
def test_zoo_with_fused_halos_is_exact_or_refused(comm):
    """spatialize(..., fuse_halos=3): the same declared outcome for every model (a run's
    margin never changes a value; a model's first forward fuses every run it can, before it
    learns where runs end, so this is the case with the most margin cropped), and models
    with convolutions in a row do fuse their exchanges. The boundary path is switched off
    here: at these batches it would take every "same" convolution, and no run would start."""
    from hpcpar.nn import _boundary_conv

    fused = {}

    def each(grid):
        for name in ZOO:
            got, msg = _run(grid, name, fuse=3)
            assert got == ZOO[name][-1], f"{name} on {grid.spec()} with fused halos: {got}"
            if got == "exact":
                fused[name] = fused.get(name, 0) + int(msg.split()[0])

    _boundary_conv.ENABLED = False
    try:
        on_grids(comm, [(1, 2, 1, 1), (1, 1, 2, 2), (1, 2, 2, 2)], each)
    finally:
        _boundary_conv.ENABLED = True
    if comm.rank == 0:
        print(f"zoo with fused halos: runs per model {fused}")
        assert fused["plain_fcn"] >= 3 and sum(1 for n in fused.values() if n) >= 10, fused


@mpi_case(nprocs=(3,), timeout=600)
def test_zoo_on_grids_with_nothing_split(comm):
    """One rank, and data parallel only: no axis is split, so a check that compares a local
    length with a global one cannot fire (plain.expand_as(x) returned x's own piece there,
    silently, while split grids refused it). Every model keeps its outcome."""
    def each(grid):
        for name in ZOO:
            got, msg = _run(grid, name)
            want = ZOO[name][-1]
            assert got == want, f"{name} on {grid.spec()}: {got}: {msg}"

    on_grids(comm, [(2, 1, 1, 1), (1, 1, 1, 1)], each)


@mpi_case(nprocs=(4,), timeout=300)
def test_the_check_draws_the_random_numbers_the_plain_model_draws(comm):
    """A latent sampled with torch.randn_like on a replicated tensor: check=True compared
    the spatial probe with a plain run that drew other numbers, and refused the model."""
    from tests.support.zoo import VAELatent, mse

    def each(grid):
        got, msg = check_model(grid, (VAELatent, 2, (8, 9, 7), mse, "like", "exact"), "vae")
        assert got == "exact", f"on {grid.spec()}: {got}: {msg}"

    on_grids(comm, [(1, 2, 1, 1), (1, 1, 2, 2)], each)


@mpi_case(nprocs=(4,), timeout=900)
def test_monai_networks_are_exact(comm):
    """Networks as MONAI releases them, not written for hpcpar: exact on a split of x, of y
    and z together, and a data x spatial grid (uneven pieces at the coarse levels)."""
    def each(grid):
        for name in MONAI:
            got, msg = _run(grid, name, zoo=MONAI)
            assert got == "exact", f"{name} on {grid.spec()}: {got}: {msg}"

    on_grids(comm, [(1, 2, 1, 1), (1, 1, 2, 2), (2, 2, 1, 1)], each)


def _escape_is_caught(grid):
    """A model that escapes the dispatch is stopped by the first-step check, on every rank,
    naming the first module that differs."""
    import pytest

    from hpcpar.errors import LayerError
    from hpcpar.nn import spatialize
    from hpcpar.parallel.spatial import local_slices
    from tests.support.zoo import Escaping

    for dtype in (torch.float64, torch.float32):   # float32 is compared in float64
        torch.manual_seed(0)
        model = spatialize(Escaping().to(dtype), grid, check=True)
        x = randn((1, 2, 6, 7, 8), 5, dtype)
        with pytest.raises(LayerError, match="spatialize check: module 'conv2'"):
            model(x[local_slices(x.shape, grid)])
    # a first call under no_grad (a validation pass first) is checked all the same; under
    # inference mode the check waits for the first call outside it
    model = spatialize(Escaping().double(), grid, check=True)
    x = randn((1, 2, 6, 7, 8), 5, torch.float64)[local_slices((1, 2, 6, 7, 8), grid)]
    with torch.no_grad(), pytest.raises(LayerError, match="spatialize check: module 'conv2'"):
        model(x)
    model = spatialize(Escaping().double(), grid, check=True)
    with torch.inference_mode():
        model(x)
    with pytest.raises(LayerError, match="spatialize check: module 'conv2'"):
        model(x)


def _float32_rounding_is_not_an_escape(grid):
    """An exact float32 model is not refused: UNet3D (batch norm) at 80³ on 8 ranks, whose
    first convolution's weight gradient differs from one process's by 2e-3 in float32
    rounding (the check refused it when it compared in float32)."""
    from hpcpar.models import UNet3D
    from hpcpar.nn import spatialize
    from hpcpar.parallel.spatial import local_slices

    torch.manual_seed(0)
    model = UNet3D(in_channels=1, out_channels=2, base_filters=4, depth=2, batch_norm=True)
    x = torch.randn(1, 1, 80, 80, 80)
    out = spatialize(model, grid, check=True)(x[local_slices(x.shape, grid)])
    assert out.shape == (1, 2, 80, 80, 80)



class _ShrinkThenReluInPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv3d(1, 2, 3, stride=2, padding=1)

    def forward(self, x):
        return torch.nn.functional.relu(self.conv(x), inplace=True)


@mpi_case(nprocs=(2,), timeout=120)
def test_writing_in_place_into_a_volume_shorter_than_its_ranks_is_refused(comm):
    """Such a volume is gathered whole into a new tensor before an op: an op writing in
    place would leave the user's tensor as it was (silently), so it is refused in one line,
    and the model's dispatch mode is left behind cleanly (torch warned of an empty mode stack
    on every refusal)."""
    import warnings

    import pytest

    from hpcpar.errors import LayerError
    from hpcpar.nn import spatialize
    from hpcpar.parallel.spatial import local_slices

    def each(grid):
        model = spatialize(_ShrinkThenReluInPlace(), grid)
        x = randn((1, 1, 2, 4, 4), 3)
        with warnings.catch_warnings(record=True) as seen, \
                pytest.raises(LayerError, match=r"relu at .*test_model_zoo.py:\d+ writes in place"
                              r" into a volume \(1, 2, 2\)") as info:
            warnings.simplefilter("always")
            model(x[local_slices(x.shape, grid)])
        assert "\n" not in str(info.value)
        assert not [w for w in seen if "mode stack" in str(w.message)]
        assert torch._C._len_torch_function_stack() == 0

    on_grids(comm, [(1, 2, 1, 1)], each)


def test_rounding_where_a_module_gives_zero_is_not_an_escape():
    """pytorchvideo's X3D: squeeze-excitation convolutions (zero bias) of the mean of a
    batch-normed volume, which is zero up to rounding on the check's one-sample probe. Their
    outputs were 1e-15 either way, and the check, judging them by their own scale, refused
    the model. A difference at a small but real scale is still one."""
    from hpcpar.nn.check import _compare

    stem = ("stem", "Conv3d", torch.ones(2, 4, dtype=torch.float64))
    ref = [stem, ("se", "Conv3d", torch.full((1, 3), 1e-15, dtype=torch.float64))]
    got = [stem, ("se", "Conv3d", torch.full((1, 3), -2e-15, dtype=torch.float64))]
    assert _compare(ref, got, {}, {}) is None
    ref[1] = ("se", "Conv3d", torch.full((1, 3), 1e-2, dtype=torch.float64))
    got[1] = ("se", "Conv3d", torch.full((1, 3), 1.5e-2, dtype=torch.float64))
    assert "module 'se' (Conv3d) differs" in _compare(ref, got, {}, {})


def test_only_calls_on_values_see_a_parameter_through_its_replicated_use():
    """A parameter used by a replicated op is passed through a gradient-scaling identity
    (``shared_decoder``); calls on the parameter itself (its attributes, hooks, in-place
    writes, metadata) must reach the parameter, or a hook would hang on a copy and
    ``p.data = ...`` would set nothing."""
    import torch.nn.functional as F

    from hpcpar.nn.optable import reads_values

    for func in (F.linear, F.conv3d, torch.Tensor.__add__, torch.Tensor.__getitem__,
                 torch.Tensor.t, torch.matmul):
        assert reads_values(func), func
    for func in (torch.Tensor.add_, torch.Tensor.__iadd__, torch.Tensor.register_hook,
                 torch.Tensor.size, torch.Tensor.dim, torch.Tensor.data.__get__,
                 torch.Tensor.data.__set__, torch.Tensor.requires_grad_,
                 torch.Tensor.retain_grad, torch.Tensor.__setitem__):
        assert not reads_values(func), func
