"""pytest plugin: collect :func:`mpi_case` functions as one item per rank count.

Load it with ``pytest_plugins = ["hpcpar.testing.pytest_plugin"]`` in a conftest. The selected items
of one rank count share one ``mpiexec`` launch for the whole session (made on the first such item;
``HPCPAR_TEST_LAUNCH=module``: one per module and rank count). When a failing case aborts the
launch, the cases it did not reach run in a new one, so each reports for itself. Set
``HPCPAR_TEST_MAX_NP`` to skip rank counts above a limit. The ranks get pytest's ``pythonpath``
setting on their ``PYTHONPATH``: a test module imports there what it imports under pytest."""

from __future__ import annotations

import os

import pytest

from hpcpar import _env

from .mpi import case_id, run_cases, startup_allowance

__all__ = ["MPIFailure", "MPIItem", "pytest_pycollect_makeitem", "pytest_configure",
           "pytest_collection_modifyitems"]

_RUNS = pytest.StashKey[dict]()
_SELECTED = pytest.StashKey[dict]()


class MPIFailure(Exception):
    pass


class MPIItem(pytest.Item):
    def __init__(self, *, fn, nprocs, **kw):
        super().__init__(**kw)
        self.fn = fn
        self.nprocs = nprocs
        self.case_timeout = fn._hpcpar_mpi["timeout"]
        self.add_marker(pytest.mark.mpi)
        for mark in getattr(fn, "pytestmark", []):
            self.own_markers.append(mark)   # a Mark (add_marker takes decorators)

    @property
    def key(self):
        if _env.get("HPCPAR_TEST_LAUNCH") == "module":
            return (str(self.path), self.nprocs)
        return ("session", self.nprocs)

    @property
    def case(self) -> str:
        return case_id(str(self.path), self.fn.__name__)

    def runtest(self):
        runs = self.config.stash.setdefault(_RUNS, {})
        if self.key not in runs:
            runs[self.key] = _launch(self.config.stash[_SELECTED][self.key], self.nprocs)
        res, output = runs[self.key][self.case]
        if res.status == "passed":
            return
        if res.status == "skipped":
            pytest.skip(res.message)
        detail = "\n".join(res.ranks[r] for r in sorted(res.ranks))
        tail = output[-4000:] if output else ""
        raise MPIFailure(f"[mpiexec -n {self.nprocs}] {res.status}: {res.message}\n{detail}"
                         f"\n--- mpiexec output (tail) ---\n{tail}")

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, MPIFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, 0, f"{self.name}"


def _launch(items: list[MPIItem], nprocs: int) -> dict:
    """Case id -> (its result, the output of the launch that ran it): the cases of ``items`` in one
    launch, and the ones a failure's abort or a case's timeout left unrun in the next."""
    results: dict = {}
    todo = list(items)
    env = _pythonpath(items[0].config) if items else None
    while todo:
        run = run_cases([(str(i.path), i.fn.__name__) for i in todo], nprocs,
                        {i.case: i.case_timeout for i in todo}, env=env)
        results.update({c: (r, run.output) for c, r in run.cases.items()})
        left = [i for i in todo if run.cases[i.case].status == "not-run"]
        if len(left) == len(todo):
            break   # no case ran (the start-up failed or hung): they report why
        todo = left   # after a case's abort or its own timeout, the rest in a new launch
    return results


def _pythonpath(config) -> dict | None:
    """The ranks' environment with pytest's ``pythonpath`` entries before ``PYTHONPATH``'s
    (None when the setting is empty: the ranks inherit it as it is)."""
    own = [str(p) for p in config.getini("pythonpath")]
    if not own:
        return None
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(own + inherited)}


def _launch_timeout(items: list[MPIItem]) -> float:
    """Seconds the first item of a shared launch may take: the launch's own limit (start-up
    and every case's timeout) and a relaunch's start-up, with a margin."""
    n = items[0].nprocs
    return 2 * startup_allowance(n) + sum(i.case_timeout for i in items) + 60


def _max_np() -> int:
    return _env.get("HPCPAR_TEST_MAX_NP")


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name, obj):
    meta = getattr(obj, "_hpcpar_mpi", None)
    if meta is None or not callable(obj):
        return None
    items = []
    for n in meta["nprocs"]:
        item = MPIItem.from_parent(collector, name=f"{name}[np{n}]", fn=obj, nprocs=n)
        if n > _max_np():
            item.add_marker(pytest.mark.skip(reason=f"HPCPAR_TEST_MAX_NP={_max_np()} < {n}"))
        items.append(item)
    return items


def pytest_configure(config):
    config.addinivalue_line("markers", "mpi: runs under mpiexec (hpcpar.testing.mpi_case)")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    selected: dict = {}
    for item in items:
        if isinstance(item, MPIItem) and not any(m.name == "skip" for m in item.iter_markers()):
            selected.setdefault(item.key, []).append(item)
    config.stash[_SELECTED] = selected
    if config.pluginmanager.hasplugin("timeout"):   # pytest-timeout: the launch has its own
        for group in selected.values():
            for item in group:
                item.add_marker(pytest.mark.timeout(_launch_timeout(group)))
