"""What the installed distributions' own metadata says about each other, read in the environment.

- every distribution's declared requirements (``Requires-Dist``) and version, and this interpreter's marker
  variables, recorded as they are: the host judges them as ``pip check`` does, with ``packaging`` (the
  library pip uses), so no evaluator of versions and markers lives here;
- no file may belong to two distributions (their ``RECORD`` files): the second install overwrote the first's
  copy, and uninstalling either deletes a file the other needs;
- no extension module may carry another interpreter's tag (``*.cpython-310-*.so`` under 3.12): the import
  system never loads it, so the module it should provide is missing.

In-environment side: standard library only (``importlib.metadata``).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


# --- markers ---------------------------------------------------------------------------------------------
def environment() -> dict[str, str]:
    """The marker variables of this interpreter (PEP 508), with no extra requested."""
    impl = sys.implementation
    iver = ".".join(map(str, impl.version[:3]))
    if impl.version.releaselevel != "final":
        iver += impl.version.releaselevel[0] + str(impl.version.serial)
    return {
        "implementation_name": impl.name, "implementation_version": iver, "os_name": os.name,
        "platform_machine": platform.machine(), "platform_release": platform.release(),
        "platform_system": platform.system(), "platform_version": platform.version(),
        "python_full_version": platform.python_version(), "platform_python_implementation":
        platform.python_implementation(), "python_version": ".".join(platform.python_version_tuple()[:2]),
        "sys_platform": sys.platform, "extra": "",
    }


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()



# --- the environment's distributions --------------------------------------------------------------------
def installed_dists(dists: Iterable[md.Distribution] | None = None) -> dict[str, md.Distribution]:
    """One distribution per normalised name: the first on ``sys.path``, the one an import finds."""
    out: dict[str, md.Distribution] = {}
    for d in md.distributions() if dists is None else dists:
        name = d.metadata["Name"] if d.metadata else None
        if name and normal(name) not in out:
            out[normal(name)] = d
    return out


def requirements(dists: Mapping[str, md.Distribution]) -> dict[str, dict[str, Any]]:
    """Every distribution's version and declared requirements, by its name as its metadata spells it."""
    return {d.metadata["Name"]: {"version": d.version, "requires": list(d.requires or [])}
            for _, d in sorted(dists.items())}


@dataclass(frozen=True)
class Collision:
    owners: tuple[tuple[str, str], ...]  # (distribution, version), sorted
    files: tuple[str, ...]  # paths relative to the site directory, sorted

    def folders(self) -> list[str]:
        """The folders holding the shared files; a file at the top of the site directory is named itself."""
        return sorted({os.path.dirname(f) + "/" if os.path.dirname(f) else f for f in self.files})

    def describe(self) -> str:
        who = " and ".join(f"{n} {v}" for n, v in self.owners)
        where = ", ".join(self.folders()[:3]) + (" ..." if len(self.folders()) > 3 else "")
        return (f"{who} both own {len(self.files)} file(s) ({where}): the later install overwrote the other's "
                "copies, and uninstalling either deletes files the other needs")

    def as_dict(self) -> dict[str, Any]:
        return {"owners": [f"{n}=={v}" for n, v in self.owners], "files": len(self.files),
                "folders": self.folders(), "examples": list(self.files[:5])}


def _record_paths(d: md.Distribution) -> list[tuple[str, str | None]]:
    """(path relative to its site directory, recorded hash) of every file a distribution installed (its
    RECORD), without its own metadata folder and byte-code."""
    out = []
    for f in d.files or []:
        path = os.path.normpath(str(f))
        parts = path.split(os.sep)
        if parts[0].endswith(".dist-info") or "__pycache__" in parts or path.endswith(".pyc"):
            continue
        out.append((path, f.hash.value if f.hash else None))
    return out


def collisions(dists: Mapping[str, md.Distribution]) -> list[Collision]:
    """Groups of files that more than one distribution's RECORD lists with different contents. The same bytes
    under several owners (the empty ``nvidia/__init__.py`` every CUDA 12 library wheel ships) are a shared
    namespace file, not a conflict."""
    owners: dict[str, dict[tuple[str, str], str | None]] = {}
    shown: dict[str, str] = {}
    for d in dists.values():
        me = (d.metadata["Name"], d.version)
        site = str(d.locate_file(""))
        for path, digest in _record_paths(d):
            full = os.path.normpath(os.path.join(site, path))
            owners.setdefault(full, {})[me] = digest
            shown.setdefault(full, path)
    groups: dict[tuple[tuple[str, str], ...], list[str]] = {}
    for full, who in owners.items():
        if len(who) > 1 and len(set(who.values())) > 1:
            groups.setdefault(tuple(sorted(who)), []).append(shown[full])
    return [Collision(who, tuple(sorted(paths))) for who, paths in sorted(groups.items())]


_EXT = re.compile(r"\.(cpython|pypy)-(\d+)[a-z]*(?:-[\w]+)*\.(?:so|pyd)$")


def foreign_extensions(dists: Mapping[str, md.Distribution], tag: str | None = None) -> dict[str, list[str]]:
    """Extension modules built for another interpreter, per distribution: ``cpython-310`` files under 3.12.
    ``tag``: this interpreter's (``cpython-312``); stable-ABI (``abi3``) and untagged files always load."""
    tag = tag or sys.implementation.cache_tag
    out: dict[str, list[str]] = {}
    for d in dists.values():
        for f in d.files or []:
            m = _EXT.search(str(f))
            if m and f"{m[1]}-{m[2]}" != tag:
                out.setdefault(f"{d.metadata['Name']}=={d.version}", []).append(str(f))
    return out


def snapshot() -> dict[str, Any]:
    """Every finding of this environment and what the host needs to judge its requirements, JSON-able, for
    the inventory's evidence."""
    dists = installed_dists()
    return {"python": f"{sys.implementation.name} {platform.python_version()}", "distributions": len(dists),
            "requirements": requirements(dists), "markers": environment(),
            "collisions": [c.as_dict() for c in collisions(dists)], "foreign_extensions": foreign_extensions(dists)}
