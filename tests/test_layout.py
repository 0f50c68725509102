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
              "hpcpar._resources", "hpcpar._units", "hpcpar._digest", "hpcpar._tables"}


def modules():
    for folder, name in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            mod = ".".join([name] + (parts[:-1] if is_pkg else parts))
            yield mod, is_pkg, path


def _imports_in(tree, mod, is_pkg):
    """(line, absolute hpcpar name) of every import in ``tree``, module ``mod``'s."""
    for node in ast.walk(tree):
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


def imports(mod, is_pkg, path):
    """Absolute names of every hpcpar module or attribute the file imports."""
    yield from _imports_in(ast.parse(path.read_text()), mod, is_pkg)


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
    """Test modules share oracles through hpcpar.testing.oracles, helpers through the one
    package tests/support (``tests.support.X``: pytest and the MPI workers have the root on
    sys.path) and fixtures through tests/conftest.py, never by importing each other: any other
    import of a name that resolves to a file or folder under tests/ (whose folders pytest and
    the workers put on sys.path) or below ``tests.`` is refused. conftest.py is pytest's."""
    tests = ROOT / "tests"
    local = {p.stem for p in tests.rglob("*.py")} | {
        d.name for d in tests.rglob("*") if d.is_dir() and d.name != "__pycache__"} | {"tests"}
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
                if name == "tests.support" or name.startswith("tests.support."):
                    continue
                if name.startswith(".") or name.split(".")[0] in local:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not bad, ("test modules import each other (shared code belongs in "
                     "hpcpar.testing.oracles or tests/support, shared fixtures in "
                     "tests/conftest.py):\n"
                     + "\n".join(bad))


def test_formats_sit_below_the_runtime():
    """The job spec and run-record formats import nothing but errors and the grid rule, so that
    tools which only read files (launch, plan, analysis, the CLI) never load the runtime."""
    allowed = allowed_imports()["hpcpar.formats"]
    assert allowed <= {"hpcpar.errors", "hpcpar.parallel"}, allowed
    readers = ("hpcpar.launch", "hpcpar.plan", "hpcpar.analysis")
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}"
           for mod, is_pkg, path in modules() if layer(mod) in readers
           for line, name in imports(mod, is_pkg, path)
           if name.startswith(("hpcpar.run.jobspec", "hpcpar.run.jobschema", "hpcpar.run.records"))]
    assert not bad, bad


def test_file_tools_never_import_the_runtime():
    """launch/ and analysis/ read and write files (jobs, records, a sweep's locked and marked
    directory) and never import the training package hpcpar.run, at the top or inside a
    function: neither their 'May import:' lines list it nor any of their modules imports it."""
    tools = ("hpcpar.launch", "hpcpar.analysis")
    rules = allowed_imports()
    listed = [pkg for pkg in tools if "hpcpar.run" in rules[pkg]]
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}"
           for mod, is_pkg, path in modules() if layer(mod) in tools
           for line, name in imports(mod, is_pkg, path) if layer(name) == "hpcpar.run"]
    assert not listed and not bad, f"hpcpar.run imported by file tools: {listed} {bad}"


