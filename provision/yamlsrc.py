"""YAML loading that remembers the line of every key path, so errors can point at it."""

from __future__ import annotations

from typing import Any

import yaml

from provision.errors import InputError

Path_ = tuple[str | int, ...]


def key_path(path: Path_) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out or "(top level)"


class Source:
    """Parsed YAML plus the line (1-based) where each key path starts."""

    def __init__(self, file: str, data: Any, lines: dict[Path_, int]):
        self.file, self.data, self.lines = file, data, lines

    def line(self, path: Path_) -> int | None:
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get((), None)

    def error(self, path: Path_, message: str) -> InputError:
        return InputError(message, file=self.file, key=key_path(path), line=self.line(path))


def _convert(node: yaml.Node, path: Path_, lines: dict[Path_, int], file: str, loader: yaml.SafeLoader) -> Any:
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
            out[key] = _convert(v, path + (key,), lines, file, loader)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(v, path + (i,), lines, file, loader) for i, v in enumerate(node.value)]
    return loader.construct_object(node, deep=True)


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
    loader = yaml.SafeLoader("")
    try:
        data = None if node is None else _convert(node, (), lines, file, loader)
    except yaml.constructor.ConstructorError as e:
        line = e.problem_mark.line + 1 if e.problem_mark else None
        raise InputError(f"cannot read value: {e.problem}", file=file, line=line) from None
    finally:
        loader.dispose()
    return Source(file, data, lines)
