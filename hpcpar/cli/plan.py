"""``hpcpar plan``: predict the step time of a job on every grid of N ranks; pick one."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import click

from hpcpar._tables import text_table
from hpcpar.cli._options import json_option, out_option, ranks_option, set_option
from hpcpar.errors import LaunchError

__all__ = ["row", "table", "plan"]


def table(preds, top: int) -> str:
    feasible = [p for p in preds if p.feasible]
    rows = [(i, p.spec, f"{p.t_step:.4f}", f"{p.t_compute:.4f}", f"{p.t_halo:.4f}",
             f"{p.t_gather:.4f}", f"{p.t_tp:.4f}", f"{p.t_allreduce_exposed:.4f}",
             f"{p.extra.get('io_exposed', 0):.4f}", f"{p.mem_bytes / 1e9:.2f}")
            for i, p in enumerate(feasible[:top], 1)]
    lines = [text_table(("#", "grid", "step s", "compute", "halo", "gather", "tp", "allred",
                         "io", "mem GB"), rows, markdown=False,
                        align=("right", "left", *["right"] * 8))]
    bad = [p for p in preds if not p.feasible]
    if bad:
        lines.append(f"infeasible ({len(bad)} grids, not recommended), e.g.:")
        lines.append(text_table(("grid", "why"), [(p.spec, p.reason) for p in
                                                  _examples(bad, max(3, min(top, 5)))],
                                markdown=False))
    return "\n".join(lines)


def _examples(bad, k: int):
    """Up to ``k`` infeasible grids, one per kind of reason first (memory, batch, extent)."""
    seen: set[str] = set()
    first: list = []
    rest: list = []
    for p in bad:
        kind = ("memory" if "GB per rank" in p.reason else
                "batch" if "not divisible" in p.reason else "extent")
        (rest if kind in seen else first).append(p)
        seen.add(kind)
    return (first + rest)[:k]


def _plan_notes(preds, ranks: int, machine, top: int) -> list[str]:
    """The ties among the grids shown (how they were ordered), and the warning of ranks that
    oversubscribe the cores."""
    from hpcpar.plan.planner import TIE, oversubscription, tie_groups  # deferred: --help

    notes, first = [], 1
    for group in tie_groups([p for p in preds if p.feasible][:top]):
        if len(group) > 1:
            notes.append(f"note: grids #{first}-#{first + len(group) - 1} predict step times "
                         f"within {TIE:.0%} of each other: ordered by predicted communication "
                         f"(halo + gather + exposed allreduce, from {machine.name}'s measured "
                         f"links), then memory per rank")
        first += len(group)
    over = oversubscription(ranks, machine)
    return notes + ([f"warning: {over}"] if over else [])


def largest_table(largest, work, budget: float, top: int) -> str:
    """The largest sample per grid, and the lever that would hold a larger one."""
    c = work.sample_shape[0]
    rows = [(r.grid, r.edge, f"{r.mem_bytes / 1e9:.2f}",
             f"{r.lever_edge} with --set {r.lever}" if r.lever else "-")
            if r.edge else (r.grid, "none", "", "-") for r in largest[:top]]
    return (f"largest cubic sample per grid within {budget / 2**30:.3g} GiB per rank "
            f"({c} channels, global batch {work.global_batch}; this job's edge is "
            f"{work.sample_shape[1]}; levers on: {_levers_on(work)}):\n"
            + text_table(("grid", "edge", "mem GB", "larger"), rows, markdown=False,
                         align=("left", "right", "right", "left")))


def _levers_on(work) -> str:
    """The memory levers the job enables, as the table's header names them."""
    on = [name for name, yes in (
        ("split head", any(layer.split for layer in work.layers)),
        ("tensor_parallel", work.tp_params > 0),
        ("activation_checkpointing", any(layer.segment >= 0 for layer in work.layers)),
        ("shard_optimizer", work.shard_optimizer),
        (work.precision, work.precision != "fp32")) if yes]
    return ", ".join(on) or "none"


