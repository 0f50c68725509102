"""Run a command under a kernel-enforced memory limit (a cgroup memory group, v1 or v2), the way
Slurm's cgroup plugin limits a job, so tests can show what happens at the limit.

Groups are made inside this process's own memory cgroup (so they count against it too), named
``hpcpar-<what>-<pid>``, and removed once their processes have exited; on v2, where this
process's group may not give children a memory controller ("no internal processes"), under the
hierarchy's root. :class:`MemoryGroup` is one group, :func:`run_limited` runs a command in a
fresh one, ``python -m hpcpar.testing.memlimit --limit 1.5GiB -- CMD...`` does it from a shell
(under ``mpiexec`` each rank gets its own group; ``--per-rank`` names it after the rank), and
:func:`mpiexec_wrapper` makes an ``mpiexec`` stand-in for ``HPCPAR_MPIEXEC`` so that each rank of
``hpcpar run`` runs under the limit of one. Needs root and a cgroup memory controller: v1, or v2
with ``memory.peak`` (Linux 5.19+); :func:`available` says why not."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from hpcpar._units import parse_bytes
from hpcpar.launch.mpiexec import find_mpiexec

__all__ = ["ROOT", "UNIFIED", "available", "parse_size", "MemoryGroup", "run_limited",
           "mpiexec_wrapper", "main"]

ROOT = Path("/sys/fs/cgroup/memory")   # cgroup v1's memory hierarchy
UNIFIED = Path("/sys/fs/cgroup")       # cgroup v2's unified hierarchy

#: a group's files per cgroup version: limit, swap limit (v1: memory + swap; v2: swap alone),
#: high-water mark, and the file whose "oom_kill N" line counts the kills
FILES = {1: {"limit": "memory.limit_in_bytes", "swap": "memory.memsw.limit_in_bytes",
             "peak": "memory.max_usage_in_bytes", "events": "memory.oom_control"},
         2: {"limit": "memory.max", "swap": "memory.swap.max", "peak": "memory.peak",
             "events": "memory.events"}}


def _version() -> int:
    """1 or 2: the cgroup version whose memory controller this machine mounts; 0: none."""
    if (ROOT / "memory.limit_in_bytes").is_file():
        return 1
    try:
        return 2 if "memory" in (UNIFIED / "cgroup.controllers").read_text().split() else 0
    except OSError:
        return 0


def _own(version: int) -> Path:
    """This process's memory cgroup directory."""
    base = ROOT if version == 1 else UNIFIED
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if (version == 1 and "memory" in controllers.split(",")) or \
                    (version == 2 and controllers == ""):
                return base / path.lstrip("/")
    except OSError:
        pass
    return base


def _memory_below(group: Path) -> bool:
    """Whether child groups of ``group`` (v2) get the memory controller, enabling it if
    allowed (it is not in a group that holds processes, unless it is the root)."""
    control = group / "cgroup.subtree_control"
    try:
        if "memory" not in control.read_text().split():
            control.write_text("+memory")
        return True
    except OSError:
        return False


def _parent() -> Path:
    """Where this process makes its groups: its own memory cgroup; on v2, the root when its
    own group cannot give children the memory controller."""
    version = _version()
    own = _own(version)
    if version == 2 and not _memory_below(own) and _memory_below(UNIFIED):
        return UNIFIED
    return own


