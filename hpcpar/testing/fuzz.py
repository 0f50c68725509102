"""Bad-but-plausible inputs for the input fuzzer (``tests/fuzz``), as hypothesis strategies.

A user's broken file is rarely random bytes: it is a valid file with one field wrong. So the
strategies here start from a valid document and change one place of it: a value of the wrong
type, a huge, negative or non-finite number, unicode, a missing key or section, deep nesting.
:func:`outcome` states the property every reader must keep: it returns normally or raises
:class:`~hpcpar.errors.HpcparError` with a one-line message; anything else (a traceback a user
would see) propagates and fails the case. Needs ``hypothesis`` (the ``test`` extra)."""

from __future__ import annotations

import copy
import json
import math
import resource
import signal
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from hypothesis import strategies as st

from hpcpar.errors import HpcparError

__all__ = ["DEEP", "plausible_values", "mutated", "to_json", "to_toml", "text_damage", "outcome",
           "time_limit", "memory_cap"]

#: stands for an array nested deeper than any parser's recursion limit, written by
#: :func:`to_json` / :func:`to_toml` as ``[[[...]]]`` (a real document cannot hold it)
DEEP = "\0deep\0"
DEEP_LEVELS = 5000
#: a case still running after this long is a hang (hypothesis's deadline only measures)
HANG_SECONDS = 10


def deep_text() -> str:
    """``[[[...]]]`` nested ``DEEP_LEVELS`` times: valid JSON and TOML, fatal to recursion."""
    return "[" * DEEP_LEVELS + "]" * DEEP_LEVELS


_NUMBERS = st.sampled_from([0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64, -2**63 - 1, 10**30,
                            10**400, 7, 3, 1000000000, 0.0, -0.0, 0.5, -1.5, 1e308, 1e-320,
                            math.nan, math.inf, -math.inf])
_STRINGS = st.sampled_from(["", " ", "1", "-1", "1e400", "nan", "inf", "true", "null", "1x1",
                            "../../etc/passwd", "/abs/path", "a/b", ".", "..", "x" * 4096,
                            "é", "１２", "\u202e", "🙂", "\t\n", "\\", "\"", "'", "=", "[", "{}",
                            "step-1", "2x2x1x1", "shard-00000.h5", "model.pt", "rank-00000.pt"])


_BAD_LITERALS = st.sampled_from(["1" * 5000, "[" * 3000 + "]" * 3000, "nan", "inf", "-1",
                                 "99999999999999999999", '"é"', "{", "true", "1e999", "[1, 'a']",
                                 "{a = {b = {c = 1}}}", '"""', "0x7fffffffffffffff"])


