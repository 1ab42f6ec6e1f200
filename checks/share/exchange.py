"""`checks share | import | validate`: results leaving this machine and results arriving from others.

Exit codes, the same for the three commands:

- 0: done; everything read was well formed (import: every run written or already present);
- 1: done, but some items were bad and left out, one warning each on stderr (a line that is not a result,
  an id outside its grammar, an unknown status, a run id already imported with different results);
- 2: bad input as a whole: a path that cannot be read, a file that is not a bundle, a results folder that
  cannot be written; one line, nothing written.

Every line printed names files and ids as text escaped for a terminal (checks.results.reader).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from checks.results import hostfacts, ids, provenance, reader
from checks.results.reader import Problem
from checks.results.store import StoreBusy
from checks.share import bundle
from checks.share.scrub import Identity, Scrubber
from inenv import atomic


@dataclass(frozen=True)
class ShareOptions:
    results: Path
    host: str | None
    out: Path | None
    show: bool


@dataclass(frozen=True)
class ImportOptions:
    bundles: tuple[Path, ...]
    results: Path


def _warn(problems: Sequence[Problem]) -> None:
    for p in problems:
        print(f"checks: {p}" if p.fatal else f"warning: {p}", file=sys.stderr)


def default_host(results: Path) -> str:
    """This machine's host id when it has results here, else the only host there is."""
    here = str(hostfacts.collect(env={})["host_id"])
    if (results / here).is_dir():
        return here
    hosts = sorted(p.name for p in results.iterdir() if p.is_dir()) if results.is_dir() else []
    if len(hosts) == 1:
        return hosts[0]
    raise bundle.BundleError(f"checks share: this machine ({here}) has no results under {results}; give "
                             f"--host, one of: {', '.join(hosts) or 'none'}")


def share(opts: ShareOptions) -> int:
    host = opts.host or default_host(opts.results)
    scrubber = Scrubber(Identity.here())
    data, problems = bundle.build(opts.results, host, scrubber, provenance.checkout())
    _warn(problems)
    payload = bundle.dumps(data)
    runs, results = len(data["runs"]), sum(len(r["results"]) for r in data["runs"])
    print(f"bundle of {host}: {runs} run(s), {results} result(s), {len(payload)} bytes; scrubbed: "
          f"{scrubber.summary()}", file=sys.stderr)
    for w in data["code"]["warnings"]:
        print(f"note: {w}", file=sys.stderr)
    if opts.show:
        sys.stdout.buffer.write(payload)
        sys.stdout.flush()
        if opts.out is None:
            print("nothing written (--show); without it the bundle goes to a file", file=sys.stderr)
            return 1 if problems else 0
    out = opts.out or Path(f"stackprobe-{host}.bundle.json")
    try:
        atomic.write_bytes(out, payload)
    except OSError as exc:
        print(f"checks share: cannot write {reader.shown(out)}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}; send it with your note on the host (see docs/contributing-results.md)", file=sys.stderr)
    return 1 if problems else 0


def import_bundles(opts: ImportOptions) -> int:
    code = 0
    own = hostfacts.own_host_id()
    for path in opts.bundles:
        b, problems = bundle.read(path)
        _warn(problems)
        if b is None:
            code = 2
            continue
        code = max(code, 1 if problems else 0)
        for w in b.code.get("warnings") or []:
            print(f"note: {reader.shown(path)}: {reader.shown(str(w)[:300])}", file=sys.stderr)
        try:
            outcome = bundle.import_bundle(b, opts.results, own)
        except StoreBusy as exc:
            print(f"checks import: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:  # the host folder could not be made or locked: nothing written
            print(f"checks import: cannot write under {reader.shown(opts.results)}: {exc.strerror or exc}; "
                  "nothing of this bundle written", file=sys.stderr)
            return 2
        _warn(outcome.refused)
        if outcome.refused:
            code = max(code, 1)
        for name in outcome.imported:
            print(f"imported {name}", file=sys.stderr)
        for name in outcome.present:
            print(f"already present: {name} (same results); skipped", file=sys.stderr)
        if outcome.error:
            print(f"checks import: stopped writing under {reader.shown(opts.results)}: {outcome.error}; "
                  f"written: {', '.join(outcome.imported) or 'nothing'}; the run it stopped at is not there",
                  file=sys.stderr)
            return 2
    if code < 2:
        print(f"next: `checks validate {opts.results}` and `checks report --results {opts.results}`",
              file=sys.stderr)
    return code


@dataclass(frozen=True)
class Checked:
    """What `checks validate` found in one path."""

    path: str
    kind: str  # results | host | bundle
    hosts: int
    runs: int
    results: int
    problems: tuple[Problem, ...]

    def to_json(self) -> dict[str, object]:
        return {"path": self.path, "kind": self.kind, "hosts": self.hosts, "runs": self.runs, "results": self.results,
                "problems": [{"where": p.where, "why": p.why, "fatal": p.fatal} for p in self.problems]}


def _one_host(path: Path) -> bool:
    """A host's own folder (named by a host id, holding files only) rather than a results directory."""
    try:
        return path.is_dir() and ids.valid("host id", path.name) and not any(p.is_dir() for p in path.iterdir())
    except OSError:
        return False


def check(path: Path) -> Checked:
    shown = reader.shown(path)
    if _one_host(path):
        problems: list[Problem] = []
        runs = reader.read_host(path, problems)
        return Checked(shown, "host", 1, len(runs), sum(len(r.results) for r in runs.values()), tuple(problems))
    if path.is_dir():
        hosts, problems = reader.read_results(path)
        return Checked(shown, "results", len(hosts), sum(len(h) for h in hosts.values()),
                       sum(len(r.results) for h in hosts.values() for r in h.values()), tuple(problems))
    b, problems = bundle.read(path)
    if b is None:
        return Checked(shown, "bundle", 0, 0, 0, tuple(problems))
    return Checked(shown, "bundle", 1, len(b.runs), sum(len(r.results) for r in b.runs), tuple(problems))


def validate(path: Path, as_json: bool = False) -> int:
    """A bundle file, a results directory or one host's folder: 0 all well formed, 1 bad items (one warning
    each), 2 unreadable."""
    found = check(path)
    if as_json:
        print(json.dumps(found.to_json(), indent=2, sort_keys=True))
    _warn(found.problems)
    if any(p.fatal for p in found.problems):
        return 2
    n = len(found.problems)
    kind = {"results": "results directory", "host": "host folder"}.get(found.kind, found.kind)
    print(f"{found.path}: {kind}, {found.hosts} host(s), {found.runs} run(s), {found.results} result(s); "
          + (f"{n} bad item(s)" if n else "all well formed"), file=sys.stderr)
    return 1 if n else 0
