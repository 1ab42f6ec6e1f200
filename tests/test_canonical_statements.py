"""common.canonical.statements: every place an import can stand, and no expression."""

from __future__ import annotations

import ast

from common import canonical

SOURCE = '''
import a
def f():
    import b
    if x:
        import c
    else:
        import d
try:
    import e
except ImportError:
    import f1
else:
    import g
finally:
    import h
match y:
    case 1:
        import i
class K:
    def m(self):
        with z:
            import j
for q in r:
    pass
else:
    import k
value = (lambda: 1)() + [n for n in range(3)][0]
'''


def test_statements_reach_every_import_and_no_expression() -> None:
    nodes = canonical.statements(ast.parse(SOURCE))
    imported = sorted(a.name for n in nodes if isinstance(n, ast.Import) for a in n.names)
    assert imported == ["a", "b", "c", "d", "e", "f1", "g", "h", "i", "j", "k"]
    assert not [n for n in nodes if isinstance(n, ast.expr)]
    assert sum(isinstance(n, ast.Assign) for n in nodes) == 1
