"""What a contribution changes in a results folder: new hosts, new cells, verdicts that flip, probe code that
changed, and which pass->fail flips a reviewed list expects (pure, but for reading a folder at a git revision).

Two states of a results folder are compared as the table shows them: per host and (cell, probe, variant), the
result of the newest run. ``checks import`` says what a bundle would change before writing it, ``checks diff
--base REV`` what the working results folder changes against the folder at a git revision, and CI fails on a
*regression*: a key whose result passed and now fails (fail, crash or hang) with the same probe hash, that
no entry of the expected-changes list (``results/expected-changes.yaml``, reviewed like code) names.

The expected-changes list is YAML: a list of entries, each with ``host``, ``cell``, ``probe`` and ``why``
(required, a sentence a reviewer read), and optionally ``variant`` (default: every variant of that probe).
"""

from __future__ import annotations

import io
import subprocess
import tarfile
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from checks.results import ids, reader
from checks.results.reader import Run
from common import escape, yamlsrc

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
        return bool(self.before_hash) and self.before_hash == self.after_hash

    @property
    def regression(self) -> bool:
        """A committed pass that now fails, measured by the same probe code."""
        return self.before_status == "pass" and self.after_status in FAILING and self.same_code

    def line(self) -> str:
        host, cell, probe, variant = self.key
        code = "same probe code" if self.same_code else \
            f"probe code {self.before_hash[:12] or 'unrecorded'} -> {self.after_hash[:12] or 'unrecorded'}"
        return escape.terminal(f"{host} {cell} {probe} {variant or '(no variant)'}: {self.before} -> {self.after} "
                               f"({code})")


@dataclass(frozen=True)
class Changes:
    new_hosts: tuple[str, ...]
    new_cells: tuple[tuple[str, str], ...]  # (host, cell) first recorded
    added: int  # results for keys not there before
    flips: tuple[Flip, ...]  # verdicts that changed on a key present on both sides
    code_changes: tuple[tuple[str, str, str, str], ...]  # (host, probe, before hash, after hash)

    @property
    def empty(self) -> bool:
        return not (self.new_hosts or self.new_cells or self.added or self.flips or self.code_changes)

    def lines(self) -> list[str]:
        """What changed, one terminal line each (ids are checked by the reader; every line escaped)."""
        out = [f"new host: {h}" for h in self.new_hosts]
        out += [f"new cell on {h}: {c}" for h, c in self.new_cells]
        if self.added:
            out.append(f"{self.added} result(s) for variants not recorded before")
        for f in self.flips:
            kind = "pass -> fail" if f.before_status == "pass" and f.after_status in FAILING else \
                "fail -> pass" if f.before_status in FAILING and f.after_status == "pass" else "verdict"
            out.append(f"{kind}: {f.line()}")
        out += [f"probe code of {p} on {h}: {a[:12] or 'unrecorded'} -> {b[:12] or 'unrecorded'}"
                for h, p, a, b in self.code_changes]
        return [escape.terminal(x) for x in out]


def _code_hash(r: Mapping[str, Any]) -> str:
    code = r.get("code")
    h = code.get("probe_hash") if isinstance(code, Mapping) else None
    return h if isinstance(h, str) else ""


def _verdict(r: Mapping[str, Any]) -> str:
    status, reason = str(r.get("status") or ""), str(r.get("reason_code") or "")
    return f"{status} ({reason})" if reason else status


def latest(runs: Mapping[str, Run]) -> dict[tuple[str, str, str], Mapping[str, Any]]:
    """Per (cell, probe, variant), the result of the newest run (run ids sort by time), as the table shows it."""
    out: dict[tuple[str, str, str], Mapping[str, Any]] = {}
    for run_id in sorted(runs):
        for r in runs[run_id].results:
            out[(str(r["cell_id"]), str(r["probe_id"]), str(r["variant"]))] = r
    return out


