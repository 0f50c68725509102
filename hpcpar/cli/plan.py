"""``hpcpar plan``: predict the step time of a job on every grid of N ranks; pick one."""

from __future__ import annotations

import os
from pathlib import Path

import click

from hpcpar.cli._options import json_option, out_option, ranks_option, set_option

__all__ = ["FIELDS", "row", "workload_from_job", "workload_of", "table", "largest_samples",
           "largest_table", "write_csv", "plan"]


def _sample_shape(job) -> tuple[tuple, int]:
    """(per-sample x shape (C, D, H, W), number of targets) from the dataset's manifest, else
    from the job's synthetic [data] size/channels."""
    from hpcpar.data import read_manifest
    from hpcpar.data.synthetic import TARGETS
    from hpcpar.errors import ConfigError

    d = job.data.params
    path = d.get("path")
    if path and (Path(path) / "manifest.json").is_file():
        m = read_manifest(path)
        return tuple(m.x.shape), int(m.y.shape[0])
    if d.get("size"):
        return (d.get("channels") or 4,) + (d["size"],) * 3, len(TARGETS)
    raise ConfigError(f"{job.name}: [data] size is not set and no dataset manifest to read it "
                      "from; add --set data.size=N")


def _model(job, sample_shape, n_targets):
    """The job's plain model on the meta device, built by its workload (no data, no memory),
    and the shape of its input (the sample without label channels)."""
    import torch

    from hpcpar.errors import ConfigError
    from hpcpar.formats.kinds import get_workload

    cls = get_workload(job.model.kind)
    if not hasattr(cls, "build_plain"):
        raise ConfigError(f"[model] kind {job.model.kind!r}: the planner models volume jobs "
                          "(cosmoflow, unet3d) and full-graph GNN jobs (gcn, sage)")
    with torch.device("meta"):
        model = cls.build_plain(job, sample_shape[0], sample_shape[1:], n_targets)
    return model, (sample_shape[0] - cls.label_channels, *sample_shape[1:])


