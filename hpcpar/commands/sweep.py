"""``hpcpar sweep JOB.toml --ranks 1,2,4 --out DIR``: a scaling study on this machine.

Each rank count N runs ``hpcpar run JOB -n N --grid G --run-dir DIR/ranks-N`` in turn, then
``hpcpar report`` writes DIR/report/. Grid of a point (:func:`point_grid`): keep the job's
spatial axes (x, y, z) when their product divides N; otherwise shrink the largest spatial axis
(z first on ties) by its smallest prime factor until it does; the data axis takes the rest.
``--weak`` scales the global batch with N: B(N) = B0 * N / N0 (N0 the smallest count of the
sweep), so the work per rank stays constant. ``--submit`` hands the whole sweep to
``hpcpar submit`` (Slurm).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import click

from hpcpar.errors import HpcparError


class SweepError(HpcparError, ValueError):
    """A sweep that cannot be run as asked (rank list, grid, batch)."""


def parse_ranks(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4] (sorted, distinct, positive)."""
    try:
        ranks = sorted({int(t) for t in str(text).split(",") if t.strip()})
    except ValueError:
        raise SweepError(f"--ranks {text!r}: expected a comma-separated list such as 1,2,4") \
            from None
    if not ranks or ranks[0] < 1:
        raise SweepError(f"--ranks {text!r}: expected positive rank counts such as 1,2,4")
    return ranks


def _smallest_factor(n: int) -> int:
    return next(f for f in range(2, n + 1) if n % f == 0)


def point_grid(job_shape, n: int) -> tuple[int, int, int, int]:
    """Grid (data, x, y, z) for N ranks from the job's grid (a -1 spatial axis counts as 1):
    the spatial axes stay while X*Y*Z divides N, else the largest one (on ties z, then y: x
    groups stay inside a node) shrinks by its smallest prime factor until the product divides
    N; data = N / (X*Y*Z)."""
    spatial = [max(1, int(a)) for a in tuple(job_shape)[1:]]
    while n % (spatial[0] * spatial[1] * spatial[2]):
        i = max(range(3), key=lambda a: (spatial[a], a))  # ties: z, then y, then x
        spatial[i] //= _smallest_factor(spatial[i])
    x, y, z = spatial
    return (n // (x * y * z), x, y, z)


def plan(job_path: str, ranks: list[int], weak: bool, sets: tuple) -> list[dict]:
    """One entry per point: ranks, grid, --set list; every point validated before any runs."""
    from hpcpar.jobspec import load_job

    job = load_job(job_path, list(sets))
    base_batch = job.train.global_batch
    points = []
    for n in ranks:
        grid = point_grid(job.grid_shape, n)
        spec = "x".join(map(str, grid))
        point_sets = list(sets)
        if weak:
            if (base_batch * n) % ranks[0]:
                raise SweepError(f"--weak: global batch {base_batch} x {n}/{ranks[0]} ranks is "
                                 f"not an integer; use rank counts that are multiples of "
                                 f"{ranks[0]}")
            point_sets.append(f"train.global_batch={base_batch * n // ranks[0]}")
        try:
            grid_sets = [f"grid.{a}={v}" for a, v in zip(("data", "x", "y", "z"), grid)]
            load_job(job_path, point_sets + grid_sets).check_ranks(n)
        except HpcparError as exc:
            raise SweepError(f"sweep point {n} ranks (grid {spec}): {exc}") from None
        points.append({"ranks": n, "grid": spec, "sets": point_sets})
    return points


def run_command(job_path: str, point: dict, run_dir: Path, resume: bool = False) -> list[str]:
    """``hpcpar run`` of one point (fresh unless ``resume``: old files are set aside)."""
    cmd = [sys.executable, "-m", "hpcpar.cli", "run", str(job_path), "-n", str(point["ranks"]),
           "--grid", point["grid"], "--run-dir", str(run_dir),
           "--resume" if resume else "--no-resume"]
    for s in point["sets"]:
        cmd += ["--set", s]
    return cmd


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_points(job_path, points, out: Path, verbose: bool, resume: bool = False) -> list[int]:
    """Run the points one after the other; returns the rank counts that failed."""
    failed = []
    for point in points:
        run_dir = out / f"ranks-{point['ranks']}"
        log = out / f"ranks-{point['ranks']}.log"
        cmd = run_command(job_path, point, run_dir, resume)
        click.echo(f"sweep: {point['ranks']} rank(s), grid {point['grid']} -> {run_dir}")
        t0 = time.monotonic()
        with open(log, "w") as fh:
            if verbose:
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, errors="replace")
                for line in proc.stdout:
                    fh.write(line)
                    click.echo(f"  {line}", nl=False)
                rc = proc.wait()
            else:
                rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
        took = time.monotonic() - t0
        if rc == 0:
            click.echo(f"sweep: {point['ranks']} rank(s) done in {took:.1f} s (log {log})")
        else:
            failed.append(point["ranks"])
            click.echo(f"sweep: {point['ranks']} rank(s) FAILED with exit code {rc} after "
                       f"{took:.1f} s; last lines of {log}:\n{_tail(log)}", err=True)
    return failed


