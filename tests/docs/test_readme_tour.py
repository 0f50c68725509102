"""Issue 32: the README's code blocks run as written, one after the other, as a user copies
them: a Python block is saved as the file its first line names (``# mpiexec -n 4 python
grid.py``) and that line is run (``mpiexec`` where it says so); a bash block runs in bash. All
run in one fresh directory (with the checkout's ``jobs/``), so a later step may use the files
an earlier one made, never its Python names. A block after ``<!-- norun -->`` (an install, a
sbatch) is skipped. The guide pages (and docs/install.md) follow the same rule, one fresh
directory per page, except that a guide's mark must say why: ``<!-- norun: needs sbatch -->``.
A line a block shows in a comment (``print(...)  # e.g. 1 (2, 2, 1, 1) ...``) must be one of
the lines it prints.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "setup.cfg").exists())
FENCE = re.compile(r"(<!-- (norun|run)(?::[ \t]*([^\n]*?))?[ \t]*-->\s*\n[ \t]*)?"  # mark: reason
                   r"```(python|bash)\n(.*?)```", re.S)
RUN_LINE = re.compile(r"#\s*((?:mpiexec -n \d+ )?python3? (?:-m pytest -q )?(\S+\.py))\s*$")
SHOWN = re.compile(r"#\s*e\.g\.\s*(.+?)\s*$", re.M)   # print(...)  # e.g. 1 (2, 2, 1, 1) ...


def blocks(text: str, default_run: bool, need_reason: bool = False) -> list[tuple[str, str]]:
    """``(language, code)`` of each block that runs: every unmarked block when
    ``default_run``, else only those after ``<!-- run -->``; never one after
    ``<!-- norun -->``. With ``need_reason`` a norun mark without ``: why`` fails, so a
    skipped block always says what it would need (an allocation, a GPU, an install ...)."""
    chosen = []
    for _, mark, why, lang, code in FENCE.findall(text):
        assert not (need_reason and mark == "norun" and not why.strip()), (
            f"<!-- norun --> needs a reason (<!-- norun: needs sbatch -->) before:\n{code}")
        if mark == "run" or (default_run and mark != "norun"):
            chosen.append((lang, textwrap.dedent(code)))     # a block in a list is indented
    return chosen


def command(lang: str, code: str, where: Path) -> list[str]:
    """The command a user runs for a block: its run line, with this Python and mpiexec."""
    if lang == "bash":
        (where / "block.sh").write_text(code)
        return ["bash", "-e", "block.sh"]
    first = code.splitlines()[0]
    m = RUN_LINE.fullmatch(first)
    assert m, ("a Python block starts with its run line (# [mpiexec -n N] python F.py, or "
               f"# python -m pytest -q F.py): {first!r}")
    (where / m.group(2)).write_text(code)
    argv = shlex.split(m.group(1))
    if argv[0] == "mpiexec":
        from hpcpar.launch.mpiexec import find_mpiexec

        argv[0] = find_mpiexec()
    return [sys.executable if a in ("python", "python3") else a for a in argv]


def run_blocks(text: str, where: Path, default_run: bool = True, timeout: int = 300,
               need_reason: bool = False) -> int:
    """Run a page's blocks in order in ``where``; the number run. The checkout comes first
    on ``PYTHONPATH``, so the blocks test this tree's code whatever is installed."""
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("PYTHONUNBUFFERED", None)   # a rank's print arrives whole, not interleaved
    chosen = blocks(text, default_run, need_reason)
    for i, (lang, code) in enumerate(chosen, 1):
        proc = subprocess.run(command(lang, code, where), cwd=where, env=env, timeout=timeout,
                              capture_output=True, text=True)
        assert proc.returncode == 0, (f"block {i} ({lang}) failed with exit code "
                                      f"{proc.returncode}:\n{code}\n{proc.stdout}\n{proc.stderr}")
        assert "Traceback" not in proc.stderr, proc.stderr
        if lang == "python":
            assert proc.stdout.strip(), f"block {i} prints nothing:\n{code}"
            printed = [line.strip() for line in proc.stdout.splitlines()]
            for shown in SHOWN.findall(code):   # one of the lines it prints, as the page shows
                assert shown in printed, (f"block {i} shows '{shown}', but printed:\n"
                                          f"{proc.stdout}")
    return len(chosen)


def test_block_marks_are_read():
    page = ("<!-- norun -->\n```bash\npip install x\n```\n```python\n# python a.py\nprint(1)\n"
            "```\n<!-- run -->\n```bash\necho hi\n```\n")
    assert blocks(page, True) == [("python", "# python a.py\nprint(1)\n"),
                                  ("bash", "echo hi\n")]
    assert blocks(page, False) == [("bash", "echo hi\n")]
    with pytest.raises(AssertionError, match="needs a reason"):   # a guide says why it skips
        blocks(page, True, need_reason=True)
    why = page.replace("<!-- norun -->", "<!-- norun: an install -->")
    assert blocks(why, True, need_reason=True) == blocks(page, True)
    # the reason is one line: a mark before another kind of block never swallows the next one
    toml = "<!-- norun: shape only -->\n```toml\na = 1\n```\n<!-- x -->\n```bash\necho 2\n```\n"
    assert blocks(toml, True, need_reason=True) == [("bash", "echo 2\n")]
    # a block inside a list item: its mark and fence are indented; the code runs dedented
    item = ("* step:\n\n  <!-- norun: a fragment -->\n  ```bash\n  x\n  ```\n"
            "  ```bash\n  echo 3\n  ```\n")
    assert blocks(item, True, need_reason=True) == [("bash", "echo 3\n")]


def test_a_shown_line_must_be_printed(tmp_path):
    page = "```python\n# python a.py\nprint(1, (2, 3))  # e.g. 1 (2, 3)\n```\n"
    assert run_blocks(page, tmp_path) == 1
    with pytest.raises(AssertionError, match=r"shows '1 \(2, 4\)', but printed:\n\s*1 \(2, 3\)"):
        run_blocks(page.replace("e.g. 1 (2, 3)", "e.g. 1 (2, 4)"), tmp_path)


def test_readme_blocks_run_as_written(tmp_path):
    (tmp_path / "jobs").symlink_to(ROOT / "jobs")
    ran = run_blocks((ROOT / "README.md").read_text(), tmp_path)
    assert ran == 5      # the tour: 3 under mpiexec, 1 bash, 1 report (the quickstart: norun)
    assert (tmp_path / "runs" / "b" / "meta.json").is_file()


PAGES = [*sorted((ROOT / "docs" / "guides").glob("*.md")), ROOT / "docs" / "install.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_guide_blocks_run_as_written(page, tmp_path):
    """Every block of a guide runs, in order, in one fresh directory that holds the
    checkout's ``jobs/`` and ``benchmarks/`` (linked) and a copy of ``examples/`` (a page
    may write there, as a user in the checkout would); a skipped block says why."""
    (tmp_path / "jobs").symlink_to(ROOT / "jobs")
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    shutil.copytree(ROOT / "examples", tmp_path / "examples",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    run_blocks(page.read_text(), tmp_path, need_reason=True)
