"""Real multi-rank tests under pytest: mark a function with :func:`mpi_case` and it runs under
``mpiexec -n N`` for each N, all cases of one rank count in one launch per session.
:mod:`~hpcpar.testing.oracles` holds the oracles the test modules share,
:mod:`~hpcpar.testing.model_check` whether a plain-torch model is exact under ``spatialize``,
:mod:`~hpcpar.testing.slurm` a private single-node Slurm for the tests,
:mod:`~hpcpar.testing.cluster` virtual nodes on one machine, :mod:`~hpcpar.testing.memlimit`
a memory cap for a command, :mod:`~hpcpar.testing.fuzz` the input fuzzer's strategies,
:mod:`~hpcpar.testing.gpu` the marks of the GPU tests,
:func:`shared_tmpdir` a temporary directory that a case's ranks share, removed after it.
What only this checkout's suite shares (the model zoo, CLI-run and fault helpers) is in
``tests/support/``, not in the package.

May import: hpcpar.errors, hpcpar.parallel, hpcpar.formats, hpcpar.launch, hpcpar.run (the
sbatch tests' job kind), hpcpar.graph, hpcpar.models (the GNN oracles: dropout masks, the Cora
training recipe), hpcpar.nn (oracles compare a split output by this rank's piece),
hpcpar.sync (a parameter's reduce scope, for whole-model gradient checks).
"""

from .mpi import mpi_case
from .shared_tmp import shared_tmpdir

__all__ = ["mpi_case", "shared_tmpdir"]
