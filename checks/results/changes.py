"""What a contribution changes in a results folder: new hosts, new cells, removed ones, verdicts that flip,
figures that change, probe code that changed, and which gated changes a reviewed list expects (pure, but for
reading a folder and the probes' code at a git revision).

Two states of a results folder are compared as the table shows them: per host and (cell, probe, variant), the
result of the newest run. ``checks import`` says what a bundle would change before writing it, ``checks diff
--base REV`` what the working results folder changes against the folder at a git revision, and CI fails on a
*gated* change that no entry of the expected-changes list (``results/expected-changes.yaml``, reviewed like
code) names:

- a pass that now fails (fail, crash or hang) for the same host, cell, probe and variant, unless this checkout
  can show that the probe's code differs: the failing line's probe hash is one this checkout computes for that
  probe (now or at REV, aliases included), and the passing line's is another one it computes. A recorded hash
  is the result's own claim; one that no probe version known here produces is unverified, and gated;
- a host, cell or result the table showed at REV that it does not show now (removed).

The expected-changes list is YAML: a list of entries, each with ``host``, ``cell``, ``probe``, ``variant`` (the
exact variant the result records, ``''`` for none) and ``why`` (a sentence a reviewer read); an entry covers
the gated change of that one key and no other.

The folder at REV is read blob by blob with git (``git ls-tree`` and ``git cat-file``): only regular files are
written, into a private temporary folder, and read there by the one reader; a symbolic link or a submodule in
the revision is one problem line, never followed. Problems of either side are reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from checks.results import ids, provenance, reader
from checks.results.reader import Problem, Run
from checks.results.result import shows_over
from checks.results.store import REUSED_FROM
from common import escape, yamlsrc
from inenv import registry

EXPECTED_FILE = reader.EXPECTED_CHANGES
FAILING = frozenset({"fail", "crash", "hang"})
ENTRY_KEYS = frozenset({"host", "cell", "probe", "variant", "why"})
Key = tuple[str, str, str, str]  # host, cell, probe, variant
Hosts = Mapping[str, Mapping[str, Run]]  # host id -> run id -> run


class ChangesError(ValueError):
    """A revision or an expected-changes list that cannot be read; one line."""


@dataclass(frozen=True)
class Flip:
    key: Key
    before: str  # status (reason)
    after: str
    before_hash: str
    after_hash: str
    before_status: str
    after_status: str

    @property
    def same_code(self) -> bool:
        """Both lines record the same probe hash (a claim each line makes; see ``code_of``)."""
        return bool(self.before_hash) and self.before_hash == self.after_hash

    @property
    def pass_to_fail(self) -> bool:
        return self.before_status == "pass" and self.after_status in FAILING

    def line(self) -> str:
        host, cell, probe, variant = self.key
        code = "same probe code" if self.same_code else \
            f"probe code {self.before_hash[:12] or 'unrecorded'} -> {self.after_hash[:12] or 'unrecorded'}"
        return escape.terminal(f"{host} {cell} {probe} {variant or '(no variant)'}: {self.before} -> {self.after} "
                               f"({code})")


@dataclass(frozen=True)
class Figures:
    """What the page shows of one key besides its verdict (note, metrics, evidence), or of a host's facts
    (``key`` then names the host only), that differs: each changed value's path with its two values."""

    key: tuple[str, ...]
    changed: tuple[tuple[str, str, str], ...]  # (path, before, after), values as short JSON text

    def line(self) -> str:
        shown = "; ".join(f"{path} {a} -> {b}" for path, a, b in self.changed[:FIGURES_SHOWN])
        more = f"; and {len(self.changed) - FIGURES_SHOWN} more" if len(self.changed) > FIGURES_SHOWN else ""
        what = f"host facts of {self.key[0]}" if len(self.key) == 1 else \
            f"figures: {' '.join(self.key[:3])} {self.key[3] or '(no variant)'}"
        return escape.terminal(f"{what}: {len(self.changed)} value(s) changed ({shown}{more})")


