"""Import paths that are file paths: ``hpcpar.kernels``, ``hpcpar.analysis`` and
``hpcpar.slurm_files`` are the top-level folders ``kernels/``, ``analysis/`` and ``slurm/`` of the
checkout this ``hpcpar/`` sits in.

``setup.cfg`` maps those folders into the ``hpcpar`` namespace, which is what an installed wheel
holds. In a source checkout, though, an editable install's finder maps them to the checkout that was
*installed*, so with a second checkout first on ``PYTHONPATH`` (a worktree for an A/B benchmark)
``import hpcpar`` and ``hpcpar.kernels`` would come from different checkouts. This finder, first on
``sys.meta_path``, resolves the three names next to this very ``hpcpar/`` whenever it sits in a
checkout (a ``setup.cfg`` beside it); elsewhere it steps aside."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

__all__ = ["install"]

#: Package name -> the checkout's top-level folder it is.
FOLDERS = {"hpcpar.kernels": "kernels", "hpcpar.analysis": "analysis",
           "hpcpar.slurm_files": "slurm"}

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _CheckoutFolders(importlib.abc.MetaPathFinder):
    """Finds the three mapped packages in this checkout's top-level folders."""

    def find_spec(self, fullname, path=None, target=None):
        folder = FOLDERS.get(fullname)
        if folder is None or not os.path.isfile(os.path.join(_ROOT, "setup.cfg")):
            return None
        init = os.path.join(_ROOT, folder, "__init__.py")
        if not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[os.path.dirname(init)])


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _CheckoutFolders) for f in sys.meta_path):
        sys.meta_path.insert(0, _CheckoutFolders())
