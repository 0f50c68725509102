"""The options several commands share, defined once so a flag means one thing everywhere.

* ``-n/--ranks``: rank count(s), always parsed the same way (``4`` or ``1,2,4``). Commands that
  run one configuration (``run``, ``info``, ``plan``) take one count and point to ``sweep``
  when given several; ``sweep`` and ``submit`` take a list.
* ``-o/--out``: where the command writes its results.
* ``--set SECTION.KEY=VALUE``: override a job field (repeatable).
* ``--json``: machine-readable output instead of the text (stdout, one document)."""

from __future__ import annotations

import click

from hpcpar.errors import ConfigError

__all__ = ["complete_site", "json_option", "node_counts", "out_option", "ranks_option",
           "set_option"]

RANKS_HELP = "Rank count(s): 4, or a list such as 1,2,4 where the command runs several."


def _parse_counts(text: str, flag: str) -> list[int]:
    """``"4,1,2"`` -> ``[1, 2, 4]`` by the sweep's own parser; a usage error (click names the
    flag)."""
    from hpcpar.launch.sweep import parse_ranks  # deferred: keeps --help fast

    try:
        return parse_ranks(text, flag)
    except ConfigError as exc:
        raise click.BadParameter(str(exc).removeprefix(f"{flag} ")) from None


def ranks_option(many: bool, help: str | None = None, required: bool = False):
    """``-n/--ranks``: with ``many`` a list of counts (``list[int]``), else one count (``int``);
    a list given to a one-count command is a usage error that names ``hpcpar sweep``."""

    def convert(ctx, param, value):
        if value is None:
            return None
        counts = _parse_counts(value, "--ranks")
        if many:
            return counts
        if len(counts) > 1:
            raise click.BadParameter(
                f"{value!r}: `hpcpar {ctx.info_name}` takes one rank count; to run or compare "
                f"several, use `hpcpar sweep JOB.toml --ranks {value}`")
        return counts[0]

    return click.option("-n", "--ranks", "ranks", callback=convert, required=required,
                        metavar="N[,N...]" if many else "N", help=help or RANKS_HELP)


def node_counts(ctx, param, value):
    """``--nodes 1,2,4`` -> ``[1, 2, 4]``, parsed like ``--ranks``."""
    return None if value is None else _parse_counts(value, "--nodes")


def out_option(help: str, required: bool = False, default=None, file: bool = False):
    """``-o/--out``: a directory (or, with ``file``, a file) the command writes.

    ``default`` reaches click only when given: click >= 8.3 takes an explicit ``default=None``
    as a value, and ``required`` then never fires (the command ran on ``None``)."""
    kind = click.Path(dir_okay=False) if file else click.Path(file_okay=False)
    given = {} if default is None else {"default": default, "show_default": True}
    return click.option("-o", "--out", "out", type=kind, required=required, help=help, **given)


def complete_set(ctx, param, incomplete: str) -> list:
    """Shell completion of ``--set``: the job's ``SECTION.KEY=`` names (the sections every
    kind shares; a kind's own ``[model]``/``[data]`` keys would need its code imported), and
    after the ``=`` the key's choices where it has a closed set."""
    from click.shell_completion import CompletionItem  # deferred: completion only

    from hpcpar.formats.jobspec import SCHEMA  # deferred: keeps --help fast

    name, eq, _ = incomplete.partition("=")
    section, _, key = name.partition(".")
    if eq:
        spec = SCHEMA.get(section, {}).get(key)
        return [CompletionItem(f"{name}={c}") for c in getattr(spec, "choices", None) or ()
                if f"{name}={c}".startswith(incomplete)]
    return [CompletionItem(f"{s}.{k}=", help=p.help or None) for s, params in SCHEMA.items()
            for k, p in params.items() if f"{s}.{k}=".startswith(incomplete)]


def complete_site(ctx, param, incomplete: str) -> list:
    """Shell completion of ``--site``: the site profiles on the search path."""
    from hpcpar.launch.site import available  # deferred: completion only

    return [n for n in available() if n.startswith(incomplete)]


def set_option(help: str = "Override a job field, e.g. --set train.lr=0.01 (repeatable)."):
    """``--set SECTION.KEY=VALUE`` (repeatable), collected as a tuple of strings."""
    return click.option("--set", "sets", multiple=True, metavar="SECTION.KEY=VALUE", help=help,
                        shell_complete=complete_set)


def json_option(help: str = "Print JSON (one document on stdout) instead of text."):
    """``--json``: machine-readable output."""
    return click.option("--json", "as_json", is_flag=True, help=help)