@dataclass(frozen=True)
class Changes:
    new_hosts: tuple[str, ...]
    new_cells: tuple[tuple[str, str], ...]  # (host, cell) first recorded
    added: int  # results for keys not there before
    flips: tuple[Flip, ...]  # verdicts that changed on a key present on both sides
    code_changes: tuple[tuple[str, str, str, str], ...]  # (host, probe, before hash, after hash)
    removed: tuple[Key, ...] = ()  # keys the table showed at the base and does not show now
    figures: tuple[Figures, ...] = ()  # keys (and hosts' facts) whose shown values changed, verdicts aside
    removed_hosts: tuple[str, ...] = ()  # hosts with results before and none now (their keys are in removed)
    removed_cells: tuple[tuple[str, str], ...] = ()  # (host, cell) with results before and none now

    @property
    def empty(self) -> bool:
        return not (self.new_hosts or self.new_cells or self.added or self.flips or self.code_changes
                    or self.removed or self.figures)

    def lines(self) -> list[str]:
        """What changed, one terminal line each (ids are checked by the reader; every line escaped)."""
        out = [f"new host: {h}" for h in self.new_hosts]
        out += [f"new cell on {h}: {c}" for h, c in self.new_cells]
        if self.added:
            out.append(f"{self.added} result(s) for variants not recorded before")
        gone_cells = set(self.removed_cells)
        for h in self.removed_hosts:
            out.append(f"removed host: {h} ({sum(1 for k in self.removed if k[0] == h)} result(s))")
        for h, c in self.removed_cells:
            if h not in self.removed_hosts:
                out.append(f"removed cell on {h}: {c} ({sum(1 for k in self.removed if k[:2] == (h, c))} result(s))")
        out += [f"removed: {' '.join(k[:3])} {k[3] or '(no variant)'}" for k in self.removed
                if k[:2] not in gone_cells]
        for f in self.flips:
            kind = "pass -> fail" if f.pass_to_fail else \
                "fail -> pass" if f.before_status in FAILING and f.after_status == "pass" else "verdict"
            out.append(f"{kind}: {f.line()}")
        out += [f.line() for f in self.figures]
        out += [f"probe code of {p} on {h}: {a[:12] or 'unrecorded'} -> {b[:12] or 'unrecorded'}"
                for h, p, a, b in self.code_changes]
        return [escape.terminal(x) for x in out]


FIGURES_SHOWN = 3  # changed values a figures line names; the count says how many more
SHOWN_VALUE = 40  # characters of one value in a figures line


def _code_hash(r: Mapping[str, Any]) -> str:
    code = r.get("code")
    h = code.get("probe_hash") if isinstance(code, Mapping) else None
    return h if isinstance(h, str) else ""


def _verdict(r: Mapping[str, Any]) -> str:
    status, reason = str(r.get("status") or ""), str(r.get("reason_code") or "")
    return f"{status} ({reason})" if reason else status


def latest(runs: Mapping[str, Run]) -> dict[tuple[str, str, str], Mapping[str, Any]]:
    """Per (cell, probe, variant), the result the table shows (run ids sort by time; ``shows_over``)."""
    out: dict[tuple[str, str, str], Mapping[str, Any]] = {}
    for run_id in sorted(runs):
        for r in runs[run_id].results:
            key = (str(r["cell_id"]), str(r["probe_id"]), str(r["variant"]))
            prev = out.get(key)
            if prev is None or shows_over(str(r.get("status")), str(prev.get("status"))):
                out[key] = r
    return out


def _leaves(value: Any, path: str, out: dict[str, str]) -> None:
    """Every scalar (and empty container) under ``value`` by its path, as canonical JSON text: values of any
    shape, nested as deep as the reader lets a result be."""
    if isinstance(value, Mapping) and value:
        for k in sorted(value, key=str):
            _leaves(value[k], f"{path}.{k}" if path else str(k), out)
    elif isinstance(value, list | tuple) and value:
        for i, v in enumerate(value):
            _leaves(v, f"{path}[{i}]", out)
    else:
        out[path] = json.dumps(value, sort_keys=True, default=str)


