"""The memory allocator of launched ranks: jemalloc where the system has it.

glibc's malloc raises its mmap threshold after the first large free (up to 32 MiB), so from the
second step on a rank's activations of 128 KiB-32 MiB come from the heap, whose holes do not fit the
next step's requests: the peak creeps up step after step (CosmoFlow 224³ on 8 ranks: 666 MiB at the
first step, 830 MiB by the sixth, where the planner's live set is 663 MiB), and a sample that fits
the first steps is killed by the memory limit later. jemalloc holds it flat (682-693 MiB) at the
same step time (demo jobs, median of 4 alternating rounds: UNet3D 1.00x, CosmoFlow 0.99x). A fixed
glibc threshold (``MALLOC_MMAP_THRESHOLD_``) holds it too but pays a page fault per fresh buffer: up
to 1.18x the step time.

``HPCPAR_ALLOCATOR`` (see hpcpar._env) chooses; ranks get it through ``LD_PRELOAD``, and a run
records which allocator its ranks had (``meta.json`` ``versions.malloc``)."""

from __future__ import annotations

import ctypes.util
import os
from collections.abc import MutableMapping

from hpcpar import _env
from hpcpar.errors import ConfigError
from hpcpar.formats.records.facts import ALLOCATORS

__all__ = ["find_jemalloc", "preload"]

#: where distributions and conda put jemalloc's shared library
_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
         "/usr/local/lib")


def find_jemalloc() -> str | None:
    """The path of jemalloc's shared library, or None."""
    dirs = [os.path.join(p, "lib") for p in (os.environ.get("CONDA_PREFIX"),) if p] + list(_DIRS)
    for d in dirs:
        path = os.path.join(d, "libjemalloc.so.2")
        if os.path.isfile(path):
            return path
    return ctypes.util.find_library("jemalloc")   # ldconfig's cache: another prefix


def preload(env: MutableMapping[str, str]) -> bool:
    """Add the allocator ``HPCPAR_ALLOCATOR`` names to ``env``'s ``LD_PRELOAD``, unless one is
    preloaded already (the user's choice wins); whether it added one."""
    choice = _env.get("HPCPAR_ALLOCATOR", env=env)
    current = env.get("LD_PRELOAD", "")
    if choice == "system" or any(a in current for a in ALLOCATORS):
        return False
    if choice in ("auto", "jemalloc"):
        path = find_jemalloc()
        if path is None:
            if choice == "jemalloc":
                raise ConfigError("HPCPAR_ALLOCATOR=jemalloc: libjemalloc.so.2 not found "
                                  "(apt install libjemalloc2, or set the library's path)")
            return False
    else:
        path = choice
        if not os.path.isfile(path):
            raise ConfigError(f"HPCPAR_ALLOCATOR={path!r}: no such file (expected auto, "
                              "jemalloc, system or an allocator library's path)")
    env["LD_PRELOAD"] = f"{path} {current}".strip()
    return True

