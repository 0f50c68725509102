"""Split-invariant augmentation: a flipped or turned sample read with ``flip``/``rot90`` is, on
1x1x1x1, 1x2x1x1 and 1x2x2x1, voxel for voxel torch's ``rot90`` + ``flip`` of the stored
sample (its label volume alike), through the inline reader and the prefetch process."""

import os

import numpy as np
import torch

from hpcpar.data.augment import apply_view, source_box, view_code
from hpcpar.testing import mpi_case, shared_tmpdir

SHAPE = (7, 6, 6)   # D uneven over 2; H == W for quarter turns


def _torch_view(a, code):
    t = torch.rot90(torch.from_numpy(np.ascontiguousarray(a)), code >> 3, dims=(-2, -1))
    flips = [t.dim() - 3 + k for k in range(3) if code >> k & 1]
    return (t.flip(flips) if flips else t).numpy()


def test_every_view_maps_boxes_exactly():
    x = np.arange(2 * np.prod(SHAPE)).reshape(2, *SHAPE)
    boxes = [((0, 4), (0, 3), (3, 6)), ((4, 7), (2, 5), (0, 2)), ((0, 7), (0, 6), (0, 6))]
    for code in range(32):
        full = _torch_view(x, code)
        for box in boxes:
            src = source_box(box, SHAPE, code)
            got = apply_view(x[(slice(None), *(slice(a, b) for a, b in src))], code)
            np.testing.assert_array_equal(got, full[(slice(None),
                                                     *(slice(a, b) for a, b in box))])
    codes = {view_code(3, e, i, True, True) for e in range(2) for i in range(16)}
    assert len(codes) > 8 and all(0 <= c < 32 for c in codes)
    assert {view_code(3, 0, i, True, False) >> 3 for i in range(16)} == {0}
    assert view_code(3, 0, 5, False, False) == 0


def _dataset(comm, tmp):
    """Sample i: random x, label volume all i (names the sample in every piece)."""
    from hpcpar.data.volume_files import VolumeFiles
    from hpcpar.data.writer import shard_counts, write_dataset

    rng = np.random.default_rng(5)
    xs = rng.standard_normal((8, *SHAPE)).astype(np.float32)
    if comm.rank == 0:
        for sub in ("img", "lab"):
            os.makedirs(os.path.join(tmp, sub))
        for i, x in enumerate(xs):
            np.save(os.path.join(tmp, "img", f"s{i}.npy"), x)
            np.save(os.path.join(tmp, "lab", f"s{i}.npy"), np.full(SHAPE, i, np.int16))
    comm.Barrier()
    names = [f"s{i}.npy" for i in range(8)]
    src = VolumeFiles([os.path.join(tmp, "img", n) for n in names],
                      [os.path.join(tmp, "lab", n) for n in names])
    out = os.path.join(tmp, "ds")
    write_dataset(out, src, shard_counts(8, samples_per_shard=3), comm=comm, chunk=2,
                  progress=False)
    return out, xs


@mpi_case(nprocs=4, timeout=240)
def test_flipped_samples_equal_on_every_grid(comm):
    from hpcpar import ProcessGrid
    from hpcpar.data import ShardedVolumeDataset
    from hpcpar.parallel.partition import part_range

    with shared_tmpdir(comm, prefix="hpcpar-test-augment-") as tmp:
        out, xs = _dataset(comm, tmp)
        nonzero = set()
        for case, shape in enumerate(((4, 1, 1, 1), (2, 2, 1, 1), (1, 2, 2, 1))):
            grid = ProcessGrid(*shape, comm=comm)
            ds = ShardedVolumeDataset(out, grid, 4, seed=9, flip=True, rot90=True,
                                      prefetch=2 if case == 1 else 0)
            box = [part_range(n, p, i) for n, p, i in
                   zip(SHAPE, grid.spatial_shape, grid.spatial_coords)]
            sel = tuple(slice(a, b) for a, b in box)
            for epoch in (0, 1):
                ds.set_epoch(epoch)
                for xb, yb in ds:
                    for x, y in zip(xb.numpy(), yb.numpy()):
                        i = int(y.flat[0])
                        assert (y == i).all() and y.shape == x.shape[1:]
                        code = view_code(9, epoch, i, True, True)
                        nonzero.add(code)
                        want = _torch_view(xs[i], code)[sel]
                        np.testing.assert_array_equal(x[0], want)
            ds.close()
            grid.free()
        assert len(nonzero) > 4 and any(c & 1 for c in nonzero) and any(c >> 3 for c in nonzero)
