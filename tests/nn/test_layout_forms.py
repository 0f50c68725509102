"""The dispatch asks a split tensor's layout for its form of the op table's rule
(:attr:`hpcpar.nn.split.Layout.forms`): a layout registers its forms beside its own code and is
served without the dispatch knowing it; an op with no form is the layout's one-line refusal."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from hpcpar.errors import LayerError
from hpcpar.testing import mpi_case
from hpcpar.testing.oracles import one_rank_grid


def test_a_layout_the_dispatch_does_not_know_is_served_by_its_forms():
    import hpcpar.nn.dispatch  # noqa: F401  (opens the split tensor's door)
    from hpcpar.nn import spatial_ops
    from hpcpar.nn.split import Layout, SplitContext, wrap

    @dataclass(frozen=True)
    class Trial(Layout):
        forms: ClassVar[dict] = {spatial_ops.reduction: lambda call, redo: ("trial", call.name)}
        refusal = ("has no form on the trial layout", "reduce it")
        mixed = ("mixes the trial layout", "keep it apart")

    ctx = SplitContext(one_rank_grid())
    x = wrap(torch.ones(1, 2, 3, 4, 5), Trial(ctx, (2, 3, 4), (3, 4, 5)))
    y = wrap(torch.ones(1, 2, 3, 4, 5), Layout(ctx, (2, 3, 4), (3, 4, 5)))
    assert x.sum() == ("trial", "sum")                       # its form
    assert x.shape == (1, 2, 3, 4, 5) and x.numel() == 120   # as it is (optable.AS_IS)
    with pytest.raises(LayerError, match=r"^spatialize: roll at \S+ has no form on the trial "
                                         r"layout on a tensor split .*; reduce it$"):
        torch.roll(x, 1, 2)
    with pytest.raises(LayerError, match="add at .* mixes the trial layout .*; keep it apart$"):
        x + y


def test_the_way_out_takes_the_layouts_own_piece():
    """local() and whole() ask the layout for this rank's own piece (Layout.own): a layout
    that holds more than its piece (a fused run's margin) gives only the piece."""
    from hpcpar.nn.split import Layout, SplitContext, local, whole, wrap

    @dataclass(frozen=True)
    class Wide(Layout):   # holds one plane of its neighbour's before its own
        def own(self, t, end=False):
            with torch._C.DisableTorchFunction():
                piece = t.as_subclass(torch.Tensor)[:, :, 1:]
            return wrap(piece, Layout(self.ctx, self.sdims, self.gshape))

    ctx = SplitContext(one_rank_grid())
    x = wrap(torch.arange(24.0).reshape(1, 1, 4, 3, 2), Wide(ctx, (2, 3, 4), (3, 3, 2)))
    assert torch.equal(local(x), torch.arange(6.0, 24.0).reshape(1, 1, 3, 3, 2))
    assert torch.equal(whole(x), local(x))


@mpi_case(nprocs=(2,), timeout=120)
def test_a_volume_shorter_than_its_ranks_is_gathered_for_what_reads_it(comm):
    """A volume pooled to fewer voxels than ranks is gathered for every op but those that read
    only its metadata (optable.METADATA), not for the layouts' whole as-is set: its values
    read and a tensor made like it are the whole volume's (as-is, .tolist() was refused and
    the buffer split, which refused the write into it)."""
    import torch.nn.functional as F

    from hpcpar.nn import spatialize
    from hpcpar.parallel.grid import ProcessGrid

    seen = {}

    class Head(torch.nn.Module):
        def forward(self, x):
            h = F.avg_pool3d(x, (4, 1, 1))   # D 4 -> 1, split over 2 ranks
            seen["values"] = h.tolist()
            buf = torch.zeros_like(h)
            buf[:, 0] = h[:, 0]
            return buf.sum()

    grid = ProcessGrid(1, 2, 1, 1, comm=comm)
    x = torch.arange(48.0).reshape(1, 2, 4, 3, 2)
    out = spatialize(Head(), grid)(x[:, :, 2 * comm.rank:2 * comm.rank + 2])
    h = F.avg_pool3d(x, (4, 1, 1))
    assert seen["values"] == h.tolist()
    assert float(out) == float(h[:, 0].sum())
    grid.free()
