"""What identifies the data a run trains on, so a resume on other data is noticed: the
checksum of each ``[data]`` path the job names (a dataset or sharded graph directory: its
``manifest.json``, which lists every shard's sha256; a single file, a graph's included: the
file). Recorded in ``RUN/meta.json`` as ``data`` by the ranks (after a dataset the job makes
exists) and compared before a resume (:func:`check_same_data`); synthetic data has no path,
and its settings are the job's own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hpcpar._digest import sha256_file
from hpcpar.errors import DataError

__all__ = ["data_identity", "check_same_data"]

#: the ``[data]`` fields that name data on disk
DATA_FIELDS = ("path", "val_path")


def path_checksum(path: str | os.PathLike) -> str | None:
    """``sha256:<hex>`` of a directory's ``manifest.json`` or of a file; None when there is
    neither (missing, or a directory without a manifest)."""
    p = Path(path)
    target = p / "manifest.json" if p.is_dir() else p
    if not target.is_file():
        return None
    try:
        return "sha256:" + sha256_file(target)
    except OSError:
        return None


def data_identity(job) -> dict:
    """``{field: {"path": ..., "checksum": ...}}`` for each data path of ``job`` that exists."""
    out = {}
    for field in DATA_FIELDS:
        path = job.data.params.get(field)
        if isinstance(path, str) and path:
            checksum = path_checksum(path)
            if checksum is not None:
                out[field] = {"path": path, "checksum": checksum}
    return out


def check_same_data(run_dir: str | os.PathLike, job) -> None:
    """Refuse (DataError, one line naming the field) to resume the run in ``run_dir`` on data
    other than its last segment's (its ``meta.json`` ``data``, when recorded)."""
    try:
        recorded = json.loads((Path(run_dir) / "meta.json").read_text()).get("data")
    except (OSError, ValueError, AttributeError):
        return
    if not isinstance(recorded, dict):
        return
    now = data_identity(job)
    for field, was in recorded.items():
        mine = now.get(field)
        if not isinstance(was, dict) or mine is None or mine["checksum"] == was.get("checksum"):
            continue
        same = "" if mine["path"] == was.get("path") else f" (was {was.get('path')!r})"
        raise DataError(f"[data] {field}: {mine['path']!r}{same} holds other data than the run "
                        f"in {run_dir} trained on ({mine['checksum'][:19]}..., recorded "
                        f"{str(was.get('checksum'))[:19]}...); run with --new-settings to "
                        f"continue on it, --fresh to start over, or another --run-dir")
