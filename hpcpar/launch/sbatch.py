"""Rendering sbatch scripts from a site profile and a template, with safe quoting.

Two quoting contexts, each with its own rule, so a job name or path holding spaces, quotes,
backslashes or ``$(...)`` reaches Slurm and the shell literally:

* the script body is read by bash: every user-supplied word goes through :func:`shlex.quote`;
* ``#SBATCH`` lines are read by sbatch's own parser (no shell): it takes ``"..."`` and ``'...'``
  quotes and a backslash escapes the next character even inside quotes, and it ends the
  option at an unquoted ``#``. :func:`sbatch_quote` writes ``"..."`` with ``\\`` and ``"``
  escaped; filename patterns additionally double ``%`` (:func:`sbatch_filename`).

Templates (``slurm/templates/*.sbatch``) hold ``{{name}}`` fields; a line that is only a field whose
value is empty disappears. Newlines and NULs in user values are refused. This module does not import
torch."""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpcpar.errors import LaunchError
from hpcpar.launch.site import Site, find_template

__all__ = ["shell_quote", "sbatch_quote", "sbatch_filename", "render", "Point", "Allocation",
           "run_script", "report_script"]

_SBATCH_BARE = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")
_FIELD = re.compile(r"\{\{\s*([a-z_]+)\s*\}\}")


def _plain(value, what: str) -> str:
    text = str(value)
    if "\n" in text or "\r" in text or "\0" in text:
        raise LaunchError(f"{what}: {text!r} contains a newline or NUL; not allowed in a "
                          "batch script")
    return text


def shell_quote(value: object, what: str = "value") -> str:
    """Quote a value (``str()`` of it) as one literal shell word; ``what`` names it in the
    :class:`LaunchError` for a newline or NUL."""
    return shlex.quote(_plain(value, what))


