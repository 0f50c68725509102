"""Per-rank runner of a test module's MPI cases (launched by :func:`hpcpar.testing.run_module`).

Usage: ``python -m hpcpar.testing.worker MODULE.py RESULT_DIR case1,case2``.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
import time
import traceback

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


def _is_skip(exc: BaseException) -> bool:
    return type(exc).__name__ in ("Skipped", "SkipTest")


def _abort(comm) -> None:
    """Abort the whole job; never return (MPI_Abort may return before the kill arrives)."""
    sys.stdout.flush()
    sys.stderr.flush()
    comm.Abort(1)
    os._exit(1)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path, outdir, names = argv[0], argv[1], [n for n in argv[2].split(",") if n]
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    log = open(os.path.join(outdir, f"rank{rank}.jsonl"), "a", buffering=1)

    def emit(rec):
        log.write(json.dumps(rec) + "\n")
        log.flush()
        os.fsync(log.fileno())

    try:
        module = _load(path)
    except BaseException:
        emit({"case": names[0] if names else "<import>", "status": "failed",
              "traceback": "importing the test module failed:\n" + traceback.format_exc()})
        time.sleep(0.5)
        _abort(comm)
    for name in names:
        fn = getattr(module, name)
        emit({"event": "start", "case": name})
        comm.Barrier()
        t0 = time.perf_counter()
        try:
            if "comm" in inspect.signature(fn).parameters:
                fn(comm=comm)
            else:
                fn()
        except BaseException as exc:  # noqa: BLE001 - report everything, then abort all ranks
            if _is_skip(exc):
                emit({"case": name, "status": "skipped", "message": str(exc),
                      "duration": time.perf_counter() - t0})
                continue
            emit({"case": name, "status": "failed", "duration": time.perf_counter() - t0,
                  "traceback": f"rank {rank}:\n" + traceback.format_exc()})
            # Let other ranks failing in the same case write their tracebacks too.
            time.sleep(0.5)
            _abort(comm)
        emit({"case": name, "status": "passed", "duration": time.perf_counter() - t0})
    comm.Barrier()
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
