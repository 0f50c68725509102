"""``hpcpar info``: what this installation and machine offer, and a grid's rank table."""

from __future__ import annotations

import importlib
import os
import platform

import click


def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception as exc:  # noqa: BLE001 - report, never crash the info command
        return f"not available ({type(exc).__name__})"


def slurm_context(env=None) -> str:
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if not job:
        return "no (not inside a Slurm allocation)"
    step = env.get("SLURM_STEP_ID")
    where = f"job {job} on {env.get('SLURM_JOB_NODELIST', '?')}"
    return f"yes, {where}" + (f", step {step}" if step else ", batch/allocation shell")


def facts() -> list[tuple[str, str]]:
    """(label, value) rows describing this environment."""
    rows = [("hpcpar", _version("hpcpar")), ("python", platform.python_version()),
            ("torch", _version("torch")), ("mpi4py", _version("mpi4py"))]
    try:
        from mpi4py import MPI

        lib = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
        rows.append(("MPI library", lib))
        rows.append(("MPI standard", "%d.%d" % MPI.Get_version()))
    except Exception as exc:  # noqa: BLE001
        rows.append(("MPI library", f"not available ({exc})"))
    rows += [("numba", _version("numba")), ("h5py", _version("h5py"))]
    try:
        import h5py

        rows.append(("h5py parallel (mpio)", "yes" if h5py.get_config().mpi else "no"))
    except Exception:  # noqa: BLE001
        pass
    try:
        import torch

        cuda = torch.cuda.is_available()
        rows.append(("CUDA available", f"yes ({torch.cuda.device_count()} devices)"
                     if cuda else "no"))
    except Exception:  # noqa: BLE001
        rows.append(("CUDA available", "unknown (torch missing)"))
    try:
        from hpcpar.parallel.comm import cuda_aware

        aware = cuda_aware()
        rows.append(("CUDA-aware MPI", f"{'yes' if aware else 'no'} ({aware.reason})"))
    except Exception as exc:  # noqa: BLE001
        rows.append(("CUDA-aware MPI", f"unknown ({exc})"))
    rows.append(("inside Slurm", slurm_context()))
    try:
        from hpcpar.launch.mpiexec import find_mpiexec

        rows.append(("mpiexec", find_mpiexec()))
    except Exception as exc:  # noqa: BLE001
        rows.append(("mpiexec", str(exc)))
    return rows


@click.command("info")
@click.option("--ranks", type=int, default=None, help="Print the rank table for this many ranks.")
@click.option("--grid", "grid_spec", default=None,
              help="Grid DATAxXxYxZ (one axis may be -1). Default: all data-parallel.")
@click.option("--ranks-per-node", type=int, default=None,
              help="Ranks per node for the table (default: all on one node).")
def info(ranks, grid_spec, ranks_per_node):
    """Versions, MPI/CUDA facts, Slurm context; with --ranks, the rank -> (data, x, y, z) ->
    node table of a grid, computed without launching anything."""
    from hpcpar.errors import GridError
    from hpcpar.parallel.grid import layout, parse_spec, resolve_shape

    if ranks is None and grid_spec is None:
        rows = facts()
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            click.echo(f"{k:<{width}}  {v}")
        return
    if ranks is None:
        shape = parse_spec(grid_spec)
        if -1 in shape:
            raise GridError(f"grid {grid_spec}: give --ranks to infer the -1 axis")
        ranks = shape[0] * shape[1] * shape[2] * shape[3]
    if ranks < 1:
        raise GridError(f"--ranks must be positive, got {ranks}")
    shape = resolve_shape(parse_spec(grid_spec) if grid_spec else (-1, 1, 1, 1), ranks)
    per_node = ranks_per_node or ranks
    click.echo(f"grid {'x'.join(map(str, shape))} (data x X x Y x Z), {ranks} ranks, "
               f"{-(-ranks // per_node)} node(s) of {per_node} ranks")
    click.echo(f"{'rank':>5} {'data':>5} {'x':>4} {'y':>4} {'z':>4} {'node':>5}")
    for e in layout(shape, per_node):
        d, i, j, k = e.coords
        click.echo(f"{e.rank:>5} {d:>5} {i:>4} {j:>4} {k:>4} {e.node:>5}")
