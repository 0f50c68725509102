"""Griffe extension for the API reference: load the packages that setup.cfg's ``package_dir``
maps into ``hpcpar`` (``kernels/`` -> ``hpcpar.kernels``, ``analysis/`` -> ``hpcpar.analysis``).

Griffe finds ``hpcpar`` by walking ``hpcpar/`` and so never sees those folders; this adds them
as submodules of the loaded package, under their installed names, so ``::: hpcpar.analysis``
works from a plain checkout as well as from any install.
"""

import configparser
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parent.parent


def mapped_packages(top: str) -> dict[str, Path]:
    """setup.cfg's ``package_dir`` entries under ``top``: ``{"analysis": ROOT / "analysis"}``."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    out = {}
    for line in cfg["options"]["package_dir"].strip().splitlines():
        name, _, folder = (s.strip() for s in line.partition("="))
        if name.startswith(top + ".") and "." not in name[len(top) + 1 :]:
            out[name[len(top) + 1 :]] = ROOT / folder
    return out


class PackageDir(griffe.Extension):
    """Attach the ``package_dir``-mapped folders to the ``hpcpar`` package."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        if pkg.name != "hpcpar":
            return
        for name, folder in mapped_packages(pkg.name).items():
            init = folder / "__init__.py"
            if name in pkg.members or not init.exists():
                continue
            sub = loader._load_module(name, init, submodules=False, parent=pkg)
            pkg.set_member(name, sub)
            loader._load_submodules(sub)

    # griffe < 2 calls the hook by this name
    def on_package_loaded(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader,
                          **kwargs) -> None:
        self.on_package(pkg=pkg, loader=loader)
