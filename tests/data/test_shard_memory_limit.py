"""``hpcpar data shard OUT --images ... --labels ...`` streams: a data set more than twice the
kernel-enforced memory limit of the whole command (a cgroup, as ``tests/run/test_memory_limit``
uses) is sharded with exit 0, no kill, a progress bar on the terminal, and shards that verify
and hold the input values. Needs root and a cgroup memory controller (skips without; fails
under CI=true). About 20 s on an idle machine.
"""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import sys
import tempfile
import termios
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcpar.data.format import read_manifest
from hpcpar.testing import memlimit

LIMIT = memlimit.parse_size("320MiB")   # the whole command; python + h5py alone is ~60 MiB
SAMPLES, CHANNELS, EDGE = 40, 2, 128    # 18 MiB of .npy per sample: 720 MiB in all


def _image(i: int) -> np.ndarray:
    """Sample ``i``'s values along D, broadcast over H and W (the test never holds a volume)."""
    return (i + np.arange(CHANNELS * EDGE, dtype=np.float32)
            .reshape(CHANNELS, EDGE, 1, 1) / 7)


def _label(i: int) -> np.ndarray:
    return ((np.arange(EDGE) + i) % 3).astype(np.uint8).reshape(1, 1, EDGE)


@pytest.fixture(scope="module")
def volumes(tmp_path_factory) -> Path:
    why = memlimit.available()
    if why:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"the data shard memory-limit test must run in CI: {why}",
                        pytrace=False)
        pytest.skip(why)
    root = tmp_path_factory.mktemp("big")
    for sub in ("img", "lab"):
        (root / sub).mkdir()
    for i in range(SAMPLES):  # written through a memory map: this process holds no volume
        x = np.lib.format.open_memmap(root / "img" / f"case{i:02d}.npy", "w+", np.float32,
                                      (CHANNELS, EDGE, EDGE, EDGE))
        x[:] = _image(i)
        x.flush()
        del x
        y = np.lib.format.open_memmap(root / "lab" / f"case{i:02d}.npy", "w+", np.uint8,
                                      (EDGE, EDGE, EDGE))
        y[:] = _label(i)
        y.flush()
        del y
    size = sum(f.stat().st_size for f in root.rglob("*.npy"))
    assert size > 2 * LIMIT, (size, LIMIT)
    return root


def _on_a_terminal(cmd: list[str], what: str) -> tuple[int, dict, str, str]:
    """Run ``cmd`` under the limit with stderr on a pseudo-terminal of 100 columns (as a user
    at a shell sees it): exit code, the group's facts, stdout and the terminal's text."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    seen: list[bytes] = []

    def drain() -> None:   # keep the terminal's buffer empty, or the command would block
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:    # EIO: the command and its children closed the terminal
                return
            if not chunk:
                return
            seen.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    with open(os.devnull, "rb") as stdin, \
            tempfile.TemporaryFile() as out:   # a file: stdout never blocks either
        try:
            rc, facts = memlimit.run_limited(cmd, LIMIT, what, stdin=stdin, stdout=out,
                                             stderr=slave,
                                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        finally:
            os.close(slave)
        reader.join(timeout=30)
        os.close(master)
        out.seek(0)
        stdout = out.read().decode()
    return rc, facts, stdout, b"".join(seen).decode(errors="replace")


@pytest.mark.timeout(300)
def test_a_data_set_twice_the_memory_limit_is_sharded_with_a_progress_bar(volumes, tmp_path):
    out = tmp_path / "out"
    rc, facts, stdout, terminal = _on_a_terminal(
        [sys.executable, "-m", "hpcpar.cli", "data", "shard", str(out),
         "--images", str(volumes / "img" / "*.npy"), "--labels", str(volumes / "lab"),
         "--samples-per-shard", "8"], "shard")
    assert rc == 0, (facts, stdout, terminal)
    assert facts["oom_kills"] == 0, facts
    assert f"wrote {out}: {SAMPLES} samples in 5 shards" in stdout, stdout
    bar = [line for line in terminal.replace("\r", "\n").splitlines()
           if line.startswith("writing out:")]
    assert bar, terminal                                # tqdm drew its bar ...
    assert "100%" in bar[-1] and f"{SAMPLES}/{SAMPLES}" in bar[-1], bar   # ... to the end

    r = subprocess.run([sys.executable, "-m", "hpcpar.cli", "data", "verify", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith(f"ok: {out}: 5 shards, {SAMPLES} "
                                                     f"samples verified"), r
    m = read_manifest(out)
    assert (m.x.shape, m.y.shape) == ((CHANNELS, EDGE, EDGE, EDGE), (EDGE, EDGE, EDGE)), m
    for i in (0, 17, SAMPLES - 1):                      # a few samples, read back exactly
        s = next(s for s in m.shards if s.start <= i < s.stop)
        with h5py.File(out / s.file, "r") as f:
            x, y = f["x"][i - s.start], f["y"][i - s.start]
        np.testing.assert_array_equal(x, np.broadcast_to(_image(i), x.shape))
        np.testing.assert_array_equal(y, np.broadcast_to(_label(i), y.shape))
