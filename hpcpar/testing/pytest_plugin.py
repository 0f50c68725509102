"""pytest plugin: collect :func:`mpi_case` functions as one item per rank count.

Load it with ``pytest_plugins = ["hpcpar.testing.pytest_plugin"]`` in a conftest. Items of one
module and rank count share one ``mpiexec`` launch (made on the first such item). Set
``HPCPAR_TEST_MAX_NP`` to skip rank counts above a limit.
"""

from __future__ import annotations

import pytest

from hpcpar import _env

from .mpi import run_module

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
        return (str(self.path), self.nprocs)

    def runtest(self):
        runs = self.config.stash.setdefault(_RUNS, {})
        if self.key not in runs:
            selected = self.config.stash[_SELECTED][self.key]
            runs[self.key] = run_module(str(self.path), self.nprocs,
                                        [i.fn.__name__ for i in selected],
                                        {i.fn.__name__: i.case_timeout for i in selected})
        run = runs[self.key]
        res = run.cases[self.fn.__name__]
        if res.status == "passed":
            return
        if res.status == "skipped":
            pytest.skip(res.message)
        detail = "\n".join(res.ranks[r] for r in sorted(res.ranks))
        tail = run.output[-4000:] if run.output else ""
        raise MPIFailure(f"[mpiexec -n {self.nprocs}] {res.status}: {res.message}\n{detail}"
                         f"\n--- mpiexec output (tail) ---\n{tail}")

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, MPIFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, 0, f"{self.name}"


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