def value_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> tuple[tuple[str, str, str], ...]:
    """(path, before, after) for every value that differs between two objects (absent: ``-``), sorted."""
    a: dict[str, str] = {}
    b: dict[str, str] = {}
    _leaves(before, "", a)
    _leaves(after, "", b)
    return tuple((k, _short(a.get(k, "-")), _short(b.get(k, "-"))) for k in sorted(a.keys() | b.keys())
                 if a.get(k) != b.get(k))


def _short(text: str) -> str:
    return text if len(text) <= SHOWN_VALUE else text[: SHOWN_VALUE - 3] + "..."


def _shown(r: Mapping[str, Any]) -> dict[str, Any]:
    """What a result says besides its verdict: its note and remediation, metrics, evidence and duration (a
    carried result's pointer to the run that measured it aside: carrying changes no figure)."""
    evidence = r.get("evidence")
    evidence = {k: v for k, v in evidence.items() if k != REUSED_FROM} if isinstance(evidence, Mapping) else evidence
    return {"note": r.get("note"), "remediation": r.get("remediation"), "metrics": r.get("metrics"),
            "evidence": evidence, "duration_s": r.get("duration_s")}


def page_facts(runs: Mapping[str, Run]) -> dict[str, Any]:
    """What a host's section header and rows show from its manifests: the newest manifest's host facts (of the
    runs with results) and, per cell, the versions the newest manifest naming the cell recorded."""
    facts: Any = {}
    cells: dict[str, Any] = {}
    for run_id in sorted(runs):
        m = runs[run_id].manifest
        if not runs[run_id].results or not isinstance(m, Mapping):
            continue
        facts = m.get("facts") if isinstance(m.get("facts"), Mapping) else facts
        for cell, entry in (m.get("cells") or {}).items() if isinstance(m.get("cells"), Mapping) else ():
            if isinstance(entry, Mapping) and entry.get("versions"):
                cells[str(cell)] = entry["versions"]
    return {"facts": facts, "versions": cells}


def compare(before: Hosts, after: Hosts) -> Changes:
    """What ``after`` changes against ``before`` (both: host id -> run id -> run)."""
    new_hosts = tuple(sorted(h for h in after if h not in before and any(r.results for r in after[h].values())))
    new_cells: list[tuple[str, str]] = []
    flips: list[Flip] = []
    figures: list[Figures] = []
    removed: list[Key] = []
    removed_hosts: list[str] = []
    removed_cells: list[tuple[str, str]] = []
    code: dict[tuple[str, str, str, str], None] = {}
    added = 0
    for host in sorted(before.keys() | after.keys()):
        if host in new_hosts:
            continue
        a, b = latest(before.get(host, {})), latest(after.get(host, {}))
        cells_a = {k[0] for k in a}
        new_cells += [(host, c) for c in sorted({k[0] for k in b} - cells_a)]
        added += sum(1 for k in b if k not in a)
        removed += [(host, *k) for k in sorted(a.keys() - b.keys())]
        for k in sorted(a.keys() & b.keys()):
            x, y = a[k], b[k]
            hx, hy = _code_hash(x), _code_hash(y)
            if hx != hy:
                code.setdefault((host, k[1], hx, hy), None)
            if _verdict(x) != _verdict(y):
                flips.append(Flip((host, *k), _verdict(x), _verdict(y), hx, hy, str(x.get("status")),
                                  str(y.get("status"))))
            if changed := value_changes(_shown(x), _shown(y)):
                figures.append(Figures((host, *k), changed))
        if a and b and (changed := value_changes(page_facts(before.get(host, {})), page_facts(after[host]))):
            figures.append(Figures((host,), changed))
        if a and not b:
            removed_hosts.append(host)
        removed_cells += [(host, c) for c in sorted(cells_a - {k[0] for k in b})]
    return Changes(new_hosts, tuple(new_cells), added, tuple(flips), tuple(code), tuple(removed), tuple(figures),
                   tuple(removed_hosts), tuple(removed_cells))


