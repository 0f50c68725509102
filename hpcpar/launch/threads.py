"""Threads per rank: one rule for every way ranks start, so that the points of a scaling study
compare like for like (a 1-rank run in the launcher's process must not use every core while launched
ranks get one thread each).

The rule (:func:`threads_per_rank`): ``OMP_NUM_THREADS`` when the user set it, else the job's
``[resources] cpus_per_task`` (default 1). Launched ranks get it as the thread variables
(:func:`thread_env`); a rank run in this process also through ``torch.set_num_threads``
(:func:`use_threads`)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from hpcpar.errors import ConfigError

__all__ = ["threads_per_rank", "thread_env", "use_threads"]

#: The variables that set the compute threads of torch (OpenMP), MKL and Numba in a rank.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def threads_per_rank(cpus_per_task: int, env: Mapping[str, str] | None = None) -> int:
    """The compute threads of each rank: ``OMP_NUM_THREADS`` (its first level when it
    lists several) when set in ``env`` (default ``os.environ``), else the job's ``cpus_per_task``.
    :class:`ConfigError` when ``OMP_NUM_THREADS`` is set but not a positive integer."""
    env = os.environ if env is None else env
    text = env.get("OMP_NUM_THREADS", "").strip()
    if not text:
        return max(1, int(cpus_per_task))
    first = text.split(",")[0].strip()
    if not (first.isascii() and first.isdigit() and 0 < int(first) < 1 << 16):
        raise ConfigError(f"OMP_NUM_THREADS={text!r}: expected a positive integer (the threads "
                          f"of each rank), or unset it to use [resources] cpus_per_task")
    return int(first)


def thread_env(threads: int) -> dict:
    """``{name: str(threads)}`` for each of :data:`THREAD_VARS`: what gives a rank ``threads``
    compute threads."""
    return {name: str(threads) for name in THREAD_VARS}


def use_threads(threads: int) -> None:
    """Give the rank that runs in this process ``threads`` threads: the variables (for libraries not
    loaded yet) and torch's intra-op threads."""
    os.environ.update(thread_env(threads))
    import torch

    torch.set_num_threads(threads)
