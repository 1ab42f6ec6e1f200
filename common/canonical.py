"""One spelling of the project's module names and file paths, for hashes of project text.

Probe hashes use the layout-free spelling (:func:`layout_free_source`): every project module name and path is
reduced to the module's own name, so where a module's folder is never reaches the hash. Image tags and lock
keys use the canonical spelling below.

A hash of project text (a probe's source, the image self-check, a cell's requirements.in) should change
when what the text says changes, not when a module it names sits in another package. Before such text is
hashed, :func:`spell` writes every project module name and path in a canonical form that does not depend
on the package a module sits in: the in-environment modules under ``checks`` (the probes and their helpers
under ``checks.probes``), the run, results and report modules directly under ``checks``, the shared
modules under ``provision`` (``memlock``, ``progress`` and ``reasons`` under ``checks``). Module file names
are the same in every spelling, so the file names the hashes include stay as they are.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from typing import Any

# The packages the canonical spelling puts the probes' helpers and the in-environment fact modules in.
HELPER_PACKAGE = "checks.probes"
SUPPORT_PACKAGE = "checks"
# Shared modules that the canonical spelling places under checks rather than provision.
CHECKS_SHARED = frozenset({"memlock", "progress", "reasons"})
# In-environment modules that the canonical spelling places under provision rather than checks.
PROVISION_IN_ENV = frozenset({"selfcheck"})

_SEP = r"(?P<sep>[./])"
_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    # probes and their helpers: inenv.probes.x, inenv.kit._x, inenv/kit/_x.py
    (re.compile(r"(?<![\w.])inenv" + _SEP + r"(?:probes|kit)\b"), r"checks\g<sep>probes"),
    (re.compile(r"(?<![\w.])inenv" + _SEP + r"(?P<mod>" + "|".join(sorted(PROVISION_IN_ENV)) + r")\b"),
     r"provision\g<sep>\g<mod>"),
    (re.compile(r"(?<![\w.])inenv\b"), "checks"),
    (re.compile(r"(?<![\w.])common" + _SEP + r"(?P<mod>" + "|".join(sorted(CHECKS_SHARED)) + r")\b"),
     r"checks\g<sep>\g<mod>"),
    (re.compile(r"(?<![\w.])common(?=[./]\w)"), "provision"),
    (re.compile(r"(?<![\w.])checks" + _SEP + r"(?:run|results|report)(?P=sep)(?=\w)"), r"checks\g<sep>"),
)


# Layout-free spelling, for probe hashes: no package path survives, so a module that moves to another folder
# leaves every probe hash as it was, with no rule to add for the move.
_PROJECT = r"(?:inenv|common|provision|checks)"
_LAYOUT_FREE: tuple[tuple[re.Pattern[str], str], ...] = (
    # `from inenv.kit import _timing`, `from checks.run.plan import X`: the package named is where it lives
    (re.compile(r"(?<![\w.])from\s+" + _PROJECT + r"(?:\.\w+)*\s+import\b"), "from . import"),
    # `inenv.kit._fi_carry` in code or text: the module's own name
    (re.compile(r"(?<![\w./])" + _PROJECT + r"(?:\.\w+)*\.(\w+)"), r"\1"),
    # `inenv/kit/_x.py`: the file's own name
    (re.compile(r"(?<![\w./])" + _PROJECT + r"(?:/\w+)*/(\w+(?:\.py)?)"), r"\1"),
)


def layout_free(text: str) -> str:
    """``text`` with every project module name and path reduced to the module's own name (no package)."""
    for pattern, repl in _LAYOUT_FREE:
        text = pattern.sub(repl, text)
    return text


def spell(text: str) -> str:
    """``text`` with the project's module names and paths in their canonical spelling."""
    for pattern, repl in _RULES:
        text = pattern.sub(repl, text)
    return text


def _import_key(node: ast.Import | ast.ImportFrom) -> tuple[int, int, str]:
    if isinstance(node, ast.Import):
        return (0, 0, node.names[0].name.lower())
    return (1 if node.level else 0, 1, (node.module or "").lower())


def _runs(body: list[ast.stmt]) -> list[list[ast.Import | ast.ImportFrom]]:
    """Blocks of import statements on consecutive lines (no blank line or comment between them)."""
    runs: list[list[ast.Import | ast.ImportFrom]] = []
    current: list[ast.Import | ast.ImportFrom] = []
    for stmt in body:
        if isinstance(stmt, ast.Import | ast.ImportFrom) and (
                not current or stmt.lineno == (current[-1].end_lineno or current[-1].lineno) + 1):
            current.append(stmt)
            continue
        if len(current) > 1:
            runs.append(current)
        current = [stmt] if isinstance(stmt, ast.Import | ast.ImportFrom) else []
    if len(current) > 1:
        runs.append(current)
    return runs


def spell_source(text: str) -> str:
    """Python source in the canonical spelling, each block of imports in the order an import sorter gives it
    in that spelling (the order a sorter picks follows the names, so a renamed package moves its lines)."""
    return _sorted_imports(spell(text))


def layout_free_source(text: str) -> str:
    """Python source in the layout-free spelling (:func:`layout_free`), each block of imports sorted in it by
    module and then by the names imported (``from . import _a`` and ``from . import outcome`` tie on module)."""
    return _sorted_imports(layout_free(text), _names_key)


def _names_key(node: ast.Import | ast.ImportFrom) -> tuple[int, int, str, tuple[str, ...]]:
    return (*_import_key(node), tuple(a.name.lower() for a in node.names))


def _sorted_imports(text: str, key: Callable[[ast.Import | ast.ImportFrom], Any] | None = None) -> str:
    key = key or _import_key
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, list[str]]] = []
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if not isinstance(body, list):
                continue
            for run in _runs(body):
                ordered = sorted(run, key=key)
                if ordered == run:
                    continue
                start, end = run[0].lineno - 1, run[-1].end_lineno or run[-1].lineno
                new = [ln for stmt in ordered for ln in lines[stmt.lineno - 1:stmt.end_lineno or stmt.lineno]]
                edits.append((start, end, new))
    for start, end, new in sorted(edits, reverse=True):
        lines[start:end] = new
    return "".join(lines)
