"""Job specs: schema, defaults, --set overrides, and malformed jobs / CLI misuse -> one-line
errors with exit code 2 and no traceback."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hpcpar
from hpcpar.errors import ConfigError
from hpcpar.formats.jobspec import load_job, parse_override
from hpcpar.formats.rundir import write_mark

GOOD = """
[job]
name = "t"
[grid]
data = 2
x = 2
[model]
kind = "cosmoflow"
n_conv_blocks = 2
base_filters = 4
dense = [16]
[data]
source = "synthetic"
size = 16
channels = 2
samples = 16
[train]
steps = 4
global_batch = 4
"""


def write(tmp_path, text, name="job.toml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def test_good_job_defaults_and_ranks(tmp_path):
    job = load_job(write(tmp_path, GOOD))
    assert job.name == "t" and job.grid_shape == (2, 2, 1, 1)
    assert job.model.kind == "cosmoflow" and job.model.params["dense"] == [16]
    assert job.model.params["kernel_size"] == 3            # workload default filled in
    assert job.train.optimizer == "adam" and job.train.precision == "fp32"
    assert job.checkpoint.keep == 3 and job.ddp.as_kwargs()["compression"] is None
    assert job.fixed_ranks() == 4 and job.check_ranks(4) == (2, 2, 1, 1)
    # the resolved JSON round-trips through the rank-side loader
    from hpcpar.formats.jobspec import load_resolved

    (tmp_path / "job.json").write_text(job.to_json())
    again = load_resolved(str(tmp_path / "job.json"))
    assert again.to_dict() == job.to_dict()


def test_overrides_are_coerced(tmp_path):
    job = load_job(write(tmp_path, GOOD), ["train.lr=0.01", "job.name=123", "train.steps=7",
                                           "data.seed=3", "ddp.hierarchical=true",
                                           "output.dir=runs/x y", "grid.data=-1"])
    assert job.train.lr == 0.01 and isinstance(job.train.lr, float)
    assert job.name == "123" and job.train.steps == 7 and job.data.params["seed"] == 3
    assert job.ddp.hierarchical is True and job.output.dir == "runs/x y"
    assert job.check_ranks(8) == (4, 2, 1, 1)
    assert parse_override("a.b='q'") == ("a", "b", "q")


def test_all_shipped_jobs_validate():
    jobs = sorted(Path(__file__).resolve().parents[2].joinpath("jobs").glob("*.toml"))
    mine = {"demo-cosmoflow", "demo-unet3d", "cosmoflow-128", "cosmoflow-512-spatial"}
    assert mine <= {p.stem for p in jobs}
    for p in jobs:
        if p.stem in mine:
            job = load_job(str(p))
            assert job.name == p.stem
    assert load_job(str(jobs[0].parent / "demo-cosmoflow.toml")).check_ranks(4) == (2, 2, 1, 1)


# (job text or None for GOOD, extra CLI args, expected fragment of the one-line error)
BAD = [
    (GOOD.replace("[train]", "[trian]"), [], "unknown section [trian] (did you mean 'train'?)"),
    (GOOD.replace("steps = 4", "setps = 4"), [], "unknown key 'setps' (did you mean 'steps'?)"),
    (GOOD + "lr = 'fast'\n", [], "[train] lr: expected a number, got 'fast'"),
    (GOOD.replace("global_batch = 4", "global_batch = 0"), [], "global_batch: 0 is out of range"),
    (GOOD + "optimizer = 'adamm'\n", [], "is not one of 'sgd', 'adam', 'adamw' (did you mean"),
    (GOOD, ["-n", "3"], "[grid] grid 2x2x1x1 needs 4 ranks, the job has 3"),
    (GOOD.replace('kind = "cosmoflow"', ""), [], "[model] kind: required key is missing"),
    (GOOD.replace('"cosmoflow"', '"cosmoflw"'), [], "unknown kind 'cosmoflw' (did you mean"),
    (GOOD + "lr = = 1\n", [], "invalid TOML"),
    (GOOD + "epochs = 2\n", [], "give exactly one of steps or epochs"),
    (GOOD.replace("steps = 4", ""), [], "give exactly one of steps or epochs"),
    (GOOD.replace("global_batch = 4", "global_batch = 3"), [],
     "global_batch: 3 does not split over 2 data-parallel ranks"),
    (GOOD.replace("steps = 4", "steps = true"), [], "steps: expected an integer, got True"),
    (GOOD.replace("n_conv_blocks", "n_conv_block"), [], "did you mean 'n_conv_blocks'"),
    (GOOD.replace("size = 16", ""), [], "[data] size: required for source = 'synthetic'"),
    (GOOD + "[resources]\ntime = 'soon'\n", [], "[resources] time: 'soon' is not a Slurm time"),
    (GOOD.replace("x = 2", "x = 0"), [], "[grid] x: 0 is out of range"),
    (GOOD.replace("dense = [16]", "dense = [16, 'a']"), [], "dense: expected a list of positive"),
    ("train = 5\n" + GOOD.replace("[train]\n", "[trainx]\n"), [],
     "'train' must be a [train] table"),
    (GOOD, ["--set", "lr=0.1"], "expected SECTION.KEY=VALUE"),
    (GOOD, ["--set", "trainig.lr=0.1"], "unknown section [trainig] (did you mean 'train'?)"),
    (GOOD, ["--set", "train.lr=abc"], "[train] lr: expected a number, got 'abc'"),
    (GOOD, ["--grid", "2xq"], "expected integers such as 2x2x1x1"),
    (GOOD, ["-n", "0"], "'0': expected positive counts such as 1,2,4"),
    (GOOD, ["--frobnicate"], "No such option '--frobnicate'"),
    (GOOD.replace("n_conv_blocks = 2", "n_conv_blocks = 5"), [],
     "5 pooling blocks need a volume of at least 32"),
    (GOOD + "activation_checkpointing = 'all'\n", [],
     "[train] activation_checkpointing: expected false, \"auto\" or a number of segments per "
     "chain >= 1, got 'all'"),
    (GOOD, ["--set", "train.activation_checkpointing=0"],
     "activation_checkpointing: expected false, \"auto\" or a number of segments per chain "
     ">= 1, got 0"),
    (GOOD + "activation_checkpointing = true\n", [], "chain >= 1, got true"),
]


@pytest.mark.parametrize("text,args,expected", BAD, ids=[f"bad{i:02d}" for i in range(len(BAD))])
def test_malformed_job_or_cli_is_one_line_exit_2(tmp_path, capsys, text, args, expected, cli_main):
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as exc:
        cli_main(["run", path, "--dry-run", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("hpcpar: error: "), err
    assert expected in lines[0], err
    assert "Traceback" not in err


def test_cli_misuse_missing_and_dir(tmp_path, capsys, cli_main):
    for argv, expected in ((["run"], "Missing argument 'JOB.toml'"),
                           (["run", str(tmp_path / "nope.toml")], "job file not found"),
                           (["run", str(tmp_path)], "is a directory")):
        with pytest.raises(SystemExit) as exc:
            cli_main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, err


def test_resume_on_another_grid_is_planned_not_refused(tmp_path, capsys, cli_main):
    """A checkpoint of another grid resumes on this one (issue 31): the dry run plans it and
    changes nothing in the run directory."""
    path = write(tmp_path, GOOD)
    ck = tmp_path / "run" / "checkpoints" / "step-000002"
    ck.mkdir(parents=True)
    (ck / "manifest.json").write_text(json.dumps({"grid": "1x4x1x1", "files": {}}))
    (tmp_path / "run" / "meta.json").write_text(json.dumps({"schema": "hpcpar.run"}))
    write_mark(tmp_path / "run", "run", "test-run")   # what hpcpar run leaves: the mark
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    cli_main(["run", path, "--dry-run", "--run-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert "ranks: 4 (grid 2x2x1x1" in out and "--no-resume" not in out
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before
    cli_main(["run", path, "--dry-run", "--run-dir", str(tmp_path / "run"), "--no-resume"])
    out = capsys.readouterr().out
    assert "ranks: 4 (grid 2x2x1x1" in out and "--no-resume" in out


def test_real_process_no_traceback_and_no_torch(tmp_path):
    """The console entry point itself: exit 2, one stderr line; validation never imports
    torch (it runs in the launcher, before any rank)."""
    bad = write(tmp_path, GOOD.replace("steps = 4", "steps = -1"), "bad.toml")
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-m", "hpcpar.cli", "run", bad], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"hpcpar: error: {bad}: [train] steps: -1 is out of range "
                                   "(must be >= 1)")
    good = write(tmp_path, GOOD, "good.toml")
    code = ("import sys; from hpcpar.formats.jobspec import load_job; "
            f"load_job({good!r}); import hpcpar.cli.run; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_jobspec_error_is_hpcpar_error():
    from hpcpar.errors import HpcparError

    assert issubclass(ConfigError, HpcparError) and ConfigError.exit_code == 2


def test_checkpoint_async_is_read_as_background_with_one_deprecation_line(tmp_path, capsys,
                                                                         cli_main):
    """``[checkpoint] async`` (a Python keyword) is now ``background``: the old key, in the
    file or in --set, is still read, and ``hpcpar run`` says so in one line; both is refused."""
    path = write(tmp_path, GOOD + "[checkpoint]\nasync = false\n")
    job = load_job(path)
    assert job.checkpoint.background is False and "async" not in job.to_dict()["checkpoint"]
    assert load_job(write(tmp_path, GOOD, "new.toml"),
                    ["checkpoint.async=false"]).checkpoint.background is False
    cli_main(["run", path, "--dry-run", "--run-dir", str(tmp_path / "run")])
    err = [line for line in capsys.readouterr().err.splitlines() if "deprecated" in line]
    assert err == [f"hpcpar: note: {path}: [checkpoint] async is deprecated: it is now called "
                   f"background (read as background = false)"], err
    with pytest.raises(ConfigError, match=r"\[checkpoint\] async and background: give only "
                                          r"background \(async is its old name\)$"):
        load_job(path, ["checkpoint.background=true"])


def test_jobs_guide_documents_every_key():
    from hpcpar.formats.jobspec import SCHEMA
    from hpcpar.run.workloads.volume import VOLUME_DATA, CosmoFlowWorkload, UNet3DWorkload

    text = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "jobs.md").read_text()
    keys = {k for s in SCHEMA.values() for k in s} | set(VOLUME_DATA)
    keys |= set(CosmoFlowWorkload.model_params) | set(UNet3DWorkload.model_params)
    missing = sorted(k for k in keys if f"`{k}`" not in text)
    assert not missing, f"docs/guides/jobs.md does not document {missing}"


def test_sections_are_typed_and_frozen(tmp_path, monkeypatch):
    """Issue 65: a job's sections are frozen dataclasses (the clamped warm-up is a new section,
    a write raises) whose keys mypy knows: a misspelt key or a write is a type error."""
    job = load_job(write(tmp_path, GOOD), ["train.warmup_steps=9"])
    assert job.train.warmup_steps == 4 and job.model.params["dense"] == [16]
    for section, attr in ((job.train, "lr"), (job, "train")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, attr, None)
    api = pytest.importorskip("mypy.api")
    monkeypatch.setenv("MYPYPATH", str(Path(hpcpar.__file__).parents[1]))
    prog = ("from hpcpar.formats.jobspec import JobSpec\n"
            "def f(job: JobSpec) -> float:\n"
            "    reveal_type(job.checkpoint.background)\n"
            "    job.train.lr = 1.0\n"
            "    return job.train.lrr\n")
    out, err, rc = api.run(["-c", prog, "--no-site-packages", "--follow-imports=silent",
                            "--cache-dir", os.devnull, "--config-file", "",
                            "--python-version", "3.11"])
    assert rc == 1 and not err, out + err
    assert re.search(r'<string>:3: note: Revealed type is "(builtins\.)?bool"', out), out
    assert '<string>:4: error: Property "lr" defined in "TrainSection" is read-only' in out, out
    assert '<string>:5: error: "TrainSection" has no attribute "lrr"' in out, out
