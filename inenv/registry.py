"""Finding probe modules. Standard library only: used by the in-environment worker and by the host.

Probes are the modules of the ``inenv.probes`` package whose names do not start with ``_``, plus
the ``*.py`` files of every directory named in ``STACKPROBE_PROBE_PATH`` (``os.pathsep``-separated).
The extra path keeps test probes out of the shipped suite.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import pkgutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import inenv.probes
from inenv.probe import Declared, ProbeSpec, declared

PROBE_PATH_ENV = "STACKPROBE_PROBE_PATH"
_EXTRA_PREFIX = "stackprobe_extra_probes."


class ProbeNotFound(LookupError):
    pass


@dataclass(frozen=True)
class ProbeLocation:
    """Where a probe's code lives: a module name in ``inenv.probes`` or a file on the extra path."""

    probe_id: str
    module: str  # importable name, or "" for a file on the extra path
    file: str = ""

    def to_arg(self) -> str:
        return f"file:{self.file}" if self.file else f"module:{self.module}"

    @classmethod
    def from_arg(cls, probe_id: str, arg: str) -> ProbeLocation:
        kind, _, value = arg.partition(":")
        return cls(probe_id, module=value) if kind == "module" else cls(probe_id, module="", file=value)


def extra_dirs(env: dict[str, str] | None = None) -> list[Path]:
    raw = (os.environ if env is None else env).get(PROBE_PATH_ENV, "")
    return [Path(p) for p in raw.split(os.pathsep) if p]


def _load_file(path: Path) -> ModuleType:
    name = _EXTRA_PREFIX + path.stem
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ProbeNotFound(f"cannot load probe file {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load(location: ProbeLocation) -> ModuleType:
    if location.file:
        return _load_file(Path(location.file))
    return importlib.import_module(location.module)


def _candidates(env: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(module name, file) pairs, shipped probes first, in a stable order."""
    out: list[tuple[str, str]] = []
    for info in sorted(pkgutil.iter_modules(inenv.probes.__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            out.append((f"inenv.probes.{info.name}", ""))
    for d in extra_dirs(env):
        for f in sorted(d.glob("*.py")) if d.is_dir() else []:
            if not f.name.startswith("_"):
                out.append(("", str(f.resolve())))
    return out


def discover(env: dict[str, str] | None = None, strict: bool = True,
             broken: dict[str, str] | None = None) -> dict[str, tuple[ProbeLocation, ModuleType]]:
    """Every probe by id. A module without a SPEC is not a probe; a duplicate id is an error. A module that
    fails to import is an error when `strict`, else it is left out and noted in `broken`."""
    found: dict[str, tuple[ProbeLocation, ModuleType]] = {}
    for module_name, file in _candidates(env):
        try:
            mod = load(ProbeLocation("", module_name, file))
        except Exception as exc:  # one line naming the module; the probe must be fixed before any run
            why = f"{module_name or file}: cannot import probe module ({type(exc).__name__}: {exc})"
            if strict:
                raise ProbeNotFound(why) from None
            if broken is not None:
                broken[module_name or file] = why
            continue
        spec = getattr(mod, "SPEC", None)
        if not isinstance(spec, ProbeSpec):
            continue
        if spec.id in found:
            other = found[spec.id][0]
            raise ProbeNotFound(
                f"probe id {spec.id!r} defined twice: {other.module or other.file} and {module_name or file}"
            )
        found[spec.id] = (ProbeLocation(spec.id, module_name, file), mod)
    return found


def find(probe_id: str, env: dict[str, str] | None = None) -> tuple[ProbeLocation, ModuleType]:
    """One probe. The module named like the id (dashes as underscores) is tried first, so a broken
    unrelated probe module cannot stop this one from running."""
    guess = probe_id.replace("-", "_")
    for module_name, file in _candidates(env):
        stem = module_name.rsplit(".", 1)[-1] if module_name else Path(file).stem
        if stem != guess:
            continue
        try:
            mod = load(ProbeLocation("", module_name, file))
        except Exception:
            break  # reported by the full search below
        spec = getattr(mod, "SPEC", None)
        if isinstance(spec, ProbeSpec) and spec.id == probe_id:
            return ProbeLocation(probe_id, module_name, file), mod
    broken: dict[str, str] = {}
    probes = discover(env, strict=False, broken=broken)
    if probe_id not in probes:
        import difflib

        close = difflib.get_close_matches(probe_id, list(probes), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(sorted(probes)) or 'none'}"
        if broken:
            hint += "; not importable here: " + "; ".join(sorted(broken.values()))
        raise ProbeNotFound(f"unknown probe {probe_id!r}{hint}")
    return probes[probe_id]


def declarations(env: dict[str, str] | None = None) -> dict[str, Declared]:
    """Probe id -> what the probe declares about its records (``inenv.probe.declared``), for every probe that
    imports here; the host reads metric and evidence keys through these."""
    return _declarations(os.pathsep.join(str(d) for d in extra_dirs(env)))


@functools.lru_cache(maxsize=8)
def _declarations(_extra: str) -> dict[str, Declared]:
    env = {**os.environ, PROBE_PATH_ENV: _extra}
    return {pid: declared(mod) for pid, (_, mod) in sorted(discover(env, strict=False).items())}
