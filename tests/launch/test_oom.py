"""``hpcpar.launch.oom``: an out-of-memory kill is read from the memory cgroup counters of
the process and its ancestors (cgroup v1 and v2 layouts, built in a temporary folder)."""

from pathlib import Path

from hpcpar.launch import oom


def v1_tree(root: Path, limit="1610612736") -> Path:
    unlimited = "9223372036854771712"
    for rel, lim in (("", unlimited), ("job", limit), ("job/step", unlimited)):
        d = root / "memory" / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
        (d / "memory.limit_in_bytes").write_text(lim + "\n")
    proc = root / "cgroup"
    proc.write_text("5:cpu:/\n4:memory:/job/step\n0::/\n")
    return proc


def kill(group: Path, n: int = 1) -> None:
    (group / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {n}\n")


def test_no_kill_no_message(tmp_path):
    proc = v1_tree(tmp_path)
    watch = oom.OomWatch(proc, tmp_path)
    assert [g.name for g, _ in watch.groups] == ["step", "job", "memory"]
    assert watch.message(1, "1x1x1x1") is None


def test_a_kill_where_the_limit_was_hit_names_it(tmp_path):
    proc = v1_tree(tmp_path)
    watch = oom.OomWatch(proc, tmp_path)
    kill(tmp_path / "memory" / "job")
    msg = watch.message(1, "1x1x1x1")
    assert msg.startswith("out of memory: rank 0 was killed by the kernel's memory limit "
                          "(cgroup job: 1.5 GiB) on grid 1x1x1x1; split the sample"), msg
    assert msg.endswith("--memory-budget 1.5GiB` shows what fits"), msg
    assert oom.memory_limit(watch.groups) == 1610612736


def test_kills_before_the_run_do_not_count(tmp_path):
    proc = v1_tree(tmp_path)
    kill(tmp_path / "memory" / "job/step", 3)
    watch = oom.OomWatch(proc, tmp_path)
    assert watch.message(8, "1x2x2x2") is None
    kill(tmp_path / "memory" / "job/step", 4)
    assert "1 of the 8 ranks' processes were killed" in watch.message(8, "1x2x2x2")


def test_v2_reads_memory_events(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    own = tmp_path / "user" / "job"
    own.mkdir(parents=True)
    (own / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 0\n")
    (own / "memory.max").write_text("max\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/user/job\n")
    watch = oom.OomWatch(proc, tmp_path)
    (own / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 1\n")
    msg = watch.message(2, "1x2x1x1")
    assert msg and "(cgroup job) on grid 1x2x1x1" in msg and "budget SIZE" in msg, msg


def test_no_cgroup_to_read(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("")
    assert oom.OomWatch(proc, tmp_path).message(1, "1x1x1x1") is None
    assert oom.memory_limit([]) is None