def compare(before: Hosts, after: Hosts) -> Changes:
    """What ``after`` changes against ``before`` (both: host id -> run id -> run)."""
    new_hosts = tuple(sorted(h for h in after if h not in before and any(r.results for r in after[h].values())))
    new_cells: list[tuple[str, str]] = []
    flips: list[Flip] = []
    code: dict[tuple[str, str, str, str], None] = {}
    added = 0
    for host in sorted(after):
        if host in new_hosts:
            continue
        a, b = latest(before.get(host, {})), latest(after[host])
        cells_a = {k[0] for k in a}
        new_cells += [(host, c) for c in sorted({k[0] for k in b} - cells_a)]
        added += sum(1 for k in b if k not in a)
        for k in sorted(a.keys() & b.keys()):
            x, y = a[k], b[k]
            hx, hy = _code_hash(x), _code_hash(y)
            if hx != hy:
                code.setdefault((host, k[1], hx, hy), None)
            if _verdict(x) != _verdict(y):
                flips.append(Flip((host, *k), _verdict(x), _verdict(y), hx, hy, str(x.get("status")),
                                  str(y.get("status"))))
    return Changes(new_hosts, tuple(new_cells), added, tuple(flips), tuple(code))


# --- the reviewed list of expected changes ------------------------------------------------------------------
@dataclass(frozen=True)
class Expected:
    host: str
    cell: str
    probe: str
    variant: str | None
    why: str

    def covers(self, f: Flip) -> bool:
        host, cell, probe, variant = f.key
        return (self.host, self.cell, self.probe) == (host, cell, probe) and self.variant in (None, variant)


def read_expected(path: Path) -> list[Expected]:
    """The expected-changes list (absent: empty); ChangesError naming the file and entry for a bad one."""
    if not path.exists():
        return []
    data, why = reader.read_bytes(path, reader.MAX_MANIFEST)
    if why or data is None:
        raise ChangesError(f"{reader.shown(path)}: {why}")
    try:
        doc = yamlsrc.plain(data.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ChangesError(f"{reader.shown(path)}: not YAML text ({str(exc).splitlines()[0][:120]}); fix the "
                           "file") from None
    if doc is None:
        return []
    if not isinstance(doc, list):
        raise ChangesError(f"{reader.shown(path)}: expected a list of entries (host, cell, probe, why)")
    out = []
    for n, e in enumerate(doc, 1):
        where = f"{reader.shown(path)}: entry {n}"
        if not isinstance(e, dict) or not {"host", "cell", "probe", "why"} <= set(e) or set(e) - ENTRY_KEYS:
            raise ChangesError(f"{where}: give exactly host, cell, probe, why and optionally variant")
        if not all(isinstance(e[k], str) for k in e) or not e["why"].strip():
            raise ChangesError(f"{where}: every field is text and why says why the change is expected")
        for kind, key in (("host id", "host"), ("cell id", "cell"), ("probe id", "probe")):
            if problem := ids.problem(kind, e[key]):
                raise ChangesError(f"{where}: {key}: {problem}")
        out.append(Expected(e["host"], e["cell"], e["probe"], e.get("variant"), e["why"]))
    return out


def unexpected_regressions(changes: Changes, expected: list[Expected]) -> list[Flip]:
    return [f for f in changes.flips if f.regression and not any(e.covers(f) for e in expected)]


# --- a results folder at a git revision ---------------------------------------------------------------------
def read_at(rev: str, folder: Path) -> tuple[dict[str, dict[str, Run]], tempfile.TemporaryDirectory[str]]:
    """The results folder ``folder`` as git revision ``rev`` of its repository holds it, read by the one reader
    (an empty folder when the revision has none); the temporary copy is the caller's to clean up."""
    folder = folder.resolve()
    try:
        top = subprocess.run(["git", "-C", str(folder), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, check=True).stdout.strip()
        rel = folder.relative_to(top).as_posix() if folder != Path(top) else "."
        subprocess.run(["git", "-C", top, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                       capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError, ValueError):
        raise ChangesError(f"--base {escape.terminal(rev)[:80]} is not a commit of the git "
                           f"repository holding {reader.shown(folder)}; give a revision such as HEAD~1 or "
                           "origin/main") from None
    tmp = tempfile.TemporaryDirectory(prefix="stackprobe-base-")
    archive = subprocess.run(["git", "-C", top, "archive", rev, "--", rel], capture_output=True)
    root = Path(tmp.name)
    if archive.returncode == 0:
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(root, filter="data")
    base = root / rel
    if not base.is_dir():
        return {}, tmp
    hosts, _ = reader.read_results(base)
    return hosts, tmp
