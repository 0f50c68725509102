"""spatialize() on one rank: the copy keeps its modules, parameters and keys; tags come from
the forward's dataflow (not registration order); split tensors answer with global shapes;
refusals are one line naming the op and the user's source line. Multi-rank exactness of whole
models is in tests/nn/test_model_zoo.py and tests/models/test_cnn_models.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hpcpar.sync.tags import reduce_scope
from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import one_rank_grid


@pytest.fixture(scope="module")
def grid():
    return one_rank_grid()


#: torch.nn's elementwise activations, out-of-place and in-place
_ACTIVATIONS = ("relu relu_ relu6 leaky_relu leaky_relu_ elu elu_ celu celu_ selu selu_ gelu "
                "silu mish hardswish hardsigmoid hardtanh hardtanh_ hardshrink softshrink "
                "tanhshrink softsign softplus sigmoid tanh logsigmoid threshold threshold_").split()


@pytest.mark.parametrize("name", _ACTIVATIONS)
def test_every_activation_is_local_by_name_not_by_torchs_tags(name):
    """torch 2.11 does not tag leaky_relu pointwise (2.13 does): a classification left to the
    tags refused CosmoFlow's own activation there."""
    from hpcpar.nn import optable, rules

    func = getattr(F, name)
    assert optable.kind_of(func) == "local", name
    assert optable.rule_for(func) is rules.pointwise


def test_cosmoflow_copy_tags_and_output(grid):
    import hpcpar.nn
    from hpcpar.models import CosmoFlow

    plain = CosmoFlow.small(input_size=16, n_conv_blocks=2, base_filters=2, dense=(8,))
    sp = hpcpar.nn.spatialize(plain, grid)
    assert sp.state_dict().keys() == plain.state_dict().keys()
    for name, p in sp.named_parameters():
        assert p is not dict(plain.named_parameters())[name]  # a copy, not the original
    x = torch.randn(2, 4, 16, 16, 16)
    y = sp(x)
    assert not hpcpar.nn.is_split(y)  # after the global pool: replicated
    assert torch.allclose(y, plain(x), atol=1e-6)
    for name, p in sp.named_parameters():  # learned from the forward
        want = "data" if name.startswith("head.") else "spatial+data"
        assert reduce_scope(p) == want, name


class _HeadFirst(nn.Module):
    """Registers the head before the convolutions."""

    def __init__(self):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.fc = nn.Linear(4, 3)
        self.conv = nn.Conv3d(2, 4, 3, padding=1)

    def forward(self, x):
        return self.fc(self.pool(F.relu(self.conv(x))).flatten(1))


def test_tags_follow_dataflow_not_registration(grid):
    from hpcpar.nn import spatialize
    from hpcpar.sync.tags import TAGS_VERSION

    sp = spatialize(_HeadFirst(), grid)
    assert getattr(sp, TAGS_VERSION, 0) == 0
    sp(torch.randn(1, 2, 5, 6, 7))
    assert getattr(sp, TAGS_VERSION) == 1
    assert reduce_scope(sp.fc.weight) == "data" and reduce_scope(sp.conv.weight) == "spatial+data"
    sp(torch.randn(1, 2, 5, 6, 7))
    assert getattr(sp, TAGS_VERSION) == 1  # unchanged dataflow: no new version


def test_split_tensors_answer_with_global_shapes(grid):
    from hpcpar.errors import LayerError
    from hpcpar.nn import is_split, local, spatialize, split_like

    seen = {}

    class Probe(nn.Module):
        def forward(self, x):
            seen["shape"], seen["numel"] = tuple(x.shape), x.numel()
            return x * 2

    y = spatialize(Probe(), grid)(torch.ones(2, 3, 4, 5, 6))
    assert is_split(y) and seen == {"shape": (2, 3, 4, 5, 6), "numel": 720}
    assert not is_split(local(y)) and local(y).shape == (2, 3, 4, 5, 6)
    t = split_like(torch.zeros(2, 4, 5, 6), y)
    assert is_split(t) and t.shape == (2, 4, 5, 6)
    with pytest.raises(LayerError, match="last three lengths"):
        split_like(torch.zeros(2, 4, 5, 7), y)
    with pytest.raises(LayerError, match="would read only this rank's piece"):
        y.tolist()
    assert float(y.sum()) == 2 * 720  # a full reduction is the global value