def _graph_parts(path: str, method: str, seed: int):
    """``ranks -> [Part]``: the graph file partitioned as the run partitions it (the same
    partitioner, seed and symmetry), then each part's owned vertices, in-edges, halo
    vertices and neighbouring parts counted."""
    import numpy as np

    from hpcpar.graph.format import GraphFile
    from hpcpar.graph.vertex_partition import partition_csr
    from hpcpar.plan.gnn import Part

    with GraphFile(path) as gf:
        indptr, indices = gf.read_structure()
        directed = gf.directed
    n = indptr.shape[0] - 1
    dest = np.repeat(np.arange(n), np.diff(indptr))

    def parts(ranks: int) -> list:
        owner = partition_csr(indptr, indices, ranks, method, seed, symmetric=not directed) \
            if ranks > 1 else np.zeros(n, np.int64)
        own_d, own_s = owner[dest], owner[indices]
        cross = own_d != own_s
        halo = np.bincount(np.unique(own_d[cross] * n + indices[cross]) // n, minlength=ranks)
        peers = np.bincount(np.unique(own_d[cross] * ranks + own_s[cross]) // ranks,
                            minlength=ranks)
        owned = np.bincount(owner, minlength=ranks)
        edges = np.bincount(own_d, minlength=ranks)
        return [Part(int(owned[r]), int(edges[r]), int(halo[r]), int(peers[r]))
                for r in range(ranks)]

    return parts


def _graph_workload(job, cls):
    """The planner's view of a full-graph job: widths from the graph file and [model]."""
    from hpcpar.errors import ConfigError
    from hpcpar.graph.format import GraphFile
    from hpcpar.plan.gnn import GraphJob
    from hpcpar.plan.planner import Workload
    from hpcpar.run.workloads.graph import make_graph_file

    d, m = job.data.params, job.model.params
    path = d["path"]
    if not os.path.exists(path):
        if not d["make"]:
            raise ConfigError(f"[data] path: {path!r}: graph file not found")
        make_graph_file(path, d)  # what the run makes first (Cora: a copy, synthetic: seconds)
    with GraphFile(path) as gf:
        features, classes, nodes = gf.num_features, gf.num_classes, gf.num_nodes
    widths = (features, *[m["hidden"]] * (m["layers"] - 1), classes)
    graph = GraphJob(widths, cls.conv, m["dropout"], m["precompute"],
                     _graph_parts(path, d["partition"], d["partition_seed"]), nodes)
    return Workload(job.name, [], (features,), 1, precision=job.train.precision,
                    optimizer=job.train.optimizer, params=graph.params, graph=graph)


def workload_from_job(path: str, overrides=(), size: int | None = None):
    """The planner's view of a job; ``size``: a cubic sample of that edge instead of the
    dataset's (the job's channels). Full-graph jobs (gcn, sage) read their graph file."""
    from hpcpar.formats.jobspec import load_job

    return workload_of(load_job(path, list(overrides)), size)


def workload_of(job, size: int | None = None):
    """The planner's view of a validated job (``JobSpec``); see :func:`workload_from_job`."""
    from hpcpar.formats.kinds import get_workload
    from hpcpar.plan.planner import Workload, mark_tensor_parallel, trace_layers

    cls = get_workload(job.model.kind)
    if hasattr(cls, "conv") and not hasattr(cls, "build_plain"):
        return _graph_workload(job, cls)
    shape, n_targets = _sample_shape(job)
    if size is not None:
        shape = (shape[0], size, size, size)
    layers = trace_layers(*_model(job, shape, n_targets))
    if job.model.params.get("tensor_parallel"):
        mark_tensor_parallel(layers, job.model.params["tp_min_features"])
    return Workload(job.name, layers, shape, job.train.global_batch,
                    precision=job.train.precision, optimizer=job.train.optimizer)


def fit_points(run_dirs, trust_kind: bool = False) -> list:
    """``(workload, grid, measured step)`` of finished runs, for :mod:`hpcpar.plan.fit`; a
    directory that is not a finished run is a one-line error. A run's ``[model] kind`` imports
    no code unless it is built in, already loaded by the job being planned, or ``trust_kind``
    (installed packages only)."""
    from hpcpar.analysis import load, scaling_table
    from hpcpar.errors import ConfigError
    from hpcpar.formats.jobspec import load_resolved
    from hpcpar.parallel.grid import resolve_shape

    points = []
    for rd in run_dirs:
        if not (Path(rd) / "job.json").is_file():
            raise ConfigError(f"--fit-on {rd}: no job.json there (not an hpcpar run directory)")
        job = load_resolved(Path(rd) / "job.json", untrusted=True, trust_kind=trust_kind)
        runs, steps = load([str(rd)])
        if steps.empty:
            raise ConfigError(f"--fit-on {rd}: no step records (the run has not trained)")
        scaled = scaling_table(runs, steps).iloc[0]
        grid = resolve_shape(job.grid_shape, int(scaled["ranks"]))
        points.append((workload_of(job), grid, float(scaled["t_step_median"])))
    return points


def table(preds, top: int) -> str:
    head = (f"{'rank':>4}  {'grid':<12} {'step s':>9} {'compute':>9} {'halo':>8} "
            f"{'gather':>8} {'tp':>8} {'allred':>8} {'io':>8} {'mem GB':>7}")
    lines = [head]
    feasible = [p for p in preds if p.feasible]
    for i, p in enumerate(feasible[:top], 1):
        lines.append(f"{i:>4}  {p.spec:<12} {p.t_step:>9.4f} {p.t_compute:>9.4f} "
                     f"{p.t_halo:>8.4f} {p.t_gather:>8.4f} {p.t_tp:>8.4f} "
                     f"{p.t_allreduce_exposed:>8.4f} "
                     f"{p.extra.get('io_exposed', 0):>8.4f} {p.mem_bytes / 1e9:>7.2f}")
    bad = [p for p in preds if not p.feasible]
    if bad:
        lines.append(f"infeasible ({len(bad)} grids, not recommended), e.g.:")
        for p in _examples(bad, max(3, min(top, 5))):
            lines.append(f"     {p.spec:<12} {p.reason}")
    return "\n".join(lines)


def _examples(bad, k: int):
    """Up to ``k`` infeasible grids, one per kind of reason first (memory, batch, extent)."""
    seen, first, rest = set(), [], []
    for p in bad:
        kind = ("memory" if "GB per rank" in p.reason else
                "batch" if "not divisible" in p.reason else "extent")
        (rest if kind in seen else first).append(p)
        seen.add(kind)
    return (first + rest)[:k]


def largest_samples(job_file, sets, work, preds, machine) -> list[tuple]:
    """Per grid ``(grid, edge, peak bytes)``: the largest cubic sample edge (the job's channels
    and batch) whose predicted peak memory per rank fits the machine's ``mem_per_rank``;
    edge and peak None: no sample the model takes fits. Largest first."""
    from hpcpar.errors import HpcparError
    from hpcpar.plan.memory import HEADROOM, estimate, largest_edge
    from hpcpar.plan.planner import BYTES, predict

    works = {work.sample_shape[1]: work}

    def at(size):
        if size not in works:
            try:
                works[size] = workload_from_job(job_file, sets, size=size)
            except HpcparError:   # smaller than the model takes
                works[size] = None
        return works[size]

    smallest = next(s for s in range(1, 1 << 14) if at(s) is not None)
    out = []
    for p in preds:
        if "not divisible" in p.reason:
            continue

        def fits(size, grid=p.grid):
            total = estimate(at(size), grid, BYTES.get(work.precision, 4)).total
            return total <= HEADROOM * machine.mem_per_rank

        edge = largest_edge(fits, smallest)
        best = predict(at(edge), p.grid, machine) if edge else None
        if best is None or not best.feasible:   # too small for this many ranks on an axis
            out.append((p.spec, None, None))
        else:
            out.append((p.spec, edge, best.mem_bytes))
    return sorted(out, key=lambda r: (-(r[1] or 0), r[0]))


def largest_table(largest, work, budget: float, top: int) -> str:
    c = work.sample_shape[0]
    lines = [f"largest cubic sample per grid within {budget / 2**30:.3g} GiB per rank "
             f"({c} channels, global batch {work.global_batch}; this job's edge is "
             f"{work.sample_shape[1]}):", f"      {'grid':<12} {'edge':>6} {'mem GB':>7}"]
    for spec, edge, mem in largest[:top]:
        lines.append(f"      {spec:<12} {edge:>6} {mem / 1e9:>7.2f}" if edge else
                     f"      {spec:<12} {'none':>6} {'':>7}")
    return "\n".join(lines)


FIELDS = ("grid", "data", "x", "y", "z", "feasible", "reason", "t_step", "t_compute", "t_halo",
          "t_gather", "t_allreduce", "t_allreduce_exposed", "t_io", "mem_bytes", "t_tp")


def row(p) -> dict:
    """One prediction as a flat record (the CSV row and the --json item)."""
    return dict(zip(FIELDS, [p.spec, *p.grid, p.feasible, p.reason, p.t_step, p.t_compute,
                             p.t_halo, p.t_gather, p.t_allreduce, p.t_allreduce_exposed, p.t_io,
                             p.mem_bytes, p.t_tp]))


def write_csv(preds, path: str) -> None:
    import csv

    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, FIELDS)
        w.writeheader()
        w.writerows(row(p) for p in preds)
    os.replace(tmp, path)


