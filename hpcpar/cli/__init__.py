"""The ``hpcpar`` command line: thin click commands that parse, call the library and print.

A leaf: may import every hpcpar package; nothing imports it."""

from hpcpar.cli.main import cli, main

__all__ = ["cli", "main"]
