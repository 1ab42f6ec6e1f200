"""What the installed distributions' own metadata says about each other, as ``pip check`` judges it.

- every declared requirement (``Requires-Dist``, markers evaluated for this interpreter, no extra requested)
  must name an installed distribution whose version its specifier allows;
- no file may belong to two distributions (their ``RECORD`` files): the second install overwrote the first's
  copy, and uninstalling either deletes a file the other needs;
- no extension module may carry another interpreter's tag (``*.cpython-310-*.so`` under 3.12): the import
  system never loads it, so the module it should provide is missing.

In-environment side: standard library only (``importlib.metadata``). Environments under test need not hold
``packaging``, so requirement strings, markers and PEP 440 versions are read by the small evaluator here;
what it cannot read is reported as unchecked, never as satisfied.
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

# --- PEP 440 versions -----------------------------------------------------------------------------------
_VERSION = re.compile(
    r"""^\s*v?(?:(?P<epoch>\d+)!)?(?P<release>\d+(?:\.\d+)*)
    (?:[-_.]?(?P<pre_l>a|b|c|rc|alpha|beta|pre|preview)[-_.]?(?P<pre_n>\d*))?
    (?:-(?P<post_n1>\d+)|[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n2>\d*))?
    (?:[-_.]?(?P<dev_l>dev)[-_.]?(?P<dev_n>\d*))?
    (?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?\s*$""",
    re.VERBOSE | re.IGNORECASE,
)
_PRE = {"a": "a", "alpha": "a", "b": "b", "beta": "b", "c": "rc", "rc": "rc", "pre": "rc", "preview": "rc"}


class Unreadable(ValueError):
    """A version, specifier or marker this evaluator does not read."""


@dataclass(frozen=True)
class Version:
    epoch: int
    release: tuple[int, ...]
    pre: tuple[str, int] | None
    post: int | None
    dev: int | None
    local: str | None

    @property
    def public(self) -> Version:
        return Version(self.epoch, self.release, self.pre, self.post, self.dev, None)

    @property
    def is_prerelease(self) -> bool:
        return self.pre is not None or self.dev is not None

    def key(self) -> tuple[Any, ...]:
        """PEP 440 order: dev < pre < final < post; a dev release sorts before everything of its release."""
        release = self.release
        while len(release) > 1 and release[-1] == 0:
            release = release[:-1]
        if self.pre is None and self.post is None and self.dev is not None:
            pre: tuple[Any, ...] = (-1, "", 0)  # 1.0.dev1 < 1.0a1
        elif self.pre is None:
            pre = (1, "", 0)
        else:
            pre = (0, *self.pre)
        post = (-1,) if self.post is None else (self.post,)
        dev = (1, 0) if self.dev is None else (0, self.dev)
        local = tuple((1, int(p), "") if p.isdigit() else (0, 0, p) for p in re.split(r"[-_.]", self.local or "")
                      if p)
        return (self.epoch, release, pre, post, dev, local)


def parse_version(text: str) -> Version:
    m = _VERSION.match(text)
    if not m:
        raise Unreadable(f"version {text!r}")
    pre = (_PRE[m["pre_l"].lower()], int(m["pre_n"] or 0)) if m["pre_l"] else None
    post_n = m["post_n1"] or m["post_n2"]
    post = int(post_n or 0) if (m["post_n1"] or m["post_l"]) else None
    dev = int(m["dev_n"] or 0) if m["dev_l"] else None
    local = m["local"].lower().replace("-", ".").replace("_", ".") if m["local"] else None
    return Version(int(m["epoch"] or 0), tuple(int(p) for p in m["release"].split(".")), pre, post, dev, local)


# --- specifiers -----------------------------------------------------------------------------------------
_CLAUSE = re.compile(r"^\s*(~=|===|==|!=|<=|>=|<|>)\s*([^\s,;]+)\s*$")


def _prefix_match(version: Version, prefix: str) -> bool:
    """``==1.2.*``: the public version's release starts with 1.2 (zero-padded)."""
    want = parse_version(prefix).release
    have = version.release + (0,) * max(0, len(want) - len(version.release))
    return version.epoch == parse_version(prefix).epoch and have[: len(want)] == want


def _clause(op: str, spec: str, version: Version) -> bool:
    if op == "===":
        return str(spec) == str(version)
    if spec.endswith(".*"):
        if op not in ("==", "!="):
            raise Unreadable(f"{op}{spec}")
        hit = _prefix_match(version, spec[:-2])
        return hit if op == "==" else not hit
    want = parse_version(spec)
    have = version if want.local else version.public  # ==2.9.1 allows 2.9.1+cu128
    if op == "==":
        return have.key() == want.key()
    if op == "!=":
        return have.key() != want.key()
    if op == "~=":
        if len(want.release) < 2:
            raise Unreadable(f"~={spec}")
        return version.public.key() >= want.key() and _prefix_match(
            version, ".".join(map(str, want.release[:-1])))
    v, w = version.public.key(), want.key()
    if op == "<=":
        return v <= w
    if op == ">=":
        return v >= w
    if op == "<":  # <2.0 does not admit 2.0's pre-releases unless it names one
        return v < w and not (version.is_prerelease and not want.is_prerelease
                              and version.release[: len(want.release)] == want.release)
    # ">": >2.0 does not admit 2.0's post-releases unless it names one
    return v > w and not (version.post is not None and want.post is None and version.public.release == want.release
                          and version.pre == want.pre)


def satisfies(version: str, specifier: str) -> bool:
    """Whether ``version`` is allowed by ``specifier`` (">=2.1,<3", "" allows every version). A pre-release
    is allowed as pip check allows it: by the clauses alone."""
    have = parse_version(version)
    for clause in filter(None, (c.strip() for c in specifier.split(","))):
        m = _CLAUSE.match(clause)
        if not m:
            raise Unreadable(f"specifier {clause!r}")
        if not _clause(m[1], m[2], have):
            return False
    return True


# --- markers --------------------------------------------------------------------------------------------
def environment() -> dict[str, str]:
    """The marker variables of this interpreter, with no extra requested."""
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


_TOKEN = re.compile(r"""\s*(?:(?P<str>'[^']*'|"[^"]*")|(?P<op>===|==|!=|<=|>=|~=|<|>|not\s+in\b|in\b)|(?P<paren>[()])
    |(?P<word>and\b|or\b)|(?P<var>[a-z_][a-z0-9_.]*))""", re.VERBOSE)
_VERSION_VARS = {"python_version", "python_full_version", "implementation_version", "platform_release"}


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise Unreadable(f"marker {text!r}")
        kind = m.lastgroup or ""
        out.append((kind, " ".join(m[kind].split())))
        pos = m.end()
    return out


def marker_true(text: str, env: Mapping[str, str]) -> bool:
    """PEP 508 marker ``text`` under ``env`` (``environment()``)."""
    toks = _tokens(text)
    pos = 0

    def value(tok: tuple[str, str]) -> tuple[str, bool]:
        kind, word = tok
        if kind == "str":
            return word[1:-1], False
        if kind == "var":
            name = word.replace(".", "_")
            if name not in env:
                raise Unreadable(f"marker variable {word!r}")
            return env[name], name in _VERSION_VARS
        raise Unreadable(f"marker {text!r}")

    def atom() -> bool:
        nonlocal pos
        if pos < len(toks) and toks[pos] == ("paren", "("):
            pos += 1
            out = disjunction()
            if pos >= len(toks) or toks[pos] != ("paren", ")"):
                raise Unreadable(f"marker {text!r}")
            pos += 1
            return out
        if pos + 3 > len(toks) or toks[pos + 1][0] != "op":
            raise Unreadable(f"marker {text!r}")
        (left, lver), op, (right, rver) = value(toks[pos]), toks[pos + 1][1], value(toks[pos + 2])
        on_extra = ("var", "extra") in (toks[pos], toks[pos + 2])
        pos += 3
        if op in ("in", "not in"):
            return (left in right) == (op == "in")
        if op == "===":
            return left == right
        if lver or rver:
            try:
                return satisfies(left, f"{op}{right}") if lver else satisfies(right, _flip(op) + left)
            except Unreadable:
                pass  # not a version (python_version == 'x'): compared as strings below
        if on_extra:
            left, right = normal(left), normal(right)
        if op == "==":
            return left == right
        if op == "!=":
            return left != right
        raise Unreadable(f"marker {text!r}")

    def conjunction() -> bool:
        nonlocal pos
        out = atom()
        while pos < len(toks) and toks[pos] == ("word", "and"):
            pos += 1
            out = atom() and out
        return out

    def disjunction() -> bool:
        nonlocal pos
        out = conjunction()
        while pos < len(toks) and toks[pos] == ("word", "or"):
            pos += 1
            out = conjunction() or out
        return out

    result = disjunction()
    if pos != len(toks):
        raise Unreadable(f"marker {text!r}")
    return result


def _flip(op: str) -> str:
    return {"<": ">", ">": "<", "<=": ">=", ">=": "<="}.get(op, op)


# --- requirements ---------------------------------------------------------------------------------------
_REQ = re.compile(r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(\[[^\]]*\])?\s*(.*)$")


@dataclass(frozen=True)
class Requirement:
    name: str
    specifier: str  # ">=2.1,<3"; "" for any version
    marker: str  # "" when none
    text: str

    def applies(self, env: Mapping[str, str]) -> bool:
        return not self.marker or marker_true(self.marker, env)


def parse_requirement(text: str) -> Requirement:
    spec, _, marker = text.partition(";")
    m = _REQ.match(spec)
    if not m:
        raise Unreadable(f"requirement {text!r}")
    rest = m[3].strip()
    if rest.startswith("@"):
        raise Unreadable(f"requirement {text!r} (a direct reference)")
    if rest.startswith("(") and rest.endswith(")"):
        rest = rest[1:-1]
    return Requirement(normal(m[1]), rest.replace(" ", ""), marker.strip(), text.strip())


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()



# --- the environment's distributions --------------------------------------------------------------------
@dataclass(frozen=True)
class Broken:
    dist: str  # the distribution that declares the requirement
    version: str
    requirement: str  # as declared ("torch==2.14.1")
    required: str  # normalised name of what it requires
    installed: str | None  # that distribution's version here; None when absent

    def describe(self) -> str:
        have = f"{self.required} {self.installed} is installed" if self.installed else f"{self.required} is absent"
        return f"{self.dist} {self.version} requires {self.requirement}, {have}"

    def as_dict(self) -> dict[str, Any]:
        return {"dist": self.dist, "version": self.version, "requirement": self.requirement,
                "required": self.required, "installed": self.installed}


def installed_dists(dists: Iterable[md.Distribution] | None = None) -> dict[str, md.Distribution]:
    """One distribution per normalised name: the first on ``sys.path``, the one an import finds."""
    out: dict[str, md.Distribution] = {}
    for d in md.distributions() if dists is None else dists:
        name = d.metadata["Name"] if d.metadata else None
        if name and normal(name) not in out:
            out[normal(name)] = d
    return out


def broken_requirements(dists: Mapping[str, md.Distribution], env: Mapping[str, str] | None = None,
                        ) -> tuple[list[Broken], list[str]]:
    """(requirements not met, requirements not read) over every installed distribution."""
    env = environment() if env is None else env
    versions = {n: d.version for n, d in dists.items()}
    broken, unread = [], []
    for name, d in sorted(dists.items()):
        for text in d.requires or []:
            try:
                req = parse_requirement(text)
                if not req.applies(env):
                    continue
                have = versions.get(req.name)
                if have is not None and satisfies(have, req.specifier):
                    continue
            except Unreadable as exc:
                unread.append(f"{name} {d.version}: {exc}")
                continue
            declared = req.text.split(";")[0].strip().replace(" ", "")
            broken.append(Broken(d.metadata["Name"], d.version, declared, req.name, have))
    return broken, unread


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
    """Every finding of this environment, JSON-able, for the inventory's evidence."""
    dists = installed_dists()
    broken, unread = broken_requirements(dists)
    out: dict[str, Any] = {"python": f"{sys.implementation.name} {platform.python_version()}",
                           "distributions": len(dists), "broken_requirements": [b.as_dict() for b in broken],
                           "collisions": [c.as_dict() for c in collisions(dists)],
                           "foreign_extensions": foreign_extensions(dists)}
    if unread:
        out["requirements_unchecked"] = unread[:20]
    return out
