"""``hpcpar.testing.memlimit``: a command under a cgroup memory limit is killed when it
touches more, runs when it touches less, and the group is gone afterwards."""

import os
import sys

import pytest

from hpcpar.testing import memlimit

TOUCH = [sys.executable, "-c", "import sys; b = bytearray(int(sys.argv[1]) << 20); "
         "b[::4096] = b'x' * len(b[::4096])"]


@pytest.fixture
def cgroups():
    why = memlimit.available()
    if why:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"memory cgroups must work in CI: {why}", pytrace=False)
        pytest.skip(why)


@pytest.mark.parametrize("text, value", [("1.5GiB", 3 << 29), ("800M", 800 << 20),
                                         ("2GB", 2 * 10**9), (4096, 4096)])
def test_parse_size(text, value):
    assert memlimit.parse_size(text) == value


def test_parse_size_refuses_nonsense():
    with pytest.raises(ValueError, match="not a memory size"):
        memlimit.parse_size("lots")


def test_killed_above_the_limit_and_runs_below_it(cgroups):
    rc, facts = memlimit.run_limited([*TOUCH, "300"], 200 << 20, "unit")
    assert rc == -9 and facts["oom_kills"] == 1, (rc, facts)
    rc, facts = memlimit.run_limited([*TOUCH, "100"], 400 << 20, "unit")
    assert rc == 0 and facts["oom_kills"] == 0, (rc, facts)
    assert facts["max_rss"] >= 100 << 20 and facts["max_usage"] >= 100 << 20, facts
    assert not list(memlimit._parent().glob(f"hpcpar-unit-{os.getpid()}"))


def test_command_line_exits_like_a_shell(cgroups, tmp_path):
    report = tmp_path / "r.txt"
    assert memlimit.main(["--limit", "200MiB", "--report", str(report), "--", *TOUCH, "300"]) \
        == 128 + 9
    rank, rc, kills, usage, rss = report.read_text().split()
    assert (rank, rc, kills) == ("0", "-9", "1")


def test_cgroup_v2_files(tmp_path, monkeypatch):
    """On a v2 host (no v1 memory hierarchy; the unified one lists "memory") a group sets
    memory.max and memory.swap.max = 0 and reads memory.peak and memory.events. This machine
    mounts v1, so the unified hierarchy is a directory laid out as the kernel's (the real
    v2 run is CI's on a v2 host)."""
    monkeypatch.setattr(memlimit, "ROOT", tmp_path / "no-v1")
    monkeypatch.setattr(memlimit, "UNIFIED", tmp_path)
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    own = memlimit._own(2)
    own.mkdir(parents=True, exist_ok=True)
    (own / "cgroup.subtree_control").write_text("")
    assert memlimit._version() == 2 and memlimit._parent() == own
    group = memlimit.MemoryGroup(200 << 20, "v2")
    assert group.path.parent == own and (own / "cgroup.subtree_control").read_text() == "+memory"
    assert (group.path / "memory.max").read_text() == str(200 << 20)
    assert not (group.path / "memory.swap.max").exists()   # no swap accounting: left alone
    (group.path / "memory.peak").write_text("123456\n")
    (group.path / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\n"
                                              "oom_group_kill 0\n")
    assert (group.oom_kills, group.max_usage, group.failcnt) == (1, 123456, 7)
    for name in ("memory.peak", "memory.events", "memory.max"):
        (group.path / name).unlink()
    group.remove()
    assert not group.path.exists()
