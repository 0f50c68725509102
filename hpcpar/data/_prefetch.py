"""Background reader process: reads the next batches' hyperslabs while the model trains.

h5py serialises every HDF5 call behind one lock, so a reader thread cannot overlap reads with
anything else that touches HDF5; a separate process can. The child is a fresh interpreter
(``python -m hpcpar.data._prefetch``), not a fork: nothing HDF5 opened in the parent is
inherited, the user's ``__main__`` is not re-imported (as spawn/forkserver would do), and it
imports numpy + h5py only (no torch, no MPI: ~0.2 s to start). It opens the shard files itself.

Protocol: the parent shares an anonymous memory file (``memfd``) split into ``depth`` slots and
writes one JSON line per request ``{"slot": k, "items": [[shard, row], ...]}`` on the child's stdin;
the child fills the slot and answers ``{"slot": k, "n": n, "bytes": b}`` (or ``{"error": msg}``) on
stdout. At most ``depth`` requests are outstanding: the bounded queue. The child exits when its
stdin closes (the parent closed it or died) and asks the kernel to kill it if the parent dies
(PR_SET_PDEATHSIG), so no orphan survives the parent."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
import subprocess
import sys
import tempfile

import numpy as np

from hpcpar.data._hyperslab import ShardFiles, read_samples
from hpcpar.errors import DataError


class SlotLayout:
    """Where x and y of each slot live in the shared buffer."""

    def __init__(self, depth: int, max_batch: int, x_shape, x_dtype, y_shape, y_dtype):
        self.depth, self.max_batch = depth, max_batch
        self.x_shape, self.y_shape = (max_batch, *x_shape), (max_batch, *y_shape)
        self.x_dtype, self.y_dtype = np.dtype(x_dtype), np.dtype(y_dtype)
        self.x_bytes = int(np.prod(self.x_shape)) * self.x_dtype.itemsize
        y_bytes = int(np.prod(self.y_shape)) * self.y_dtype.itemsize
        self.slot_bytes = -(-(self.x_bytes + y_bytes) // 64) * 64
        self.total = depth * self.slot_bytes

    def views(self, buf, slot: int):
        off = slot * self.slot_bytes
        x = np.ndarray(self.x_shape, self.x_dtype, buffer=buf, offset=off)
        y = np.ndarray(self.y_shape, self.y_dtype, buffer=buf, offset=off + self.x_bytes)
        return x, y

    def to_json(self) -> dict:
        return {"depth": self.depth, "max_batch": self.max_batch, "x_shape": self.x_shape[1:],
                "x_dtype": self.x_dtype.str, "y_shape": self.y_shape[1:],
                "y_dtype": self.y_dtype.str}

    @classmethod
    def from_json(cls, d: dict) -> SlotLayout:
        return cls(d["depth"], d["max_batch"], d["x_shape"], d["x_dtype"], d["y_shape"],
                   d["y_dtype"])


class Prefetcher:
    """Parent side: ``submit(slot, items)``, ``result() -> (slot, n, bytes)``, ``views``."""

    def __init__(self, paths, x_key: str, y_key: str, box, layout: SlotLayout,
                 open_kwargs: dict, gshape=None):
        self.layout = layout
        fd = os.memfd_create("hpcpar-prefetch") if hasattr(os, "memfd_create") else None
        if fd is None:  # non-Linux: an unlinked temporary file

            fd, tmp = tempfile.mkstemp(prefix="hpcpar-prefetch-")
            os.unlink(tmp)
        os.ftruncate(fd, max(layout.total, 1))
        self._buf = mmap.mmap(fd, max(layout.total, 1))
        config = {"fd": fd, "paths": list(paths), "x_key": x_key, "y_key": y_key,
                  "box": [list(b) for b in box], "layout": layout.to_json(),
                  "open_kwargs": open_kwargs, "parent": os.getpid(),
                  "gshape": None if gshape is None else [int(n) for n in gshape]}
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "hpcpar.data._prefetch"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, pass_fds=(fd,), env=env, text=True, bufsize=1)
        os.close(fd)
        self._send(config)
        self.outstanding = 0

    def _send(self, obj) -> None:
        stdin = self._proc.stdin
        assert stdin is not None  # opened with stdin=PIPE
        try:
            stdin.write(json.dumps(obj) + "\n")
            stdin.flush()
        except (BrokenPipeError, OSError):
            raise DataError(self._died()) from None

    def _died(self) -> str:
        code = self._proc.poll()
        return f"prefetch process exited (code {code}); see its error above"

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def submit(self, slot: int, items) -> None:
        self._send({"slot": slot, "items": [[int(v) for v in item] for item in items]})
        self.outstanding += 1

    def result(self):
        stdout = self._proc.stdout
        assert stdout is not None  # opened with stdout=PIPE
        line = stdout.readline()
        if not line:   # the process is gone: nothing outstanding will ever be answered
            self.outstanding = 0
            raise DataError(self._died())
        self.outstanding -= 1
        msg = json.loads(line)
        if "error" in msg:
            raise DataError(msg["error"])
        return msg["slot"], msg["n"], msg["bytes"]

    def views(self, slot: int):
        return self.layout.views(self._buf, slot)

    def drain(self) -> None:
        """Collect answers to requests nobody will consume (an iterator left early); a dead
        process answers nothing (:meth:`result` then clears ``outstanding``)."""
        while self.outstanding:
            try:
                self.result()
            except DataError:
                pass

    def close(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is None:
            return
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        del self._proc  # closed: a second close() finds no process
        try:
            self._buf.close()
        except BufferError:  # a view is still alive somewhere; the mapping dies with it
            pass

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when the parent dies; then re-check the parent."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)


def main() -> None:
    """Child side: serve read requests until stdin closes. The training's stop signals are the
    parent's to handle (it checkpoints, then closes our stdin): srun delivers them to every process
    of the step, and dying on one would leave the parent's requests unanswered."""
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    config = json.loads(sys.stdin.readline())
    _die_with_parent(config["parent"])
    layout = SlotLayout.from_json(config["layout"])
    buf = mmap.mmap(config["fd"], max(layout.total, 1))
    files = ShardFiles(config["paths"], config["x_key"], config["y_key"],
                       **config["open_kwargs"])
    box = [tuple(b) for b in config["box"]]
    out = sys.stdout
    try:
        for line in sys.stdin:
            req = json.loads(line)
            slot, items = req["slot"], req["items"]
            x, y = layout.views(buf, slot)
            try:
                nbytes = read_samples(files, items, box, x, y, config["gshape"])
                reply = {"slot": slot, "n": len(items), "bytes": nbytes}
            except DataError as exc:
                reply = {"slot": slot, "error": str(exc)}
            del x, y
            out.write(json.dumps(reply) + "\n")
            out.flush()
    except (BrokenPipeError, KeyboardInterrupt):
        pass
    finally:
        files.close()


if __name__ == "__main__":
    main()
