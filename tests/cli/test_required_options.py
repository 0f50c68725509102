"""Every required option and argument of every command is enforced by click: leaving one out is
one line naming it, exit 2, no traceback (issue 32: click >= 8.3 took an explicit
``default=None`` as a value, so ``required`` never fired and the command ran on ``None``)."""

import subprocess
import sys
from pathlib import Path

import click

from hpcpar.errors import EXIT_USAGE

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "jobs" / "demo-cosmoflow.toml")


def _commands(cmd, path=()):
    """(words, command) for every runnable command, found by walking the click tree."""
    if isinstance(cmd, click.Group):
        ctx = click.Context(cmd)
        for name in cmd.list_commands(ctx):
            yield from _commands(cmd.get_command(ctx, name), (*path, name))
    else:
        yield path, cmd


def _value(param, tmp_path: Path) -> str:
    """A value click accepts for ``param``, so only the omitted parameter can fail."""
    kind = param.type
    if isinstance(kind, click.Choice):
        return str(kind.choices[0])
    if isinstance(kind, click.IntRange | click.FloatRange) and kind.min is not None:
        return str(kind.min)
    if not isinstance(kind, click.Path):
        return "1"  # a number, a rank count, a name
    made = tmp_path / f"given-{param.name}"
    if kind.exists:
        made.mkdir(exist_ok=True) if kind.file_okay is False else made.touch()
    return str(made)


def _without(cmd, missing, tmp_path: Path) -> list[str]:
    """The command's arguments with every required parameter but ``missing``; a positional
    argument is left out with the ones after it (click would shift them into its place)."""
    words = []
    for param in cmd.params:
        if param is missing or not param.required:
            continue
        if isinstance(param, click.Argument):
            if cmd.params.index(param) > cmd.params.index(missing) \
                    and isinstance(missing, click.Argument):
                continue
            words.append(_value(param, tmp_path))
        else:
            words += [param.opts[-1], _value(param, tmp_path)]
    return words


def _missing_message(param) -> str:
    """What click's one line names for a missing ``param``."""
    if isinstance(param, click.Argument):
        return f"Missing argument '{param.human_readable_name}'"
    return "Missing option " + " / ".join(f"'{opt}'" for opt in param.opts)


def test_every_required_parameter_left_out_is_one_line_exit_2(run_cli, cli_group, tmp_path):
    cases = [(path, cmd, param) for path, cmd in _commands(cli_group) for param in cmd.params
             if param.required]
    # the walk reaches nested groups and both kinds of parameter (not a vacuous loop)
    assert {("sweep", "out"), ("submit", "out"), ("data graph make", "nodes"),
            ("data shard", "out")} <= {(" ".join(p), prm.name) for p, _, prm in cases}
    for path, cmd, param in cases:
        args = [*path, *_without(cmd, param, tmp_path)]
        code, out, err = run_cli(args)
        lines = err.strip().splitlines()
        assert code == EXIT_USAGE, (args, code, err)
        assert len(lines) == 1 and lines[0].startswith("hpcpar: error: "), (args, err)
        assert _missing_message(param) in lines[0], (args, lines[0])


def test_console_script_missing_out_is_one_line(tmp_path):
    """The two commands of the issue, as a user types them (the installed ``hpcpar`` script)."""
    script = Path(sys.executable).with_name("hpcpar")
    for args in (["sweep", DEMO, "--ranks", "1,2"], ["submit", DEMO, "--dry-run"]):
        proc = subprocess.run([str(script), *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == EXIT_USAGE, proc.stderr
        assert proc.stderr.strip() == "hpcpar: error: Missing option '-o' / '--out'.", proc.stderr
        assert "Traceback" not in proc.stdout + proc.stderr
        assert not list(tmp_path.iterdir()), "nothing is written when an option is missing"