def _on_this_host(m, name: str):
    """The ``local`` machine with this host's cores (its file may come from another host);
    any other machine as its file says."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return replace(m, cores=cores) if name == "local" and cores else m


def _where(m, name: str) -> str:
    """The machine line's cores: this host's for ``local`` (one node holds every rank),
    else cores and ranks per node from the machine file."""
    if name == "local":
        return f"this host, {m.cores} cores"
    return f"{m.cores or m.ranks_per_node} cores, {m.ranks_per_node} ranks/node"


FIELDS = ("grid", "data", "x", "y", "z", "feasible", "reason", "t_step", "t_compute", "t_halo",
          "t_gather", "t_allreduce", "t_allreduce_exposed", "t_io", "mem_bytes", "t_tp")


def row(p) -> dict:
    """One prediction as a flat record (the CSV row and the --json item)."""
    return dict(zip(FIELDS, [p.spec, *p.grid, p.feasible, p.reason, p.t_step, p.t_compute,
                             p.t_halo, p.t_gather, p.t_allreduce, p.t_allreduce_exposed, p.t_io,
                             p.mem_bytes, p.t_tp]))


def write_csv(preds, path: str) -> None:
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
    from hpcpar.launch.mpiexec import rank_env  # deferred: keeps --help fast
    from hpcpar.plan.job import (  # deferred: keeps --help fast
        dataset_note,
        fit_points,
        largest_samples,
        workload_from_job,
    )
    from hpcpar.plan.machine import load_machine, machines_dir  # deferred: keeps --help fast
    from hpcpar.plan.planner import grids  # deferred: keeps --help fast
    from hpcpar.plan.planner import plan as make_plan  # deferred: keeps --help fast

    if calibrate:
        from hpcpar.launch.launcher import (  # deferred: keeps --help fast
            default_ranks,
            launch_command,
            plan_launch,
        )

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
    m = _on_this_host(load_machine(machine), machine)
    if budget is not None:
        from hpcpar.plan.memory import parse_bytes  # deferred: keeps --help fast

        m = replace(m, mem_per_rank=float(parse_bytes(budget)))
    work = workload_from_job(job, sets)
    note = dataset_note(job, sets)
    if note:
        click.echo(f"hpcpar: note: {note}", err=True)
    if budget is not None and work.graph is not None:
        raise click.UsageError("--memory-budget: the largest cubic sample is for volume jobs")
    count = sum(1 for _ in grids(ranks))
    if count > 1000:    # seconds, not minutes; say so
        click.echo(f"hpcpar: plan: predicting {count} grids of {ranks} ranks", err=True)
    preds = make_plan(work, ranks, m)
    fit = None
    if fit_runs:
        from hpcpar.plan import fit as fitting  # deferred: keeps --help fast

        table_ = fitting.ratios(fit_points(fit_runs, trust_kind), m)
        fit = fitting.scale(table_, ranks)
        fitting.apply(preds, fit)
    largest = largest_samples(job, sets, work, preds, m) if budget is not None else None
    if csv_path:
        write_csv(preds, csv_path)
    if as_json:
        extra = {} if largest is None else {"memory_budget": m.mem_per_rank,
                                            "largest_samples": [asdict(r) for r in largest]}
        if fit is not None:
            extra["fit_scale"] = fit
        click.echo(json.dumps({"job": work.name, "ranks": ranks, "machine": m.name,
                               "global_batch": work.global_batch, "params": work.params,
                               "grids": [row(p) for p in preds], **extra}))
        return
    click.echo(f"{work.name}: {ranks} ranks on {m.name} ({_where(m, machine)}), "
               f"sample {'x'.join(map(str, work.sample_shape))}, global batch "
               f"{work.global_batch}, {work.params / 1e6:.2f} M parameters")
    if fit is not None:
        click.echo(f"fitted on {len(fit_runs)} run(s): every step x{fit:.2f} "
                   "(their measured / predicted step)")
    click.echo(table(preds, top))
    for line in _plan_notes(preds, ranks, m, top):
        click.echo(f"hpcpar: {line}", err=True)
    if largest is not None:
        click.echo(largest_table(largest, work, m.mem_per_rank, top))
    if csv_path:
        click.echo(f"all {len(preds)} grids -> {csv_path}")
