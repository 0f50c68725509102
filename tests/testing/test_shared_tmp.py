"""hpcpar.testing.shared_tmpdir: one directory for all ranks of a case, removed after it."""

import shutil

import pytest

from hpcpar.testing import mpi_case, shared_tmpdir


@mpi_case(nprocs=(2,), timeout=60)
def test_same_directory_on_every_rank_gone_after_the_block(comm):
    with shared_tmpdir(comm, prefix="hpcpar-test-shared-tmp-") as tmp:
        assert comm.allgather(tmp) == [tmp] * comm.size
        assert tmp.is_dir() and tmp.name.startswith("hpcpar-test-shared-tmp-")
        (tmp / f"rank-{comm.rank}").write_text("written")
        comm.Barrier()
        assert sorted(p.name for p in tmp.iterdir()) == ["rank-0", "rank-1"]
    comm.Barrier()   # rank 0 removes it after the block's barrier; look once it is done
    assert not tmp.exists()

    # a body that raises leaves the directory (a failed case's files, to look at)
    with pytest.raises(RuntimeError, match="deliberate"):
        with shared_tmpdir(comm) as kept:
            raise RuntimeError("deliberate")
    comm.Barrier()
    assert kept.is_dir() and kept.name.startswith("hpcpar-test-")
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(kept)
