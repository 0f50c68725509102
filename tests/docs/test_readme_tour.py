"""Issue 32: the README's code blocks run as written, one after the other, as a user copies
them: a Python block is saved as the file its first line names (``# mpiexec -n 4 python
grid.py``) and that line is run (``mpiexec`` where it says so); a bash block runs in bash. All
run in one fresh directory (with the checkout's ``jobs/``), so a later step may use the files
an earlier one made, never its Python names. A block after ``<!-- norun -->`` (an install, a
sbatch) is skipped. Guide pages opt in block by block with ``<!-- run -->``.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "setup.cfg").exists())
FENCE = re.compile(r"(<!-- (norun|run) -->\s*\n)?```(python|bash)\n(.*?)```", re.S)
RUN_LINE = re.compile(r"#\s*((?:mpiexec -n \d+ )?python3? (\S+\.py))\s*$")


def blocks(text: str, default_run: bool) -> list[tuple[str, str]]:
    """``(language, code)`` of each block that runs: every unmarked block when
    ``default_run``, else only those after ``<!-- run -->``; never one after
    ``<!-- norun -->``."""
    return [(lang, code) for _, mark, lang, code in FENCE.findall(text)
            if mark == "run" or (default_run and mark != "norun")]


def command(lang: str, code: str, where: Path) -> list[str]:
    """The command a user runs for a block: its run line, with this Python and mpiexec."""
    if lang == "bash":
        (where / "block.sh").write_text(code)
        return ["bash", "-e", "block.sh"]
    first = code.splitlines()[0]
    m = RUN_LINE.fullmatch(first)
    assert m, f"a Python block starts with its run line (# [mpiexec -n N] python F.py): {first!r}"
    (where / m.group(2)).write_text(code)
    argv = shlex.split(m.group(1))
    if argv[0] == "mpiexec":
        from hpcpar.launch.mpiexec import find_mpiexec

        argv[0] = find_mpiexec()
    return [sys.executable if a in ("python", "python3") else a for a in argv]


def run_blocks(text: str, where: Path, default_run: bool = True, timeout: int = 300) -> int:
    """Run a page's blocks in order in ``where``; the number run."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    chosen = blocks(text, default_run)
    for i, (lang, code) in enumerate(chosen, 1):
        proc = subprocess.run(command(lang, code, where), cwd=where, env=env, timeout=timeout,
                              capture_output=True, text=True)
        assert proc.returncode == 0, (f"block {i} ({lang}) failed with exit code "
                                      f"{proc.returncode}:\n{code}\n{proc.stdout}\n{proc.stderr}")
        assert "Traceback" not in proc.stderr, proc.stderr
        if lang == "python":
            assert proc.stdout.strip(), f"block {i} prints nothing:\n{code}"
    return len(chosen)


def test_block_marks_are_read():
    page = ("<!-- norun -->\n```bash\npip install x\n```\n```python\n# python a.py\nprint(1)\n"
            "```\n<!-- run -->\n```bash\necho hi\n```\n")
    assert blocks(page, True) == [("python", "# python a.py\nprint(1)\n"),
                                  ("bash", "echo hi\n")]
    assert blocks(page, False) == [("bash", "echo hi\n")]


def test_readme_blocks_run_as_written(tmp_path):
    (tmp_path / "jobs").symlink_to(ROOT / "jobs")
    ran = run_blocks((ROOT / "README.md").read_text(), tmp_path)
    assert ran == 5      # the tour: 3 under mpiexec, 1 bash, 1 report (the quickstart: norun)
    assert (tmp_path / "runs" / "b" / "meta.json").is_file()


MARKED = sorted(p.name for p in (ROOT / "docs" / "guides").glob("*.md")
                if blocks(p.read_text(), default_run=False))


@pytest.mark.parametrize("page", MARKED or [pytest.param(
    None, marks=pytest.mark.skip(reason="no guide block is marked <!-- run --> yet"))])
def test_guide_blocks_marked_run_run_as_written(page, tmp_path):
    text = (ROOT / "docs" / "guides" / page).read_text()
    (tmp_path / "jobs").symlink_to(ROOT / "jobs")
    assert run_blocks(text, tmp_path, default_run=False) > 0