def plausible_values(containers: bool = True) -> st.SearchStrategy:
    """Values a field might wrongly hold: edge-case numbers, odd strings (unicode, paths, numbers as
    text), booleans, None, and with ``containers`` lists, tables and :data:`DEEP`."""
    scalars = st.one_of(_NUMBERS, _STRINGS, st.booleans(), st.none(),
                        st.integers(min_value=-2**70, max_value=2**70),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
    if not containers:
        return scalars
    return st.one_of(scalars, st.just(DEEP), st.lists(scalars, max_size=4),
                     st.dictionaries(st.sampled_from(["a", "x", "kind", "1", ""]), scalars,
                                     max_size=3))


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a JSON-like document: the key/index path to each value (root included)."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def mutated(draw, doc: Any, max_edits: int = 3) -> Any:
    """A copy of ``doc`` with one to ``max_edits`` places changed: replaced by a plausible value,
    deleted, wrapped in a list, given an unknown key, or replaced by a sibling's value."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, max_edits))):
        path = draw(st.sampled_from(_paths(doc)))
        op = draw(st.sampled_from(["replace", "replace", "delete", "wrap", "add", "swap"]))
        if not path:
            if op in ("replace", "delete"):
                return draw(plausible_values())
            continue
        *head, last = path
        parent = doc
        for key in head:
            parent = parent[key]
        if op == "delete":
            del parent[last]
        elif op == "wrap":
            parent[last] = [parent[last]]
        elif op == "add" and isinstance(parent[last], dict):
            parent[last][draw(st.sampled_from(["extra", "kind", "steps", "x", "é"]))] = \
                draw(plausible_values())
        elif op == "swap" and isinstance(parent, dict) and len(parent) > 1:
            parent[last] = copy.deepcopy(parent[draw(st.sampled_from(sorted(parent, key=str)))])
        else:
            parent[last] = draw(plausible_values())
    return doc


def to_json(doc: Any) -> str:
    """JSON text of ``doc`` as a careless writer makes it: NaN/Infinity allowed, :data:`DEEP`
    written out."""
    return json.dumps(doc, allow_nan=True).replace(json.dumps(DEEP), deep_text())


def _toml_value(v: Any) -> str:
    if v is None:
        return '"null"'       # TOML has no null: the nearest thing a user would write
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) \
            else repr(v)
    if isinstance(v, int):
        return str(v)
    if v == DEEP:
        return deep_text()
    if isinstance(v, str):
        return json.dumps(v)   # a TOML basic string (a lone surrogate makes it invalid TOML)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}"
                               for k, x in v.items()) + "}"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def to_toml(doc: Any) -> str:
    """TOML text of a job-like document: tables as ``[section]``, anything else inline."""
    if not isinstance(doc, dict):
        return f"value = {_toml_value(doc)}\n"
    lines = [f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in doc.items()
             if not isinstance(v, dict)]
    for name, table in doc.items():
        if isinstance(table, dict):
            lines.append(f"[{json.dumps(str(name))}]")
            lines += [f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


@st.composite
def text_damage(draw, text: str) -> str:
    """``text`` damaged as files get damaged: truncated, a line duplicated or dropped, a field
    replaced by a bad number or garbage."""
    lines = text.splitlines(keepends=True)
    op = draw(st.sampled_from(["truncate", "drop", "dup", "field", "garbage", "value"]))
    assigned = [i for i, line in enumerate(lines) if "=" in line]
    if op == "value" and assigned:     # a TOML-like `key = value`: the value made bad
        i = draw(st.sampled_from(assigned))
        key = lines[i].split("=", 1)[0]
        lines[i] = f"{key}= {draw(_BAD_LITERALS)}\n"
        return "".join(lines)
    if op == "truncate" or not lines:
        return text[:draw(st.integers(0, len(text)))]
    i = draw(st.integers(0, len(lines) - 1))
    if op == "drop":
        del lines[i]
    elif op == "dup":
        lines.insert(i, lines[i])
    elif op == "garbage":
        lines.insert(i, draw(st.sampled_from(["\0\0\0\n", "garbage\n", ",,,,\n", "\n",
                                              "é,🙂\n", "1" * 5000 + "\n"])))
    else:
        cells = lines[i].rstrip("\n").split(",")
        j = draw(st.integers(0, len(cells) - 1))
        cells[j] = draw(st.sampled_from(["", "nan", "inf", "-inf", "-1", "0", "1e308", "x",
                                         "99999999999999999999999", "-0", "1e-320"]))
        lines[i] = ",".join(cells) + "\n"
    return "".join(lines)


class Hang(Exception):
    """A case ran past :data:`HANG_SECONDS`."""


@contextmanager
def time_limit(seconds: float = HANG_SECONDS):
    """Interrupt the block with :class:`Hang` after ``seconds`` (SIGALRM: main thread only),
    so an input that makes a reader loop for minutes fails its case instead of hanging CI."""
    def alarm(signum, frame):
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def outcome(action: Callable[[], Any]) -> str:
    """Run ``action`` (within :func:`time_limit`) and name how it ended: ``"ok"``, or the class of
    the :class:`~hpcpar.errors.HpcparError` it raised after checking that its message is one
    non-empty line. Any other exception propagates (that is the failure the fuzzer looks for)."""
    try:
        with time_limit():
            action()
    except HpcparError as exc:
        msg = str(exc)
        assert msg and "\n" not in msg and "\r" not in msg, \
            f"{type(exc).__name__} message is not one line: {msg!r}"
        return type(exc).__name__
    return "ok"


@contextmanager
def memory_cap(extra_bytes: int):
    """Cap this process's address space at its current size plus ``extra_bytes`` (the soft
    limit only, restored on exit): an input that makes a reader allocate without bound fails
    with MemoryError instead of exhausting the machine."""
    with open("/proc/self/statm") as fh:
        size = int(fh.read().split()[0]) * resource.getpagesize()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = size + extra_bytes
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield cap
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
