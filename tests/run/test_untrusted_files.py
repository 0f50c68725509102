"""Nothing read from a run directory is trusted: a checkpoint's step is cross-checked against
its directory name and saved state (rotation never deletes the newest valid one), and a
recorded ``[model] kind`` imports no code (``report --plan``, ``plan --fit-on``) unless it is
built in or installed and trusted. Real runs (``hpcpar run`` subprocesses), real files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from hpcpar.errors import DataError, RunDirError
from hpcpar.run.checkpoint import resume, store
from tests.support.cli_run import micro_job_toml

CLI = [sys.executable, "-m", "hpcpar.cli"]
JOB = micro_job_toml("ck", steps=6, checkpoint="every = 3\nkeep = 5")


def _hpcpar(args, cwd=None, env=None):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 6-step run with checkpoints at steps 3 and 6, and its job file."""
    root = tmp_path_factory.mktemp("base")
    (root / "j.toml").write_text(JOB)
    r = _hpcpar(["run", root / "j.toml", "-n", "1", "--run-dir", root / "run"])
    assert r.returncode == 0, r.stderr
    return root


def _copy(finished, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished / "run", run)
    return run


def _one_line_error(r) -> str:
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcpar: error: "), r.stderr
    return lines[0]


def _continue(finished, run, *sets):
    """Rerun the job to 12 steps in ``run`` (resumes from its newest valid checkpoint)."""
    args = ["run", finished / "j.toml", "-n", "1", "--run-dir", run, "--new-settings",
            "--set", "train.steps=12"]
    for s in sets:
        args += ["--set", s]
    return _hpcpar(args)


def _log(run) -> str:
    return (run / "logs" / "rank-00000.log").read_text()


def _steps(run) -> list:
    from hpcpar.analysis import load

    return load([str(run)])[1]["step"].tolist()


def _edit_manifest(path: Path, **changes) -> None:
    m = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**m, **changes}))


def test_manifest_step_is_not_trusted(finished, tmp_path):
    run = _copy(finished, tmp_path)
    _edit_manifest(run / "checkpoints" / "step-000006", step=999)   # "done" after 6 of 12
    r = _continue(finished, run)
    assert r.returncode == 0, r.stderr
    out = _log(run)
    assert "step-000006: manifest step 999 does not match the directory name" in out
    assert "checkpoints/step-000003 at step 3" in out
    assert _steps(run) == list(range(12))        # every step trained, none twice
    assert (run / "checkpoints" / "step-000006.corrupt").is_dir()   # set aside, kept


def test_directory_named_after_a_later_step_is_neither_resumed_nor_kept_over_valid(
        finished, tmp_path):
    run = _copy(finished, tmp_path)
    ck = run / "checkpoints"
    shutil.copytree(ck / "step-000003", ck / "step-99999999999")
    r = _continue(finished, run, "checkpoint.keep=1")
    assert r.returncode == 0, r.stderr
    out = _log(run)
    assert "checkpoints/step-000006 at step 6" in out, out
    assert _steps(run) == list(range(12))
    assert sorted(p.name for p in ck.iterdir()) == ["step-000012",
                                                    "step-99999999999.corrupt"]


def test_only_corrupt_checkpoints_left_warns_and_restarts_once(finished, tmp_path):
    run = _copy(finished, tmp_path)
    for p in list((run / "checkpoints").iterdir()):
        p.rename(p.with_name(p.name + ".corrupt"))
    r = _continue(finished, run)
    assert r.returncode == 0, r.stderr
    warned = [line for line in _log(run).splitlines() if "set aside" in line]
    assert len(warned) == 1 and "starts again from step 0" in warned[0], _log(run)
    assert _steps(run) == list(range(12))


@pytest.fixture
def comm():
    from mpi4py import MPI

    return MPI.COMM_SELF


def _save(comm, d, step, keep=3, last_epoch=None):
    sched = {"last_epoch": step if last_epoch is None else last_epoch}
    return store.save(d, step, comm=comm, model_state=nn.Linear(2, 2).state_dict(),
                     trainer_state={"scheduler": sched, "history": [[step, 0.5]]},
                     rank_state={}, info={"grid": "1x1x1x1"}, keep=keep)


def test_step_cross_checked_against_saved_state(tmp_path, comm):
    path = _save(comm, tmp_path, 6)
    renamed = path.rename(tmp_path / "step-000005")   # name and manifest agree, state does not
    _edit_manifest(renamed, step=5)
    store.verify(renamed)
    with pytest.raises(RunDirError, match=r"step-000005: manifest step 5 does not match the "
                       r"saved training state \(scheduler at step 6"):
        resume.load(renamed, 0)