# --- the reviewed list of expected changes ------------------------------------------------------------------
@dataclass(frozen=True)
class Expected:
    host: str
    cell: str
    probe: str
    variant: str
    why: str

    def covers(self, key: Key) -> bool:
        """Whether the entry names exactly this (host, cell, probe, variant)."""
        return (self.host, self.cell, self.probe, self.variant) == key


def read_expected(path: Path) -> list[Expected]:
    """The expected-changes list (absent: empty); ChangesError naming the file and entry for a bad one."""
    if not os.path.lexists(path):
        return []
    data, why = reader.read_bytes(path, reader.MAX_MANIFEST)
    if why or data is None:
        raise ChangesError(f"{reader.shown(path)}: {why}; make it a regular YAML file")
    try:
        doc = yamlsrc.plain(data.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ChangesError(f"{reader.shown(path)}: not YAML text ({str(exc).splitlines()[0][:120]}); fix the "
                           "file") from None
    if doc is None:
        return []
    if not isinstance(doc, list):
        raise ChangesError(f"{reader.shown(path)}: expected a list of entries (host, cell, probe, variant, why)")
    out = []
    for n, e in enumerate(doc, 1):
        where = f"{reader.shown(path)}: entry {n}"
        if not isinstance(e, dict) or set(e) != ENTRY_KEYS:
            raise ChangesError(f"{where}: give exactly host, cell, probe, variant (as the result records it, '' for "
                               "none) and why")
        if not all(isinstance(e[k], str) for k in e) or not e["why"].strip():
            raise ChangesError(f"{where}: every field is text and why says why the change is expected")
        for kind, key in (("host id", "host"), ("cell id", "cell"), ("probe id", "probe"), ("variant", "variant")):
            if problem := ids.problem(kind, e[key]):
                raise ChangesError(f"{where}: {key}: {problem}")
        out.append(Expected(e["host"], e["cell"], e["probe"], e["variant"], e["why"]))
    return out


# --- the gate -----------------------------------------------------------------------------------------------
SAME, CHANGED, UNVERIFIED = "same", "changed", "unverified"
Versions = Mapping[str, frozenset[str]]  # probe id -> the probe hashes this checkout computes for it


def code_of(f: Flip, versions: Versions) -> str:
    """Whether a flip's two lines were made by the same probe code (SAME), by two versions this checkout can
    show to differ (CHANGED: each recorded hash is one it computes for the probe, aliases included), or
    neither (UNVERIFIED: a hash no version known here produces, or none recorded)."""
    if f.same_code:
        return SAME
    known = versions.get(f.key[2], frozenset())
    a, b = _version(f.before_hash, known), _version(f.after_hash, known)
    if a is None or b is None:
        return UNVERIFIED
    return SAME if a == b else CHANGED


def _version(recorded: str, known: frozenset[str]) -> str | None:
    """The version (a hash this checkout computes) that a recorded hash names, directly or by alias."""
    return next((k for k in sorted(known) if recorded and provenance.same_code(recorded, k)), None)


@dataclass(frozen=True)
class Gated:
    """A change CI fails on unless an expected-changes entry names its key."""

    key: Key
    why: str

    def line(self) -> str:
        host, cell, probe, variant = self.key
        return escape.terminal(f"{host} {cell} {probe} {variant or '(no variant)'}: {self.why}")

    def entry(self) -> str:
        """The expected-changes entry that would cover it, as YAML text (why left for the reviewer)."""
        host, cell, probe, variant = self.key
        return f"- {{host: {host}, cell: {cell}, probe: {probe}, variant: '{variant}', why: ...}}"


def gated(changes: Changes, versions: Versions) -> list[Gated]:
    """Every change CI fails on (before the expected-changes list is applied): pass -> fail flips not shown to
    come from other probe code, and removed results."""
    out = []
    for f in changes.flips:
        if not f.pass_to_fail:
            continue
        how = code_of(f, versions)
        if how == SAME:
            out.append(Gated(f.key, f"{f.before} -> {f.after} with the same probe code"))
        elif how == UNVERIFIED:
            out.append(Gated(f.key, f"{f.before} -> {f.after}; probe code {f.before_hash[:16] or 'unrecorded'} -> "
                                    f"{f.after_hash[:16] or 'unrecorded'} is not two versions of the probe this "
                                    "checkout computes (unverified)"))
    out += [Gated(k, "removed: the table showed it at the base and does not now") for k in changes.removed]
    return out


def unexpected(changes: Changes, expected: Iterable[Expected], versions: Versions) -> list[Gated]:
    """The gated changes no expected-changes entry names."""
    entries = list(expected)
    return [g for g in gated(changes, versions) if not any(e.covers(g.key) for e in entries)]


# --- a results folder and the probes' code at a git revision ------------------------------------------------
@dataclass(frozen=True)
class Base:
    """A results folder as a git revision holds it: the repository's top, the revision's commit, what the one
    reader read there and its problems (named ``REV:path``)."""

    top: Path
    rev: str
    commit: str
    rel: str  # the results folder, relative to the top ("." for the top itself)
    hosts: dict[str, dict[str, Run]]
    problems: tuple[Problem, ...]


def _git(top: Path | str, *args: str, data: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(top), *args], input=data, capture_output=True)


