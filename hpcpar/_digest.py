"""File checksums: one helper, so data-shard and checkpoint manifests hash files alike.
``hashlib.file_digest`` reads in blocks (files far larger than memory) without the GIL held for the
hashing."""

from __future__ import annotations

import hashlib
import os

__all__ = ["sha256_file"]


def sha256_file(path: str | os.PathLike) -> str:
    """The hex SHA-256 digest (64 hex digits) of a file's contents."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()
