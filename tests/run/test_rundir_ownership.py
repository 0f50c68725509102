"""Issue 35, run side: ``hpcpar run`` uses only a directory that is new, empty or a run
directory (``--run-dir .`` in a project folder is refused before anything in it changes), and
``--fresh`` moves only hpcpar's own run files aside, leaving the user's files (and the job file
being run) where they are. Real ``hpcpar run`` processes."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from hpcpar.testing.cli_run import tiny_job_toml

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
            "and no hpcpar meta.json or job.json); choose a new or empty directory"], err
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
    assert moved.keys() == {k for k in made if k != "job.toml"}  # every run file but the job
    assert {k: made[k] for k in moved} == moved  # moved intact
    assert (rd / "job.toml").read_text() == JOB and (rd / "meta.json").exists()
