"""``hpcpar._env``: the one home of every ``HPCPAR_*`` variable, its reference page, typed
values read at call time, and one-line errors for values that do not parse."""

import re
from pathlib import Path

import pytest

from hpcpar import _env
from hpcpar.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "environment.md"
NAME = re.compile(r"\bHPCPAR_[A-Z][A-Z0-9_]*\b")
SOURCES = [ROOT / "hpcpar", ROOT / "kernels", ROOT / "analysis"]


def test_page_and_registry_list_the_same_variables():
    rows = set(re.findall(r"^\| `(HPCPAR_[A-Z0-9_]+)` \|", PAGE.read_text(), re.M))
    assert rows == set(_env.VARS)
    assert set(NAME.findall(PAGE.read_text())) == set(_env.VARS)
    for var in _env.VARS.values():      # default and effect as the registry states them
        assert f"| `{var.name}` | {var.default} | {var.effect} |" in PAGE.read_text(), var.name


def test_every_variable_named_anywhere_is_registered():
    places = [p for d in SOURCES + [ROOT / "tests", ROOT / "docs", ROOT / "benchmarks"]
              for p in d.rglob("*") if p.suffix in (".py", ".md")]
    unknown = {(n, str(p.relative_to(ROOT))) for p in places
               for n in NAME.findall(p.read_text()) if n not in _env.VARS}
    assert not unknown, f"HPCPAR_* names not in hpcpar._env.VARS: {sorted(unknown)}"


def test_no_module_reads_a_variable_itself():
    read = re.compile(r"""(?:environ\s*\[|(?<!_env)\.get\(|getenv\()\s*["']HPCPAR_""")
    bad = [f"{p.relative_to(ROOT)}:{i}" for d in SOURCES for p in d.rglob("*.py")
           if p.name != "_env.py"
           for i, line in enumerate(p.read_text().splitlines(), 1) if read.search(line)]
    assert not bad, f"read HPCPAR_* through hpcpar._env.get instead: {bad}"


def test_defaults_and_typed_values(monkeypatch):
    for name in _env.VARS:
        monkeypatch.delenv(name, raising=False)
    assert _env.get("HPCPAR_STALL_TIMEOUT") == 600.0
    assert _env.get("HPCPAR_DDP_SHM") is True
    assert _env.get("HPCPAR_CUDA_AWARE") is None
    assert _env.get("HPCPAR_LAUNCH") is None
    assert _env.get("HPCPAR_SRUN_MPI") is None and _env.get("HPCPAR_SRUN_FLAGS") == []
    assert _env.get("HPCPAR_TEST_MAX_NP") == 8
    monkeypatch.setenv("HPCPAR_STALL_TIMEOUT", "off")      # read at call time
    assert _env.get("HPCPAR_STALL_TIMEOUT") == 0.0
    monkeypatch.setenv("HPCPAR_DDP_SHM", "0")
    assert _env.get("HPCPAR_DDP_SHM") is False
    monkeypatch.setenv("HPCPAR_FAKE_NODES", " 3 ")
    assert _env.get("HPCPAR_FAKE_NODES") == 3
    monkeypatch.setenv("HPCPAR_SITE_PATH", "/a:/b")
    assert _env.get("HPCPAR_SITE_PATH") == ["/a", "/b"]
    env = {"HPCPAR_SRUN_FLAGS": "--cpu-bind=cores --exclusive", "HPCPAR_SRUN_MPI": ""}
    assert _env.get("HPCPAR_SRUN_FLAGS", env) == ["--cpu-bind=cores", "--exclusive"]
    assert _env.get("HPCPAR_SRUN_MPI", env) == ""       # set empty: no --mpi flag
    assert _env.get("HPCPAR_LAUNCH", {"HPCPAR_LAUNCH": ""}) is None


@pytest.mark.parametrize("name, value, expected", [
    ("HPCPAR_STALL_TIMEOUT", "soon", "expected seconds"),
    ("HPCPAR_STALL_TIMEOUT", "-1", "expected seconds >= 0"),
    ("HPCPAR_FAKE_NODES", "0", "expected a positive integer"),
    ("HPCPAR_TEST_MAX_NP", "two", "expected a positive integer"),
    ("HPCPAR_DDP_SHM", "yes", "expected 0 or 1"),
    ("HPCPAR_HALO_KERNELS", "cuda", "expected one of auto, torch, numba"),
    ("HPCPAR_SRUN_FLAGS", "--x='unclosed", "expected shell words"),
])
def test_bad_values_are_one_line_config_errors(name, value, expected):
    with pytest.raises(ConfigError, match=f"^{name}=.*: {expected}") as info:
        _env.get(name, {name: value})
    assert "\n" not in str(info.value) and info.value.exit_code == 2
