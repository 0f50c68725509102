"""Issue 35, run side: ``hpcpar run`` uses only a directory that is new, empty or a run
directory (``--run-dir .`` in a project folder is refused before anything in it changes), and
``--fresh`` moves only hpcpar's own run files aside, leaving the user's files (and the job file
being run) where they are. Issue 67: what marks a run directory is ``hpcpar-run.json``, which
only ``hpcpar run`` writes (a ``job.json`` from ``--print-config --json``, a ``meta.json`` or
a lock file alone marks nothing), and ``--fresh`` moves only what that mark lists. Real
``hpcpar run`` processes."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.cli_run import tiny_job_toml

JOB = tiny_job_toml(data=1, x=1, steps="2", checkpoint="every = 1")


def hpcpar_run(*args, cwd):
    """(exit code, stderr) of ``hpcpar run ARGS`` as its own process."""
    p = subprocess.run([sys.executable, "-m", "hpcpar.cli", "run", *map(str, args)], cwd=cwd,
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    return p.returncode, p.stderr


def snapshot(root) -> dict:
    root = Path(root)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "dir" for p in sorted(root.rglob("*"))}


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("hpcpar: error:")]


def test_a_project_folder_is_not_a_run_directory(tmp_path):
    (tmp_path / "job.toml").write_text(JOB)
    (tmp_path / "model.py").write_text("print('my code')\n")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.md").write_text("- everything\n")
    before = snapshot(tmp_path)
    for extra in (["--fresh"], []):
        rc, err = hpcpar_run("job.toml", "--run-dir", ".", *extra, cwd=tmp_path)
        assert rc == 2, err
        assert error_lines(err) == [
            "hpcpar: error: --run-dir .: not a run directory (it holds 'job.toml' and 2 more "
            "and no hpcpar-run.json, which hpcpar run writes); choose a new or empty "
            "directory"], err
        assert snapshot(tmp_path) == before  # nothing moved, no lock, no job.json


def test_fresh_moves_only_hpcpars_own_files(tmp_path):
    (tmp_path / "job.toml").write_text(JOB)
    rc, err = hpcpar_run("job.toml", "--run-dir", "r", cwd=tmp_path)
    assert rc == 0, err
    rd = tmp_path / "r"
    made = snapshot(rd)
    (rd / "notes.txt").write_text("what I saw in this run\n")
    (rd / "plots").mkdir()
    (rd / "plots" / "loss.py").write_text("import matplotlib\n")
    mine = {k: v for k, v in snapshot(rd).items() if k not in made}
    # start over from the job file kept in the run directory itself
    rc, err = hpcpar_run("r/job.toml", "--run-dir", "r", "--fresh", cwd=tmp_path)
    assert rc == 0 and not error_lines(err), err
    (previous,) = rd.glob("previous-*")
    after = snapshot(rd)
    assert mine.items() <= after.items()  # the user's files stay where they were
    moved = {k.split("/", 1)[1]: v for k, v in after.items() if k.startswith(previous.name + "/")}
    # every run file but the job and the mark (the directory stays hpcpar's)
    assert moved.keys() == {k for k in made if k not in ("job.toml", "hpcpar-run.json")}
    assert {k: made[k] for k in moved} == moved  # moved intact
    assert (rd / "job.toml").read_text() == JOB and (rd / "meta.json").exists()


def _project(tmp_path) -> dict:
    """A user's folder: their job, a log folder, metrics and notes of their own."""
    (tmp_path / "job.toml").write_text(JOB)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-00000.log").write_text("my own log\n")
    (tmp_path / "metrics.json").write_text('{"mine": 1}\n')
    (tmp_path / "notes.md").write_text("- keep\n")
    return snapshot(tmp_path)


