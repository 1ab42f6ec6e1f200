"""Which code made a result: the stackprobe version, the git commit and whether the code trees (``checks/``,
``inenv/``, ``common/``) differed from it, and a hash of the probe's own source (host side).

The probe hash covers the probe module, the private helper modules of ``inenv/kit/`` (``_*.py``) and
the in-environment fact modules of ``inenv/`` (toolkit lookup, target parsing, distribution table...) it
imports, found by reading its imports with ``ast``, transitively. The probe API itself (``inenv.probe``,
``inenv.status``) is left out: it is the contract every probe shares, not a probe's judgement.
It is computed on the host from the ``inenv/`` tree that is mounted into the containers, so it names the
code the ranks ran. Two checkouts with the same probe source give the same hash wherever they live (file
names, not paths, are hashed), and in whichever package a module sits: the text is hashed with every project
module name and path reduced to the module's own name (common.canonical.layout_free), so moving a folder
changes no hash and needs no rule; results hashed in the earlier spelling stay current through ALIASES, each
entry of which names the commit that proves it. The modules a probe imports are found by their own names, so
a move changes that neither.
A verdict whose recorded hash differs from the current source's was made by other code: `checks report`
marks it for a rerun.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import json
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from common import canonical
from inenv import registry
from inenv.probe import DECLARED_MARK

CODE_ROOT = Path(__file__).resolve().parents[2]  # the directory that holds the `checks` package
HELPERS = CODE_ROOT / "inenv" / "kit"  # the probes' helpers; the fact modules are in its parent folder
CODE_TREES = ("checks", "inenv", "common")  # what a verdict's code comes from: their changes make a run dirty
API_MODULES = frozenset({"probe", "status", "probes"})  # shared by every probe: not part of a probe's hash
UNKNOWN = "unknown"
HASH_CHARS = 16
GIT_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Checkout:
    """The code of a whole run: the package version and the git commit it came from."""

    version: str
    commit: str  # "unknown" outside a git checkout
    dirty: bool | None  # checks/ differs from the commit (None: unknown)

    def for_probe(self, probe_hash: str) -> Provenance:
        return Provenance(self.version, self.commit, self.dirty, probe_hash)

    def to_json(self, probe_hashes: Mapping[str, str]) -> dict[str, Any]:
        """``code`` in a run manifest: this checkout and the hash of each probe the run selected."""
        return {"version": self.version, "commit": self.commit, "dirty": self.dirty,
                "probe_hashes": dict(sorted(probe_hashes.items()))}


@dataclass(frozen=True)
class Provenance:
    """The code one result was made by (``code`` in a ProbeResult's JSON)."""

    version: str
    commit: str
    dirty: bool | None
    probe_hash: str

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "commit": self.commit, "dirty": self.dirty, "probe_hash": self.probe_hash}

    @classmethod
    def from_json(cls, obj: Any) -> Provenance | None:
        """None when ``obj`` is not a well-formed ``code`` object."""
        if not isinstance(obj, dict):
            return None
        if not all(isinstance(obj.get(k), str) for k in ("version", "commit", "probe_hash")):
            return None
        if obj.get("dirty") is not None and not isinstance(obj.get("dirty"), bool):
            return None
        return cls(obj["version"], obj["commit"], obj.get("dirty"), obj["probe_hash"])


# --- the checkout -------------------------------------------------------------------------------------------
def package_version(root: Path = CODE_ROOT) -> str:
    """The version in the checkout's pyproject.toml, else the installed package's, else "unknown"."""
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text()).get("project", {})
        if project.get("name") == "stackprobe" and isinstance(project.get("version"), str):
            return project["version"]
    except (OSError, tomllib.TOMLDecodeError):
        pass
    try:
        return importlib.metadata.version("stackprobe")
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def checkout(root: Path = CODE_ROOT) -> Checkout:
    """Version, commit and dirty flag of the code under ``root``. A ``root`` that is not itself the top of a
    git checkout (an installed package, even one inside somebody's checkout) has commit "unknown"."""
    version = package_version(root)
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top.strip()).resolve() != root.resolve():
        return Checkout(version, UNKNOWN, None)
    commit = (_git(root, "rev-parse", "--verify", "HEAD") or "").strip()
    status = _git(root, "status", "--porcelain", "--untracked-files=normal", "--", *CODE_TREES)
    if not commit:
        return Checkout(version, UNKNOWN, None)
    return Checkout(version, commit, None if status is None else bool(status.strip()))


