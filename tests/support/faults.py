"""Fault-injection helpers the tests share: whether this machine can give a test a private
tmpfs (a full or read-only disk) in a mount namespace of its own."""

from __future__ import annotations

import os
import shutil
import subprocess

__all__ = ["can_mount"]


def can_mount() -> bool:
    """Root with ``unshare -m``: a 4 KiB tmpfs mounts in a private namespace (gone with it)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                        "mount -t tmpfs -o size=4k hpcpar-probe /mnt"], capture_output=True)
    return p.returncode == 0
