"""Real multi-rank tests under pytest: mark a function with :func:`mpi_case` and it runs under
``mpiexec -n N`` for each N, all cases of one rank count in one launch per session;
:func:`shared_tmpdir` is a temporary directory that a case's ranks share. The submodules hold
the shared oracles, model checks, a private Slurm, virtual nodes, memory caps, fuzzing
strategies and GPU marks; what only this checkout's suite shares is in ``tests/support/``.

May import: hpcpar.errors, hpcpar.parallel, hpcpar.formats, hpcpar.launch, hpcpar.run (the sbatch
tests' job kind), hpcpar.graph, hpcpar.models (the GNN oracles: dropout masks, the Cora training
recipe), hpcpar.nn (oracles compare a split output by this rank's piece), hpcpar.sync (a parameter's
reduce scope, for whole-model gradient checks)."""

from .mpi import mpi_case
from .shared_tmp import shared_tmpdir

__all__ = ["mpi_case", "shared_tmpdir"]