def test_tests_and_benchmarks_reach_the_cli_only_through_one_door():
    """The CLI is a leaf for tests, benchmarks and examples too: they run commands by name (the
    ``run_cli``/``cli_main``/``cli_group`` fixtures of tests/conftest.py, or ``python -m
    hpcpar.cli``), never import what a command module holds; conftest.py is the one door."""
    door = ROOT / "tests" / "conftest.py"
    bad = []
    for folder in ("tests", "benchmarks", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == door:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                if any(n == "hpcpar.cli" or n.startswith("hpcpar.cli.") for n in names):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "imports of hpcpar.cli outside the CLI and tests/conftest.py:\n" + \
        "\n".join(bad)


def _runtime_imports(mod, is_pkg, path):
    """hpcpar names the module imports when it runs, at import time or inside a function (a
    deferred import still makes a circle), but not those only for type checking."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    yield from (name for _, name in _imports_in(tree, mod, is_pkg))


def test_no_import_circles():
    """No two modules import each other, directly or around a loop (a circle, even through an
    import deferred into a function, makes the import order matter and hides which module is
    the lower one). A package's ``__init__`` re-exporting its modules is not an edge back."""
    mods = {mod: (is_pkg, path) for mod, is_pkg, path in modules()}
    graph = {}
    for mod, (is_pkg, path) in mods.items():
        deps = set()
        for name in _runtime_imports(mod, is_pkg, path):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != mod and not mod.startswith(name + "."):
                deps.add(name)
        graph[mod] = deps
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def architecture_mermaid(rules) -> str:
    """The layer diagram of docs/DEV.md, drawn from the ``May import:`` lines: a node per
    package, an edge ``package --> package it may import`` per listed package (the foundation
    modules, which every layer may use, left out). Node ids carry a ``p_`` prefix: ``graph``
    is a Mermaid keyword."""
    short = {pkg: pkg.split(".", 1)[1] for pkg in rules}
    nodes = [f'    p_{name}["{name}"]' for name in sorted(short.values())]
    edges = sorted(f"    p_{short[pkg]} --> p_{dep.split('.', 1)[1]}"
                   for pkg, allowed in rules.items() if allowed
                   for dep in allowed if dep in rules)
    return "```mermaid\ngraph TD\n" + "\n".join(nodes + edges) + "\n```"


def test_dev_guide_diagram_is_the_may_import_lines():
    """docs/DEV.md draws the architecture; it must say what the layout test enforces (on a
    change of a ``May import:`` line, paste the block this failure prints)."""
    want = architecture_mermaid(allowed_imports())
    have = re.search(r"```mermaid\n.*?```", (ROOT / "docs" / "DEV.md").read_text(), re.S)
    assert have is not None and have.group(0) == want, (
        "docs/DEV.md's architecture diagram differs from the 'May import:' lines; "
        "replace it with:\n" + want)


def test_every_package_is_installed():
    """setup.cfg lists every package folder: a folder left out installs nowhere except in an
    editable checkout (found by the second pass's move into hpcpar.formats)."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "hpcpar").rglob("__init__.py")}
    assert found <= listed, f"packages missing from setup.cfg [options] packages: {found - listed}"


# Third-party packages that a function may import where it is used without saying why: each is
# slow to import (a tenth of a second to seconds) or optional, and deferring it keeps ``import
# hpcpar`` and ``hpcpar --help`` fast. Any other import inside a function (stdlib, hpcpar, or one of
# these already imported at the module's top) carries ``# deferred: <why>`` on its first line.
DEFERRABLE = {"torch", "torch_geometric", "numpy", "numba", "scipy", "pandas", "pyarrow",
              "matplotlib", "h5py", "mpi4py", "jsonschema", "jinja2", "tqdm", "tensorboard",
              "pymetis", "pytest"}
DEFERRED = re.compile(r"#\s*deferred:\s*\S")


def unjustified_function_imports(source: str) -> list[tuple[int, str]]:
    """(line, statement) of every import inside a function of ``source`` that neither defers a
    :data:`DEFERRABLE` package the module does not import at its top nor carries the marker."""
    tree, lines = ast.parse(source), source.splitlines()
    top, inner = set(), []

    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # loads nothing at run time
            if isinstance(child, ast.Import | ast.ImportFrom):
                if in_function:
                    inner.append(child)
                elif isinstance(child, ast.Import):
                    top.update(a.name.split(".")[0] for a in child.names)
                elif not child.level:
                    top.add((child.module or "").split(".")[0])
            walk(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    walk(tree, False)
    bad = []
    for node in inner:
        if DEFERRED.search(lines[node.lineno - 1]):
            continue
        if isinstance(node, ast.Import):
            packages = {a.name.split(".")[0] for a in node.names}
        else:
            packages = {"." if node.level else (node.module or "").split(".")[0]}
        if not packages <= DEFERRABLE - top:
            bad.append((node.lineno, lines[node.lineno - 1].strip()))
    return bad


def test_imports_inside_functions_only_defer_something():
    """An import inside a function hides a dependency from the reader and runs again on every
    call; it belongs there only to defer a slow or optional package (the list above) or, with a
    ``# deferred: <why>`` comment, for another reason (e.g. an hpcpar module that loads torch,
    kept off ``hpcpar <command> --help``). Everything else goes to the module's top."""
    bad = [f"{path.relative_to(ROOT)}:{line}: {text}"
           for _, _, path in modules()
           for line, text in unjustified_function_imports(path.read_text())]
    assert not bad, ("imports inside functions without a reason (move them to the module's top, "
                     "or add '# deferred: <why>'):\n" + "\n".join(bad))


def test_the_function_import_rule_can_fail():
    source = ("import numpy as np\n"
              "def f():\n"
              "    import json\n"                                  # stdlib: move it up
              "    from hpcpar.errors import ConfigError\n"         # hpcpar, no reason
              "    from . import sibling\n"                         # relative, no reason
              "    import numpy\n"                                  # already at the top
              "    import torch\n"                                  # deferrable: fine
              "    from hpcpar.nn import spatialize  # deferred: loads torch\n"
              "    return json, ConfigError, sibling, numpy, torch, spatialize\n")
    assert [line for line, _ in unjustified_function_imports(source)] == [3, 4, 5, 6]
