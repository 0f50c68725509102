"""The ``hpcpar`` command line.

Sub-commands live in their own modules and load lazily (importing torch costs seconds), so ``hpcpar
--help`` is instant. Register a command by adding it to ``COMMANDS``. User errors
(:class:`hpcpar.HpcparError`, click usage errors) print one line and exit 2."""

from __future__ import annotations

import importlib
import sys

import click

from hpcpar._version import __version__
from hpcpar.cli.examples import attach, epilog
from hpcpar.errors import EXIT_ABORTED, EXIT_USAGE, HpcparError

__all__ = ["LazyGroup", "cli", "main"]

# name -> (module, attribute, one-line help)
COMMANDS = {
    "info": ("hpcpar.cli.info", "info", "Versions, MPI/CUDA facts, and a grid's rank table."),
    "run": ("hpcpar.cli.run", "run", "Run a training job (mpiexec locally, srun in Slurm)."),
    "sweep": ("hpcpar.cli.sweep", "sweep", "Run a job at several rank counts and report."),
    "report": ("hpcpar.cli.report", "report", "Scaling tables and plots from run records."),
    "submit": ("hpcpar.cli.submit", "submit", "Render and submit sbatch jobs (sweeps)."),
    "status": ("hpcpar.cli.submit", "status", "State of the Slurm jobs of a sweep."),
    "data": ("hpcpar.cli.data", "data", "Make, inspect, verify and re-shard datasets."),
    "plan": ("hpcpar.cli.plan", "plan", "Predict step time for every grid; pick one."),
    "schema": ("hpcpar.cli.schema", "schema", "The job file schema as JSON Schema."),
    "predict": ("hpcpar.cli.predict", "predict",
                "Whole-volume inference with a trained model, split over ranks."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:
                raise click.UsageError(f"command {name!r} is not available in this build") \
                    from None
            raise
        return attach(getattr(mod, attr), name)

    def format_commands(self, ctx, formatter):
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=epilog(""))
@click.version_option(__version__, prog_name="hpcpar")
def cli():
    """hpcpar: train large-sample 3D CNNs and full graphs over many MPI ranks, then see how well it
    scaled."""


def main(argv=None) -> None:
    """Console entry point: one-line errors and exit code 2 for user errors."""
    try:
        cli.main(args=argv, prog_name="hpcpar", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("hpcpar: aborted", err=True)
        sys.exit(EXIT_ABORTED)
    except click.ClickException as exc:
        hint = _set_hint(sys.argv[1:] if argv is None else list(argv))
        message = exc.format_message()
        click.echo(f"hpcpar: error: {hint if hint and 'extra argument' in message else message}",
                   err=True)
        sys.exit(EXIT_USAGE)
    except HpcparError as exc:
        click.echo(f"hpcpar: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)


def _set_hint(argv: list[str]) -> str | None:
    """The right form of a ``--set KEY VALUE`` (two words) in ``argv``: click takes KEY as the
    option's value and VALUE as an unexpected extra argument, which says nothing of the fix."""
    for i, word in enumerate(argv[:-2]):
        if word == "--set" and "=" not in argv[i + 1] and not argv[i + 2].startswith("-"):
            return (f"--set takes one word SECTION.KEY=VALUE: use --set "
                    f"{argv[i + 1]}={argv[i + 2]}")
    return None