def _repository(folder: Path, rev: str) -> tuple[Path, str, str]:
    """(top, results folder relative to it, commit of ``rev``), or ChangesError saying which of them is wrong."""
    where = reader.shown(folder)
    if not folder.is_dir():
        raise ChangesError(f"--base: the results folder {where} does not exist or is not a folder; give "
                           "--results FOLDER inside a git clone")
    try:
        found = _git(folder, "rev-parse", "--show-toplevel")
    except OSError as exc:
        raise ChangesError(f"--base needs git, which cannot be run ({exc.strerror or exc}); install git") from None
    if found.returncode != 0:
        raise ChangesError(f"--base: {where} is not inside a git repository; run it in a clone whose history has "
                           "the base revision, or compare two runs, hosts or cells as A and B") from None
    top = Path(os.fsdecode(found.stdout.strip()))
    try:
        rel = folder.resolve().relative_to(top.resolve()).as_posix()
    except ValueError:
        raise ChangesError(f"--base: {where} lies outside its repository {reader.shown(top)}") from None
    commit = _git(top, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if commit.returncode != 0:
        raise ChangesError(f"--base {escape.terminal(rev)[:80]} is not a commit of the git repository "
                           f"{reader.shown(top)}; give a revision such as HEAD~1 or origin/main (a shallow clone may "
                           "lack it: fetch more history)")
    return top, rel, commit.stdout.decode().strip()


def _blobs(top: Path, commit: str, rel: str, dest: Path, problems: list[Problem]) -> None:
    """Write the regular files under ``rel`` at ``commit`` into ``dest`` (the same relative paths), reading
    each blob with git; a symbolic link, a submodule or an unsafe name is one problem and written as nothing."""
    listed = _git(top, "ls-tree", "-r", "-z", "--full-tree", commit, *(["--", rel] if rel != "." else []))
    if listed.returncode != 0:
        raise ChangesError(f"--base: git cannot list {commit[:12]}:{rel} "
                           f"({escape.terminal(listed.stderr.decode(errors='replace').strip())[:160]})")
    wanted: list[tuple[str, str]] = []  # (object id, path)
    for entry in filter(None, listed.stdout.split(b"\0")):
        meta, _, raw = entry.partition(b"\t")
        mode, kind, oid = meta.decode().split()
        path = os.fsdecode(raw)
        where = f"{commit[:12]}:{reader.shown(path)}"
        parts = path.split("/")
        if any(part in ("", ".", "..") for part in parts):
            problems.append(Problem(where, "a path no checkout can hold; not read"))
        elif mode == "120000":
            problems.append(Problem(where, "a symbolic link in the revision; not followed"))
        elif kind != "blob" or mode not in ("100644", "100755"):
            problems.append(Problem(where, f"a {kind} (mode {mode}), not a regular file; not read"))
        else:
            wanted.append((oid, path))
    if not wanted:
        return
    batch = _git(top, "cat-file", "--batch", data="".join(f"{oid}\n" for oid, _ in wanted).encode())
    out, at = batch.stdout, 0
    for _, path in wanted:
        head_end = out.find(b"\n", at)
        head = out[at:head_end].split()
        if head_end < 0 or len(head) != 3 or head[1] != b"blob":
            raise ChangesError(f"--base: git cannot read {commit[:12]}:{reader.shown(path)}")
        size = int(head[2])
        data = out[head_end + 1: head_end + 1 + size]
        at = head_end + 1 + size + 1
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)


