"""``hpcpar.predict(model, source, out, grid)``: whole-volume inference across ranks, exact.

Each sample goes to one data group (the partition rule over the samples); its spatial group
runs the spatialized forward on the whole volume (or on halo-aware slabs of it along D,
:mod:`hpcpar.run.slabs`, when ``max_slab`` is smaller than D), each rank reading only its
hyperslab of the input (:mod:`hpcpar.data._hyperslab`) and writing only its piece of the
output (:mod:`hpcpar.run.predict_output`). The forward runs under ``torch.inference_mode``:
no autograd state, no halo kept for a backward; a rank's memory is the forward's live set.
Post-processing (softmax, sigmoid, argmax over channels, a storage type) is per voxel, so it
runs on each piece. The result equals the one-process whole-volume forward to rounding.

Also the per-rank entry of ``hpcpar predict`` (``python -m hpcpar.run.predict``).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from hpcpar.data._hyperslab import ShardFiles, read_samples
from hpcpar.data.format import check_file, open_h5, read_manifest
from hpcpar.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, ConfigError, DataError, HpcparError
from hpcpar.parallel.agree import agree
from hpcpar.parallel.grid import ProcessGrid, rank_of
from hpcpar.parallel.partition import box, owner, part_range

from . import predict_output as output
from .slabs import Slab, model_reach, param_dtype, slab_plan

__all__ = ["Post", "predict", "main"]

DTYPES = ("float32", "float64", "float16", "uint8")


@dataclass(frozen=True)
class Post:
    """Per-voxel post-processing of the model's output (N, C, ...): ``softmax`` or
    ``sigmoid`` over values, then ``argmax`` over channels (kept as one channel, class
    indices), stored as ``dtype``; ``uint8`` stores labels, or probabilities times 255."""

    argmax: bool = False
    softmax: bool = False
    sigmoid: bool = False
    dtype: str = "float32"

    def check(self) -> None:
        if self.softmax and self.sigmoid:
            raise ConfigError("--softmax and --sigmoid: choose one")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.dtype == "uint8" and not (self.argmax or self.softmax or self.sigmoid):
            raise ConfigError("--dtype uint8 stores labels (--argmax) or probabilities "
                              "(--softmax/--sigmoid), not raw outputs")

    def channels(self, c: int) -> int:
        if self.argmax and self.dtype == "uint8" and c > 256:
            raise ConfigError(f"--argmax --dtype uint8: the model has {c} classes (> 256)")
        return 1 if self.argmax else c

    def apply(self, y):
        """The stored values of a piece ``y`` (N, C, d, h, w) as a numpy array."""
        import torch

        if not y.is_floating_point() or y.dtype == torch.float16:
            y = y.float()
        if self.softmax:
            y = torch.softmax(y, dim=1)
        elif self.sigmoid:
            y = torch.sigmoid(y)
        if self.argmax:
            return y.argmax(dim=1, keepdim=True).numpy().astype(self.dtype)
        if self.dtype == "uint8":
            return (y * 255).round().numpy().astype(np.uint8)
        return y.numpy().astype(self.dtype)


class VolumeSource:
    """The inputs: a sharded dataset folder (its manifest) or one HDF5 file with ``x`` (N, C,
    D, H, W); targets (``y``) are not needed."""

    def __init__(self, path: str | os.PathLike, x_key: str = "x"):
        path = os.fspath(path)
        self.path = path
        if os.path.isdir(path):
            m = read_manifest(path)
            self.shape = (m.num_samples, *m.x.shape)
            self.dtype = np.dtype(m.x.dtype)
            self.paths = [os.path.join(path, s.file) for s in m.shards]
            self.locate = m.locate  # (shard, row) of a sample
            self.x_key = m.x.key
            return
        check_file(path)
        with open_h5(path) as f:
            if x_key not in f:
                raise DataError(f"{path}: missing dataset '{x_key}' (the inputs, (N, C, D, H, W))")
            x = f[x_key]
            if x.ndim != 5:
                raise DataError(f"{path}: dataset '{x_key}' is {x.shape}; expected (N, C, D, H, W)")
            self.shape, self.dtype = tuple(x.shape), x.dtype
        self.paths, self.x_key = [path], x_key
        self.locate = self._one_file

    @staticmethod
    def _one_file(sample: int) -> tuple[int, int]:
        return 0, int(sample)

    def files(self) -> ShardFiles:
        return ShardFiles(self.paths, self.x_key, None)


def _out_shape(model, in_channels: int, size: tuple) -> tuple[int, ...]:
    """The model's output shape for one sample (a meta-device forward: no data, no memory);
    refuses a model whose output is not one value per input voxel."""
    import torch

    with torch.no_grad():
        y = copy.deepcopy(model).to("meta")(torch.empty(1, in_channels, *size, device="meta",
                                                        dtype=param_dtype(model)))
    if not isinstance(y, torch.Tensor) or y.dim() != 5 or tuple(y.shape[2:]) != tuple(size):
        got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        raise ConfigError(f"predict: the model's output for a (1, {in_channels}, "
                          f"{', '.join(map(str, size))}) input is {got}; predict needs one "
                          "output per voxel (N, C, D, H, W) of the same size")
    return tuple(y.shape[1:])


def _regions(grid: ProcessGrid, n: int, slabs: list[Slab], size: tuple) -> list:
    """Every rank's pieces of the output: (rank, sample, box) for every sample and slab."""
    out = []
    spatial = grid.spatial_shape
    for sample in range(n):
        g = owner(n, grid.shape[0], sample)
        for s in slabs:
            for k, j, i in itertools.product(*(range(p) for p in reversed(spatial))):
                b = _central(s, size, spatial, (i, j, k))
                if b is not None:
                    out.append((rank_of((g, i, j, k), grid.shape), sample, b))
    return out


