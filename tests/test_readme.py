"""README.md is generated from docs/readme/*.md; the quickstart has exactly two commands."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_is_up_to_date():
    r = subprocess.run([sys.executable, str(ROOT / "docs" / "build_readme.py"), "--check"])
    assert r.returncode == 0, "README.md is stale: run python docs/build_readme.py"


def test_quickstart_has_two_commands_and_ci_runs_the_test_one():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quickstart.*?```bash\n(.*?)```", text, re.S).group(1)
    commands = [ln for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1].strip() in ci
