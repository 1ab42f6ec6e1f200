"""The reason catalogue (common/reasons.yaml): load it, validate it, match failure text against it, and choose the
next step a failure gets: a reason's remedies per NCCL release range, each offered only where a result on that
release shows its exact setting passing (:func:`offered`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from common import yamlsrc

CATALOGUE = Path(__file__).with_name("reasons.yaml")
GENERIC = "unknown-error"
_CODE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_ERROR_LINE = re.compile(r"(error|Error|ERROR|exception|Exception|failed|Failed|FAILED|abort|what\(\):|WARN)")
_SETTING_VAR = re.compile(r"^NCCL_[A-Z0-9_]+$")
KEYS = ("code", "patterns", "message", "remediation", "remedies", "harness", "host_bound")
REMEDY_KEYS = ("nccl", "setting", "remediation")

Setting = tuple[tuple[str, str], ...]  # NCCL variables and their values, sorted by name


class CatalogueError(ValueError):
    pass


@dataclass(frozen=True)
class Remedy:
    """A next step that holds for a range of NCCL releases: the exact setting it advises (``setting``) and its
    text. It is offered for a failure on a release in ``releases`` only where a result on that release shows the
    setting passing (:func:`offered`)."""

    releases: SpecifierSet  # PEP 440 specifiers over NCCL's release, e.g. ">=2.24,<2.31"
    setting: Setting
    remediation: str

    def covers(self, release: str) -> bool:
        try:
            return Version(release) in self.releases
        except InvalidVersion:
            return False


@dataclass(frozen=True)
class Reason:
    code: str
    patterns: tuple[re.Pattern[str], ...]
    message: str
    remediation: str  # the next step; for a reason with remedies, what holds when none is shown passing
    harness: bool = False  # stackprobe's own failure, not the feature's: never reused
    remedies: tuple[Remedy, ...] = ()  # tried in order (:func:`offered`)
    host_bound: bool = False  # a partial saying how far this host could check, not a shortfall of the stack


@dataclass(frozen=True)
class Catalogue:
    reasons: tuple[Reason, ...]

    def get(self, code: str) -> Reason | None:
        return next((r for r in self.reasons if r.code == code), None)

    @property
    def harness_codes(self) -> frozenset[str]:
        """The codes of the harness's own failures (``harness: true``)."""
        return frozenset(r.code for r in self.reasons if r.harness)

    @property
    def host_bound_codes(self) -> frozenset[str]:
        """The codes of partials that say how far the host could check (``host_bound: true``)."""
        return frozenset(r.code for r in self.reasons if r.host_bound)

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
        unknown = set(entry) - set(KEYS)
        if unknown:
            raise CatalogueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {', '.join(KEYS)}")
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
        host_bound = entry.get("host_bound", False)
        if not isinstance(host_bound, bool):
            raise CatalogueError(f"{where}.host_bound: must be true or false, got {host_bound!r}")
        remedies = _remedies(entry.get("remedies", []), f"{where}.remedies")
        out.append(Reason(code, tuple(compiled), entry["message"].strip(), entry["remediation"].strip(), harness,
                          remedies, host_bound))
    if not any(r.code == GENERIC for r in out):
        raise CatalogueError(f"{source}: the generic code {GENERIC!r} must exist")
    return Catalogue(tuple(out))


def _remedies(raw: Any, where: str) -> tuple[Remedy, ...]:
    """A reason's ``remedies``: a list of mappings with ``nccl`` (PEP 440 specifiers over NCCL's release),
    ``setting`` (NCCL variables and their values, the exact setting the text advises) and ``remediation``."""
    if not isinstance(raw, list):
        raise CatalogueError(f"{where}: must be a list of mappings with {', '.join(REMEDY_KEYS)}")
    out = []
    for i, item in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(item, dict) or set(item) != set(REMEDY_KEYS):
            got = sorted(item) if isinstance(item, dict) else type(item).__name__
            raise CatalogueError(f"{at}: must be a mapping of exactly {', '.join(REMEDY_KEYS)}, got {got}")
        text = item["nccl"]
        try:
            releases = SpecifierSet(text) if isinstance(text, str) and text.strip() else None
        except InvalidSpecifier:
            releases = None
        if releases is None:
            raise CatalogueError(f"{at}.nccl: NCCL releases as PEP 440 specifiers like '>=2.24,<2.31', got {text!r}")
        setting = item["setting"]
        if not isinstance(setting, dict) or not setting or not all(
                isinstance(k, str) and _SETTING_VAR.match(k) and isinstance(v, str) and v.strip()
                for k, v in setting.items()):
            raise CatalogueError(f"{at}.setting: a mapping of NCCL variables to values, e.g. {{NCCL_ALGO: Ring}}, "
                                 f"got {setting!r}")
        if not isinstance(item["remediation"], str) or not item["remediation"].strip():
            raise CatalogueError(f"{at}.remediation: must be a non-empty string")
        out.append(Remedy(releases, tuple(sorted(setting.items())), item["remediation"].strip()))
    return tuple(out)


def offered(reason: Reason, release: str | None, passed: Callable[[str, Setting], bool]) -> str:
    """The next step a failure with ``reason`` gets on NCCL ``release``: the first remedy whose releases include it
    and whose exact setting ``passed(release, setting)`` says a result on that release shows passing (and none
    failing); else the reason's release-independent remediation. Without a known release no remedy is offered."""
    for remedy in reason.remedies:
        if release and remedy.covers(release) and passed(release, remedy.setting):
            return remedy.remediation
    return reason.remediation


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
