"""Submitting a job file to Slurm as a scaling sweep, and reading back the sweep's state.

``plan_submit`` renders one batch script per point (or one job array) plus an optional report job,
the allocation resolved as site profile < job ``[resources]`` < command line; ``submit`` writes them
to ``OUT/slurm/``, submits them and records each job (array tasks: each task) in ``OUT/jobs.json``;
runs land in ``OUT/ranks-N/`` as with ``hpcpar sweep``. ``sweep_status`` joins those records with
``sacct`` (when accounting exists) or ``scontrol show job`` and with each run directory. This module
does not import torch."""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import shlex
import shutil
import sys
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcpar._tables import text_table
from hpcpar.errors import LaunchError
from hpcpar.formats.jobspec import TIME_RE, load_job, parse_override
from hpcpar.launch.sbatch import Allocation, Point, report_script, run_script, sbatch_filename
from hpcpar.launch.site import Site, load_site
from hpcpar.launch.slurmcmd import run_slurm
from hpcpar.launch.sweep import plan as sweep_plan

__all__ = ["parse_after", "plan_submit", "sbatch", "dry_run_text", "submit", "parse_scontrol",
           "run_dir_state", "sweep_status", "format_status"]

RECORDS = "jobs.json"
SCRIPTS = "slurm"
RECORD_VERSION = 1
_DEPEND = re.compile(r"^(?:(after|afterok|afterany|afternotok|aftercorr|afterburstbuffer):)?"
                     r"(\d+(?:_\d+)?(?:[:+]\d+(?:_\d+)?)*)$")


@dataclass
class BatchJob:
    """One script to submit: a run (one point, or an array over points) or the report.
    ``dependency`` is its ``--dependency`` ("" for none); ``job_id`` is set once submitted."""

    kind: str                       # "run" or "report"
    label: str                      # "ranks-4", "array", "report"
    script: Path
    text: str
    points: list[Point] = field(default_factory=list)
    dependency: str = ""
    job_id: str = ""

    def sbatch_argv(self) -> list[str]:
        """The ``sbatch --parsable [--dependency=...] SCRIPT`` command line."""
        argv = ["sbatch", "--parsable"]
        if self.dependency:
            argv.append(f"--dependency={self.dependency}")
        return argv + [str(self.script)]


# -- planning ---------------------------------------------------------------------------------
def _explicit_resources(job_path: Path, sets) -> set[str]:
    """The [resources] keys the user wrote (job file or --set), as opposed to defaults."""
    try:
        raw = tomllib.loads(job_path.read_text()).get("resources", {})
    except (OSError, tomllib.TOMLDecodeError):
        raw = {}
    keys = set(raw) if isinstance(raw, dict) else set()
    for text in sets:
        section, key, _ = parse_override(text)
        if section == "resources":
            keys.add(key)
    return keys


def parse_after(values: Iterable[str | int]) -> str:
    """Turn ``--after`` values into a Slurm ``--dependency`` value (all required).

    A job id ``123`` means ``afterok:123``; ``TYPE:ID[:ID]`` passes through; comma-separated lists
    are allowed. Anything else raises :class:`LaunchError`."""
    parts = []
    for value in values:
        for item in str(value).split(","):
            item = item.strip()
            m = _DEPEND.match(item)
            if not m:
                raise LaunchError(f"--after {item!r}: expected a job id such as 1234 or "
                                  "TYPE:ID such as afterany:1234")
            parts.append(f"{m.group(1) or 'afterok'}:{m.group(2)}")
    return ",".join(parts)


def _points(job, job_path: Path, out: Path, site: Site, ranks, nodes, tpn: int | None,
            explicit: set, weak: bool, sets: list[str]) -> list[Point]:
    """Sweep points; grids and weak-scaling batches as ``hpcpar sweep`` chooses them."""
    r = job.resources
    if ranks and nodes:
        raise LaunchError("give --ranks or --nodes, not both")
    if nodes:
        if not tpn:
            raise LaunchError("--nodes needs ranks per node: give --ranks-per-node N, or set "
                              "[resources] tasks_per_node in "
                              f"the job or [node] tasks_per_node in the site ({site.source})")
        sizes = [(n * tpn, n) for n in nodes]
    else:
        if not ranks:
            fixed = job.fixed_ranks() or (r.nodes * tpn if tpn else None)
            if fixed is None:
                raise LaunchError("how many ranks? give --ranks N[,N...] or --nodes N[,N...] "
                                  "(or a grid without -1, or [resources] tasks_per_node)")
            ranks = [fixed]
        base = r.nodes if "nodes" in explicit else 1
        sizes = [(n, math.ceil(n / tpn) if tpn else min(base, n)) for n in ranks]
    if len({s for s, _ in sizes}) != len(sizes):
        raise LaunchError(f"sweep sizes repeat: {[s for s, _ in sizes]}")
    order = sorted(sizes)      # the weak-scaling base is the smallest count
    planned = {p["ranks"]: p for p in sweep_plan(str(job_path), [n for n, _ in order], weak,
                                                 tuple(sets))}
    points = []
    for n, k in order:
        own = planned[n]["sets"][len(sets):]
        args = ["--grid", planned[n]["grid"]] + [a for s in own for a in ("--set", s)]
        points.append(Point(label=f"ranks-{n}", ranks=n, nodes=k, run_dir=out / f"ranks-{n}",
                            args=args))
    return points


