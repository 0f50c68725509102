"""Per-rank runner of MPI test cases (launched by :func:`hpcpar.testing.mpi.run_cases`).

Usage: ``python -m hpcpar.testing.worker CASES.json RESULT_DIR``; ``CASES.json`` lists
``/path/module.py::function`` names, a module's cases together."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
import time
import traceback
import warnings

__all__ = ["main"]


def _load(path: str):
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = "hpcpar_mpitest_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"{path}: not a Python module"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class _Process:
    """What a test module may change for the whole process, taken before the first module
    and put back after each, so every module starts as in a fresh process."""

    def __init__(self):
        import torch

        self.env, self.cwd = dict(os.environ), os.getcwd()
        self.warnings = list(warnings.filters)
        self.torch = (torch.get_default_dtype(), torch.get_num_threads(), torch.get_rng_state(),
                      torch.are_deterministic_algorithms_enabled(), torch.is_grad_enabled())

    def restore(self) -> None:
        import torch

        if os.environ != self.env:
            os.environ.clear()
            os.environ.update(self.env)
        os.chdir(self.cwd)
        warnings.filters[:] = self.warnings   # type: ignore[index]  # a list at run time
        dtype, threads, rng, deterministic, grad = self.torch
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_grad_enabled(grad)
        torch.set_rng_state(rng)


def _is_skip(exc: BaseException) -> bool:
    return type(exc).__name__ in ("Skipped", "SkipTest")


def _abort(comm) -> None:
    """Abort the whole job; never return (MPI_Abort may return before the kill arrives)."""
    sys.stdout.flush()
    sys.stderr.flush()
    comm.Abort(1)
    os._exit(1)


def _by_module(ids: list[str]) -> list[tuple[str, list[tuple[str, str]]]]:
    """``[(path, [(case id, function), ...]), ...]`` in the listed order."""
    out: list[tuple[str, list[tuple[str, str]]]] = []
    for cid in ids:
        path, name = cid.rsplit("::", 1)
        if not out or out[-1][0] != path:
            out.append((path, []))
        out[-1][1].append((cid, name))
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as fh:
        ids = json.load(fh)
    outdir = argv[1]
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    log = open(os.path.join(outdir, f"rank{rank}.jsonl"), "a", buffering=1)

    def emit(rec):
        log.write(json.dumps(rec) + "\n")
        log.flush()
        os.fsync(log.fileno())

    fresh = _Process()
    for path, cases in _by_module(ids):
        try:
            module = _load(path)
        except BaseException as exc:  # noqa: BLE001 - reported, then every rank aborts
            if _is_skip(exc):   # pytest.importorskip at module level: its cases are skipped
                for cid, _ in cases:
                    emit({"case": cid, "status": "skipped", "message": str(exc)})
                fresh.restore()
                continue
            emit({"case": cases[0][0], "status": "failed",
                  "traceback": "importing the test module failed:\n" + traceback.format_exc()})
            time.sleep(0.5)
            _abort(comm)
        for cid, name in cases:
            fn = getattr(module, name)
            emit({"event": "start", "case": cid})
            comm.Barrier()
            t0 = time.perf_counter()
            try:
                if "comm" in inspect.signature(fn).parameters:
                    fn(comm=comm)
                else:
                    fn()
            except BaseException as exc:  # noqa: BLE001 - report everything, then abort all ranks
                if _is_skip(exc):
                    emit({"case": cid, "status": "skipped", "message": str(exc),
                          "duration": time.perf_counter() - t0})
                    continue
                emit({"case": cid, "status": "failed", "duration": time.perf_counter() - t0,
                      "traceback": f"rank {rank}:\n" + traceback.format_exc()})
                # Let other ranks failing in the same case write their tracebacks too.
                time.sleep(0.5)
                _abort(comm)
            emit({"case": cid, "status": "passed", "duration": time.perf_counter() - t0})
        del module
        fresh.restore()
        comm.Barrier()
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
