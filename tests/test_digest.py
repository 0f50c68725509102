"""One file checksum for every manifest: ``hpcpar._digest.sha256_file`` (``hashlib.file_digest``),
and the data format hashes shards with that very function."""

import hashlib
import os

import hpcpar.data.format
from hpcpar._digest import sha256_file


def test_sha256_file_is_the_one_helper(tmp_path):
    path = tmp_path / "shard.bin"
    data = os.urandom((1 << 22) + 12345)      # more than one read block
    path.write_bytes(data)
    assert sha256_file(path) == sha256_file(str(path)) == hashlib.sha256(data).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert sha256_file(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()
    assert hpcpar.data.format.sha256_file is sha256_file


def test_checkpoints_use_the_same_helper():
    import hpcpar.run.checkpoint.store as store

    assert store.sha256_file is sha256_file
