"""Every reason code the in-environment side can emit, read from its sources (an AST scan, nothing imported).

A reason code reaches a result through a few doors, and each is a *sink* here:

- ``outcome(status, note, reason_code, ...)``: the third positional argument or ``reason_code=``;
- any call with a ``reason_code=`` keyword (a probe's own ``done(...)`` helper, a judgement's constructor);
- a dict literal with the key ``"reason_code"``, and ``x["reason_code"] = ...``;
- the constructor of a class with a ``code`` or ``reason_code`` field (``Skip``, a judgement dataclass),
  by position or keyword;
- ``record.get("key")``: every value the module stores under that key (``{"code": ...}``,
  ``facts["multicast_reason"] = ...``);
- ``return code, note`` of a function whose result is read as ``(reason_code, note)`` (the worker's
  ``skip_reason``): found as ``outcome(..., reason_code=x[0])``, or unpacked first (``note, code = f(...)``).

Each sink's expression is resolved to the string literals it can hold: constants, both sides of ``a if c else
b`` and ``a or b``, names assigned in the function or the module (``for code, pat in TABLE`` takes the
first element of every row of TABLE), names imported from another scanned module, a function's parameter
(through every call of that function), and the return values of a scanned function it calls. An expression
none of these explain is *unresolved*: a new kind of door the scan has to learn, reported by file and line.
Reading ``obj.reason_code`` or ``obj.code`` is not a source: the constructor that set it is a sink.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

CODE_FIELDS = ("reason_code", "code")


@dataclass
class Module:
    name: str  # dotted, e.g. inenv.probes.ar_latency
    path: Path
    tree: ast.Module
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)


@dataclass
class Scan:
    codes: dict[str, list[str]] = field(default_factory=dict)  # code -> where it is emitted (path:line)
    unresolved: list[str] = field(default_factory=list)  # path:line: expression the scan cannot follow


def _func_name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


class Scanner:
    def __init__(self, root: Path, paths: list[Path]) -> None:
        self.root = root
        self.modules: dict[str, Module] = {}
        for p in paths:
            name = ".".join(p.relative_to(root).with_suffix("").parts)
            tree = ast.parse(p.read_text(), str(p))
            m = Module(name, p, tree)
            for node in ast.walk(tree):
                for child in ast.iter_child_nodes(node):
                    m.parents[child] = node
            self.modules[name] = m
        # classes whose constructor sets a reason code: name -> (field position, field name)
        self.code_classes: dict[str, tuple[int, str]] = {}
        for m in self.modules.values():
            for node in ast.walk(m.tree):
                if isinstance(node, ast.ClassDef):
                    fields = [s.target.id for s in node.body
                              if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
                    for i, f in enumerate(fields):
                        if f in CODE_FIELDS:
                            self.code_classes[node.name] = (i, f)
        self._busy: set[tuple[int, int]] = set()

    # --- where things are ----------------------------------------------------------------------------
    def _scope(self, m: Module, node: ast.AST) -> ast.AST:
        """The innermost function holding ``node``, else the module."""
        cur = m.parents.get(node)
        while cur is not None and not isinstance(cur, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            cur = m.parents.get(cur)
        return cur if cur is not None else m.tree

    def _where(self, m: Module, node: ast.AST) -> str:
        return f"{m.path.relative_to(self.root)}:{getattr(node, 'lineno', 0)}"

    def _functions(self, name: str) -> Iterator[tuple[Module, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for m in self.modules.values():
            for node in ast.walk(m.tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                    yield m, node

    def _module_of(self, m: Module, local: str) -> tuple[Module | None, str | None]:
        """What ``local`` names in module ``m`` by an import: (module, attribute or None for the module)."""
        for node in m.tree.body:
            if isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    if (a.asname or a.name) == local:
                        sub = self.modules.get(f"{node.module}.{a.name}")
                        if sub is not None:
                            return sub, None
                        return self.modules.get(node.module), a.name
            if isinstance(node, ast.Import):
                for a in node.names:
                    if (a.asname or a.name) == local:
                        return self.modules.get(a.name), None
        return None, None

    # --- resolving an expression to the literals it can hold ------------------------------------------
    def resolve(self, m: Module, expr: ast.AST, at: ast.AST) -> tuple[set[str], list[str]]:
        key = (id(m), id(expr))
        if key in self._busy:
            return set(), []
        self._busy.add(key)
        try:
            return self._resolve(m, expr, at)
        finally:
            self._busy.discard(key)

    def _union(self, parts: list[tuple[set[str], list[str]]]) -> tuple[set[str], list[str]]:
        codes: set[str] = set()
        bad: list[str] = []
        for c, b in parts:
            codes |= c
            bad += b
        return codes, bad

    def _resolve(self, m: Module, expr: ast.AST, at: ast.AST) -> tuple[set[str], list[str]]:
        if isinstance(expr, ast.Constant):
            return ({expr.value} if isinstance(expr.value, str) and expr.value else set()), []
        if isinstance(expr, ast.IfExp):
            return self._union([self.resolve(m, expr.body, at), self.resolve(m, expr.orelse, at)])
        if isinstance(expr, ast.BoolOp):
            return self._union([self.resolve(m, v, at) for v in expr.values])
        if isinstance(expr, ast.Attribute):
            if expr.attr in CODE_FIELDS:
                return set(), []  # set by a constructor, itself a sink
            if isinstance(expr.value, ast.Name):
                target, attr = self._module_of(m, expr.value.id)
                if target is not None and attr is None:
                    return self._global(target, expr.attr, expr)
        if isinstance(expr, ast.Name):
            return self._name(m, expr.id, self._scope(m, at), expr)
        if isinstance(expr, ast.Call):
            return self._call(m, expr, at)
        if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant):
            index = expr.slice.value
            if isinstance(index, int):
                return self._element(m, expr.value, index, at)
        return set(), [f"{self._where(m, expr)}: {ast.unparse(expr)}"]

    def _element(self, m: Module, expr: ast.AST, index: int, at: ast.AST) -> tuple[set[str], list[str]]:
        """The literals element ``index`` of a tuple-valued expression can hold."""
        if isinstance(expr, ast.Tuple | ast.List):
            return self.resolve(m, expr.elts[index], at) if index < len(expr.elts) else (set(), [])
        if isinstance(expr, ast.Constant) and expr.value is None:
            return set(), []
        if isinstance(expr, ast.Name):
            scope = self._scope(m, at)
            values = list(self._assigned(scope, expr.id))
            return self._union([self._element(m, v, index, v) for v in values]) if values else (
                set(), [f"{self._where(m, expr)}: {ast.unparse(expr)}[{index}]"])
        if isinstance(expr, ast.Call):
            fns = self._callee(m, expr)
            if fns:
                return self._union([self._element(fm, r, index, r) for fm, fn in fns for r in self._returns(fn)])
        return set(), [f"{self._where(m, expr)}: {ast.unparse(expr)}[{index}]"]

    @staticmethod
    def _assigned(scope: ast.AST, name: str) -> Iterator[ast.AST]:
        body = scope.body if isinstance(scope, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef) else []
        for stmt in body:
            for node in ast.walk(stmt):
                if isinstance(node, ast.Assign):
                    for t in node.targets:
                        if isinstance(t, ast.Name) and t.id == name:
                            yield node.value
                        elif isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                            yield from (v for e, v in zip(t.elts, node.value.elts, strict=False)
                                        if isinstance(e, ast.Name) and e.id == name)
                elif isinstance(node, ast.AnnAssign | ast.NamedExpr) and isinstance(node.target, ast.Name) \
                        and node.target.id == name and node.value is not None:
                    yield node.value

    @staticmethod
    def _loop_rows(scope: ast.AST, name: str) -> Iterator[tuple[ast.AST, int]]:
        """``for a, name in ROWS``: (ROWS, position of ``name``)."""
        for node in ast.walk(scope):
            if isinstance(node, ast.For | ast.comprehension) and isinstance(node.target, ast.Tuple):
                for i, t in enumerate(node.target.elts):
                    if isinstance(t, ast.Name) and t.id == name:
                        yield node.iter, i

    @staticmethod
    def _unpacked(scope: ast.AST, name: str) -> Iterator[tuple[ast.Call, int]]:
        """``a, name = f(...)``: (the call, position of ``name``)."""
        body = scope.body if isinstance(scope, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef) else []
        for stmt in body:
            for node in ast.walk(stmt):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                    for t in node.targets:
                        if isinstance(t, ast.Tuple):
                            yield from ((node.value, i) for i, e in enumerate(t.elts)
                                        if isinstance(e, ast.Name) and e.id == name)

    def _name(self, m: Module, name: str, scope: ast.AST, expr: ast.AST) -> tuple[set[str], list[str]]:
        parts = [self.resolve(m, v, v) for v in self._assigned(scope, name)]
        parts += [self._element(m, call, i, call) for call, i in self._unpacked(scope, name)]
        for rows, i in self._loop_rows(scope, name):
            parts.append(self._rows(m, rows, i, expr))
        if parts:
            return self._union(parts)
        if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            params = [a.arg for a in (*scope.args.posonlyargs, *scope.args.args)]
            kwonly = [a.arg for a in scope.args.kwonlyargs]
            if name in params or name in kwonly:
                return self._parameter(m, scope, name, params)
            return self._name(m, name, self._scope(m, scope), expr)
        return self._global(m, name, expr)

    def _rows(self, m: Module, rows: ast.AST, i: int, at: ast.AST) -> tuple[set[str], list[str]]:
        if isinstance(rows, ast.Name):
            values = list(self._assigned(self._scope(m, at), rows.id)) or list(self._assigned(m.tree, rows.id))
            if values:
                return self._union([self._rows(m, v, i, v) for v in values])
        if isinstance(rows, ast.Tuple | ast.List):
            return self._union([self._element(m, row, i, row) for row in rows.elts])
        return set(), [f"{self._where(m, rows)}: rows of {ast.unparse(rows)}"]

    def _global(self, m: Module, name: str, expr: ast.AST) -> tuple[set[str], list[str]]:
        values = list(self._assigned(m.tree, name))
        if values:
            return self._union([self.resolve(m, v, v) for v in values])
        target, attr = self._module_of(m, name)
        if target is not None and attr is not None:
            return self._global(target, attr, expr)
        return set(), [f"{self._where(m, expr)}: {name}"]

    def _parameter(self, m: Module, fn: ast.AST, name: str, params: list[str]) -> tuple[set[str], list[str]]:
        """A parameter holds what every call of its function passes (its default too)."""
        parts: list[tuple[set[str], list[str]]] = []
        defaults = fn.args.defaults
        for p, d in zip(params[len(params) - len(defaults):], defaults, strict=True):
            if p == name:
                parts.append(self.resolve(m, d, d))
        for p, d in zip([a.arg for a in fn.args.kwonlyargs], fn.args.kw_defaults, strict=True):
            if p == name and d is not None:
                parts.append(self.resolve(m, d, d))
        fname = getattr(fn, "name", "")
        method = bool(params) and params[0] in ("self", "cls")
        owner = self._owner(m, fn) if method else ""
        for cm in self.modules.values():
            if owner and not self._knows(cm, owner):
                continue  # a method of that name on another class
            for call in ast.walk(cm.tree):
                if not isinstance(call, ast.Call) or not fname or _func_name(call) != fname:
                    continue
                pos = params.index(name) - method if name in params else -1
                for kw in call.keywords:
                    if kw.arg == name:
                        parts.append(self._value_or_function(cm, kw.value, call))
                if 0 <= pos < len(call.args):
                    parts.append(self._value_or_function(cm, call.args[pos], call))
        return self._union(parts)

    @staticmethod
    def _owner(m: Module, fn: ast.AST) -> str:
        parent = m.parents.get(fn)
        return parent.name if isinstance(parent, ast.ClassDef) else ""

    @staticmethod
    def _knows(m: Module, cls: str) -> bool:
        """Whether module ``m`` defines or imports the class ``cls`` (so it may call its methods)."""
        return any((isinstance(n, ast.ClassDef) and n.name == cls)
                   or (isinstance(n, ast.ImportFrom) and any((a.asname or a.name) == cls for a in n.names))
                   for n in m.tree.body)

    def _value_or_function(self, m: Module, expr: ast.AST, at: ast.AST) -> tuple[set[str], list[str]]:
        """An argument: a code, or a function that returns one (a classifier passed to be called)."""
        if isinstance(expr, ast.Name | ast.Attribute):
            fns = self._callee(m, ast.Call(func=expr, args=[], keywords=[]))
            if fns:
                return self._union([self.resolve(fm, r, r) for fm, fn in fns for r in self._returns(fn)])
        return self.resolve(m, expr, at)

    def _callee(self, m: Module, call: ast.Call) -> list[tuple[Module, ast.FunctionDef | ast.AsyncFunctionDef]]:
        f = call.func
        if isinstance(f, ast.Name):
            local = [(m, n) for n in ast.walk(m.tree)
                     if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == f.id]
            if local:
                return local
            target, attr = self._module_of(m, f.id)
            if target is not None and attr is not None:
                return [(target, n) for n in target.tree.body
                        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == attr]
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            target, attr = self._module_of(m, f.value.id)
            if target is not None and attr is None:
                return [(target, n) for n in target.tree.body
                        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == f.attr]
        return []

    @staticmethod
    def _returns(fn: ast.AST) -> list[ast.AST]:
        out: list[ast.AST] = []
        todo = list(ast.iter_child_nodes(fn))
        while todo:
            node = todo.pop()
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
                continue
            if isinstance(node, ast.Return) and node.value is not None:
                out.append(node.value)
            todo.extend(ast.iter_child_nodes(node))
        return out

    def _keyed(self, m: Module, key: str) -> tuple[set[str], list[str]]:
        """What ``record.get(key)`` can read: every ``{key: value}`` and ``x[key] = value`` of the module."""
        parts = []
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Dict):
                parts += [self.resolve(m, v, v) for k, v in zip(node.keys, node.values, strict=True)
                          if isinstance(k, ast.Constant) and k.value == key]
            elif isinstance(node, ast.Assign):
                parts += [self.resolve(m, node.value, node) for t in node.targets
                          if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant)
                          and t.slice.value == key]
        return self._union(parts) if parts else (set(), [f"{m.path.relative_to(self.root)}: nothing sets {key!r}"])

    def _call(self, m: Module, call: ast.Call, at: ast.AST) -> tuple[set[str], list[str]]:
        if (isinstance(call.func, ast.Attribute) and call.func.attr == "get" and call.args
                and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)):
            return self._keyed(m, call.args[0].value)
        fns = self._callee(m, call)
        if fns:
            return self._union([self.resolve(fm, r, r) for fm, fn in fns for r in self._returns(fn)])
        f = call.func
        if isinstance(f, ast.Name):  # a parameter holding a function: what every caller passes
            scope = self._scope(m, at)
            if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
                params = [a.arg for a in (*scope.args.posonlyargs, *scope.args.args)]
                if f.id in params or f.id in [a.arg for a in scope.args.kwonlyargs]:
                    codes, _ = self._parameter(m, scope, f.id, params)
                    return codes, []
        return set(), [f"{self._where(m, call)}: {ast.unparse(call)}"]

    # --- the sinks ----------------------------------------------------------------------------------
    def sinks(self) -> Iterator[tuple[Module, ast.AST, ast.AST]]:
        """(module, the expression holding a reason code, the node it sits in)."""
        for m in self.modules.values():
            for node in ast.walk(m.tree):
                if isinstance(node, ast.Call):
                    name = _func_name(node)
                    for kw in node.keywords:
                        if kw.arg == "reason_code":
                            yield m, kw.value, node
                    if name == "outcome" and len(node.args) > 2:
                        yield m, node.args[2], node
                    if name in self.code_classes:
                        pos, fname = self.code_classes[name]
                        if pos < len(node.args):
                            yield m, node.args[pos], node
                        for kw in node.keywords:
                            if kw.arg == fname and fname != "reason_code":
                                yield m, kw.value, node
                elif isinstance(node, ast.Dict):
                    for k, v in zip(node.keys, node.values, strict=True):
                        if isinstance(k, ast.Constant) and k.value == "reason_code":
                            yield m, v, node
                elif isinstance(node, ast.Assign):
                    for t in node.targets:
                        if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant) \
                                and t.slice.value == "reason_code":
                            yield m, node.value, node

    def scan(self) -> Scan:
        out = Scan()
        for m, expr, node in self.sinks():
            codes, bad = self.resolve(m, expr, node)
            for c in codes:
                out.codes.setdefault(c, []).append(self._where(m, node))
            out.unresolved += bad
        out.unresolved = sorted(set(out.unresolved))
        return out


def in_environment_sources(root: Path) -> list[Path]:
    """The in-environment side: the probe API, the worker, the rank launcher, the GPU gate, every probe."""
    inenv = root / "inenv"
    return [inenv / n for n in ("probe.py", "worker.py", "rank.py", "gpugate.py")] + sorted(
        [*(inenv / "probes").glob("*.py"), *(inenv / "kit").glob("*.py")])


def emitted_codes(root: Path) -> Scan:
    return Scanner(root, in_environment_sources(root)).scan()
