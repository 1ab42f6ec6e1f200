"""One spelling of the project's module names and file paths, for every hash of project text: probe hashes,
image tags (the self-check's files) and lock keys (a cell's requirements.in).

A hash of project text should change when what the text says changes, not when a module it names sits in
another folder. :func:`layout_free` reduces every project module name and path to the module's own name
(``inenv.kit._elf`` and ``inenv/kit/_elf.py`` to ``_elf`` and ``_elf.py``, ``common/catalog.yaml`` to
``catalog.yaml``), so where a module's folder is never reaches a hash and a move needs no rule here.
"""

from __future__ import annotations

import ast
import re

# No package path survives: a module that moves to another folder leaves every hash as it was.
_PROJECT = r"(?:inenv|common|provision|checks)"
_LAYOUT_FREE: tuple[tuple[re.Pattern[str], str], ...] = (
    # `from inenv.kit import _timing`, `from checks.run.plan import X`: the package named is where it lives
    (re.compile(r"(?<![\w.])from\s+" + _PROJECT + r"(?:\.\w+)*\s+import\b"), "from . import"),
    # `inenv.kit._fi_build` in code or text: the module's own name
    (re.compile(r"(?<![\w./])" + _PROJECT + r"(?:\.\w+)*\.(\w+)"), r"\1"),
    # `inenv/kit/_x.py`: the file's own name
    (re.compile(r"(?<![\w./])" + _PROJECT + r"(?:/\w+)*/(\w+(?:\.py)?)"), r"\1"),
)


def layout_free(text: str) -> str:
    """``text`` with every project module name and path reduced to the module's own name (no package)."""
    for pattern, repl in _LAYOUT_FREE:
        text = pattern.sub(repl, text)
    return text


def _import_key(node: ast.Import | ast.ImportFrom) -> tuple[int, int, str, tuple[str, ...]]:
    """Where an import sorts: plain imports first, then absolute and relative ``from`` imports, by module and
    then by the names imported (``from . import _a`` and ``from . import outcome`` tie on module)."""
    names = tuple(a.name.lower() for a in node.names)
    if isinstance(node, ast.Import):
        return (0, 0, node.names[0].name.lower(), names)
    return (1 if node.level else 0, 1, (node.module or "").lower(), names)


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


def statements(tree: ast.AST) -> list[ast.AST]:
    """``tree`` and every statement under it at any depth, with the except handlers and match cases that hold
    statements: all that can hold an import, without walking a single expression."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(node, name, None)
            if isinstance(children, list):
                todo.extend(c for c in children if isinstance(c, ast.AST))
    return out


def layout_free_source(text: str) -> str:
    """Python source in the layout-free spelling (:func:`layout_free`), each block of imports sorted in it by
    module and then by the names imported (``from . import _a`` and ``from . import outcome`` tie on module)."""
    return _sorted_imports(layout_free(text))


def _sorted_imports(text: str) -> str:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, list[str]]] = []
    for node in statements(tree):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if not isinstance(body, list):
                continue
            for run in _runs(body):
                ordered = sorted(run, key=_import_key)
                if ordered == run:
                    continue
                start, end = run[0].lineno - 1, run[-1].end_lineno or run[-1].lineno
                new = [ln for stmt in ordered for ln in lines[stmt.lineno - 1:stmt.end_lineno or stmt.lineno]]
                edits.append((start, end, new))
    for start, end, new in sorted(edits, reverse=True):
        lines[start:end] = new
    return "".join(lines)
