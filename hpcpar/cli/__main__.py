"""``python -m hpcpar.cli``: the ``hpcpar`` command without the console script."""

from hpcpar.cli.main import main

main()
