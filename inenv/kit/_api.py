"""Which generation of a library's API is installed, and the verdict when the adapter knows none of them.

A probe's adapter lists, per API generation it can drive, the names that generation must have
(``"module:attribute"`` or ``"module"``). The first generation whose names all resolve is the one to use.
When none does, the feature was never reached: the verdict is ``skip`` with ``probe-api-unknown``, naming
the package version and every name looked for, never ``fail`` (a ``fail`` says the feature itself was
reached and did not work).

Only a module that is not there, or an attribute it does not define, counts as absent. A module that is
there and breaks while importing (a missing dependency, a library that does not load) is a real failure of
the installed package: that error propagates to the probe, which reports it.

In-environment side: standard library only.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inenv.probe import outcome

REASON = "probe-api-unknown"


@dataclass(frozen=True)
class Generation:
    """One API generation: a short name and the names it must provide."""

    name: str  # e.g. "trtllm-moe-a2a (flashinfer <= 0.6)"
    needs: tuple[str, ...]  # "module:attribute" or "module"


@dataclass(frozen=True)
class ApiUnknown:
    """No known generation is installed: the package, its version and what was looked for."""

    package: str
    version: str | None
    looked_for: tuple[str, ...]

    @property
    def note(self) -> str:
        version = self.version or "(version unknown)"
        return (
            f"{self.package} {version} has none of the APIs this probe knows; looked for: {', '.join(self.looked_for)}"
        )

    def outcome(self) -> dict[str, Any]:
        return outcome(
            "skip",
            note=self.note,
            reason_code=REASON,
            evidence={"package": self.package, "version": self.version, "looked_for": list(self.looked_for)},
        )


def package_version(*distributions: str) -> str | None:
    """The installed version of the first of ``distributions`` that is installed."""
    for dist in distributions:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def _absent(exc: ModuleNotFoundError, module: str) -> bool:
    """Whether ``exc`` says ``module`` itself (or a package above it) does not exist."""
    missing = exc.name or ""
    return bool(missing) and (module == missing or module.startswith(missing + "."))


def resolve(name: str) -> Any | None:
    """The object ``"module:attribute"`` (or the module) names; None when the module or attribute is absent.

    Any other import error propagates: the module exists and is broken."""
    module, _, attr = name.partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if _absent(exc, module):
            return None
        raise
    if not attr:
        return mod
    obj: Any = mod
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def detect(generations: Sequence[Generation], package: str, distributions: Sequence[str]) -> Generation | ApiUnknown:
    """The first generation whose names all resolve, else what was looked for in which version."""
    for gen in generations:
        if all(resolve(n) is not None for n in gen.needs):
            return gen
    looked: list[str] = []
    for gen in generations:
        looked.extend(n for n in gen.needs if n not in looked)
    return ApiUnknown(package, package_version(*distributions), tuple(looked))
