"""The README is short and points into the documentation site (docs/, built by mkdocs).

Checks: the quickstart has exactly two commands and CI runs the test one (then only the
benchmarks' smoke stage); the README's links and the site's nav point at pages that exist,
and every page is in the nav; the README sections that docs/index.md includes exist; the
tour's Python steps run as written on 4 ranks; with mkdocs installed, ``mkdocs build
--strict`` passes (a broken link or a docstring that does not parse fails it).
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "setup.cfg").exists())
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"


def nav_pages():
    """Every ``*.md`` path in mkdocs.yml's nav (relative to docs/)."""
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    return re.findall(r"^\s*-\s*(?:[^:\n]+:\s*)?(\S+\.md)\s*$", nav, re.M)


def test_quickstart_has_two_commands_and_ci_runs_the_test_one():
    block = re.search(r"## Quickstart.*?```bash\n(.*?)```", README, re.S).group(1)
    commands = [ln for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(commands) == 2
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
          if ln.strip() and not ln.startswith("#")]
    assert commands[1].strip() in ci, "CI runs the README's test command as written"
    # after the tests CI runs only the benchmarks' smoke stage (docs/guides/testing.md), and
    # under set -e, so a failing test or smoke benchmark fails CI
    after = ci[ci.index(commands[1].strip()) + 1:]
    assert after in ([], ["benchmarks/smoke.sh"]), f"CI runs more after the tests: {after}"
    assert "set -euo pipefail" in ci


def test_readme_is_short_and_its_links_resolve():
    assert len(README.splitlines()) <= 250, "README.md: move details into a docs/ page"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert local, "the README links to the docs pages"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_measured_table_has_one_current_figure_per_row():
    """Issue 64: every cell of the "Measured" table reads at a glance (under 200 characters:
    histories live in docs/guides/measurements.md), and every row gives its figure's date (or
    says it is undated or not measured), a baseline on the same cores and a command."""
    section = README.split("## Measured", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in ln.strip().strip("|").split(" | ")]
            for ln in section.splitlines() if ln.startswith("|") and "---" not in ln]
    assert rows[0] == ["what", "hpcpar (date)", "baseline, same cores", "command"]
    assert len(rows) > 10
    for row in rows[1:]:
        assert len(row) == 4 and all(row), row
        long = [c for c in row if len(c) >= 200]
        assert not long, f"a Measured cell of {len(long[0])} characters: {long[0][:60]}..."
        assert re.search(r"20\d\d-\d\d|undated|not measured", row[1]), row[1]
    assert "measurements.md" in section


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    nav = set(nav_pages())
    missing = sorted(p for p in nav if not (DOCS / p).exists())
    assert not missing, f"mkdocs.yml nav names missing pages: {missing}"
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")} - {"DEV.md"}
    assert not pages - nav, f"pages not in mkdocs.yml's nav: {sorted(pages - nav)}"


def test_index_includes_existing_readme_sections():
    index = (DOCS / "index.md").read_text()
    sections = re.findall(r'--8<-- "README\.md:(\w+)"', index)
    assert sections
    for name in sections:
        assert f"[start:{name}]" in README and f"[end:{name}]" in README, name


def readme_section(name):
    return README.split(f"[start:{name}]")[1].split(f"[end:{name}]")[0]


def test_api_reference_names_existing_modules():
    mods = {m for p in (DOCS / "api").glob("*.md")
            for m in re.findall(r"^::: (\S+)", p.read_text(), re.M)}
    assert {"hpcpar", "hpcpar.parallel.grid", "hpcpar.sync.ddp", "hpcpar.analysis"} <= mods
    for mod in sorted(mods):
        assert importlib.util.find_spec(mod) is not None, mod


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="needs the docs extra")
def test_mkdocs_build_strict(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                        "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
