"""Real multi-rank tests under pytest: mark a function with :func:`mpi_case` and it runs under
``mpiexec -n N`` for each N, all cases of one module and rank count in one launch.

May import: hpcpar.errors, hpcpar.parallel, hpcpar.launch.
"""

from .mpi import CaseResult, ModuleRun, mpi_case, run_module

__all__ = ["mpi_case", "run_module", "ModuleRun", "CaseResult"]
