"""Reading Python source without running it: the statements of a parsed module, where imports can be."""

from __future__ import annotations

import ast


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
