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
from hpcpar.testing.oracles import one_rank_grid


@pytest.fixture(scope="module")
def grid():
    return one_rank_grid()


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
        return self.conv(x).flatten(2)   # (N, C, DHW): only a full flatten is split


class _Rolled(nn.Module):
    def forward(self, x):
        return torch.roll(x, 1, dims=3)


class _Mixed(nn.Module):
    """One parameter used on the split volume and on a replicated tensor."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return (x * self.scale).mean(dim=(2, 3, 4)) * self.scale


@pytest.mark.parametrize("model, op, why", [
    (_Flat(), "flatten", "merges a split dim"),
    (_Rolled(), "roll", "has no exact spatial form"),
    (_Mixed(), "parameter 'scale'", "used both on split tensors and on replicated ones"),
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
