"""``hpcpar data``: make, inspect, verify and re-shard HDF5 volume datasets.

``make`` and ``shard`` run in parallel under ``mpiexec`` (each rank writes its own shards) and as
one rank without it. torch/h5py/mpi4py load inside the commands, not at import."""

from __future__ import annotations

import json
import os
import sys

import click

from hpcpar.cli._options import json_option
from hpcpar.errors import DataError

__all__ = ["data", "make", "cosmoflow", "shard", "info", "verify"]

CHUNK_OPTION = click.option(
    "--chunk", default="auto", show_default=True,
    help="Chunk edge target along D, H, W, or D,H,W (0: whole axis; auto: D min(32, D/4), "
         "H half, W whole), or grid:XxYxZ (one chunk per rank block of that spatial grid: "
         "each rank reads one chunk per sample straight into place).")
GRID_OPTION = click.option(
    "--grid", default=None, metavar="DxXxYxZ",
    help="The process grid you will train on (or its spatial part XxYxZ): chunks become one "
         "per rank block of it, as --chunk grid:XxYxZ; other grids still read the data.")


@click.group()
def data():
    """Make, inspect, verify and re-shard sharded HDF5 volume datasets."""


@data.group()
def make():
    """Generate a synthetic dataset."""


LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                 "MV2_COMM_WORLD_SIZE", "SLURM_STEP_ID")


def _comm():
    """MPI.COMM_WORLD under a launcher (or once MPI is loaded), else a one-rank stand-in so
    the command needs no MPI initialisation when run directly."""
    if "mpi4py.MPI" in sys.modules or any(v in os.environ for v in LAUNCHER_VARS):
        from mpi4py import MPI

        return MPI.COMM_WORLD
    from hpcpar.data.writer import SerialComm  # deferred: keeps --help fast

    return SerialComm()


@make.command()
@click.argument("out", type=click.Path())
@click.option("--samples", default=64, show_default=True, help="Number of samples.")
@click.option("--size", default=128, show_default=True, help="Edge of the cubic volume.")
@click.option("--channels", default=4, show_default=True, help="Channels per sample.")
@click.option("--shards", default=8, show_default=True, help="Number of shard files.")
@click.option("--seed", default=0, show_default=True, help="Data seed (sample i depends on "
              "(seed, i) only).")
@CHUNK_OPTION
@GRID_OPTION
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def cosmoflow(out, samples, size, channels, shards, seed, chunk, grid, force, quiet):
    """CosmoFlow-like Gaussian random fields; targets: amplitude, slope, cutoff, nonlinearity
    (normalised to [-1, 1])."""
    from hpcpar.data.format import chunk_from_options  # deferred: keeps --help fast
    from hpcpar.data.synthetic import CosmoflowSource, check_params  # deferred: keeps --help fast
    from hpcpar.data.writer import shard_counts, write_dataset  # deferred: keeps --help fast

    check_params(size, channels, seed, samples)
    chunking = chunk_from_options(chunk, grid)
    comm = _comm()
    counts = shard_counts(samples, shards=shards)
    m = write_dataset(out, CosmoflowSource(samples, size, channels, seed), counts, comm=comm,
                      chunk=chunking, force=force, progress=not quiet)
    if comm.Get_rank() == 0:
        click.echo(f"wrote {out}: {m.num_samples} samples in {len(m.shards)} shards "
                   f"(x {tuple(m.x.shape)} {m.x.dtype}, y {tuple(m.y.shape)}) "
                   f"with {comm.Get_size()} rank(s)")


@data.command()
@click.argument("in_file", nargs=-1, metavar="[IN.h5]", type=click.Path())
@click.argument("out", type=click.Path())
@click.option("--images", default=None, metavar="GLOB",
              help="Image files instead of IN.h5, one sample each: a glob ('scans/*.nii.gz') "
                   "or a folder of .npy, .npz, .nii(.gz), .tif(f) or .h5 files.")
@click.option("--labels", default=None, metavar="GLOB",
              help="With --images: label volumes (D, H, W), paired with the images by file "
                   "stem.")
@click.option("--targets", "targets_csv", default=None, metavar="FILE.csv",
              help="With --images: per-sample targets, a CSV with a header row whose first "
                   "column is the image's stem.")