def sbatch_quote(value: object, what: str = "value") -> str:
    """Quote one ``#SBATCH`` option value literally for sbatch's parser (not a shell): double-quoted
    unless it is a plain word. Refuses a newline or NUL like :func:`shell_quote`."""
    text = _plain(value, what)
    if text and _SBATCH_BARE.match(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def sbatch_filename(path: str | os.PathLike) -> str:
    """Escape a path for ``--output``: ``%`` doubled so ``%j``-style patterns stay literal. Append
    the pattern you want after escaping the directory."""
    return str(path).replace("%", "%%")


def sbatch_lines(options: list[tuple[str, object]]) -> str:
    """``#SBATCH --opt=value`` lines: a value of None, False or "" drops the option, True writes the
    bare flag."""
    lines = []
    for opt, value in options:
        if value is None or value is False or value == "":
            continue
        if value is True:
            lines.append(f"#SBATCH {opt}")
        else:
            lines.append(f"#SBATCH {opt}={sbatch_quote(value, opt)}")
    return "\n".join(lines)


def render(template: str, values: dict[str, str], source: str = "<template>") -> str:
    """Fill a template's ``{{name}}`` fields (``source`` names the template in messages);
    lines that are a lone empty field are dropped, a field without a value is a
    :class:`LaunchError`."""
    missing = sorted({m.group(1) for m in _FIELD.finditer(template)} - set(values))
    if missing:
        raise LaunchError(f"{source}: unknown template field(s) {', '.join(missing)}; known: "
                          f"{', '.join(sorted(values))}")
    out = []
    for line in template.splitlines():
        m = _FIELD.fullmatch(line.strip())
        if m and not values[m.group(1)]:
            continue
        out.append(_FIELD.sub(lambda mm: values[mm.group(1)], line))
    return "\n".join(out) + "\n"


# -- what goes into a script --------------------------------------------------------------------
@dataclass
class Point:
    """One sweep point: ``label`` is ``"ranks-N"``; ``args`` are its own ``hpcpar run`` arguments
    (``--grid``, weak-scaling batch)."""

    label: str
    ranks: int
    nodes: int
    run_dir: Path
    args: list[str] = field(default_factory=list)

    @property
    def tasks_per_node(self) -> int | None:
        """Ranks per node, or None when they do not divide evenly."""
        return self.ranks // self.nodes if self.ranks % self.nodes == 0 else None


@dataclass
class Allocation:
    """What the scheduler is asked for (resolved from site, job ``[resources]`` and CLI); "" leaves
    an option to Slurm. ``chdir`` is where ``submit`` ran, so a job's relative paths (``[data]
    path``) mean what they meant there, whatever directory ``sbatch`` is later run from."""

    name: str
    time: str
    cpus_per_task: int
    gpus_per_node: int = 0
    account: str = ""
    partition: str = ""
    qos: str = ""
    constraint: str = ""
    exclusive: bool = False
    output: str = ""            # a filename pattern, already sbatch_filename()-escaped
    options: list[str] = field(default_factory=list)
    chdir: str = ""


def _common_options(a: Allocation) -> list[tuple[str, object]]:
    return [("--job-name", a.name), ("--account", a.account), ("--partition", a.partition),
            ("--qos", a.qos), ("--constraint", a.constraint), ("--chdir", a.chdir)]


def _extra_lines(options: list[str], what: str) -> list[str]:
    lines = []
    for opt in options:
        flag, sep, value = _plain(opt, what).partition("=")
        lines.append(f"#SBATCH {flag}" + (f"={sbatch_quote(value, what)}" if sep else ""))
    return lines


def _setup_block(site: Site) -> str:
    lines = []
    if site.setup["modules"]:
        lines.append("module load " + " ".join(shell_quote(m, "[setup] modules")
                                               for m in site.setup["modules"]))
    lines += [_plain(c, "[setup] commands") for c in site.setup["commands"]]
    return "\n".join(lines)


def _env_block(site: Site, omp_threads: int | None, with_site: bool = True) -> str:
    env = dict(site.env) if with_site else {}
    if omp_threads:
        env.setdefault("OMP_NUM_THREADS", str(omp_threads))
    return "\n".join(f"export {k}={shell_quote(v, f'[env] {k}')}" for k, v in env.items())


def _python_words(site: Site, python: str) -> str:
    exe = site.setup["python"] or python
    return f"{shell_quote(exe, 'python')} -m hpcpar.cli"


def run_script(site: Site, alloc: Allocation, points: list[Point], *, job: Path, out: Path,
               python: str, sets: Sequence[str] = (), grace: int | None = None,
               max_requeues: int | None = None, array: bool = False) -> str:
    """The batch script for one sweep point, or for all points as one job array.

    In an array, task i runs point i and the allocation is sized for the largest point. The script
    checkpoints on the pre-timeout signal and requeues itself; ``grace`` (seconds between that
    signal and the limit) and ``max_requeues`` default to the site's. No points, several points
    without ``array``, or a bad value raise :class:`LaunchError`."""
    if not points:
        raise LaunchError("no sweep points to render")
    if len(points) > 1 and not array:
        raise LaunchError("several sweep points need array=True (or one script per point)")
    grace = site.requeue["grace"] if grace is None else grace
    max_requeues = site.requeue["max"] if max_requeues is None else max_requeues
    sig = site.requeue["signal"]
    if not re.fullmatch(r"[A-Z0-9]+", sig):
        raise LaunchError(f"{site.source}: [requeue] signal: {sig!r} is not a signal name "
                          "such as USR1")
    big = max(points, key=lambda p: (p.nodes, p.ranks))
    uniform = all(p.nodes == big.nodes and p.ranks == big.ranks for p in points)
    opts = _common_options(alloc) + [("--nodes", big.nodes)]
    if big.tasks_per_node and uniform:
        opts.append(("--ntasks-per-node", big.tasks_per_node))
    else:
        opts.append(("--ntasks", big.ranks))
    opts += [("--cpus-per-task", alloc.cpus_per_task),
             ("--gpus-per-node", alloc.gpus_per_node if site.sbatch["request_gpus"] else None),
             ("--exclusive", alloc.exclusive), ("--time", alloc.time),
             ("--output", alloc.output), ("--open-mode", "append"),
             ("--signal", f"B:{sig}@{grace}" if grace else None), ("--requeue", True)]
    if array:
        opts.append(("--array", f"0-{len(points) - 1}"))
    sbatch = "\n".join([sbatch_lines(opts)] + _extra_lines(site.sbatch["options"] + alloc.options,
                                                            "[sbatch] options"))

    def words(args) -> str:
        return " ".join(shell_quote(a, "hpcpar run argument") for a in args)

    def assign(p: Point) -> str:
        return (f"RANKS={p.ranks} NODES={p.nodes} "
                f"RUN_DIR={shell_quote(p.run_dir, 'run directory')}")

    if array:
        cases = "\n".join(f"    {i}) {assign(p)} POINT_ARGS=({words(p.args)}) ;;"
                          for i, p in enumerate(points))
        point = (f'case "$SLURM_ARRAY_TASK_ID" in\n{cases}\n'
                 '    *) echo "hpcpar: no sweep point for array task '
                 '$SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;\nesac')
        srun = ['--nodes="$NODES"', '--ntasks="$RANKS"']
        point_args = ' "${POINT_ARGS[@]}"'
    else:
        p = points[0]
        point = assign(p)
        srun = [f"--nodes={p.nodes}", f"--ntasks={p.ranks}"]
        if p.tasks_per_node:
            srun.append(f"--ntasks-per-node={p.tasks_per_node}")
        point_args = "".join(f" {words([a])}" for a in p.args)
    srun += [f"--cpus-per-task={alloc.cpus_per_task}", "--kill-on-bad-exit=1"]
    if site.srun["cpu_bind"]:
        srun.append(f"--cpu-bind={shell_quote(site.srun['cpu_bind'])}")
    if site.srun["mpi"]:
        srun.append(f"--mpi={shell_quote(site.srun['mpi'])}")
    if alloc.gpus_per_node:
        srun += [shell_quote(o, "[srun] gpu_options") for o in site.srun["gpu_options"]]
    srun += [shell_quote(o, "[srun] options") for o in site.srun["options"]]
    run_args = point_args + "".join(f" --set {shell_quote(s, '--set')}" for s in sets)
    what = (f"{len(points)} sweep points as a job array" if array
            else f"{points[0].ranks} ranks on {points[0].nodes} node(s)")
    values = {
        "title": f"hpcpar job {_plain(alloc.name, 'job name')!r}: {what}",
        "site": site.name, "out": shell_quote(out, "--out"),
        "sbatch": sbatch, "setup": _setup_block(site),
        "environment": _env_block(site, omp_threads(site, alloc.cpus_per_task)),
        "point": point, "hpcpar": _python_words(site, python),
        "job": shell_quote(job, "job file"), "max_requeues": str(max_requeues),
        "signal": sig, "signal_note": (f"--signal=B:{sig}@{grace}: SIG{sig} {grace} s before the "
                                       "time limit" if grace else f"no --signal: SIG{sig} only "
                                       f"from `scancel --batch --signal={sig}`"),
        "srun": " ".join(srun), "run_args": run_args,
    }
    return render(_template(site, "template"), values, site.site["template"])


def report_script(site: Site, alloc: Allocation, run_dirs: list[Path], report_dir: Path, *,
                  out: Path, python: str) -> str:
    """The ``--report`` job: one task running ``hpcpar report RUN_DIRS... -o REPORT_DIR``."""
    opts = _common_options(alloc) + [
        ("--nodes", 1), ("--ntasks", 1), ("--cpus-per-task", alloc.cpus_per_task),
        ("--exclusive", alloc.exclusive), ("--time", alloc.time), ("--output", alloc.output)]
    values = {
        "title": f"hpcpar report {_plain(alloc.name, 'job name')!r}",
        "site": site.name, "out": shell_quote(out, "--out"), "sbatch": sbatch_lines(opts),
        "setup": _setup_block(site),
        # the site's [env] targets the training ranks (e.g. GPU-aware MPI): not the report
        "environment": _env_block(site, omp_threads(site, alloc.cpus_per_task), False),
        "hpcpar": _python_words(site, python),
        "runs": " ".join(shell_quote(d, "run directory") for d in run_dirs),
        "report_dir": shell_quote(report_dir, "report directory"),
    }
    return render(_template(site, "report_template"), values, site.site["report_template"])


def omp_threads(site: Site, cpus_per_task: int) -> int:
    """Threads per rank: the task's CPUs over the hardware threads per core (at least 1)."""
    return max(1, cpus_per_task // site.node["threads_per_core"])


def _template(site: Site, key: str) -> str:
    name = site.site[key]
    if "/" not in name and not name.endswith(".sbatch"):
        # a template named in a profile file may sit beside that profile
        beside = Path(site.source).parent / f"{name}.sbatch"
        if beside.is_file():
            return beside.read_text()
    return find_template(name).read_text()
