"""Every ``HPCPAR_*`` environment variable: read here, documented here.

``get("HPCPAR_STALL_TIMEOUT")`` returns the variable's typed value, read from ``os.environ`` (or
from the ``env`` mapping given, for functions that take an ``env=`` argument) at call time, so tests
can set variables with ``monkeypatch.setenv``. An unset or empty variable gives the default; a value
that does not parse raises :class:`hpcpar.errors.ConfigError` naming the variable and what was
expected.

:data:`VARS` is the reference: name, default and effect of each variable.
docs/reference/environment.md lists the same names, and no other module reads an ``HPCPAR_*``
variable itself (tests check both). This module imports nothing from hpcpar but the leaves
:mod:`hpcpar.errors` and :mod:`hpcpar._units`: every layer may use it."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hpcpar._units import parse_bytes
from hpcpar.errors import ConfigError


@dataclass(frozen=True)
class Var:
    """One variable: its name, the default as the docs show it, what it does, and the parser
    from the raw text (``None`` when unset) to the typed value."""

    name: str
    default: str
    effect: str
    parse: Callable[[str, str | None], Any]


def _bad(name: str, text: str, expected: str) -> ConfigError:
    return ConfigError(f"{name}={text!r}: expected {expected}")


def _unless_blank(convert, default):
    """A parser: unset or blank -> ``default``, else ``convert(name, stripped text)``."""
    def parse(name, text):
        if text is None or text.strip() == "":
            return default
        return convert(name, text.strip())
    return parse


def _bool(name, text):
    if text not in ("0", "1"):
        raise _bad(name, text, "0 or 1")
    return text == "1"


def _allocator(name, text):
    """auto, jemalloc, system or a path (checked where it is used: on the launching host)."""
    if text in ("auto", "jemalloc", "system") or "/" in text:
        return text
    raise _bad(name, text, "auto, jemalloc, system or an allocator library's path")


def _one_of(*choices: str):
    def convert(name, text):
        if text not in choices:
            raise _bad(name, text, f"one of {', '.join(choices)}")
        return text
    return convert


def _positive_int(name, text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise _bad(name, text, "a positive integer")
    return value


def _seconds(name, text):
    if text.lower() in ("off", "none", "no"):
        return 0.0
    try:
        seconds = float(text)
    except ValueError:
        raise _bad(name, text, "seconds (0 or 'off' disables it)") from None
    if seconds < 0:
        raise _bad(name, text, "seconds >= 0")
    return seconds


def _size_or_off(name, text):
    if text.lower() in ("off", "none", "no"):
        return None
    return parse_bytes(text, name)


def _text(name, text):
    """The raw text, ``None`` when unset (empty stays empty: it can mean "none")."""
    return text


def _nonempty(name, text):
    return text if text else None


def _paths(name, text):
    return [p for p in (text or "").split(os.pathsep) if p]


def _words(name, text):
    try:
        return shlex.split(text or "")
    except ValueError as exc:
        raise _bad(name, text, f"shell words ({exc})") from None


DEFAULT_STALL_TIMEOUT = 600.0

VARS: dict[str, Var] = {v.name: v for v in [
    Var("HPCPAR_CUDA_AWARE", "auto-detect", "`1`/`0`: treat the MPI library as CUDA-aware or not, "
        "skipping the detection (mpi4py query, vendor variables, ompi_info).",
        _unless_blank(_bool, None)),
    Var("HPCPAR_FORCE_STAGING", "0", "`1`: send CPU tensors through the device staging path too "
        "(tests).", _unless_blank(_bool, False)),
    Var("HPCPAR_FAKE_NODES", "one node per host", "k: pretend the ranks are spread over k nodes "
        "(tests of node-aware code on one machine).", _unless_blank(_positive_int, None)),
    Var("HPCPAR_DDP_SHM", "1", "`0`: no shared-memory reduction of gradient buckets when all ranks "
        "share a node.", _unless_blank(_bool, True)),
    Var("HPCPAR_STALL_TIMEOUT", "600", "Seconds a gradient sync may wait before the stall detector "
        "names the missing ranks and aborts the job; `0` or `off` disables the detector.",
        _unless_blank(_seconds, DEFAULT_STALL_TIMEOUT)),
    Var("HPCPAR_HALO_KERNELS", "auto", "`torch` or `numba`: force the halo pack/unpack path "
        "(`auto` takes torch's strided copy, measured faster on the CPU and on GPUs; `numba` the "
        "Numba CPU twins, or the CUDA kernel for tensors on a GPU).",
        _unless_blank(_one_of("auto", "torch", "numba"), "auto")),
    Var("HPCPAR_ALLOCATOR", "auto", "Memory allocator of the ranks `hpcpar run` launches (through "
        "`LD_PRELOAD`): `auto` (jemalloc when found, else the system's malloc), `jemalloc` "
        "(required), `system`, or an allocator library's path. glibc's malloc lets a rank's peak "
        "creep up step after step.", _unless_blank(_allocator, "auto")),
    Var("HPCPAR_CHECKPOINT_SPILL", "16MiB", "Smallest split-head tensor (weight, optimizer moment) "
        "that the rank writing a checkpoint gathers into a file in the checkpoint directory "
        "instead of memory (page cache the kernel can write out and drop); `off`: always memory.",
        _unless_blank(_size_or_off, 16 << 20)),
    Var("HPCPAR_PROGRESS", "0", "`1`: rank 0 shows a progress bar over the steps (`hpcpar run` "
        "sets it when stderr is a terminal) and over the samples `hpcpar data make`/`shard` write, "
        "also when stderr is a log file or a pipe.", _unless_blank(_bool, False)),
    Var("HPCPAR_LAUNCH", "decided from the environment", "`direct`, `srun` or `mpiexec`: force how "
        "`hpcpar run` starts the ranks.",
        _unless_blank(_one_of("direct", "srun", "mpiexec"), None)),
    Var("HPCPAR_MPIEXEC", "the mpiexec beside python, else on PATH", "The `mpiexec` command to "
        "launch ranks with.", _nonempty),
    Var("HPCPAR_SRUN_MPI", "pmi2 with the pip mpich wheel, else none", "Value of `srun --mpi=`; "
        "set it empty for no `--mpi` flag.", _text),
    Var("HPCPAR_SRUN_FLAGS", "none", "Extra `srun` flags (shell words), appended to every `srun` "
        "launch.", _words),
    Var("HPCPAR_SITE_PATH", "none", "Folders (`:`-separated) searched before "
        "`~/.config/hpcpar/sites` and the bundled profiles for site profiles `<name>.toml`.",
        _paths),
    Var("HPCPAR_TEMPLATE_PATH", "none", "Folders (`:`-separated) searched before "
        "`~/.config/hpcpar/templates` and the bundled templates for batch templates "
        "`<name>.sbatch`.", _paths),
    Var("HPCPAR_MACHINES", "the bundled slurm/machines/", "Folder of the planner's machine files "
        "(`hpcpar plan --machine NAME`).", _nonempty),
    Var("HPCPAR_REGEN_GOLDEN", "0", "`1`: the golden-file tests (batch scripts, reports) rewrite "
        "their files in `tests/golden/` instead of comparing; review the diff.",
        _unless_blank(_bool, False)),
    Var("HPCPAR_TEST_LAUNCH", "session", "`module`: one `mpiexec` per test module and rank count "
        "for the MPI test cases (`hpcpar.testing.mpi_case`) instead of one per rank count for the "
        "whole session.", _unless_blank(_one_of("session", "module"), "session")),
    Var("HPCPAR_TEST_MAX_NP", "8", "MPI test cases (`hpcpar.testing.mpi_case`) with more ranks "
        "than this are skipped.", _unless_blank(_positive_int, 8)),
]}


#: (name, raw text) -> its parsed value, for immutable values only: some variables are read
#: on every halo message (``HPCPAR_FORCE_STAGING``), and the text is still read each time.
_PARSED: dict[tuple[str, str | None], Any] = {}


def get(name: str, env: Mapping[str, str] | None = None):
    """Typed value of ``name`` from ``env`` (default: ``os.environ``), read now."""
    raw = (os.environ if env is None else env).get(name)
    try:
        return _PARSED[name, raw]
    except KeyError:
        pass
    value = VARS[name].parse(name, raw)
    if value is None or isinstance(value, (bool, int, float, str, tuple)):
        _PARSED[name, raw] = value
    return value


def names() -> list[str]:
    """Every variable hpcpar reads, sorted."""
    return sorted(VARS)