@click.option("--size", "fit_size", default=None, metavar="DxHxW",
              help="With --images: centre-crop every volume to this size (N or DxHxW); "
                   "without it, volumes of different sizes are refused.")
@click.option("--pad", is_flag=True, help="With --size: zero-pad volumes smaller than it.")
@click.option("--x-key", default="x", show_default=True,
              help="Dataset with the volumes, (N, C, D, H, W) or (N, D, H, W).")
@click.option("--y-key", default="y", show_default=True,
              help="Dataset with the targets, (N, K) or (N,).")
@click.option("--samples-per-shard", type=int, required=True, help="Samples per shard.")
@CHUNK_OPTION
@GRID_OPTION
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--allow-nonfinite", is_flag=True, help="Keep NaN/inf values (else an error "
              "naming the sample); the manifest then records the data as not finite.")
@click.option("--transform", type=click.Choice(["none", "log1p"]), default="none",
              show_default=True,
              help="Input transform training applies at run time, recorded in the manifest "
                   "(the stored values are copied unchanged); [data] transform = 'auto' "
                   "follows it.")
def shard(in_file, out, images, labels, targets_csv, fit_size, pad, x_key, y_key, samples_per_shard,
          chunk, grid, force, quiet, allow_nonfinite, transform):
    """Shard a single HDF5 file (IN.h5 OUT), or image files with their label volumes or per-sample
    targets (OUT --images ... --labels/--targets ...), into an hpcpar dataset directory; values are
    copied as they are, and no input transform is applied at run time unless --transform asks."""
    from hpcpar.data.format import chunk_from_options  # deferred: keeps --help fast
    from hpcpar.data.writer import H5Source, shard_counts, write_dataset  # deferred: fast --help

    chunking = chunk_from_options(chunk, grid)
    given = [o for o, v in (("--labels", labels), ("--targets", targets_csv),
                            ("--size", fit_size), ("--pad", pad or None)) if v is not None]
    if images is None and given:
        raise click.UsageError(f"{given[0]} needs --images")
    if pad and fit_size is None:
        raise click.UsageError("--pad needs --size (the size to pad to)")
    if images is None:
        if len(in_file) != 1:
            raise click.UsageError("expected IN.h5 OUT (or OUT --images GLOB ...)")
        source = H5Source(in_file[0], x_key, y_key)
    else:
        from hpcpar.data.volume_files import VolumeFiles, expand  # deferred: keeps --help fast

        if in_file:
            raise click.UsageError("with --images, give OUT only (no IN.h5)")
        source = VolumeFiles(expand(images, "--images"),
                             expand(labels, "--labels") if labels is not None else None,
                             targets_csv, _size(fit_size), pad)
    try:
        comm = _comm()
        counts = shard_counts(len(source), samples_per_shard=samples_per_shard)
        m = write_dataset(out, source, counts, comm=comm, chunk=chunking, force=force,
                          progress=not quiet, allow_nonfinite=allow_nonfinite, transform=transform)
    finally:
        source.close()
    if comm.Get_rank() == 0:
        click.echo(f"wrote {out}: {m.num_samples} samples in {len(m.shards)} shards "
                   f"(x {tuple(m.x.shape)}, y {tuple(m.y.shape)}; transform at run time: "
                   f"{m.transform})")


