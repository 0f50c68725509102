"""Real multi-rank tests under pytest: mark a function with :func:`mpi_case` and it runs under
``mpiexec -n N`` for each N, all cases of one rank count in one launch per session.
:mod:`~hpcpar.testing.oracles` holds the oracles the test modules share,
:mod:`~hpcpar.testing.zoo` the models written in other people's style that they convert,
:mod:`~hpcpar.testing.slurm` a private single-node Slurm for the tests,
:func:`shared_tmpdir` a temporary directory that a case's ranks share, removed after it.

May import: hpcpar.errors, hpcpar.parallel, hpcpar.formats, hpcpar.launch, hpcpar.run (the
sbatch tests' job kind), hpcpar.graph, hpcpar.models (the GNN oracles: dropout masks, the Cora
training recipe), hpcpar.nn (oracles compare a split output by this rank's piece),
hpcpar.sync (a parameter's reduce scope, for whole-model gradient checks).
"""

from .mpi import CaseResult, ModuleRun, mpi_case, run_cases, run_module
from .shared_tmp import shared_tmpdir

__all__ = ["mpi_case", "run_module", "run_cases", "ModuleRun", "CaseResult", "shared_tmpdir"]