def submit_command(job_path, out, ranks, weak, sets) -> list[str]:
    cmd = [sys.executable, "-m", "hpcpar.cli", "submit", str(job_path), "--out", str(out),
           "--ranks", ",".join(map(str, ranks)), "--report"]
    if weak:
        cmd.append("--weak")
    for s in sets:
        cmd += ["--set", s]
    return cmd


@click.command("sweep")
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--ranks", "ranks_text", required=True, help="Rank counts, e.g. 1,2,4.")
@click.option("--out", type=click.Path(file_okay=False), required=True,
              help="Sweep directory: DIR/ranks-N/ per point, DIR/report/ at the end.")
@click.option("--weak", is_flag=True, help="Weak scaling: global batch grows with the ranks.")
@click.option("--submit", is_flag=True, help="Submit the points and the report to Slurm "
              "(hpcpar submit) instead of running here.")
@click.option("--set", "sets", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override a job field at every point (repeatable).")
@click.option("--warmup", type=click.IntRange(min=0), default=None,
              help="Steps the report drops at the start of each run [default: max(1, n/10)].")
@click.option("--resume", is_flag=True, help="Continue interrupted points from their "
              "checkpoints instead of starting each point afresh.")
@click.option("-v", "--verbose", is_flag=True, help="Stream each run's output.")
def sweep(job, ranks_text, out, weak, submit, sets, warmup, resume, verbose):
    """Run JOB at each rank count, then write the scaling report into OUT/report/."""
    ranks = parse_ranks(ranks_text)
    if submit:
        if weak:
            raise SweepError("--weak --submit: hpcpar submit has no per-point global batch "
                             "yet; run the weak sweep locally or submit each point with "
                             "--set train.global_batch=...")
        rc = subprocess.run(submit_command(job, out, ranks, weak, sets)).returncode
        sys.exit(rc)
    points = plan(job, ranks, weak, sets)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(
        {"job": str(job), "ranks": ranks, "weak": weak, "sets": list(sets),
         "points": [dict(p, command=run_command(job, p, out / f"ranks-{p['ranks']}", resume))
                    for p in points]}, indent=1) + "\n")
    failed = run_points(job, points, out, verbose, resume)
    done = [out / f"ranks-{p['ranks']}" for p in points
            if (out / f"ranks-{p['ranks']}" / "meta.json").exists()]
    if not done:
        raise SweepError(f"{out}: no point of the sweep left run records; see the logs there")
    from hpcpar.analysis.render import write_report

    from .report import print_report

    rep = write_report(done, out / "report", mode="weak" if weak else "strong", warmup=warmup,
                       title=f"hpcpar {'weak' if weak else 'strong'} scaling: {Path(job).name}")
    print_report(rep)
    if failed:
        raise SweepError(f"sweep: point(s) {', '.join(map(str, failed))} failed; their rows "
                         f"are partial or missing (logs in {out})")
