"""YAML loading that remembers the line of every key path, so errors can point at it.

Bounded: a document expands to at most MAX_NODES values (aliases are expanded as they are read, so a small
alias bomb is refused at once instead of growing without end) and nests at most MAX_DEPTH levels. A float
keeps the text it was written as (``raw``), so a version written ``2.10`` can be told apart from ``2.1``.
"""

from __future__ import annotations

from typing import Any

import yaml

from common.errors import InputError

Path_ = tuple[str | int, ...]
MAX_NODES = 100_000  # values in one document once aliases are expanded (a matrix has a few hundred)
MAX_DEPTH = 64


# libyaml's parser where PyYAML was built with it: the same safe subset, several times faster on the catalogues
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def plain(text: str) -> Any:
    """``yaml.safe_load`` of ``text`` (its errors too), by the fastest safe loader this interpreter has."""
    return yaml.load(text, Loader=_SAFE_LOADER)  # noqa: S506 - a safe loader, the C one where present


def key_path(path: Path_) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out or "(top level)"


class Source:
    """Parsed YAML plus the line (1-based) where each key path starts."""

    def __init__(self, file: str, data: Any, lines: dict[Path_, int], raw: dict[Path_, str] | None = None):
        self.file, self.data, self.lines = file, data, lines
        self.raw = raw or {}  # key path -> the text a float was written as

    def line(self, path: Path_) -> int | None:
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get((), None)

    def error(self, path: Path_, message: str) -> InputError:
        return InputError(message, file=self.file, key=key_path(path), line=self.line(path))


class _Budget:
    def __init__(self, file: str) -> None:
        self.file, self.left = file, MAX_NODES

    def spend(self, node: yaml.Node, depth: int) -> None:
        self.left -= 1
        if self.left < 0:
            raise InputError(f"more than {MAX_NODES} values once aliases (*name) are expanded; a matrix needs far "
                             "fewer: write the values out instead of nesting aliases", file=self.file,
                             line=node.start_mark.line + 1)
        if depth > MAX_DEPTH:
            raise InputError(f"nested deeper than {MAX_DEPTH} levels", file=self.file, line=node.start_mark.line + 1)


def _convert(node: yaml.Node, path: Path_, lines: dict[Path_, int], file: str, loader: yaml.SafeLoader,
             budget: _Budget, raw: dict[Path_, str]) -> Any:
    budget.spend(node, len(path))
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode):
                raise InputError("mapping keys must be plain words", file=file, line=k.start_mark.line + 1)
            key = k.value
            if key in out:
                raise InputError(f"duplicate key '{key}'", file=file, key=key_path(path + (key,)),
                                 line=k.start_mark.line + 1)
            lines[path + (key,)] = k.start_mark.line + 1
            out[key] = _convert(v, path + (key,), lines, file, loader, budget, raw)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(v, path + (i,), lines, file, loader, budget, raw) for i, v in enumerate(node.value)]
    value = loader.construct_object(node, deep=True)
    if isinstance(value, float):
        raw[path] = node.value
    return value


def load(text: str, file: str) -> Source:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        raise InputError(f"not valid YAML: {e.problem or e.context}", file=file, line=line) from None
    except yaml.YAMLError as e:
        raise InputError(f"not valid YAML: {str(e).splitlines()[0]}", file=file) from None
    lines: dict[Path_, int] = {}
    raw: dict[Path_, str] = {}
    loader = yaml.SafeLoader("")
    try:
        data = None if node is None else _convert(node, (), lines, file, loader, _Budget(file), raw)
    except yaml.constructor.ConstructorError as e:
        line = e.problem_mark.line + 1 if e.problem_mark else None
        raise InputError(f"cannot read value: {e.problem}", file=file, line=line) from None
    finally:
        loader.dispose()
    return Source(file, data, lines, raw)
