"""The reason catalogue (common/reasons.yaml): load it, validate it, match failure text against it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from common import yamlsrc

CATALOGUE = Path(__file__).with_name("reasons.yaml")
GENERIC = "unknown-error"
_CODE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_ERROR_LINE = re.compile(r"(error|Error|ERROR|exception|Exception|failed|Failed|FAILED|abort|what\(\):|WARN)")


class CatalogueError(ValueError):
    pass


@dataclass(frozen=True)
class Reason:
    code: str
    patterns: tuple[re.Pattern[str], ...]
    message: str
    remediation: str
    harness: bool = False  # stackprobe's own failure, not the feature's: never reused


@dataclass(frozen=True)
class Catalogue:
    reasons: tuple[Reason, ...]

    def get(self, code: str) -> Reason | None:
        return next((r for r in self.reasons if r.code == code), None)

    @property
    def harness_codes(self) -> frozenset[str]:
        """The codes of the harness's own failures (``harness: true``)."""
        return frozenset(r.code for r in self.reasons if r.harness)

    def match(self, texts: list[str]) -> Reason | None:
        """The first entry (catalogue order) with a pattern found in any of the texts."""
        for reason in self.reasons:
            for pattern in reason.patterns:
                if any(pattern.search(t) for t in texts if t):
                    return reason
        return None


def parse(data: Any, source: str) -> Catalogue:
    if not isinstance(data, list):
        raise CatalogueError(f"{source}: expected a list of reasons, got {type(data).__name__}")
    out: list[Reason] = []
    seen: set[str] = set()
    for i, entry in enumerate(data):
        where = f"{source}: entry {i}"
        if not isinstance(entry, dict):
            raise CatalogueError(f"{where}: expected a mapping with code, patterns, message, remediation")
        unknown = set(entry) - {"code", "patterns", "message", "remediation", "harness"}
        if unknown:
            raise CatalogueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: code, patterns, message, "
                                 "remediation, harness")
        code = entry.get("code")
        if not isinstance(code, str) or not _CODE.match(code):
            raise CatalogueError(f"{where}: code must be a lowercase slug like 'nccl-error', got {code!r}")
        where = f"{source}: {code}"
        if code in seen:
            raise CatalogueError(f"{where}: code defined twice")
        seen.add(code)
        for key in ("message", "remediation"):
            if not isinstance(entry.get(key), str) or not entry[key].strip():
                raise CatalogueError(f"{where}.{key}: must be a non-empty string")
        patterns = entry.get("patterns") or []
        if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
            raise CatalogueError(f"{where}.patterns: must be a list of regex strings")
        compiled = []
        for p in patterns:
            try:
                compiled.append(re.compile(p))
            except re.error as exc:
                raise CatalogueError(f"{where}.patterns: {p!r} is not a valid regex ({exc})") from None
        harness = entry.get("harness", False)
        if not isinstance(harness, bool):
            raise CatalogueError(f"{where}.harness: must be true or false, got {harness!r}")
        out.append(Reason(code, tuple(compiled), entry["message"].strip(), entry["remediation"].strip(), harness))
    if not any(r.code == GENERIC for r in out):
        raise CatalogueError(f"{source}: the generic code {GENERIC!r} must exist")
    return Catalogue(tuple(out))


def load(path: Path = CATALOGUE) -> Catalogue:
    try:
        data = yamlsrc.plain(path.read_text())
    except OSError as exc:
        raise CatalogueError(f"{path}: cannot read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise CatalogueError(f"{path}:{line} is not valid YAML") from None
    return parse(data, str(path))


@lru_cache(maxsize=1)
def default() -> Catalogue:
    return load()


def last_error_line(texts: list[str]) -> str:
    """The last line that looks like an error, else the last non-empty line, across the texts in order."""
    best = ""
    fallback = ""
    for text in texts:
        for line in (text or "").splitlines():
            line = line.strip()
            if not line:
                continue
            fallback = line
            if _ERROR_LINE.search(line):
                best = line
    return (best or fallback)[:300]
