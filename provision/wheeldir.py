"""A folder of wheels standing in for a package index (hosts without one): what it holds, and whether
each wheel is the one the lock names (its sha256 among the lock's hashes) or a local build of that version
(a trimmed or rebuilt wheel: installed, and recorded as not the index's bytes)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from provision.interp import norm


@dataclass(frozen=True)
class Wheel:
    name: str  # normalised
    version: str
    path: Path
    sha256: str


@dataclass(frozen=True)
class WheelDir:
    path: Path
    wheels: tuple[Wheel, ...]

    def of(self, name: str, version: str) -> list[Wheel]:
        """The wheels of one exact version (several when built for several platforms)."""
        return [w for w in self.wheels if w.name == norm(name) and _same(w.version, version)]

    def has(self, name: str, version: str) -> bool:
        return bool(self.of(name, version))

    def locked_bytes(self, name: str, version: str, hashes: frozenset[str]) -> bool | None:
        """True when a wheel of this version here is byte for byte one the lock lists, False when none is,
        None when the lock has no hashes for it."""
        if not hashes:
            return None
        return any(w.sha256 in hashes for w in self.of(name, version))


def _same(a: str, b: str) -> bool:
    """Versions as installers compare them (1.0 is 1.0.0)."""
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def scan(folder: Path) -> WheelDir:
    """Every readable wheel file name in ``folder`` (not its subfolders); others are ignored."""
    out = []
    for p in sorted(folder.glob("*.whl")):
        try:
            name, version, _build, _tags = parse_wheel_filename(p.name)
        except InvalidWheelFilename:
            continue
        out.append(Wheel(norm(str(name)), str(version), p, _sha256(p)))
    return WheelDir(folder, tuple(out))
