"""One CLI convention: every --help ends with examples that name real commands; --json where a
command reports something; `run --print-config` prints the resolved job (a job file that gives
back the same job); `schema` is a JSON Schema the shipped jobs satisfy; errors with an obvious
fix say it, and the fix works."""

import json
import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import click
import pytest

from hpcpar.formats.jobspec import load_job

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "jobs" / "demo-cosmoflow.toml")


def _commands(cli):
    ctx = click.Context(cli)

    def walk(cmd, path):
        yield path, cmd
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                yield from walk(cmd.get_command(ctx, name), f"{path} {name}".strip())

    return dict(walk(cli, ""))


def test_every_help_ends_with_examples_of_real_commands(run_cli, cli_group):
    commands = _commands(cli_group)
    for path in commands:
        rc, out, _ = run_cli([*path.split(), "--help"])
        assert rc == 0
        tail = out.rstrip().split("Examples:")
        assert len(tail) == 2, f"hpcpar {path} --help has no examples"
        for line in tail[1].strip().splitlines():
            words = shlex.split(line.split("#")[0].replace("$(", " ").replace(")", " "))
            words = words[words.index("hpcpar") + 1:]
            if words[0] == "COMMAND":
                continue
            named = max((" ".join(words[:k]) for k in range(1, 4)
                         if " ".join(words[:k]) in commands), key=len, default=None)
            assert named, f"hpcpar {path} --help: {line!r} names no command"
            assert named.startswith(path) or path == "", (path, line)


def test_print_config_round_trips(run_cli, tmp_path):
    args = ["run", DEMO, "-n", "2", "--grid", "1x2x1x1", "--set", "train.steps=10"]
    rc, out, err = run_cli([*args, "--print-config"])
    assert rc == 0, err
    doc = tomllib.loads(out)
    assert doc["train"]["beta2"] == 0.999 and doc["ddp"]["bucket_cap_mb"] == 25.0  # defaults
    assert doc["grid"] == {"data": 1, "x": 2, "y": 1, "z": 1}                      # resolved
    (tmp_path / "resolved.toml").write_text(out)
    again = load_job(tmp_path / "resolved.toml").to_dict()
    assert again == load_job(DEMO, ["train.steps=10", "grid.data=1"]).to_dict()
    rc, out, _ = run_cli([*args, "--print-config", "--json"])
    assert rc == 0 and json.loads(out) == again


def test_schema_is_json_schema_of_the_jobs(run_cli):
    jsonschema = pytest.importorskip("jsonschema")
    rc, out, _ = run_cli(["schema"])
    assert rc == 0
    schema = json.loads(out)
    jsonschema.Draft202012Validator.check_schema(schema)
    for path in sorted((ROOT / "jobs").glob("*.toml")):
        doc = tomllib.loads(path.read_text())
        jsonschema.validate(doc, schema)
        rc, out, _ = run_cli(["schema", "--kind", doc["model"]["kind"]])
        jsonschema.validate(doc, json.loads(out))
    bad = {"model": {"kind": "cosmoflow", "n_conv_blokcs": 3}, "train": {"steps": 1}}
    with pytest.raises(jsonschema.ValidationError, match="n_conv_blokcs"):
        jsonschema.validate(bad, json.loads(run_cli(["schema", "--kind", "cosmoflow"])[1]))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"model": {"kind": "gcn"}, "train": {"lr": -1.0}}, schema)


def test_a_smoke_run_clamps_the_warmup(run_cli):
    """Issue 64: ``--set train.steps=2`` on a job with warmup_steps = 5 runs (the warm-up is
    clamped to the steps, said in one line), and the job as run records the clamped value."""
    rc, out, err = run_cli(["run", DEMO, "-n", "1", "--grid", "1x1x1x1", "--set",
                            "train.steps=2", "--dry-run"])
    assert rc == 0, err
    assert "hpcpar: note: " in err and "[train] warmup_steps 5 > steps 2: clamped to 2" in err
    rc, out, err = run_cli(["run", DEMO, "-n", "1", "--grid", "1x1x1x1", "--set",
                            "train.steps=2", "--print-config", "--json"])
    assert rc == 0, err
    assert json.loads(out)["train"]["warmup_steps"] == 2


