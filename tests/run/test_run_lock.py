"""The run-directory lock's local part is a kernel lock (``filelock``) held while the run
lasts: a live holder on this host is refused whatever its lock file says (a file overwritten
or damaged by hand, a pid that reads as gone), and the holder's death frees it."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from hpcpar.errors import RunDirError
from hpcpar.formats.rundir import LOCK_NAME, RunLock

HOLD = ("import sys, time\nfrom hpcpar.formats.rundir import RunLock\n"
        "RunLock(sys.argv[1]).acquire()\nprint('held', flush=True)\ntime.sleep(600)\n")


def test_live_holder_is_refused_even_when_its_file_names_a_dead_pid(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        lock = tmp_path / LOCK_NAME
        assert json.loads(lock.read_text())["pid"] == holder.pid
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
        warned = []
        with pytest.raises(RunDirError, match=f"in use by another hpcpar run \\(pid {dead.pid}"):
            RunLock(tmp_path, warn=warned.append).acquire()
        assert not warned and json.loads(lock.read_text())["pid"] == dead.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the holder is gone (killed: its file stays behind): the next run takes over
    warned = []
    lock = RunLock(tmp_path, warn=warned.append)
    lock.acquire()
    assert len(warned) == 1 and "taking over a stale lock" in warned[0]
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
