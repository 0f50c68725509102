"""What only the test suite and the benchmarks share, kept out of the installed package: the
model zoo (:mod:`tests.support.zoo`), driving ``hpcpar run`` as a process
(:mod:`tests.support.cli_run`), headless Chromium for the report tests
(:mod:`tests.support.browser`) and the mount-namespace probe of the fault tests
(:mod:`tests.support.faults`).

Imported as ``tests.support.X`` from the checkout's root: pytest puts it on the path
(``pythonpath`` in setup.cfg) and hands it to the ranks of an ``mpi_case``;
``benchmarks/smoke.sh`` sets ``PYTHONPATH`` to it.
"""