def test_set_key_value_in_two_words_is_answered_with_the_right_form(run_cli):
    """Issue 64: ``--set train.steps 6`` is one line naming ``--set train.steps=6``, not
    click's "unexpected extra argument"."""
    for args in (["run", DEMO, "--set", "train.steps", "6", "--dry-run"],
                 ["sweep", DEMO, "-n", "1", "-o", "x", "--set", "train.steps", "6"]):
        rc, _, err = run_cli(args)
        assert rc == 2 and err.strip().splitlines() == [
            "hpcpar: error: --set takes one word SECTION.KEY=VALUE: use --set train.steps=6"]


def test_errors_suggest_a_fix_that_works(run_cli):
    rc, _, err = run_cli(["run", DEMO, "-n", "2", "--set", "train.steps=4", "--dry-run"])
    assert rc == 2 and "run with -n 4, or fit the grid to 2 ranks: --grid 1x2x1x1" in err
    rc, out, err = run_cli(["run", DEMO, "-n", "2", "--set", "train.steps=4", "--set",
                            "train.warmup_steps=0", "--grid", "1x2x1x1", "--dry-run", "--json"])
    assert rc == 0, err
    assert json.loads(out)["grid"] == "1x2x1x1"
    rc, _, err = run_cli(["run", DEMO, "-n", "6", "--set", "grid.data=-1", "--dry-run"])
    assert rc == 2 and "--set train.global_batch=18" in err


def test_json_output(run_cli):
    rc, out, _ = run_cli(["info", "--json"])
    assert rc == 0 and "torch" in json.loads(out)
    rc, out, _ = run_cli(["info", "--ranks", "4", "--grid", "-1x2x1x1", "--json"])
    table = json.loads(out)["table"]
    assert [(r["rank"], r["data"], r["x"]) for r in table] == [(0, 0, 0), (1, 0, 1), (2, 1, 0),
                                                               (3, 1, 1)]
    rc, out, _ = run_cli(["plan", DEMO, "-n", "4", "--json"])
    grids = json.loads(out)["grids"]
    assert rc == 0 and {g["grid"] for g in grids} >= {"4x1x1x1", "2x2x1x1"}
    fastest = min(g["t_step"] for g in grids if g["feasible"])  # first, up to a tie (1%)
    assert grids[0]["feasible"] and fastest <= grids[0]["t_step"] <= fastest * 1.01


def _flags(cmd) -> dict:
    """option name -> (is a flag, metavar, multiple) of one command."""
    ctx = click.Context(cmd)
    return {name: (p.is_flag, p.make_metavar(ctx), p.multiple)
            for p in cmd.params if isinstance(p, click.Option) for name in p.opts}


def test_one_meaning_per_flag(cli_group):
    """A flag name means the same thing in every command: same short form, same kind."""
    commands = {path: cmd for path, cmd in _commands(cli_group).items()
                if not isinstance(cmd, click.Group)}
    seen: dict = {}
    for path, cmd in commands.items():
        for p in cmd.params:
            if isinstance(p, click.Option):
                long = next((o for o in p.opts if o.startswith("--")), None)
                seen.setdefault(long, set()).add((tuple(sorted(p.opts)), p.is_flag, p.multiple,
                                                  path))
    for long in ("--ranks", "--out", "--set", "--json"):
        forms = {(opts, flag, multiple) for opts, flag, multiple, _ in seen[long]}
        assert len(forms) == 1, f"{long} differs between commands: {seen[long]}"
    assert {path for *_, path in seen["--ranks"]} >= {"run", "info", "plan", "sweep", "submit"}
    assert {path for *_, path in seen["--out"]} >= {"sweep", "submit", "report", "plan",
                                                    "schema"}
    assert {path for *_, path in seen["--json"]} >= {"run", "info", "plan", "sweep", "submit",
                                                     "status", "report", "data info",
                                                     "data verify"}


