"""Finding the ``mpiexec`` that matches the MPI library mpi4py was built against."""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig

from hpcpar import _env
from hpcpar.errors import LaunchError
from hpcpar.launch.allocator import preload

__all__ = ["find_mpiexec", "rank_env"]


def find_mpiexec() -> str:
    """The ``mpiexec`` to launch ranks with: ``HPCPAR_MPIEXEC``, else the one installed beside this
    Python (the ``mpich`` wheel puts it there), else the first ``mpiexec``/``mpirun`` on PATH;
    :class:`LaunchError` when none is found."""
    forced = _env.get("HPCPAR_MPIEXEC")
    if forced:
        return forced
    for d in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        for name in ("mpiexec", "mpirun"):
            cand = os.path.join(d, name)
            if os.access(cand, os.X_OK):
                return cand
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found:
            return found

    raise LaunchError("no mpiexec found: pip install 'hpcpar[mpich]' or load your site's MPI "
                      "module, or set HPCPAR_MPIEXEC")


def rank_env(extra: dict | None = None) -> dict:
    """A copy of ``os.environ`` for launched ranks, with ``extra`` on top: one compute thread per
    rank unless the user set one, and jemalloc (:mod:`hpcpar.launch.allocator`)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env.setdefault("NUMBA_NUM_THREADS", env["OMP_NUM_THREADS"])
    # huge pages for torch's CPU allocator: fresh activation buffers cost ~4x less to fault in
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    preload(env)
    if extra:
        env.update(extra)
    return env