def plan_submit(job_file: str | os.PathLike, out: str | os.PathLike, *,
                site: str | Site = "generic", ranks: Sequence[int] | None = None,
                nodes: Sequence[int] | None = None, array: bool = False,
                after: Sequence[str | int] = (), report: bool = False, time: str | None = None,
                sets: Sequence[str] = (), python: str | None = None, grace: int | None = None,
                max_requeues: int | None = None, weak: bool = False,
                ranks_per_node: int | None = None) -> list[BatchJob]:
    """Everything ``hpcpar submit`` would submit, rendered but not written, in order.

    ``time`` and ``ranks_per_node`` default to the job's ``[resources]``, then the site's;
    ``python`` to this interpreter; ``grace`` is the seconds between the pre-timeout signal and the
    time limit. A bad option raises :class:`LaunchError`, a point whose job does not validate
    :class:`ConfigError`."""
    job_path = Path(job_file).expanduser().absolute()
    out = Path(out).expanduser().absolute()
    if "\\" in str(out):
        raise LaunchError(f"--out {str(out)!r}: a backslash turns off Slurm's %j log-file "
                          "patterns (and is dropped): choose a directory without one")
    sets = list(sets)
    site = load_site(site) if isinstance(site, str) else site
    job = load_job(str(job_path), sets)
    r = job.resources
    explicit = _explicit_resources(job_path, sets)
    if ranks_per_node is not None and ranks_per_node < 1:
        raise LaunchError(f"--ranks-per-node {ranks_per_node}: expected a positive count")
    tpn = ranks_per_node or r.tasks_per_node or site.node["tasks_per_node"] or None
    points = _points(job, job_path, out, site, ranks, nodes, tpn, explicit, weak, sets)
    time = time or r.time or site.sbatch["time"]
    if not TIME_RE.match(time):
        raise LaunchError(f"--time {time!r}: not a Slurm time such as 30, 01:30:00 or 1-00:00:00")
    if "cpus_per_task" in explicit or not site.node["cpus"]:
        cpus = r.cpus_per_task
    else:
        cpus = max(1, site.node["cpus"] // (tpn or 1))
    gpus = r.gpus_per_node if "gpus_per_node" in explicit else site.node["gpus"]
    pick = {k: (getattr(r, k) if getattr(r, k) is not None else site.sbatch[k])
            for k in ("account", "partition", "qos", "constraint")}
    python = python or sys.executable
    scripts = out / SCRIPTS
    dependency = parse_after(after) if after else ""

    def alloc(name: str, output: str, points=(), **kw) -> Allocation:
        base = dict(name=name, time=time, cpus_per_task=cpus,
                    gpus_per_node=_gpus(gpus, points, "gpus_per_node" in explicit),
                    exclusive=site.sbatch["exclusive"], chdir=str(Path.cwd()),
                    output=f"{sbatch_filename(scripts)}/{output}", **pick)
        base.update(kw)
        return Allocation(**base)

    common: dict[str, Any] = dict(job=job_path, out=out, python=python, sets=sets,
                                  grace=grace, max_requeues=max_requeues)
    jobs = []
    if array:
        a = alloc(f"{job.name}-sweep", "array-%A_%a.out", points)
        jobs.append(BatchJob("run", "array", scripts / "array.sbatch",
                             run_script(site, a, points, array=True, **common), points, dependency))
    else:
        for p in points:
            a = alloc(f"{job.name}-{p.label}", f"{p.label}-%j.out", [p])
            jobs.append(BatchJob("run", p.label, scripts / f"{p.label}.sbatch",
                                 run_script(site, a, [p], **common), [p], dependency))
    if report:
        rep = site.report
        a = alloc(f"{job.name}-report", "report-%j.out", time=rep["time"],
                  cpus_per_task=rep["cpus_per_task"], gpus_per_node=0, exclusive=rep["exclusive"],
                  **{k: rep[k] or pick[k] for k in ("partition", "qos", "constraint")})
        text = report_script(site, a, [p.run_dir for p in points], out / "report", out=out,
                             python=python)
        jobs.append(BatchJob("report", "report", scripts / "report.sbatch", text))
    return jobs


def _gpus(gpus: int, points, explicit: bool) -> int:
    """GPUs per node to request: the site's, but no more than the most ranks any of
    ``points`` puts on a node (a 2-rank job on a 4-GPU node asks for 2; each rank drives
    one); a job's own ``[resources] gpus_per_node`` as it is."""
    if explicit or not gpus or not points:
        return gpus
    return min(gpus, max(-(-p.ranks // p.nodes) for p in points))


# -- submitting -------------------------------------------------------------------------------
def sbatch(job: BatchJob, env: Mapping[str, str] | None = None) -> str:
    """Submit one (written) script with ``sbatch --parsable`` and return the Slurm job id;
    :class:`LaunchError` with sbatch's last error line if it fails."""
    proc = run_slurm(job.sbatch_argv(), env)
    if proc.returncode != 0:
        msg = proc.stderr.strip().splitlines()
        raise LaunchError(f"sbatch {job.script} failed: {msg[-1] if msg else proc.returncode}")
    return proc.stdout.strip().split(";")[0]


def dry_run_text(jobs: list[BatchJob]) -> str:
    """What ``--dry-run`` prints: each job's script under the sbatch command for it."""
    parts = []
    for j in jobs:
        argv = j.sbatch_argv()
        if j.kind == "report":
            argv[2:2] = ["--dependency=afterany:<the jobs above>"]
        parts.append(f"# ==> {shlex.join(argv)}\n{j.text}")
    return "\n".join(parts)


def _records(j: BatchJob, out: Path, now: str) -> list[dict]:
    base = {"kind": j.kind, "label": j.label, "script": str(j.script),
            "dependency": j.dependency, "submitted": now}
    if j.kind == "report":
        return [{"id": j.job_id, **base, "run_dir": str(out / "report")}]
    array = j.label == "array"
    return [{"id": f"{j.job_id}_{i}" if array else j.job_id,
             **({"array_job": j.job_id} if array else {}), **base, "label": p.label,
             "ranks": p.ranks, "nodes": p.nodes, "run_dir": str(p.run_dir)}
            for i, p in enumerate(j.points)]


def _append_records(out: Path, records: list[dict]) -> None:
    path = out / RECORDS
    doc: dict[str, Any] = read_records(out) if path.exists() else {"version": RECORD_VERSION,
                                                                   "jobs": []}
    doc["jobs"].extend(records)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def submit(jobs: list[BatchJob], out: str | os.PathLike,
           env: Mapping[str, str] | None = None) -> list[dict]:
    """Write the scripts and submit them in order (the report after the runs); return the records
    written. Each job is recorded in ``OUT/jobs.json`` once sbatch accepted it, so when sbatch fails
    (:class:`LaunchError`) the jobs submitted before stay recorded."""
    out = Path(out).expanduser().absolute()
    (out / SCRIPTS).mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    run_ids: list[str] = []
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    for j in jobs:
        j.script.write_text(j.text)
        j.script.chmod(0o755)
        if j.kind == "report":
            j.dependency = "afterany:" + ":".join(run_ids)
        try:
            j.job_id = sbatch(j, env)
        except LaunchError as exc:
            done = f" (already submitted: {', '.join(r['id'] for r in records)})" if records \
                else ""
            raise LaunchError(f"{exc}{done}") from None
        if j.kind == "run":
            run_ids.append(j.job_id)
        new = _records(j, out, now)
        _append_records(out, new)
        records += new
    return records


# -- status ----------------------------------------------------------------------------------
def read_records(out: str | os.PathLike) -> dict:
    """Read a sweep's ``jobs.json``: ``version`` and ``jobs`` (one record per job or array task).
    :class:`LaunchError` when missing, not JSON, or of another record version."""
    path = Path(out) / RECORDS
    if not path.is_file():
        raise LaunchError(f"{out}: no {RECORDS} here (not a directory made by hpcpar submit)")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise LaunchError(f"{path}: not valid JSON ({exc})") from None
    if doc.get("version") != RECORD_VERSION:
        raise LaunchError(f"{path}: record version {doc.get('version')!r}, expected "
                          f"{RECORD_VERSION}")
    return doc


def parse_scontrol(line: str) -> dict:
    """One ``scontrol show ... --oneliner`` record as ``{key: value}`` strings; a value may hold
    spaces and runs up to the next ``Key=``."""
    fields = {}
    matches = list(re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=", line))
    for m, nxt in zip(matches, matches[1:] + [None]):
        fields[m.group(1)] = line[m.end():nxt.start() if nxt else len(line)].strip()
    return fields


def _task_ids(spec: str) -> set[str]:
    """``ArrayTaskId`` of a pending array record: ``0-3``, ``1,3-4`` or ``0-7%2``."""
    ids: set[str] = set()
    for part in spec.split("%")[0].split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit():
            ids.update(str(i) for i in range(int(lo), int(hi or lo) + 1))
    return ids


def _scontrol_states(env=None) -> dict[str, dict]:
    proc = run_slurm(["scontrol", "show", "job", "--oneliner"], env)
    if proc.returncode != 0:
        raise LaunchError(f"scontrol show job failed: {proc.stderr.strip()}")
    states = {}
    for line in proc.stdout.splitlines():
        if not line.startswith("JobId="):
            continue
        rec = parse_scontrol(line)
        reason = rec.get("Reason", "")
        info = {"state": rec.get("JobState", "?"), "reason": "" if reason == "None" else reason,
                "exit": rec.get("ExitCode", ""), "restarts": rec.get("Restarts", "0"),
                "elapsed": rec.get("RunTime", ""), "nodes": rec.get("NodeList", "")}
        states[rec["JobId"]] = info
        array, task = rec.get("ArrayJobId"), rec.get("ArrayTaskId")
        if array and task:
            for t in _task_ids(task):
                states[f"{array}_{t}"] = info
    return states


def _sacct_states(ids: list[str], env=None) -> dict[str, dict]:
    """States from accounting; empty where there is no sacct or no slurmdbd."""
    if not ids or not shutil.which("sacct"):
        return {}
    try:
        proc = run_slurm(["sacct", "-n", "-P", "-X", "-j", ",".join(ids),
                           "-o", "JobID,State,ExitCode,Elapsed,NodeList"], env)
    except LaunchError:
        return {}
    if proc.returncode != 0:
        return {}
    states = {}
    for line in proc.stdout.splitlines():
        jid, state, code, elapsed, nodes = (line.split("|") + [""] * 5)[:5]
        states[jid] = {"state": state.split()[0] if state else "?", "reason": "",
                       "exit": code, "restarts": "", "elapsed": elapsed, "nodes": nodes}
    return states


def run_dir_state(run_dir: str | os.PathLike) -> str:
    """What a run (or report) directory shows: ``"finished"`` (metrics.json), ``"written"`` (a
    report), ``"checkpoint step-N"``, ``"started"`` or ``"-"`` (absent)."""
    d = Path(run_dir)
    if (d / "metrics.json").is_file():
        return "finished"
    if d.name == "report" and (d / "scaling.csv").is_file():
        return "written"
    ckpts = sorted((d / "checkpoints").glob("step-*")) if (d / "checkpoints").is_dir() else []
    if ckpts:
        return f"checkpoint {ckpts[-1].name}"
    return "started" if d.is_dir() else "-"


def sweep_status(out: str | os.PathLike, env: Mapping[str, str] | None = None) -> list[dict]:
    """Each recorded job of a sweep with its Slurm state and its run directory's state: its record
    plus ``state``, ``reason``, ``exit``, ``restarts``, ``elapsed``, ``nodes`` and ``run``.
    :class:`LaunchError` when there is no readable ``jobs.json``."""
    records = read_records(out)["jobs"]
    ids = [r["id"] for r in records]
    try:
        live, why = _scontrol_states(env), "no longer known to slurmctld and no accounting"
    except LaunchError as exc:      # no Slurm here: the run directories still tell
        live, why = {}, str(exc)
    acct = _sacct_states([i for i in ids if i not in live], env)
    rows = []
    for rec in records:
        info = live.get(rec["id"]) or acct.get(rec["id"]) or {
            "state": "UNKNOWN", "reason": why, "exit": "", "restarts": "", "elapsed": "",
            "nodes": ""}
        rows.append({**rec, **info, "run": run_dir_state(rec["run_dir"])})
    return rows


def format_status(rows: list[dict]) -> str:
    """The aligned table ``hpcpar status`` prints from ``sweep_status`` rows."""
    cols = [("JOBID", "id"), ("LABEL", "label"), ("RANKS", "ranks"), ("STATE", "state"),
            ("EXIT", "exit"), ("RESTARTS", "restarts"), ("ELAPSED", "elapsed"),
            ("RUN", "run"), ("REASON", "reason")]
    return text_table([h for h, _ in cols],
                      [[r.get(k, "") or "" for _, k in cols] for r in rows], markdown=False)
