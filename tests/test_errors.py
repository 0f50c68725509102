"""``hpcpar.errors``: every error class in one module under one root, each with its exit code,
and the reference page listing every class and every exit code."""

import ast
import re
from pathlib import Path

import hpcpar
from hpcpar import errors

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "errors.md"


def test_one_root_and_an_exit_code_each():
    assert errors.ERRORS[0] is errors.HpcparError
    for cls in errors.ERRORS:
        assert issubclass(cls, errors.HpcparError)
        assert cls.exit_code in errors.EXIT_CODES.values()
        assert getattr(hpcpar, cls.__name__) is cls          # importable from the top level
    assert errors.EXIT_CODES == {"EXIT_OK": 0, "EXIT_FAILED": 1, "EXIT_USAGE": 2,
                                 "EXIT_REQUEUE": 3, "EXIT_DIVERGED": 4,
                                 "EXIT_BELOW_REFERENCE": 5, "EXIT_OUT_OF_MEMORY": 6,
                                 "EXIT_ABORTED": 130}


def test_no_error_class_outside_errors_py():
    """Exception classes live in hpcpar/errors.py (the test harness's own, in hpcpar/testing,
    excepted)."""
    bad = []
    for folder in ("hpcpar", "kernels", "analysis"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "hpcpar" / "errors.py" or "testing" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and any(
                        re.search(r"(Error|Exception)$", ast.unparse(b)) for b in node.bases):
                    bad.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert not bad, bad


def test_page_lists_every_class_and_exit_code():
    text = PAGE.read_text()
    for cls in errors.ERRORS:
        assert re.search(rf"^\| `{cls.__name__}` \| {cls.exit_code} \|", text, re.M), cls
        if cls is not errors.HpcparError:
            assert f"### `{cls.__name__}`" in text, cls
    for name, code in errors.EXIT_CODES.items():
        assert re.search(rf"^\| {code} \| `{name}` \|", text, re.M), name
    documented = set(re.findall(r"^\| `(\w+Error)` \|", text, re.M))
    assert documented == {c.__name__ for c in errors.ERRORS}
