"""The ranks' allocator (hpcpar.launch.allocator): ``hpcpar run``'s ranks get jemalloc where
the system has it, the user's own ``LD_PRELOAD`` or ``HPCPAR_ALLOCATOR=system`` wins, and a
bad choice is one line. Checked in real processes: which library is mapped, not which
variable is set."""

import subprocess
import sys

import pytest

from hpcpar.errors import ConfigError
from hpcpar.launch import allocator
from hpcpar.launch.mpiexec import rank_env

JEMALLOC = allocator.find_jemalloc()


def _mapped(env) -> str:
    """The allocator a child process started with ``env`` has mapped."""
    code = "from hpcpar.formats.records.facts import malloc_in_use; print(malloc_in_use())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(JEMALLOC is None, reason="libjemalloc.so.2 is not installed here "
                    "(apt install libjemalloc2)")
def test_ranks_get_jemalloc_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("HPCPAR_ALLOCATOR", raising=False)
    assert _mapped(rank_env()) == "jemalloc"
    monkeypatch.setenv("HPCPAR_ALLOCATOR", "system")
    assert _mapped(rank_env()) == "system"
    monkeypatch.setenv("HPCPAR_ALLOCATOR", JEMALLOC)
    assert _mapped(rank_env()) == "jemalloc"


def test_the_users_preload_wins_and_bad_choices_are_one_line(monkeypatch, tmp_path):
    env = {"LD_PRELOAD": "/opt/x/libtcmalloc.so.4"}
    allocator.preload(env)
    assert env == {"LD_PRELOAD": "/opt/x/libtcmalloc.so.4"}
    env = {"HPCPAR_ALLOCATOR": str(tmp_path / "libnone.so")}
    with pytest.raises(ConfigError, match=r"HPCPAR_ALLOCATOR=.*libnone.so': no such file"):
        allocator.preload(env)
    with pytest.raises(ConfigError, match="HPCPAR_ALLOCATOR='tc': expected auto, jemalloc"):
        allocator.preload({"HPCPAR_ALLOCATOR": "tc"})
    monkeypatch.setattr(allocator, "find_jemalloc", lambda: None)   # a system without it
    env = {"LD_PRELOAD": "/opt/y/libfoo.so"}
    allocator.preload(env)
    assert env == {"LD_PRELOAD": "/opt/y/libfoo.so"}            # auto: the system's malloc
    with pytest.raises(ConfigError, match="HPCPAR_ALLOCATOR=jemalloc: libjemalloc.so.2 not "
                                          "found"):
        allocator.preload({"HPCPAR_ALLOCATOR": "jemalloc"})
