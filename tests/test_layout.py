"""The layer rules of the package layout, read from each package's ``__init__`` docstring.

Every package states on a ``May import:`` line which hpcpar packages it may import; this test
parses every module (imports inside functions included) and fails on any import outside that
list, on any import of ``hpcpar.cli`` from outside the CLI, and on a package without the line.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# source folder -> package name (setup.cfg maps kernels/ and analysis/ into hpcpar)
SOURCES = {"hpcpar": "hpcpar", "kernels": "hpcpar.kernels", "analysis": "hpcpar.analysis"}
# top-level modules every layer may use: they import no hpcpar package themselves
FOUNDATION = {"hpcpar.errors", "hpcpar._env", "hpcpar._lazy", "hpcpar._version",
              "hpcpar._resources", "hpcpar._units"}


def modules():
    for folder, name in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            mod = ".".join([name] + (parts[:-1] if is_pkg else parts))
            yield mod, is_pkg, path


def imports(mod, is_pkg, path):
    """Absolute names of every hpcpar module or attribute the file imports."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("hpcpar."):
                yield node.lineno, name


def layer(mod):
    """``hpcpar.sync._buckets`` -> ``hpcpar.sync``; top-level modules are their own layer."""
    return ".".join(mod.split(".")[:2])


def allowed_imports():
    rules = {}
    for mod, is_pkg, path in modules():
        if is_pkg and mod.count(".") == 1:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            m = re.search(r"May import:(.*?)(?:\n\s*\n|\Z)", doc, re.S)
            listed = None if m is None else re.sub(r"\(.*?\)", "", m.group(1), flags=re.S)
            rules[mod] = None if m is None else set(re.findall(r"hpcpar(?:\.\w+)?", listed))
    return rules


def test_every_package_states_what_it_may_import():
    missing = [pkg for pkg, allowed in allowed_imports().items()
               if allowed is None and pkg != "hpcpar.cli"]
    assert not missing, f"packages without a 'May import:' line: {missing}"


def test_imports_follow_the_layers():
    rules = allowed_imports()
    bad = []
    for mod, is_pkg, path in modules():
        own = layer(mod)
        for line, name in imports(mod, is_pkg, path):
            target = layer(name)
            where = f"{path.relative_to(ROOT)}:{line} imports {name}"
            if own == target or mod == "hpcpar":
                if mod == "hpcpar" and target == "hpcpar.cli":
                    bad.append(where)
                continue
            if target == "hpcpar.cli" and own != "hpcpar.cli":
                bad.append(where + " (nothing outside the CLI imports it)")
            elif own in FOUNDATION or (own not in rules and own != "hpcpar.cli"):
                if target not in FOUNDATION:
                    bad.append(where + " (a foundation module imports no hpcpar package)")
            elif own == "hpcpar.cli" or target in FOUNDATION:
                continue
            elif target not in rules[own]:
                bad.append(where + f" (not in {own}'s 'May import:' line)")
    assert not bad, "layer rule broken:\n" + "\n".join(bad)


@pytest.mark.parametrize("rule", ["parallel"])
def test_parallel_imports_no_other_layer(rule):
    allowed = allowed_imports()["hpcpar.parallel"]
    assert allowed <= {"hpcpar.errors", "hpcpar.kernels"}, allowed


def test_no_test_module_imports_another():
    """Test modules share oracles through hpcpar.testing.oracles (importable inside the MPI
    workers, which load one test file by path) and fixtures through tests/conftest.py, never by
    importing each other: any import of a name that resolves to a file or folder under tests/
    (whose folders pytest and the workers put on sys.path) is refused. conftest.py is pytest's."""
    tests = ROOT / "tests"
    local = {p.stem for p in tests.rglob("*.py")} | {
        d.name for d in tests.rglob("*") if d.is_dir() and d.name != "__pycache__"}
    bad = []
    for path in sorted(tests.rglob("*.py")):
        if path.name == "conftest.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = ["." * node.level + (node.module or "")] if node.level else [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith(".") or name.split(".")[0] in local:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not bad, ("test modules import each other (shared code belongs in "
                     "hpcpar.testing.oracles, shared fixtures in tests/conftest.py):\n"
                     + "\n".join(bad))
