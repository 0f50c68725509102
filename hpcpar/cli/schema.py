"""``hpcpar schema``: the job file's JSON Schema, for editors and CI checks of job files."""

from __future__ import annotations

import json

import click

__all__ = ["schema"]


@click.command("schema")
@click.option("--kind", default=None, metavar="KIND",
              help="Add this [model] kind's keys (built-in, installed, or "
                   "package.module:Workload) and reject unknown ones.")
@click.option("-o", "--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="Write the schema to this file instead of stdout.")
def schema(kind, out_path):
    """Print the job file schema as JSON Schema (draft 2020-12): every section and key, its
    type, range, choices, default and meaning."""
    from hpcpar.formats.jobschema import json_schema  # deferred: keeps --help fast

    text = json.dumps(json_schema(kind), indent=2) + "\n"
    if out_path:
        with open(out_path, "w") as f:
            f.write(text)
        click.echo(f"hpcpar: wrote {out_path}", err=True)
    else:
        click.echo(text, nl=False)
