"""Whole volumes over the spatial grid (hpcpar.parallel.spatial): which slice each rank holds, by
the partition rule, and the error for an axis with fewer voxels than ranks."""

import pytest


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
