"""Copying the shards a node will read to node-local disk, once per node.

The lowest rank of each node (``grid.node_comm``) copies the union of the shards its node's ranks
need into ``STAGE_TO/<dataset>-<manifest digest>/``, each file to a temporary name then renamed, so
a crashed copy is never taken for a finished one and a later run on the same node reuses what is
there (matching size). The other ranks of the node wait for it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import TYPE_CHECKING

from hpcpar.errors import DataError
from hpcpar.parallel.agree import agree

from .format import MANIFEST, Manifest, member_path

if TYPE_CHECKING:
    from collections.abc import Iterable

    from mpi4py import MPI

__all__ = ["staged_dir", "stage_shards"]


def staged_dir(stage_to: str, directory: str, manifest: Manifest) -> str:
    """Where a dataset is staged: ``STAGE_TO/<dataset>-<manifest digest>`` (the digest tells
    datasets of one name apart)."""
    digest = hashlib.sha256(json.dumps(manifest.to_json(), sort_keys=True).encode())
    name = os.path.basename(os.path.abspath(directory).rstrip("/")) or "dataset"
    return os.path.join(stage_to, f"{name}-{digest.hexdigest()[:12]}")


def _copy(src: str, dst: str) -> int:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if os.path.exists(dst) and os.path.getsize(dst) == os.path.getsize(src):
        return 0
    tmp = f"{dst}.partial-{os.getpid()}"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
    return os.path.getsize(dst)


def stage_shards(directory: str, manifest: Manifest, needed: Iterable[int], stage_to: str,
                 node_comm: MPI.Comm) -> tuple[str, int]:
    """Copy the shards a node needs (``needed``: those this rank reads) to node-local disk, once per
    node: collective over ``node_comm``, whose rank 0 copies. Returns ``(staged directory, bytes
    this rank copied)``; DataError on every rank of the node if the copy failed."""
    wanted = node_comm.gather(sorted(set(int(i) for i in needed)), root=0)
    dest = staged_dir(stage_to, directory, manifest)

    def copy() -> int:
        copied = 0
        try:
            os.makedirs(dest, exist_ok=True)
            assert wanted is not None  # gather's result on its root
            for i in sorted(set().union(*wanted)):
                field = f"{os.path.join(directory, MANIFEST)}: field 'shards[{i}].file'"
                f = manifest.shards[i].file
                copied += _copy(member_path(directory, f, field), member_path(dest, f, field))
            src_manifest = os.path.join(directory, MANIFEST)
            if os.path.exists(src_manifest):
                _copy(src_manifest, os.path.join(dest, MANIFEST))
        except OSError as exc:
            raise DataError(f"{stage_to}: staging {directory} failed ({exc})") from None
        return copied

    copied = agree(node_comm, copy, root=0)
    return dest, copied if node_comm.Get_rank() == 0 else 0