@click.command("plan")
@click.argument("job", required=False, type=click.Path(dir_okay=False))
@ranks_option(many=False, help="Total ranks to plan for.")
@click.option("--machine", default="local", show_default=True,
              help="Machine file: a name in slurm/machines/ or a path.")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), help="Write every grid.")
@set_option()
@click.option("--calibrate", is_flag=True,
              help="Measure this machine and write a machine file: 2 ranks (or -n N) here; "
                   "in a Slurm allocation all its tasks (2+ nodes: the network too).")
@out_option("With --calibrate: the machine file to write (default "
            "slurm/machines/local.toml).", file=True)
@click.option("--memory-budget", "budget", metavar="SIZE", default=None,
              help="Memory per rank (e.g. 1.5GiB, a Slurm --mem-per-cpu or cgroup limit) "
                   "instead of the machine file's; also print the largest cubic sample that "
                   "fits it on each grid.")
@click.option("--fit-on", "fit_runs", multiple=True, metavar="RUN",
              type=click.Path(file_okay=False),
              help="Finished run directories (e.g. the demo job's, at the rank counts you "
                   "plan for): scale every predicted step by their measured / predicted "
                   "step (repeatable).")
@click.option("--trust-kind", is_flag=True,
              help="Let --fit-on runs whose [model] kind is neither built in nor JOB's load "
                   "it from an installed package (never from the working directory).")