def _central(s: Slab, size: tuple, spatial, coords) -> tuple | None:
    """The part of a rank's piece of slab ``s``'s output inside its central part, in volume
    coordinates (None: empty)."""
    (d0, d1), *rest = box((s.hi - s.lo, *size[1:]), spatial, coords)
    d0, d1 = max(d0 + s.lo, s.start), min(d1 + s.lo, s.stop)
    return ((d0, d1), *rest) if d0 < d1 else None


def predict(model: Any, source: str | os.PathLike, out: str | os.PathLike,
            grid: ProcessGrid | str | Sequence[int] | None = None, *,
            max_slab: int | None = None, post: Post | None = None,
            channels: int | None = None, force: bool = False,
            progress: Callable[[dict], None] | None = None) -> dict:
    """Run a plain model (``torch.nn.Module``, (N, C, D, H, W) -> (N, C', D, H, W)) over every
    sample of ``source`` (a dataset folder or an HDF5 file with ``x``) and write its outputs to
    the HDF5 file ``out``.

    Collective over ``grid.comm``. The model is spatialized over the grid's x, y, z axes (a
    copy; ``model`` is not changed) and evaluated in inference mode; each data group takes its
    share of the samples. ``grid``: a :class:`~hpcpar.ProcessGrid` or its spec
    (``"1x2x1x1"``); None: every rank its own samples (``data = world size``). ``max_slab``
    tiles each volume into slabs of at most this many voxels along D (plus the model's
    receptive-field margin, :mod:`hpcpar.run.slabs`); None: whole volumes. ``channels``: use
    the first ``channels`` input channels (None: all). ``force`` replaces an existing ``out``
    that is not an incomplete prediction. ``progress`` is called on rank 0 after each of its
    samples with that sample's record. The output holds ``y`` (N, C, D, H, W) and the attribute
    ``complete`` (1 only when every rank finished): see :mod:`hpcpar.run.predict_output`.

    Returns the run's record (same on every rank): samples, grid, slabs, wall time, voxels/s
    per rank (min, mean), peak memory per rank (max, bytes). Raises DataError (unreadable
    input, unwritable output), ConfigError (a model whose output is not per voxel, bad
    post-processing options), RunDirError (``out`` exists and may not be replaced).
    """
    import torch

    from hpcpar.nn.spatializer import spatialize  # deferred: loads the dispatch tables
    from hpcpar.nn.split import local  # deferred: loads the dispatch tables

    start = time.perf_counter()
    grid = ProcessGrid(-1) if grid is None else ProcessGrid.from_spec(grid)
    post = post or Post()
    comm = grid.comm
    (n, _c, *size), in_c, out_c = agreed(comm, lambda: _describe(source, channels, post, model))
    src = VolumeSource(source)
    size = tuple(size)
    if max_slab is not None and max_slab < 1:
        raise ConfigError(f"--max-slab: expected a positive voxel count, got {max_slab}")
    reach = None
    if max_slab is not None and max_slab < size[0]:
        reach = agreed(comm, lambda: model_reach(model, in_c, size[1:]))
    slabs = slab_plan(size[0], max_slab, reach)
    agreed(comm, lambda: output.prepare(out, force))
    settings = {"source": os.fspath(source), "grid": grid.spec(), "samples": n,
                "slabs": len(slabs), "margin": reach.margin if reach else 0, **asdict(post)}
    mpio = _has_mpio()
    regions = _regions(grid, n, slabs, size) if not mpio and grid.rank == 0 else []
    writer = output.Output(
        out, (n, post.channels(out_c), *size), post.dtype, comm, regions, settings, mpio)
    net = spatialize(model, grid).eval()
    ptype = param_dtype(model)
    files = src.files()
    d_idx, coords, spatial = grid.coords[0], grid.spatial_coords, grid.spatial_shape
    a, b = part_range(n, grid.shape[0], d_idx)
    voxels, busy = 0, 0.0
    try:
        for sample in range(a, b):
            t0 = time.perf_counter()
            for s in slabs:
                inbox = box((s.hi - s.lo, *size[1:]), spatial, coords)
                rbox = ((inbox[0][0] + s.lo, inbox[0][1] + s.lo), *inbox[1:])
                x = np.empty((1, _c, *(hi - lo for lo, hi in rbox)), src.dtype)
                read_samples(files, [src.locate(sample)], rbox, x, np.empty((1, 0)))
                with torch.inference_mode():
                    y = local(net(torch.from_numpy(x[:, :in_c]).to(ptype)))
                keep = _central(s, size, spatial, coords)
                if keep is None:
                    continue
                cut = tuple(slice(k0 - r0, k1 - r0) for (k0, k1), (r0, _) in zip(keep, rbox))
                piece = post.apply(y[0, :, cut[0], cut[1], cut[2]][None])[0]
                writer.write(sample, keep, piece)
                voxels += int(np.prod(piece.shape[1:]))
            dt = time.perf_counter() - t0
            busy += dt
            if progress is not None and grid.rank == 0:
                progress({"sample": sample, "done": sample - a + 1, "of": b - a, "seconds": dt})
    finally:
        files.close()
    # the same record on every rank (mpio writes it collectively): the slowest rank's time
    stats = comm.allgather((voxels / busy if busy else 0.0,
                            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                            time.perf_counter() - start))
    rates = [r for r, _, _ in stats]
    record = {**settings, "wall_s": round(max(t for _, _, t in stats), 3),
              "voxels_per_s_per_rank_min": round(min(rates), 1),
              "voxels_per_s_per_rank_mean": round(sum(rates) / len(rates), 1),
              "peak_rss_bytes_max": max(m for _, m, _ in stats)}
    writer.close(record)
    comm.Barrier()
    return record