def _size(text):
    """``--size``: N or DxHxW as a (D, H, W) triple, or None."""
    if text is None:
        return None
    parts = text.lower().split("x")
    if len(parts) not in (1, 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise click.BadParameter(f"{text!r}: expected N or DxHxW (positive integers)",
                                 param_hint="--size")
    return tuple(int(p) for p in parts) * (3 // len(parts))


@data.command()
@click.argument("directory", type=click.Path())
@json_option("Print the manifest as one JSON object (with the dataset's total bytes).")
def info(directory, as_json):
    """Format version, sample count, shapes, chunks and the shard table."""
    from hpcpar.data.format import read_manifest  # deferred: keeps --help fast

    m = read_manifest(directory)
    total = sum(s.bytes for s in m.shards)
    if as_json:
        click.echo(json.dumps({"dataset": str(directory), "bytes": total, **m.to_json()},
                              allow_nan=False, default=str))
        return
    click.echo(f"dataset        {directory}")
    click.echo(f"format         {m.format} v{m.format_version}")
    click.echo(f"samples        {m.num_samples} in {len(m.shards)} shards, "
               f"{total / 2**20:.1f} MiB")
    click.echo(f"x              {m.x.key} {tuple(m.x.shape)} {m.x.dtype} chunks "
               f"{tuple(m.x.chunks) if m.x.chunks else 'contiguous'}")
    names = f" ({', '.join(m.y.names)})" if m.y.names else ""
    click.echo(f"y              {m.y.key} {tuple(m.y.shape)} {m.y.dtype}{names}")
    click.echo(f"transform      {m.transform} (applied to x at run time)")
    for key, value in m.source.items():
        click.echo(f"source.{key:<8} {value}")
    click.echo("shards:")
    for s in m.shards:
        click.echo(f"  {s.file}  samples [{s.start}, {s.stop})  {s.bytes} bytes  "
                   f"sha256 {s.sha256[:16]}")


@data.command()
@click.argument("directory", type=click.Path())
@click.option("--no-checksum", is_flag=True, help="Skip the sha256 check and the value scan "
              "(shapes only).")
@json_option("Print one JSON object: ok, the problems found, shards and samples checked.")
def verify(directory, no_checksum, as_json):
    """Check every shard: present, HDF5, size, sha256, keys, shapes, dtypes, sample range, and every
    value finite (NaN/inf only where the manifest records them). A sharded graph (hpcpar data graph
    partition): every part file's size, sha256, datasets and ranges."""
    from hpcpar.data.format import read_manifest, verify_dataset  # deferred: keeps --help fast

    if _is_graph(directory):
        return _verify_graph(directory, no_checksum, as_json)
    problems = verify_dataset(directory, checksum=not no_checksum)
    m = read_manifest(directory) if not problems else None
    if _verdict(directory, problems, no_checksum, as_json,
                {"shards": len(m.shards) if m else None,
                 "samples": m.num_samples if m else None}):
        return
    assert m is not None
    scanned = "" if no_checksum else ", values finite" if all(
        (m.stats.get(k) or {}).get("finite", True) for k in ("x", "y")) else \
        ", NaN/inf present as the manifest records"
    click.echo(f"ok: {directory}: {len(m.shards)} shards, {m.num_samples} samples verified"
               f"{scanned}")


def _is_graph(directory) -> bool:
    try:
        from hpcpar.graph.shards import is_sharded_graph  # deferred: keeps --help fast
    except ModuleNotFoundError:
        return False
    return is_sharded_graph(directory)


def _verdict(directory, problems, no_checksum, as_json, counts: dict) -> bool:
    """Report ``verify``'s problems (one line each, exit 2) or its JSON verdict; True when
    the JSON was printed (nothing more to say)."""
    if as_json:  # the verdict is the document; the exit code still says it (2 when not ok)
        click.echo(json.dumps({"dataset": str(directory), "ok": not problems,
                               "problems": problems, "checksums": not no_checksum, **counts}))
        if problems:
            raise SystemExit(DataError.exit_code)
        return True
    if problems:
        for p in problems[1:]:
            click.echo(f"hpcpar: error: {p}", err=True)
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise DataError(problems[0] + more)
    return False


def _verify_graph(directory, no_checksum, as_json):
    """``data verify`` of a sharded graph: the same report and exit codes as for volumes."""
    from hpcpar.graph.shards import (  # deferred: keeps --help fast
        read_graph_manifest,
        verify_graph_shards,
    )

    problems = verify_graph_shards(directory, checksum=not no_checksum)
    m = read_graph_manifest(directory) if not problems else None
    if _verdict(directory, problems, no_checksum, as_json,
                {"parts": m["parts"] if m else None, "nodes": m["num_nodes"] if m else None}):
        return
    assert m is not None
    click.echo(f"ok: {directory}: sharded graph, {m['parts']} parts, {m['num_nodes']} nodes, "
               f"{m['num_edges']} edges verified")


try:  # `hpcpar data graph ...` lives in the GNN's module when that is installed
    from hpcpar.cli.graph import graph as _graph
except ModuleNotFoundError as _exc:
    if _exc.name != "hpcpar.cli.graph":
        raise
else:
    data.add_command(_graph, "graph")