def test_ranks_parses_alike_and_single_run_commands_point_to_sweep(run_cli, tmp_path):
    rc, _, err = run_cli(["run", DEMO, "-n", "1,2", "--dry-run"])
    assert rc == 2 and "takes one rank count" in err and "hpcpar sweep JOB.toml --ranks 1,2" \
        in err
    for cmd in (["run", DEMO, "--dry-run"], ["sweep", DEMO, "-o", str(tmp_path / "s")],
                ["plan", DEMO], ["info"]):
        rc, _, err = run_cli([*cmd, "-n", "0"])
        assert rc == 2 and "'-n' / '--ranks'" in err and "positive" in err, (cmd, err)
        rc, _, err = run_cli([*cmd, "--ranks", "two"])
        assert rc == 2 and "expected a count such as 4" in err, (cmd, err)
    assert not (tmp_path / "s").exists()


def test_report_json_is_the_scaling_table(run_cli, tmp_path):
    from hpcpar.analysis import synthetic_run

    for p, grid in ((1, (1, 1, 1, 1)), (2, (2, 1, 1, 1))):
        synthetic_run(tmp_path / "sweep" / f"ranks-{p}", grid=grid, steps=4)
    rc, out, err = run_cli(["report", str(tmp_path / "sweep"), "-o", str(tmp_path / "rep"),
                            "--json"])
    assert rc == 0, err
    doc = json.loads(out)
    assert [p["ranks"] for p in doc["points"]] == [1, 2]
    assert doc["verdict"] and Path(doc["files"]["report.html"]).exists()
    import pandas as pd

    table = pd.read_csv(doc["files"]["scaling.csv"])
    assert list(table["ranks"]) == [1, 2]
    assert doc["points"][1]["speedup"] == pytest.approx(table["speedup"][1])


def test_data_info_and_verify_json(run_cli, tmp_path):
    out = tmp_path / "d"
    rc, _, err = run_cli(["data", "make", "cosmoflow", str(out), "--samples", "3", "--size",
                          "8", "--shards", "2", "--quiet"])
    assert rc == 0, err
    rc, text, _ = run_cli(["data", "info", str(out), "--json"])
    doc = json.loads(text)
    assert rc == 0 and doc["num_samples"] == 3 and len(doc["shards"]) == 2 and doc["bytes"] > 0
    rc, text, _ = run_cli(["data", "verify", str(out), "--json"])
    assert rc == 0 and json.loads(text) == {"dataset": str(out), "ok": True, "problems": [],
                                            "checksums": True, "shards": 2, "samples": 3}
    shard = sorted(out.glob("*.h5"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    rc, text, _ = run_cli(["data", "verify", str(out), "--json"])
    doc = json.loads(text)
    assert rc == 2 and not doc["ok"] and shard.name in doc["problems"][0]


@pytest.mark.usefixtures("shipped_profiles_only")
def test_completion_of_set_keys_and_site_names():
    """Issue 64: the shell completes ``--set`` keys (and a key's choices after ``=``) and
    ``--site`` profile names, not only commands and options."""
    def complete(args, incomplete):
        words = ["hpcpar", *args, incomplete]
        env = {**os.environ, "_HPCPAR_COMPLETE": "bash_complete",
               "COMP_WORDS": " ".join(words), "COMP_CWORD": str(len(words) - 1)}
        r = subprocess.run([sys.executable, "-m", "hpcpar.cli"], env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return [ln.split(",", 1)[1] for ln in r.stdout.splitlines()]

    for command in ("run", "sweep", "submit", "plan"):
        assert complete([command, DEMO, "--set"], "train.st") == ["train.steps="], command
    assert "grid.data=" in complete(["run", DEMO, "--set"], "")
    assert complete(["run", DEMO, "--set"], "train.optimizer=ad") == [
        "train.optimizer=adam", "train.optimizer=adamw"]
    assert complete(["submit", DEMO, "--site"], "") == ["frontier", "generic", "perlmutter"]
    assert complete(["submit", DEMO, "--site"], "pe") == ["perlmutter"]