@pytest.mark.parametrize("manifest", ["[1, 2]", '{"step": "6"}', '{"step": true}',
                                      "[" * 3000 + "]" * 3000])
def test_bad_manifest_is_one_line(tmp_path, comm, manifest):
    path = _save(comm, tmp_path, 6)
    (path / "manifest.json").write_text(manifest)
    with pytest.raises(RunDirError) as exc:
        store.verify(path)
    assert str(path) in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(RunDirError, match="no valid checkpoint"):
        resume.choose_resumable(tmp_path, comm, log=lambda m: None)
    with pytest.raises(ValueError, match="unreadable manifest"):   # `hpcpar run`'s pre-check
        resume.check_compatible(path, (1, 1, 1, 1))                   # skips it


def test_rotation_keeps_the_step_just_written(tmp_path, comm):
    _save(comm, tmp_path, 2)
    shutil.copytree(tmp_path / "step-000002", tmp_path / "step-99999999999")
    (tmp_path / "step-\u0663").mkdir()       # non-ASCII digits: not a checkpoint name
    _save(comm, tmp_path, 4, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000004", "step-99999999999",
                                                          "step-\u0663"]
    assert [p.name for p in store.list_checkpoints(tmp_path)] == ["step-99999999999",
                                                                 "step-000004"]
    logged = []
    assert resume.choose_resumable(tmp_path, comm, log=logged.append).name == "step-000004"
    assert "step-99999999999: manifest step 2 does not match" in logged[0]


# -- numbers from files and flags ----------------------------------------------------------------
DEEP = "[" * 3000 + "]" * 3000