def test_print_config_json_or_a_lock_file_does_not_make_a_run_directory(tmp_path):
    before = _project(tmp_path)
    p = subprocess.run([sys.executable, "-m", "hpcpar.cli", "run", "job.toml", "-n", "1",
                        "--print-config", "--json"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    (tmp_path / "job.json").write_text(p.stdout)
    assert isinstance(json.loads(p.stdout)["job"], dict)
    (tmp_path / "hpcpar.lock").write_text("")
    (tmp_path / "meta.json").write_text('{"schema": "hpcpar.run", "status": "ok"}')
    before = snapshot(tmp_path)
    for extra in (["--fresh"], ["--new-settings", "--set", "train.lr=0.5"], []):
        rc, err = hpcpar_run("job.toml", "--run-dir", ".", *extra, cwd=tmp_path)
        assert rc == 2, err
        (line,) = error_lines(err)
        assert "not a run directory" in line and "hpcpar-run.json" in line, line
        assert snapshot(tmp_path) == before  # nothing moved, appended or overwritten


def test_the_mark_names_the_run_and_the_lock_records_it(tmp_path):
    (tmp_path / "job.toml").write_text(JOB)
    held = []
    from hpcpar.formats.rundir import MARK_NAME, RunLock, read_mark

    rd = tmp_path / "r"
    rc, err = hpcpar_run("job.toml", "--run-dir", rd, cwd=tmp_path)
    assert rc == 0, err
    mark = read_mark(rd)
    assert mark is not None and len(mark["run_id"]) == 32 and "metrics.json" in mark["entries"]
    lock = RunLock(rd, warn=held.append)
    lock.acquire()
    try:
        assert json.loads((rd / "hpcpar.lock").read_text())["run_id"] == mark["run_id"]
    finally:
        lock.release()
    assert json.loads((rd / MARK_NAME).read_text()) == mark and not held


def test_fresh_moves_only_the_entries_the_mark_lists(tmp_path):
    (tmp_path / "job.toml").write_text(JOB)
    rc, err = hpcpar_run("job.toml", "--run-dir", "r", cwd=tmp_path)
    assert rc == 0, err
    rd = tmp_path / "r"
    mark = json.loads((rd / "hpcpar-run.json").read_text())
    mark["entries"].remove("logs")      # this run directory's logs/ are not hpcpar's
    (rd / "hpcpar-run.json").write_text(json.dumps(mark))
    log = (rd / "logs" / "rank-00000.log").read_text()
    rc, err = hpcpar_run("job.toml", "--run-dir", "r", "--fresh", cwd=tmp_path)
    assert rc == 0 and not error_lines(err), err
    (previous,) = rd.glob("previous-*")
    assert (previous / "metrics.json").exists() and not (previous / "logs").exists()
    assert (rd / "logs" / "rank-00000.log").read_text().startswith(log)  # left in place


def test_fresh_refuses_to_move_the_job_file_being_run(tmp_path):
    (tmp_path / "job.toml").write_text(JOB)
    rc, err = hpcpar_run("job.toml", "--run-dir", "r", cwd=tmp_path)
    assert rc == 0, err
    rd = tmp_path / "r"
    (rd / "records" / "job.toml").write_text(JOB)
    before = snapshot(rd)
    rc, err = hpcpar_run(rd / "records" / "job.toml", "--run-dir", "r", "--fresh", cwd=tmp_path)
    assert rc == 2, err
    (line,) = error_lines(err)
    assert line.endswith("job.toml: --fresh moves records/ of " + str(rd.resolve()) +
                         " aside, this job file with it; copy it out of the run directory "
                         "first"), line
    assert snapshot(rd) == before


def test_a_run_file_that_is_a_directory_or_a_fifo_is_refused(tmp_path):
    (tmp_path / "job.toml").write_text(JOB)
    rc, err = hpcpar_run("job.toml", "--run-dir", "r", cwd=tmp_path)
    assert rc == 0, err
    rd = tmp_path / "r"
    (rd / "job.toml").unlink()
    (rd / "job.toml").mkdir()
    rc, err = hpcpar_run("job.toml", "--run-dir", "r", cwd=tmp_path)
    assert rc == 2, err
    assert error_lines(err) == [f"hpcpar: error: {rd.relative_to(tmp_path)}/job.toml: a directory, "
                                "where hpcpar keeps a file of the run; move it away, or choose "
                                "another --run-dir"], err
    (rd / "job.toml").rmdir()
    (rd / "meta.json").unlink()
    os.mkfifo(rd / "meta.json")
    rc, err = hpcpar_run("job.toml", "--run-dir", "r", cwd=tmp_path)  # no hang (timeout 300)
    assert rc == 2, err
    (line,) = error_lines(err)
    assert line.endswith("meta.json: not a regular file, where hpcpar keeps a file of the run; "
                         "move it away, or choose another --run-dir"), line


def test_a_tilde_in_the_job_is_the_home_directory_for_every_writer(tmp_path):
    """Issue 67: ``[output] dir = "~/runs/x"`` is expanded once where the job is parsed:
    training and the records' merge (pyarrow, which expands ``~`` itself) write the same
    directory, and no literal ``./~`` is made."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "job.toml").write_text(JOB + '[output]\ndir = "~/runs/x"\n')
    p = subprocess.run([sys.executable, "-m", "hpcpar.cli", "run", "job.toml"], cwd=work,
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1", HOME=str(home)))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    rd = home / "runs" / "x"
    assert p.stdout.strip() == str(rd)
    assert {"meta.json", "steps.parquet", "logs", "hpcpar-run.json"} <= set(os.listdir(rd))
    assert os.listdir(work) == ["job.toml"]     # no ./~
    assert json.loads((rd / "job.json").read_text())["job"]["output"]["dir"] == str(rd)