def available() -> str | None:
    """None when memory groups can be made here, else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "needs root to create memory cgroups"
    version = _version()
    if not version:
        return f"no cgroup memory controller (v1 at {ROOT}, or v2 at {UNIFIED})"
    probe = _parent() / f"hpcpar-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError as exc:
        return f"cannot create a memory cgroup under {probe.parent}: {exc.strerror}"
    try:
        missing = [n for n in FILES[version].values() if n != FILES[version]["swap"]
                   and not (probe / n).is_file()]
    finally:
        probe.rmdir()
    if missing:
        return (f"cgroup v{version} groups under {probe.parent} lack {', '.join(missing)} "
                "(v2's memory.peak needs Linux 5.19+)")
    return None


def parse_size(text: str | int) -> int:
    """Bytes from ``"1.5GiB"``, ``"800M"``, ``"2GB"`` or an int (binary units for K/M/G)."""
    return text if isinstance(text, int) else parse_bytes(text, "--limit")


class MemoryGroup:
    """A memory cgroup with a hard ``limit`` in bytes (no swap either, where the kernel accounts
    it), named ``hpcpar-<what>-<pid>``."""

    def __init__(self, limit: int, what: str = "limit"):
        self.limit = int(limit)
        self.version = _version()
        self.files = FILES[self.version]
        self.path = _parent() / f"hpcpar-{what}-{os.getpid()}"
        self.path.mkdir()
        try:
            (self.path / self.files["limit"]).write_text(str(self.limit))
            swap = self.path / self.files["swap"]
            if swap.exists():
                swap.write_text(str(self.limit) if self.version == 1 else "0")
        except OSError:
            self.path.rmdir()
            raise

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def _event(self, name: str) -> int:
        m = re.search(rf"^{name} (\d+)", self._read(self.files["events"]), re.M)
        return int(m.group(1)) if m else 0

    def add(self, pid: int) -> None:
        """Move process ``pid`` into the group (its later children are born there)."""
        (self.path / "cgroup.procs").write_text(str(pid))

    @property
    def oom_kills(self) -> int:
        """Processes the kernel killed because the group hit its limit."""
        return self._event("oom_kill")

    @property
    def max_usage(self) -> int:
        """High-water mark of the group's charged memory, bytes."""
        return int(self._read(self.files["peak"]))

    @property
    def failcnt(self) -> int:
        """Times an allocation hit the limit (reclaim kicked in; v2: memory.events' max)."""
        return int(self._read("memory.failcnt")) if self.version == 1 else self._event("max")

    def remove(self, timeout: float = 10.0) -> None:
        """Remove the group once its processes have exited (they must be ending)."""
        end = time.monotonic() + timeout
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.05)

    def __enter__(self) -> MemoryGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def run_limited(cmd: list[str], limit: int, what: str = "limit", **popen) -> tuple[int, dict]:
    """Run ``cmd`` (and all it starts; ``popen`` goes to ``subprocess.Popen``) in a new group
    limited to ``limit`` bytes, which the child joins before it executes ``cmd`` (every byte it
    touches counts); MPI's inherited descriptors stay open for a rank wrapped this way. Returns the
    exit code (negative: that signal) and the group's ``oom_kills``, ``max_usage`` (page cache
    included), ``failcnt`` and ``max_rss`` (bytes, of the command or its waited-for descendants)."""
    with MemoryGroup(limit, what) as group:
        procs = group.path / "cgroup.procs"
        popen.setdefault("close_fds", False)
        proc = subprocess.Popen(cmd, preexec_fn=lambda: procs.write_text(str(os.getpid())), **popen)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = rc = os.waitstatus_to_exitcode(status)
        facts = {"oom_kills": group.oom_kills, "max_usage": group.max_usage,
                 "failcnt": group.failcnt, "limit": limit, "max_rss": usage.ru_maxrss * 1024}
    return rc, facts


def mpiexec_wrapper(path: Path, limit: int, report: Path | None = None) -> Path:
    """Write (to ``path``, returned) an executable ``mpiexec`` stand-in that starts
    every rank in its own group of ``limit`` bytes; point ``HPCPAR_MPIEXEC`` at it and ``hpcpar run
    -n N`` runs each rank under the limit of one (what ``--mem-per-cpu`` promises on a cluster).
    Each rank appends ``rank rc oom_kills max_usage max_rss`` to ``report`` when given."""
    real = find_mpiexec()
    tail = ["--report", str(report)] if report else []
    wrap = shlex.join([sys.executable, "-m", "hpcpar.testing.memlimit", "--limit", str(limit),
                       "--per-rank", *tail, "--"])
    path = Path(path)
    path.write_text(f"#!/bin/sh\n# {shlex.quote(real)} -n N CMD..., each rank under "
                    f"{limit} bytes\nn=\"$1\"; np=\"$2\"; shift 2\n"
                    f"exec {shlex.quote(real)} \"$n\" \"$np\" {wrap} \"$@\"\n")
    path.chmod(0o755)
    return path


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--limit SIZE [--per-rank] [--report FILE] -- CMD...``; exits with the
    command's code (128 + signal when killed). ``--limit SIZE --write-mpiexec PATH``: write
    :func:`mpiexec_wrapper`'s script."""
    p = argparse.ArgumentParser(prog="python -m hpcpar.testing.memlimit",
                                description="run a command under a cgroup memory limit")
    p.add_argument("--limit", required=True, type=parse_size, help="e.g. 1.5GiB")
    p.add_argument("--per-rank", action="store_true",
                   help="name the group after the MPI rank (one group per rank)")
    p.add_argument("--report", help="append 'rank rc oom_kills max_usage max_rss' to this file")
    p.add_argument("--write-mpiexec", metavar="PATH",
                   help="write an mpiexec stand-in for HPCPAR_MPIEXEC that runs every rank "
                        "under --limit (see mpiexec_wrapper) and exit")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.write_mpiexec:
        mpiexec_wrapper(Path(args.write_mpiexec), args.limit,
                        Path(args.report).resolve() if args.report else None)
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("give the command after --")
    rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    rc, facts = run_limited(cmd, args.limit, f"rank{rank}" if args.per_rank else "limit")
    if facts["oom_kills"]:
        print(f"memlimit: rank {rank}: {facts['oom_kills']} process(es) killed by the memory "
              f"limit of {args.limit / 2**30:.3g} GiB", file=sys.stderr)
    if args.report:
        with open(args.report, "a") as fh:
            fh.write(f"{rank} {rc} {facts['oom_kills']} {facts['max_usage']} "
                     f"{facts['max_rss']}\n")
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
