"""Every import resolves to the file at that path in the checkout being run: with a second
checkout first on PYTHONPATH (the worktree of an A/B benchmark), ``hpcpar`` and its mapped
top-level folders (kernels/, analysis/, slurm/) all come from that checkout, never from the
editable install's; and without it, all from this one."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("hpcpar", "hpcpar.kernels", "hpcpar.kernels.halo_pack", "hpcpar.analysis",
         "hpcpar.analysis.stats", "hpcpar.slurm_files")
PROBE = ("import importlib, json; print(json.dumps({n: importlib.import_module(n).__file__ "
         f"for n in {NAMES!r}}}))")


def _files(cwd, pythonpath=None) -> dict:
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return {k: Path(v).resolve() for k, v in json.loads(out.splitlines()[-1]).items()}


def test_a_second_checkout_never_picks_up_this_ones_code(tmp_path):
    other = tmp_path / "other"
    for part in ("hpcpar", "kernels", "analysis", "slurm"):
        shutil.copytree(ROOT / part, other / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "setup.cfg", other / "setup.cfg")
    theirs = _files(tmp_path, pythonpath=other)
    assert all(other.resolve() in f.parents for f in theirs.values()), theirs
    ours = _files(tmp_path)
    assert all(ROOT in f.parents for f in ours.values()), ours