# --- probe source hashes ------------------------------------------------------------------------------------
PROJECT_PACKAGES = frozenset({"inenv", "common", "provision", "checks"})


def _imported_names(source: str, in_helpers: bool) -> set[str]:
    return set(_imported(source, in_helpers))


@functools.lru_cache(maxsize=1024)
def _imported(source: str, in_helpers: bool) -> frozenset[str]:
    """The own names of the project modules ``source`` imports and of what it imports from them, whatever
    package they sit in: ``from inenv.kit import _a`` gives ``kit`` and ``_a``, ``import inenv.toolkit``
    gives ``toolkit``; third-party imports give nothing. A relative import counts only from a helper module
    (``in_helpers``): from a probe it names a module of the probes' own folder, not a helper. Each name is then
    looked up as a file where helpers, fact modules and probes live (probe_sources), so no folder name of
    the project decides what is found."""
    found: set[str] = set()
    for node in canonical.statements(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in PROJECT_PACKAGES:
                    found.update(parts[1:])
        elif isinstance(node, ast.ImportFrom):
            parts = node.module.split(".") if node.module else []
            if node.level == 0 and parts and parts[0] in PROJECT_PACKAGES:
                found.update(parts[1:])
            elif not (node.level == 1 and in_helpers):
                continue
            else:
                found.update(parts)
            found.update(a.name for a in node.names)
    return frozenset(found)


def _helpers_of(names: set[str]) -> set[str]:
    return {name for name in names if name.startswith("_") and name != "__init__"}


def _probes_of(names: set[str]) -> set[str]:
    return {name for name in names if not name.startswith("_")}


def _supports_of(names: set[str]) -> set[str]:
    return {name for name in _probes_of(names) if name not in API_MODULES}


def helper_imports(source: str, in_helpers: bool = False) -> set[str]:
    """Names of the private helper modules (``_x``) that ``source`` imports."""
    return _helpers_of(_imported_names(source, in_helpers))


def probe_imports(source: str) -> set[str]:
    """Names of the other probe modules (``inenv.probes.x``) that ``source`` may import (a name is a probe
    only where a probe file has it)."""
    return _probes_of(_imported_names(source, False))


def support_imports(source: str) -> set[str]:
    """Names of the in-environment fact modules (``inenv.toolkit``, ...) that ``source`` may import, the probe
    API aside (a name is one only where a fact module's file has it)."""
    return _supports_of(_imported_names(source, False))


def probe_sources(path: Path, helpers: Path = HELPERS) -> list[Path]:
    """The probe file and every helper and support module it imports, transitively, in a stable order."""
    seen: dict[str, Path] = {}
    todo = [(path, path.resolve().parent == helpers.resolve())]
    sources = [path]
    while todo:
        current, in_helpers = todo.pop()
        text = current.read_text()
        names = _imported_names(text, in_helpers)
        plain = _imported_names(text, False) if in_helpers else names  # relative imports name helpers only
        wanted = [(n, helpers / f"{n}.py", True) for n in sorted(_helpers_of(names))]
        wanted += [(f"inenv.{n}", helpers.parent / f"{n}.py", False) for n in sorted(_supports_of(plain))]
        # another probe's module that this one imports parts of: its code is part of this probe's
        wanted += [(f"probe {n}", helpers.parent / "probes" / f"{n}.py", False) for n in sorted(_probes_of(plain))]
        for key, file, is_helper in wanted:
            if key not in seen and file.is_file():
                seen[key] = file
                todo.append((file, is_helper))
    return sources + [seen[n] for n in sorted(seen)]


DECLARED_NAMES = frozenset({"METRICS", "EVIDENCE", "ALLREDUCE_PATH", "BUILD_COST", "SOURCES", "DISTRIBUTIONS"})


def hashed_bytes(path: Path) -> bytes:
    """The bytes of a source that count for its hash: all of them, less a probe's declaration block at the end
    of the file (from the line starting with ``inenv.probe.DECLARED_MARK``), which describes what the probe
    records and changes no verdict. The block is left out only when it holds nothing but assignments of
    the declared names; anything else in it counts like the rest of the file."""
    data = path.read_bytes()
    mark = ("\n" + DECLARED_MARK).encode()
    at = data.find(mark)
    if at < 0:
        return data
    try:
        block = ast.parse(data[at:].decode())
    except (SyntaxError, UnicodeDecodeError):
        return data
    if not all(isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
               and node.targets[0].id in DECLARED_NAMES for node in block.body):
        return data
    return data[:at].rstrip(b"\n") + b"\n"


def source_hash(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0" + _layout_free(hashed_bytes(p).decode()).encode() + b"\0")
    return h.hexdigest()[:HASH_CHARS]


@functools.lru_cache(maxsize=1024)
def _layout_free(text: str) -> str:
    """canonical.layout_free_source, once per distinct text: every probe hashes the kit modules it shares with the
    others, and the report, the plan and the recorder ask for the same hashes in one process."""
    return canonical.layout_free_source(text)


# Results made before probe hashes were taken in the layout-free spelling carry the hash that the code of
# their day took of the probe. Each entry of this table says: at commit ``commit``, the probe file ``probe``
# hashed to the entry's key by that commit's own hashing code, and to ``hash`` by this checkout's; so a result
# recorded with the key was made by the code that ``hash`` names. tests/test_probe_hash_aliases.py recomputes
# both sides of every entry from the repository's history; an entry it cannot prove does not belong here.
ALIASES = Path(__file__).with_name("probe_hash_aliases.json")
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Alias:
    """One entry of the alias table: ``old`` (a hash results recorded) names the code ``new`` hashes now."""

    old: str
    new: str
    probe: str  # the probe's file, relative to the repository, at ``commit``
    commit: str  # 40 hex digits: the commit whose code hashed ``probe`` to ``old``

    @classmethod
    def from_json(cls, old: str, obj: Any) -> Alias | None:
        """None unless ``obj`` is ``{"hash": <16 hex>, "probe": "<path>.py", "commit": <40 hex>}``."""
        if not isinstance(obj, dict) or set(obj) != {"hash", "probe", "commit"}:
            return None
        new, probe, commit = obj["hash"], obj["probe"], obj["commit"]
        if not all(isinstance(v, str) for v in (new, probe, commit)):
            return None
        if not (_is_hash(old) and _is_hash(new) and len(commit) == 40 and set(commit) <= _HEX
                and probe.endswith(".py") and not probe.startswith("/") and ".." not in probe.split("/")):
            return None
        return cls(old, new, probe, commit)


def _is_hash(text: str) -> bool:
    return len(text) == HASH_CHARS and set(text) <= _HEX


def read_aliases(path: Path = ALIASES) -> list[Alias | str]:
    """Every entry of the alias table, or for an entry that is not well formed its key (a malformed entry
    aliases nothing); [] when the file is absent or unreadable."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(table, dict):
        return []
    return [Alias.from_json(k, v) or k for k, v in sorted(table.items())]


@functools.cache
def _aliases() -> dict[str, str]:
    return {a.old: a.new for a in read_aliases() if isinstance(a, Alias)}


def same_code(recorded: str | None, current: str | None) -> bool:
    """Whether a result's recorded probe hash names the probe code that ``current`` hashes."""
    return current is not None and recorded is not None and current in (recorded, _aliases().get(recorded))


# Host-side code that decides verdicts, versioned like probe code: each such module declares what it is at its
# top (``VERDICT_ROLE = "requirement judge"``), and that declaration is the only list of them (VERDICT_CODE is
# read off the files of checks/). A judge that decides or shapes a verdict as it is recorded (the requirement
# judge, the classifier of a worker that gave no verdict, the reader of Slurm's accounting) writes its version
# into the result's evidence under JUDGED_BY (file name -> version) and the versions of the third-party
# distributions it imports under JUDGED_WITH (distribution -> version): judged_evidence; the gate reader,
# applied whenever advice is given, is shown with its version beside the gates it read. A judge's version
# (judge_version) hashes its file together with every project module in its import closure (found by reading
# import statements, transitively, judge_sources: the rules the gate reader applies in engine_rules.py and the
# judge's distribution table in inenv/dists.py count because the judges import them), the record a verdict is
# written in and the probe API aside (RECORD_MODULES: shared by every judge, like the probe API for probe
# hashes). A verdict judged by another version than this checkout's, or with other third-party versions than
# this host's, or recording none of them, is stale (checks.results.freshness).
JUDGE_MARK = "VERDICT_ROLE"
JUDGE_TREES = ("checks",)  # where the host-side judges live
JUDGED_BY = "judged_by"
JUDGED_WITH = "judged_with"
RECORD_MODULES = API_MODULES | {"provenance", "result"}  # the versioning itself and the typed result
# What every verdict passes through, whichever probe or judge made it: the probe API, the worker that runs a probe
# and merges its ranks' outcomes, the typed result and this versioning. Part of no hash (a change would mark
# every verdict stale): the run's commit names their code (Checkout). Every other module that makes or changes a
# verdict is in a probe's hash or a judge's version (tests/test_verdict_code_provenance.py).
SHARED_CONTRACT = RECORD_MODULES | {"worker"}


def declared_judges(root: Path = CODE_ROOT) -> dict[str, tuple[Path, str]]:
    """File name -> (path, role) of every module under JUDGE_TREES that declares a JUDGE_MARK string at its top
    (read with ast, nothing imported). Raises ValueError when two judges share a file name (the name is what a
    result records)."""
    out: dict[str, tuple[Path, str]] = {}
    for tree in JUDGE_TREES:
        for path in sorted((root / tree).rglob("*.py")):
            text = path.read_text()
            if JUDGE_MARK not in text:
                continue
            for node in ast.parse(text).body:
                if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [JUDGE_MARK]
                        and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                    if path.name in out:
                        raise ValueError(f"two judges named {path.name}: {out[path.name][0]} and {path}")
                    out[path.name] = (path, node.value.value)
    return out


VERDICT_CODE = {name: path for name, (path, _) in declared_judges().items()}
VERDICT_CODE_ROLE = {name: role for name, (_, role) in declared_judges().items()}


def _module_file(module: str, root: Path) -> Path | None:
    """The file of project module ``module`` (dotted) under ``root``, or None (a name, not a module)."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=64)
def _judge_imports(source: str) -> tuple[frozenset[tuple[str, str]], frozenset[str]]:
    """(project imports as (module, module.name) pairs, top-level names of other imports at module level) that
    ``source``'s import statements name; ``from a.b import c`` names module ``a.b.c`` where that is one, else
    ``a.b`` (judge_sources decides, by the files there are)."""
    project: set[tuple[str, str]] = set()
    other: set[str] = set()
    tree = ast.parse(source)
    for node in canonical.statements(tree):
        if isinstance(node, ast.Import):
            names = [(a.name, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [(node.module, f"{node.module}.{a.name}") for a in node.names]
        else:
            continue
        for module, deeper in names:
            top = module.split(".")[0]
            if top in PROJECT_PACKAGES:
                project.add((module, deeper))
            elif node in tree.body and top != "__future__":
                other.add(top)
    return frozenset(project), frozenset(other)


def _named_files(path: Path, root: Path) -> set[Path]:
    """The files of the project modules ``path``'s import statements name; RECORD_MODULES left out."""
    project, _ = _judge_imports(path.read_text())
    modules = {deeper if _module_file(deeper, root) else module for module, deeper in project}
    return {f for m in modules if m.split(".")[-1] not in RECORD_MODULES and (f := _module_file(m, root))}


def judge_sources(path: Path, root: Path = CODE_ROOT) -> list[Path]:
    """The judge's file, then every project module of its import closure (the modules its import statements
    name, theirs, and so on), in the order of their file names; RECORD_MODULES left out and not followed."""
    seen = {path}
    todo = [path]
    while todo:
        for f in _named_files(todo.pop(), root) - seen:
            seen.add(f)
            todo.append(f)
    return [path, *sorted(seen - {path}, key=lambda f: (f.name, f.as_posix()))]


@functools.cache
def _providers(top: str) -> tuple[str, ...]:
    """The distributions that provide top-level module ``top`` (``yaml``: PyYAML), else ``top`` itself. A
    distribution named as the module answers first; else each distribution's ``top_level.txt``, or the first
    parts of the file names its RECORD lists. importlib.metadata.packages_distributions() answers the same for
    every module at once but checks that each RECORD file exists: 9.5 s of a 14.6 s quick level on a GPU host
    whose python held 75 distributions (26,000 stat calls), on the thread that records results."""
    try:
        named = importlib.metadata.distribution(top).metadata["Name"]
    except importlib.metadata.PackageNotFoundError:
        named = None
    if named:
        return (str(named),)
    found = set()
    for dist in importlib.metadata.distributions():
        listed = dist.read_text("top_level.txt")
        names = set(listed.split()) if listed else {
            f.parts[0].removesuffix(".py") for f in dist.files or () if f.parts and not f.parts[0].endswith("-info")}
        name = dist.metadata["Name"]
        if top in names and name:
            found.add(str(name))
    return tuple(sorted(found)) or (top,)


def judge_third_party(path: Path, root: Path = CODE_ROOT) -> list[str]:
    """The distributions whose modules the judge's files import at module level (not the standard library,
    not the project), sorted: ``packaging`` for the requirement judge."""
    tops: set[str] = set()
    for f in judge_sources(path, root):
        tops |= _judge_imports(f.read_text())[1]
    return sorted({d for top in tops - set(sys.stdlib_module_names) for d in _providers(top)})


def _installed(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN


def code_version(path: Path) -> str:
    """The version of one host-side module alone: its file hashed as probe sources are (layout-free)."""
    return source_hash([path])


def judge_version(path: Path, root: Path = CODE_ROOT) -> str:
    """The version of a judge: its file and the project modules it imports, each whole (a probe module's
    declaration block included), hashed layout-free as probe sources are."""
    h = hashlib.sha256()
    for p in judge_sources(path, root):
        h.update(p.name.encode() + b"\0" + _layout_free(p.read_text()).encode() + b"\0")
    return h.hexdigest()[:HASH_CHARS]


def judged_evidence(path: Path) -> dict[str, dict[str, str]]:
    """What a judge (``path``, one of VERDICT_CODE) adds to the evidence of a verdict it decided or shaped: its
    version under JUDGED_BY and the third-party versions it judged with under JUDGED_WITH."""
    return {JUDGED_BY: {path.name: judge_version(path)}, JUDGED_WITH: verdict_code_with(path.name)}


def verdict_code_versions() -> dict[str, str]:
    """File name -> version of each host-side judge of VERDICT_CODE, as this checkout has it."""
    return {name: judge_version(path) for name, path in VERDICT_CODE.items() if path.is_file()}


def verdict_code_with(name: str) -> dict[str, str]:
    """Distribution -> the version installed here, for each third-party distribution judge ``name`` imports."""
    path = VERDICT_CODE.get(name)
    return {d: _installed(d) for d in judge_third_party(path)} if path is not None and path.is_file() else {}


def probe_hash(path: Path, helpers: Path = HELPERS) -> str:
    return source_hash(probe_sources(path, helpers))


def probe_hashes(modules: Mapping[str, ModuleType], helpers: Path = HELPERS) -> dict[str, str]:
    """Probe id -> hash of its source, for loaded probe modules."""
    return {pid: probe_hash(Path(str(m.__file__)), helpers) for pid, m in sorted(modules.items())}


def current_probe_hashes() -> dict[str, str]:
    """The hash of every probe this checkout has (including those on STACKPROBE_PROBE_PATH)."""
    return probe_hashes({pid: mod for pid, (_, mod) in registry.discover().items()})
