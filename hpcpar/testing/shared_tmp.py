"""A temporary directory that every rank of an MPI test case shares, removed after the case (so that
a run of the suite leaves nothing in /tmp)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["shared_tmpdir"]


@contextmanager
def shared_tmpdir(comm: MPI.Comm, prefix: str = "hpcpar-test-") -> Iterator[Path]:
    """A new directory made by rank 0 (name starting with ``prefix``), its path yielded on every
    rank of ``comm`` (collective).

    On a clean exit all ranks meet at a barrier, then rank 0 removes the directory. When the body
    raises, nothing waits and nothing is removed: a barrier could hang while another rank is gone
    (the MPI harness aborts the job on any rank's failure), and a failed case's files stay to look
    at.

    Example:
        ```python
        @mpi_case(nprocs=2)
        def test_files(comm):
            with shared_tmpdir(comm, prefix="hpcpar-files-") as tmp:
                ...   # every rank reads and writes under tmp
        ```"""
    rank = comm.Get_rank()
    path = Path(comm.bcast(tempfile.mkdtemp(prefix=prefix) if rank == 0 else None))
    yield path   # an exception in the body is raised here: no barrier, no removal
    comm.Barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
