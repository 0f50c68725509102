"""``hpcpar info``: what this installation and machine offer, and a grid's rank table."""

from __future__ import annotations

import importlib
import json
import os
import platform

import click

from hpcpar._tables import text_table
from hpcpar.cli._options import json_option, ranks_option
from hpcpar.errors import GridError
from hpcpar.parallel.grid import MAX_TABLE_RANKS, layout, parse_spec, resolve_shape

__all__ = ["facts", "info"]


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

        lib = " ".join(MPI.Get_library_version().strip("\x00 \n").splitlines()[0].split())
        rows.append(("MPI library", lib))
        rows.append(("MPI standard", "{}.{}".format(*MPI.Get_version())))
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
        from hpcpar.parallel.cuda_aware import cuda_aware  # deferred: loads torch

        aware = cuda_aware()
        rows.append(("CUDA-aware MPI", f"{'yes' if aware else 'no'} ({aware.reason})"))
    except Exception as exc:  # noqa: BLE001
        rows.append(("CUDA-aware MPI", f"unknown ({exc})"))
    rows.append(("inside Slurm", slurm_context()))
    try:
        from hpcpar.launch.mpiexec import find_mpiexec  # deferred: keeps --help fast

        rows.append(("mpiexec", find_mpiexec()))
    except Exception as exc:  # noqa: BLE001
        rows.append(("mpiexec", str(exc)))
    rows.append(("ranks' allocator", _allocator()))
    return rows


def _allocator() -> str:
    """What ``hpcpar run`` preloads for its ranks, and why (hpcpar.launch.allocator)."""
    from hpcpar.launch.allocator import preload  # deferred: keeps --help fast

    env: dict[str, str] = dict(os.environ)
    before = env.get("LD_PRELOAD", "")
    try:
        preload(env)
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    added = env.get("LD_PRELOAD", "").removesuffix(before).strip()
    if added:
        return f"preloaded: {added}"
    return (f"as LD_PRELOAD says ({before})" if before else
            "the system's malloc (no libjemalloc.so.2 found, or HPCPAR_ALLOCATOR=system; "
            "a rank's peak memory can creep up over the steps)")


@click.command("info")
@ranks_option(many=False, help="Print the rank table for this many ranks.")
@click.option("--grid", "grid_spec", default=None,
              help="Grid DATAxXxYxZ (one axis may be -1). Default: all data-parallel.")
@click.option("--ranks-per-node", type=click.IntRange(min=1), default=None,
              help="Ranks per node for the table (default: all on one node).")
@json_option("Print one JSON object (the facts, or the grid and its rank table).")
def info(ranks, grid_spec, ranks_per_node, as_json):
    """Versions, MPI/CUDA facts, Slurm context; with --ranks, the rank -> (data, x, y, z) ->
    node table of a grid, computed without launching anything."""
    from hpcpar.launch.allocation import rank_hosts  # deferred: keeps --help fast

    hosts = rank_hosts()
    if ranks is None and grid_spec is None:
        rows = facts()
        if as_json:
            click.echo(json.dumps({**dict(rows), "allocation_hosts": hosts or []}))
            return
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            click.echo(f"{k:<{width}}  {v}")
        if hosts:
            click.echo(f"\nrank -> host as srun places this allocation's {len(hosts)} tasks "
                       f"(block):")
            for r, h in enumerate(hosts):
                click.echo(f"{r:>5}  {h}")
        return
    if ranks is None:
        shape = parse_spec(grid_spec)
        if -1 in shape:
            raise GridError(f"grid {grid_spec}: give --ranks to infer the -1 axis")
        ranks = shape[0] * shape[1] * shape[2] * shape[3]
    if ranks < 1:
        raise GridError(f"--ranks must be positive, got {ranks}")
    if ranks > MAX_TABLE_RANKS:
        raise GridError(f"--ranks {ranks}: the rank table lists at most {MAX_TABLE_RANKS} "
                        f"ranks")
    shape = resolve_shape(parse_spec(grid_spec) if grid_spec else (-1, 1, 1, 1), ranks)
    spec = "x".join(map(str, shape))
    if hosts and ranks_per_node is None and len(hosts) == ranks:  # the allocation's placement
        title = (f"grid {spec} (data x X x Y x Z), {ranks} ranks on this allocation's "
                 f"{len(dict.fromkeys(hosts))} node(s)")
        table = [(e, hosts[e.rank]) for e in layout(shape, ranks)]
    else:
        per_node = ranks_per_node or ranks
        title = (f"grid {spec} (data x X x Y x Z), {ranks} ranks, {-(-ranks // per_node)} "
                 f"node(s) of {per_node} ranks")
        table = [(e, str(e.node)) for e in layout(shape, per_node)]
    if as_json:
        click.echo(json.dumps({"grid": spec, "ranks": ranks, "table": [
            dict(zip(("rank", "data", "x", "y", "z", "node"), (e.rank, *e.coords, node)))
            for e, node in table]}))
        return
    click.echo(title)
    click.echo(text_table(("rank", "data", "x", "y", "z", "node"), [(e.rank, *e.coords, node)
                          for e, node in table], markdown=False, align=("right",) * 6))