def _bounded(args, cwd):
    """``hpcpar ARGS`` under a 2 GiB address-space limit and a 90 s timeout."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=90, preexec_fn=limit)


@pytest.mark.parametrize("args, expected", [
    (["--set", "model.n_conv_blocks=10000000000"], "n_conv_blocks: 10000000000 is out of range"),
    (["--set", "model.n_conv_blocks=20000"], "n_conv_blocks: 20000 is out of range"),
    (["--set", "train.seed=18446744073709551616"], "[train] seed: 18446744073709551616 is out"),
    (["--set", "train.seed=4294967296"], "[train] seed: 4294967296 is out of range"),
    (["--set", "data.seed=4294967296"], "[data] seed: 4294967296 is out of range"),
    (["--set", "train.steps=" + "9" * 5000], "--set train.steps: the value is out of range"),
    (["--set", f"model.dense={DEEP}"], "--set model.dense: the value nests too deeply"),
    (["--grid", "1x99999999999999999999"], "expected integers such as 2x2x1x1"),
    (["--grid", "\uff12x1"], "expected integers such as 2x2x1x1"),
    ("deep", "invalid TOML: arrays or tables nest too deeply"),
])
def test_job_numbers_are_range_checked(tmp_path, args, expected):
    job = tmp_path / "j.toml"
    job.write_text(JOB + (f"[output]\ncallbacks = {DEEP}\n" if args == "deep" else ""))
    args = [] if args == "deep" else args
    line = _one_line_error(_bounded(["run", job, "-n", "1", "--run-dir", tmp_path / "r",
                                     *args], tmp_path))
    assert expected in line
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("args", [["--ranks", "99999999"], ["--grid", "9999999x9999999"],
                                  ["--grid", "99999999999999999999"]])
def test_info_rank_table_is_bounded(tmp_path, args):
    line = _one_line_error(_bounded(["info", *args], tmp_path))
    assert "at most" in line


# -- a run directory's [model] kind ---------------------------------------------------------------
EVIL = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"


@pytest.fixture
def foreign_kind(finished, tmp_path):
    """A copy of the finished run whose records name ``evilkind:W`` and, in the working
    directory, the module ``evilkind`` that writes a marker file when imported."""
    run = _copy(finished, tmp_path)
    for name in ("job.json", "meta.json"):
        doc = json.loads((run / name).read_text())
        doc["job"]["model"]["kind"] = "evilkind:W"
        (run / name).write_text(json.dumps(doc))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    marker = tmp_path / "MARKER"
    (cwd / "evilkind.py").write_text(EVIL.format(marker=str(marker)))
    return run, cwd, marker


def test_report_plan_imports_no_module_a_run_names(foreign_kind, tmp_path):
    run, cwd, marker = foreign_kind
    for extra in ([], ["--trust-kind"]):     # trusted or not: never from the working dir
        r = _hpcpar(["report", run, "-o", tmp_path / "rep", "--plan", "local", "--force",
                     *extra], cwd=cwd)
        assert r.returncode == 0, r.stderr
        assert not marker.exists(), "report --plan imported a module named by a run"
    table = (tmp_path / "rep" / "predicted.csv")
    text = table.read_text() if table.exists() else (tmp_path / "rep" / "report.md").read_text()
    assert "is not installed" in text


def test_plan_fit_on_imports_no_module_a_run_names(foreign_kind, finished):
    run, cwd, marker = foreign_kind
    plan = ["plan", finished / "j.toml", "-n", "1", "--fit-on", run]
    line = _one_line_error(_hpcpar(plan, cwd=cwd))
    assert "'evilkind:W' is not built in" in line and "--trust-kind" in line
    line = _one_line_error(_hpcpar([*plan, "--trust-kind"], cwd=cwd))
    assert "module 'evilkind' is not installed" in line
    assert not marker.exists(), "plan --fit-on imported a module named by a run"
    # an installed module named by import path loads once trusted
    for name in ("job.json", "meta.json"):
        doc = json.loads((run / name).read_text())
        doc["job"]["model"]["kind"] = "hpcpar.run.workloads.volume:CosmoFlowWorkload"
        (run / name).write_text(json.dumps(doc))
    assert "is not built in" in _one_line_error(_hpcpar(plan, cwd=cwd))
    r = _hpcpar([*plan, "--trust-kind"], cwd=cwd)
    assert r.returncode == 0 and "fitted on 1 run" in r.stdout, r.stderr


@pytest.mark.parametrize("link", ["logs/rank-00000.log", "records/rank-00000.csv"])
def test_run_files_are_never_written_through_a_link(finished, tmp_path, link):
    """Issue 67: a symbolic link placed at a log or a step record of a run directory is
    refused in one line; its target (a user's file elsewhere) is neither appended to nor
    truncated."""
    run = _copy(finished, tmp_path)
    victim = tmp_path / "precious.txt"
    victim.write_text("my data\n")
    (run / link).unlink()
    (run / link).symlink_to(victim)
    r = _continue(finished, run)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert f"{run / link}: a symbolic link; hpcpar writes no run file through a link " \
           f"(remove it)" in r.stderr, r.stderr
    assert victim.read_text() == "my data\n"


def test_a_fifo_named_meta_json_never_blocks_report(finished, tmp_path):
    """Issue 67: ``hpcpar report`` blocked forever opening a FIFO named meta.json."""
    run = _copy(finished, tmp_path)
    (run / "meta.json").unlink()
    os.mkfifo(run / "meta.json")
    r = _hpcpar(["report", run, "--out", tmp_path / "rep"])      # times out (300 s) if it blocks
    assert _one_line_error(r) == (f"hpcpar: error: no readable run records: {run}/meta.json: "
                                  f"not a regular file (hpcpar reads only files it wrote)")


def test_a_fifo_named_manifest_json_never_blocks_a_graph_reader(tmp_path):
    """Issue 67: the sharded-graph check of ``[data] path`` opened manifest.json blocking."""
    import threading

    from hpcpar.graph.shards import is_sharded_graph, read_graph_manifest

    os.mkfifo(tmp_path / "manifest.json")
    out: list = []
    t = threading.Thread(target=lambda: out.append(is_sharded_graph(tmp_path)), daemon=True)
    t.start()
    t.join(30)
    assert out == [False], "is_sharded_graph blocked on a FIFO"
    with pytest.raises(DataError, match="manifest.json: not a regular file"):
        read_graph_manifest(tmp_path)


class _Code:
    """Pickles as a call to ``open(marker, "w")``: loading it would run code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_code_carrying_checkpoint_with_a_valid_checksum_is_one_line(finished, tmp_path):
    """Issue 67: refused (weights_only), but as an UnpicklingError traceback."""
    import torch

    run = _copy(finished, tmp_path)
    ck = run / "checkpoints" / "step-000006"
    marker = tmp_path / "MARKER"
    torch.save({"step": _Code(marker)}, ck / "trainer.pt")
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"]["trainer.pt"] = {"sha256": store.sha256_file(ck / "trainer.pt"),
                                       "bytes": (ck / "trainer.pt").stat().st_size}
    (ck / "manifest.json").write_text(json.dumps(manifest))
    r = _continue(finished, run)
    assert not marker.exists(), "the checkpoint's code ran"
    assert "Traceback" not in r.stderr and "UnpicklingError" not in r.stderr, r.stderr
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == (
        f"hpcpar: error: {ck}/trainer.pt: refused to unpickle (it needs io.open, which could "
        f"run code); hpcpar's checkpoints hold tensors and plain values only"), r.stderr
