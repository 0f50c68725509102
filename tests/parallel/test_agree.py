"""hpcpar.parallel.agree: a step that fails on some ranks raises the same one-line error on
every rank, naming the failing ranks, and no rank is left waiting in a later collective."""

import pytest

from hpcpar.errors import CommError, DataError, RunDirError
from hpcpar.parallel.agree import agree
from hpcpar.testing import mpi_case


def _fails_on(ranks, rank, cls=DataError):
    def step(x):
        if rank in ranks:
            raise cls(f"bad.h5: field 'x' is not {x}")
        return x + rank
    return step


@mpi_case(nprocs=(3,), timeout=60)
def test_one_rank_fails_every_rank_raises_the_same_error_naming_it(comm):
    last = comm.size - 1
    with pytest.raises(DataError) as e:
        agree(comm, _fails_on({last}, comm.rank), 1)
    assert str(e.value) == f"rank {last}: bad.h5: field 'x' is not 1"
    with pytest.raises(DataError) as e:
        agree(comm, _fails_on({1, 2}, comm.rank), 2, what="reading bad.h5")
    assert str(e.value) == "reading bad.h5 failed on ranks 1, 2: bad.h5: field 'x' is not 2"
    with pytest.raises(DataError) as e:   # every rank failed: nothing to name
        agree(comm, _fails_on({0, 1, 2}, comm.rank), 3)
    assert str(e.value) == "bad.h5: field 'x' is not 3"
    # no failure: each rank keeps its own result, and the ranks still talk (no one left behind)
    assert agree(comm, _fails_on(set(), comm.rank), 4) == 4 + comm.rank
    assert comm.allreduce(1) == comm.size


@mpi_case(nprocs=(3,), timeout=60)
def test_root_step_shares_its_result_or_its_error(comm):
    assert agree(comm, lambda: f"made by {comm.rank}", root=0) == "made by 0"
    with pytest.raises(RunDirError, match=r"^run/: cannot write meta\.json$"):
        agree(comm, lambda: (_ for _ in ()).throw(RunDirError("run/: cannot write meta.json")),
              root=0)
    assert comm.allreduce(1) == comm.size


@mpi_case(nprocs=(3,), timeout=60)
def test_a_foreign_failure_reaches_every_rank(comm):
    """With ``catch=Exception`` a bug's own rank keeps its exception; the others raise
    ``foreign_as`` naming it. Without, it is not a user error and is not caught."""
    def step():
        if comm.rank == 1:
            raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError if comm.rank == 1 else CommError) as e:
        agree(comm, step, catch=Exception)
    assert str(e.value) == ("disk on fire" if comm.rank == 1 else "rank 1: disk on fire")
    assert comm.allreduce(1) == comm.size