def agreed(comm, action):
    """:func:`hpcpar.parallel.agree.agree` with rank 0 acting (every rank gets its result or
    its error), the error marked collective: every rank raised it, rank 0 alone prints it."""
    try:
        return agree(comm, action, root=0)
    except HpcparError as exc:
        exc.collective = True  # read by _rank_main
        raise


def _describe(source, channels, post: Post, model) -> tuple:
    """(shape (N, C, D, H, W) of the inputs, input channels, output channels), checked: run
    once (rank 0) and shared, so every rank gets the same answer or the same error."""
    post.check()
    src = VolumeSource(source)
    n, c = src.shape[:2]
    in_c = c if channels is None else channels
    if not 0 < in_c <= c:
        raise DataError(f"{source}: the model takes {in_c} input channels but 'x' has {c}")
    out_c = _out_shape(model, in_c, tuple(src.shape[2:]))[0]
    post.channels(out_c)
    return src.shape, in_c, out_c


def _has_mpio() -> bool:
    import h5py

    return bool(h5py.get_config().mpi)


# -- the per-rank entry of `hpcpar predict` ---------------------------------------------------
def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """What every rank of ``hpcpar predict`` runs: load the model, predict, print progress
    and a summary line (rank 0). Raises :class:`~hpcpar.errors.HpcparError` on a user error
    (run in the CLI's process, the CLI prints it); :func:`_rank_main` is the launched form."""
    from mpi4py import MPI

    from hpcpar.run.predict_model import load_model  # deferred: the job formats

    ap = argparse.ArgumentParser(prog="python -m hpcpar.run.predict")
    ap.add_argument("target", nargs="?")
    for flag in ("--data", "--out"):
        ap.add_argument(flag, required=True)
    for flag in ("--grid", "--model", "--weights"):
        ap.add_argument(flag, default=None)
    ap.add_argument("--max-slab", type=int, default=None)
    for flag in ("--argmax", "--softmax", "--sigmoid", "--force"):
        ap.add_argument(flag, action="store_true")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    rank = MPI.COMM_WORLD.Get_rank()
    model, channels = load_model(args.target, args.model, args.weights)

    def shown(p: dict) -> None:
        _say(f"hpcpar predict: sample {p['sample']} ({p['done']}/{p['of']} of data group 0) "
             f"in {p['seconds']:.2f} s")

    record = predict(model, args.data, args.out, args.grid or f"1x{MPI.COMM_WORLD.Get_size()}",
                     max_slab=args.max_slab, post=Post(args.argmax, args.softmax,
                                                       args.sigmoid, args.dtype),
                     channels=channels, force=args.force, progress=shown)
    if rank == 0:
        _say(f"hpcpar predict: {record['samples']} sample(s) -> {args.out} on grid "
             f"{record['grid']} ({record['slabs']} slab(s)/sample) in {record['wall_s']:.1f} s, "
             f"{record['voxels_per_s_per_rank_mean']:.3g} voxels/s per rank, peak memory "
             f"{record['peak_rss_bytes_max'] / 2**20:.0f} MiB per rank")
    return EXIT_OK


def _rank_main() -> None:
    """``python -m hpcpar.run.predict``: a user error is one line (rank 0) and its exit
    code, a crash one line naming the rank; either way OUT stays marked incomplete and
    ``os._exit`` ends the rank at once, so the launcher stops the others."""
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    try:
        rc = main()
    except HpcparError as exc:
        if not getattr(exc, "collective", False):
            _say(f"hpcpar: error: [rank {rank}] {exc}")
        elif rank == 0:
            _say(f"hpcpar: error: {exc}")
        os._exit(getattr(exc, "exit_code", EXIT_USAGE))
    except BaseException as exc:  # noqa: BLE001 - any crash: one line with the rank, stop all
        _say(f"hpcpar: error: [rank {rank}] {type(exc).__name__}: {exc}")
        os._exit(EXIT_FAILED)
    sys.exit(rc)


if __name__ == "__main__":
    _rank_main()