@json_option("Print one JSON object: the job, ranks, machine and every grid (fastest "
             "feasible first).")
def plan(job, ranks, machine, top, csv_path, sets, calibrate, out, as_json, budget,
         fit_runs, trust_kind):
    """Predict one training step of JOB on every grid that factors --ranks, fastest first,
    with the compute / halo / gather / exposed-allreduce / I/O breakdown and memory per rank."""
    import subprocess
    import sys

    from hpcpar.errors import LaunchError
    from hpcpar.launch.mpiexec import rank_env
    from hpcpar.plan.machine import load_machine, machines_dir
    from hpcpar.plan.planner import plan as make_plan

    if calibrate:
        from hpcpar.launch.launcher import default_ranks, launch_command, plan_launch

        out = out or str(machines_dir() / "local.toml")
        n = ranks or default_ranks() or 2  # inside an allocation: all its tasks (srun)
        argv = [sys.executable, "-m", "hpcpar.plan.calibrate", str(Path(out).resolve())]
        mode = plan_launch(n)
        cmd = argv if mode == "direct" else launch_command(mode, n, argv)
        r = subprocess.run(cmd, env=rank_env(), timeout=900)
        if r.returncode:
            raise LaunchError(f"calibration failed (exit code {r.returncode})")
        return
    if not job or not ranks:
        raise click.UsageError("give JOB.toml and --ranks N (or --calibrate)")
    m = load_machine(machine)
    if budget is not None:
        from dataclasses import replace

        from hpcpar.plan.memory import parse_bytes

        m = replace(m, mem_per_rank=float(parse_bytes(budget)))
    work = workload_from_job(job, sets)
    if budget is not None and work.graph is not None:
        raise click.UsageError("--memory-budget: the largest cubic sample is for volume jobs")
    preds = make_plan(work, ranks, m)
    fit = None
    if fit_runs:
        from hpcpar.plan import fit as fitting

        table_ = fitting.ratios(fit_points(fit_runs, trust_kind), m)
        fit = fitting.scale(table_, ranks)
        fitting.apply(preds, fit)
    largest = largest_samples(job, sets, work, preds, m) if budget is not None else None
    if csv_path:
        write_csv(preds, csv_path)
    if as_json:
        import json

        extra = {} if largest is None else {
            "memory_budget": m.mem_per_rank,
            "largest_samples": [{"grid": g, "edge": e, "mem_bytes": b} for g, e, b in largest]}
        if fit is not None:
            extra["fit_scale"] = fit
        click.echo(json.dumps({"job": work.name, "ranks": ranks, "machine": m.name,
                               "global_batch": work.global_batch, "params": work.params,
                               "grids": [row(p) for p in preds], **extra}))
        return
    click.echo(f"{work.name}: {ranks} ranks on {m.name} ({m.ranks_per_node} ranks/node), "
               f"sample {'x'.join(map(str, work.sample_shape))}, global batch "
               f"{work.global_batch}, {work.params / 1e6:.2f} M parameters")
    if fit is not None:
        click.echo(f"fitted on {len(fit_runs)} run(s): every step x{fit:.2f} "
                   "(their measured / predicted step)")
    click.echo(table(preds, top))
    if largest is not None:
        click.echo(largest_table(largest, work, m.mem_per_rank, top))
    if csv_path:
        click.echo(f"all {len(preds)} grids -> {csv_path}")