def _renamed(problems: Iterable[Problem], root: Path, label: str) -> tuple[Problem, ...]:
    prefix = reader.shown(root) + "/"
    return tuple(Problem(p.where.replace(prefix, label), p.why, p.fatal) for p in problems)


def read_at(rev: str, folder: Path) -> Base:
    """The results folder ``folder`` as git revision ``rev`` of its repository holds it, read blob by blob and
    then by the one reader (no host when the revision has no such folder)."""
    top, rel, commit = _repository(folder, rev)
    problems: list[Problem] = []
    with tempfile.TemporaryDirectory(prefix="stackprobe-base-") as tmp:
        root = Path(tmp)
        _blobs(top, commit, rel, root, problems)
        base = root / rel
        hosts: dict[str, dict[str, Run]] = {}
        if base.is_dir():
            hosts, found = reader.read_results(base)
            problems += _renamed(found, root, f"{commit[:12]}:")
    return Base(top, rev, commit, rel, hosts, tuple(problems))


def code_versions(base: Base, probes: Mapping[str, Path], now: Mapping[str, str],
                  root: Path = provenance.CODE_ROOT) -> tuple[dict[str, frozenset[str]], tuple[Problem, ...]]:
    """Probe id -> the hashes this checkout computes for it: its own now (``now``) and, where the base revision
    holds the probe's file at the path it has here (``probes``: probe id -> file under ``root``), the hash of
    that revision's code (its ``inenv`` tree read blob by blob, hashed by this checkout's hashing)."""
    versions = {pid: frozenset({h}) for pid, h in now.items()}
    inside = {pid: f.resolve().relative_to(root.resolve()) for pid, f in probes.items()
              if f.resolve().is_relative_to(root.resolve())}
    if not inside:
        return versions, ()
    problems: list[Problem] = []
    helpers = provenance.HELPERS.resolve().relative_to(root.resolve())
    tree = helpers.parent.as_posix()  # the in-environment tree: probes, helpers and fact modules
    with tempfile.TemporaryDirectory(prefix="stackprobe-base-code-") as tmp:
        at = Path(tmp)
        _blobs(base.top, base.commit, tree, at, problems)
        for pid, rel in sorted(inside.items()):
            if (at / rel).is_file():
                versions[pid] = versions.get(pid, frozenset()) | {provenance.probe_hash(at / rel, at / helpers)}
    return versions, tuple(problems)


def code_now() -> tuple[dict[str, Path], dict[str, str]]:
    """This checkout's probes: probe id -> file, and probe id -> hash."""
    modules = {pid: mod for pid, (_, mod) in registry.discover().items()}
    return {pid: Path(str(mod.__file__)) for pid, mod in modules.items()}, provenance.probe_hashes(modules)