class _Flat(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(1, 2, 3, padding=1)

    def forward(self, x):
        return self.conv(x).flatten(3)   # (N, C, D, HW): part of the volume merged


class _Rolled(nn.Module):
    def forward(self, x):
        return torch.roll(x, 1, dims=3)


class _Mixed(nn.Module):
    """One parameter used on the split volume and on a replicated tensor (refused before:
    its gradient mixes partial and complete parts)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return (x * self.scale).mean(dim=(2, 3, 4)) * self.scale


class _Positional(nn.Module):
    """Ops whose ``dim`` comes after another positional argument (``topk(x, k, dim)``)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("model, op, why", [
    (_Flat(), "flatten", "merges a split dim"),
    # read as their dim, k = 1 and n = 1 named the channels, and each rank ran them on its
    # piece of a spatial dim: silently wrong
    (_Positional(lambda x: torch.topk(x, 1, 3)[0]), "topk", "mixes values along a split dim"),
    (_Positional(lambda x: torch.diff(x, 1, 2)), "diff", "mixes values along a split dim"),
    # the nonzero form: this rank's indices, in its own coordinates
    (_Positional(lambda x: x * torch.where(x > 0)[0].numel()), "where",
     "lists the indices of the nonzero elements"),
    # a random slope per element while training, drawn by each rank for its piece
    (nn.RReLU().train(), "rrelu", "draws random numbers"),
    (_Rolled(), "roll", "has no exact spatial form"),
    (_Positional(lambda x: x.flip(-1)), "flip", "mirrors a split dim"),
    (_Positional(lambda x: x.flip(1, 2)), "flip", "mirrors a split dim"),  # dims one by one
])
def test_refusals_name_the_op_and_the_source_line(grid, model, op, why):
    from hpcpar.errors import LayerError
    from hpcpar.nn import spatialize

    with pytest.raises(LayerError) as info:
        spatialize(model, grid)(torch.randn(1, 1, 4, 4, 4))
    msg = str(info.value)
    assert op in msg and why in msg and "\n" not in msg
    if "parameter" not in op:
        assert f"{__file__}:" in msg  # the user's own line


def test_positional_dims_along_the_channels_stay_exact(grid):
    """The same ops along the channels (a positional dim after k, n or p) run on each piece."""
    from hpcpar.nn import local, spatialize

    def ops(x):
        return torch.cat([torch.topk(x, 1, 1)[0], torch.diff(x, 1, 1), F.normalize(x, 2.0, 1),
                          torch.sort(x, 1)[0]], dim=1)

    x = torch.randn(1, 3, 4, 5, 6)
    torch.testing.assert_close(local(spatialize(_Positional(ops), grid)(x)), ops(x))


class _ScaleBySum(torch.autograd.Function):
    """x / x.sum(): its backward sums over the volume ((g * x).sum())."""

    @staticmethod
    def forward(ctx, x):
        total = x.sum()
        ctx.save_for_backward(x, total)
        return x / total

    @staticmethod
    def backward(ctx, g):
        x, total = ctx.saved_tensors
        return g / total - (g * x).sum() / total ** 2


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class _Applies(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.conv = nn.Conv3d(1, 2, 3, padding=1)
        self.fn = fn

    def forward(self, x):
        return self.fn(torch.exp(0.1 * self.conv(x)))


@pytest.mark.parametrize("fn, why", [
    (_ScaleBySum.apply, "custom autograd.Function"),
    # a reentrant checkpoint no split tensor enters: hpcpar cannot tell what it closes over
    (lambda h: h * torch.utils.checkpoint.checkpoint(torch.tanh, h.mean(), use_reentrant=True),
     "torch.utils.checkpoint (use_reentrant=True)"),
])
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # the no_grad run
def test_a_custom_function_whose_backward_runs_on_pieces_is_refused(grid, fn, why):
    """Its backward ran on this rank's piece (a sum over the volume was this rank's share,
    gradients 2.7e-2 to 3.5 off on 2 ranks; a reentrant checkpoint's recomputation runs
    outside the dispatch unless a split tensor enters it, hpcpar.nn.checkpointing.Recomputed):
    refused in one line, also when a forward without gradients (settle, validation) came
    first."""
    from hpcpar.errors import LayerError
    from hpcpar.nn import spatialize

    model = spatialize(_Applies(fn), grid)
    x = torch.randn(1, 1, 4, 5, 6)
    with torch.no_grad():
        model(x)
    with pytest.raises(LayerError) as info:
        model(x)
    assert why in str(info.value) and "\n" not in str(info.value)


def test_a_custom_function_marked_local_runs_and_is_exact(grid):
    from hpcpar.nn import local, local_function, spatialize

    torch.manual_seed(0)
    plain = _Applies(local_function(_Square).apply)
    model = spatialize(plain, grid)
    x = torch.randn(1, 1, 4, 5, 6)
    torch.testing.assert_close(local(model(x)), plain(x))
    with pytest.raises(TypeError, match="not a torch.autograd.Function"):
        local_function(nn.ReLU)


def test_elementwise_where_and_an_evaluating_rrelu_stay_exact(grid):
    from hpcpar.nn import local, spatialize

    model = _Positional(lambda x: F.rrelu(torch.where(x > 0, x, 2 * x), training=False))
    x = torch.randn(1, 2, 4, 5, 6)
    torch.testing.assert_close(local(spatialize(model, grid)(x)), model(x))
    rrelu = nn.RReLU().eval()
    torch.testing.assert_close(local(spatialize(rrelu, grid)(x)), rrelu(x))


def test_torch_compile_of_a_spatialized_model_says_what_is_refused(grid):
    """dynamo's first probe of a split tensor (``_is_view``) was refused as if the model had
    called it; the line now says torch.compile is what cannot run."""
    from hpcpar.nn import spatialize

    model = torch.compile(spatialize(_Positional(torch.relu), grid))
    with pytest.raises(Exception, match="torch.compile cannot trace a model split over"):
        model(torch.randn(1, 2, 4, 5, 6))


def test_channel_flips_and_new_tensors_of_the_global_shape_stay_exact(grid):
    """flip over batch or channels is local, and x.new_ones(x.shape) (x.shape being the
    global shape) is this rank's piece, like ones_like; both were refused."""
    from hpcpar.nn import local, spatialize

    def ops(x):
        return (x.flip(1) * x.new_ones(x.shape) + x.new_full(x.shape, 2.0)
                + x.new_zeros(*x.shape) + x.new_tensor([1.0, 2.0]).view(1, 2, 1, 1, 1)
                + x.new_ones(x.shape[2]).view(1, 1, -1, 1, 1))

    x = torch.randn(1, 2, 4, 5, 6)
    torch.testing.assert_close(local(spatialize(_Positional(ops), grid)(x)), ops(x))


def test_a_plain_tensor_expanded_or_viewed_as_a_split_one_is_itself_reshaped(grid):
    """``scale.expand_as(x)`` and ``w.view_as(x)`` / ``reshape_as(x)`` with the first plain and
    ``x`` split returned ``x``'s own piece wherever no axis was split (one rank, data parallel
    only): silently wrong. Split grids refused them. They now take ``x``'s layout
    (tests/nn/test_model_zoo.py runs split grids)."""
    from hpcpar.nn import local, spatialize

    weight = torch.tensor([0.5, -2.0]).view(1, 2, 1, 1, 1)
    field = torch.linspace(-1, 1, 2 * 4 * 5 * 6)

    def ops(x):
        return (x * x.mean().expand_as(x) + weight.expand_as(x)
                + x.sum(dim=(2, 3, 4), keepdim=True).expand_as(x)
                + x * field.view_as(x) - field.reshape_as(x))

    x = torch.randn(1, 2, 4, 5, 6)
    torch.testing.assert_close(local(spatialize(_Positional(ops), grid)(x)), ops(x))


@mpi_case(nprocs=(2,), timeout=120)
def test_a_parameter_used_on_split_and_replicated_tensors_gets_its_gradient(comm):
    """The split use's partial gradients are summed over the spatial group, the replicated
    use's complete one divided by the group's size first: the sum is torch's gradient."""
    import hpcpar
    from hpcpar.nn import spatialize

    grid = hpcpar.ProcessGrid(x=2)
    x = torch.randn(2, 1, 5, 4, 3, generator=torch.Generator().manual_seed(0),
                    dtype=torch.float64)
    plain = _Mixed().double()
    plain.scale.data.fill_(1.5)
    ref = plain(x)
    ref.square().sum().backward()
    model = hpcpar.DDP(spatialize(_Mixed().double(), grid), grid)
    model.module.scale.data.fill_(1.5)
    out = model(x[:, :, :3] if grid.coords[1] == 0 else x[:, :, 3:])
    assert torch.allclose(out, ref.detach(), rtol=1e-13)
    out.square().sum().backward()
    assert reduce_scope(model.module.scale) != "data"
    assert torch.allclose(model.module.scale.grad, plain.scale.grad, rtol=1e-12)


class _Late(nn.Module):
    """``scale`` on a replicated tensor only, until ``both`` is set."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.both = False

    def forward(self, x):
        pooled = x.mean(dim=(2, 3, 4)) * self.scale
        return pooled.sum() + ((x * self.scale).mean() if self.both else 0.0)


@mpi_case(nprocs=(2,), timeout=120)
def test_a_parameter_that_turns_split_after_a_replicated_use_is_refused(comm):
    """A head parameter's replicated use skips the gradient scaling once the forwards have
    shown it is replicated only; a later forward that then also uses it on split tensors
    would count the replicated use once per rank: refused in one line naming it."""
    import hpcpar
    from hpcpar.errors import LayerError
    from hpcpar.nn import spatialize

    grid = hpcpar.ProcessGrid(x=2)
    model = spatialize(_Late(), grid)
    x = torch.randn(1, 1, 2, 3, 3)
    model(x).backward()
    model.both = True
    with pytest.raises(LayerError, match="parameter 'scale' was used on replicated tensors "
                                         "only until this forward"):
        model(x)


def test_var_and_std_read_their_positional_flag_as_unbiased(grid):
    """``x.var(dims, True)``: torch reads the positional flag as ``unbiased``; it was taken
    for ``keepdim``, and the global variance came back (N, C, 1, 1, 1) instead of (N, C),
    silently; also through the merged spatial dims."""
    from hpcpar.nn import local, spatialize

    class Stats(nn.Module):
        def forward(self, x):
            return (x.var((2, 3, 4), True), x.std((2, 3, 4), False),
                    torch.var_mean(x, (2, 3, 4), True)[0], x.var((2, 3, 4), True, True),
                    x.flatten(2).var(-1, True), torch.norm(x.flatten(2), 2, -1, True))

    x = torch.randn(2, 3, 4, 5, 6, dtype=torch.float64)
    for got, want in zip(spatialize(Stats(), grid)(x), Stats()(x)):
        assert local(got).shape == want.shape and torch.allclose(local(got), want)


class _PermutedHead(nn.Module):
    """A segmentation head written channels-last by hand: (N, D, H, W, classes) out."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.conv(x).permute(0, 2, 3, 4, 1))


@mpi_case(nprocs=(2,), timeout=120)
def test_whole_assembles_a_split_output_wherever_its_split_dims_are(comm):
    """``whole(y)``: the single-process output on the spatial root, None on the other rank,
    also for an output whose split dims are no longer last (gathering ``local(y)`` assumes
    them last); a flattened output has no volume to assemble: one line on every rank."""
    import hpcpar
    from hpcpar.errors import LayerError
    from hpcpar.nn import spatialize, whole
    from hpcpar.parallel.spatial import local_slices

    x = torch.randn(2, 2, 5, 6, 7, generator=torch.Generator().manual_seed(0),
                    dtype=torch.float64)
    torch.manual_seed(0)   # the same weights on every rank
    plain = _PermutedHead().double()
    ref = plain(x)
    for grid in (hpcpar.ProcessGrid(x=2), hpcpar.ProcessGrid(y=2)):
        y = spatialize(plain, grid)(x[local_slices(x.shape, grid)])
        full = whole(y)
        if grid.spatial_comm.Get_rank() == 0:
            assert full is not None and full.shape == ref.shape
            assert torch.allclose(full, ref.detach(), rtol=1e-12)
        else:
            assert full is None
        assert whole(ref) is ref   # a plain tensor is whole already
        flat = spatialize(plain.conv, grid)(x[local_slices(x.shape, grid)]).flatten(1)
        with pytest.raises(LayerError, match="split dims are merged"):
            whole(flat)
