"""Whole volumes over the spatial grid (hpcpar.parallel.spatial): which slice each rank holds, by
the partition rule, the error for an axis with fewer voxels than ranks, and pieces that do not
tile one volume refused on every rank (never a rank left sending)."""

import pytest

from hpcpar.testing import mpi_case


def test_partition_of_whole_volumes():
    from types import SimpleNamespace

    from hpcpar.errors import LayerError
    from hpcpar.parallel.spatial import local_shape, local_slices

    grid = SimpleNamespace(spatial_shape=(3, 1, 2), spatial_coords=(2, 0, 1))
    # 17 over 3: 6, 6, 5 -> rank 2 holds [12, 17); 4 over 2: [2, 4)
    assert local_slices((1, 2, 17, 5, 4), grid)[2:] == (slice(12, 17), slice(0, 5),
                                                         slice(2, 4))
    assert local_shape((17, 5, 4), grid, rank=0) == (6, 5, 2)
    with pytest.raises(LayerError, match="axis x has 2 voxels .* over 3 ranks"):
        local_shape((1, 1, 2, 5, 4), grid)


@mpi_case(nprocs=(4,), timeout=60)
def test_gather_refuses_pieces_that_do_not_tile_one_volume_on_every_rank(comm):
    import torch

    from hpcpar import ProcessGrid
    from hpcpar.errors import LayerError
    from hpcpar.parallel import spatial

    grid = ProcessGrid(1, 2, 2, 1)
    x = torch.arange(2 * 7 * 6 * 5, dtype=torch.float32).reshape(1, 2, 7, 6, 5)
    mine = x[spatial.local_slices(x.shape, grid)]
    full = spatial.gather(mine, grid)
    assert (full is None) == (grid.spatial_comm.Get_rank() != 0)
    assert full is None or torch.equal(full, x)
    assert torch.equal(spatial.allgather_volume(mine, grid)[0], x)
    # D and H swapped on the way (7 splits 4 + 3, 6 splits 3 + 3): the extents along y differ
    # between ranks at the same y coordinate; every rank raises before any piece travels
    swapped = mine.transpose(2, 3).contiguous()
    for fn in (spatial.gather, spatial.allgather_volume):
        with pytest.raises(LayerError, match="do not tile one volume"):
            fn(swapped, grid)
    with pytest.raises(LayerError, match="three distinct dims"):
        spatial.gather(mine, grid, dims=(2, 2, 3))
    moved = spatial.gather(mine.movedim((2, 3, 4), (0, 1, 2)).contiguous(), grid, dims=(0, 1, 2))
    assert moved is None or torch.equal(moved, x.movedim((2, 3, 4), (0, 1, 2)))
    with pytest.raises(LayerError, match="different dtypes"):
        spatial.gather(mine.double() if grid.spatial_comm.Get_rank() == 1 else mine, grid)
    comm.Barrier()   # no piece is left in flight: the ranks meet again
