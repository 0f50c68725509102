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
    assert not list(memlimit._own_group().glob(f"hpcpar-unit-{os.getpid()}"))


def test_command_line_exits_like_a_shell(cgroups, tmp_path):
    report = tmp_path / "r.txt"
    assert memlimit.main(["--limit", "200MiB", "--report", str(report), "--", *TOUCH, "300"]) \
        == 128 + 9
    rank, rc, kills, usage, rss = report.read_text().split()
    assert (rank, rc, kills) == ("0", "-9", "1")
