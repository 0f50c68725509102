"""hpcpar's own data files (sbatch templates, site profiles, machine files): installed as
package data, or the source checkout's ``slurm/`` folder when running from a checkout."""

from __future__ import annotations

from contextlib import suppress
from importlib.resources import files
from pathlib import Path

PACKAGE_DATA = "hpcpar.slurm_files"   # setup.cfg maps the repository's slurm/ folder here


def data_dirs() -> list[Path]:
    """The folders holding hpcpar's own ``templates/`` and ``sites/`` (installed package data,
    else the source checkout's ``slurm/``)."""
    dirs = []
    with suppress(ModuleNotFoundError, TypeError):
        dirs.append(Path(str(files(PACKAGE_DATA))))
    checkout = Path(__file__).resolve().parent.parent / "slurm"
    if checkout.is_dir() and checkout not in dirs:
        dirs.append(checkout)
    return dirs
