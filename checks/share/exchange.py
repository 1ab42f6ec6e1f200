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
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from checks.results import changes, hostfacts, hostresults, hwclass, ids, provenance, reader
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
    accept_flips: bool = False  # write runs that change what the folder says about a host it already holds


# The advice lines `checks advise` prints for one host (given by the command line, which reaches the report
# layer): compared before and after an import to show what a bundle would flip.
AdviceOf = Callable[[hostresults.HostResults], list[str]]


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
        print(f"note: {reader.shown(w)}", file=sys.stderr)
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


def claims_current(b: bundle.Bundle, current: Mapping[str, str]) -> tuple[int, int]:
    """(results whose recorded probe hash is this checkout's hash of that probe, results in all): a claim only,
    since a bundle can copy any hash; the page marks every imported result for a rerun (checks.results.freshness)."""
    rows = [r for run in b.runs for r in run.results]
    same = sum(1 for r in rows if isinstance(r.get("code"), Mapping)
               and r["code"].get("probe_hash") is not None and r["code"].get("probe_hash") == current.get(
                   str(r.get("probe_id"))))
    return same, len(rows)


def unclean(b: bundle.Bundle) -> tuple[int, int]:
    """(results made by a checkout with uncommitted changes or changes nobody recorded: dirty true or unknown,
    results made by code of no known commit or that record no code), as the bundle's results say."""
    rows = [r.get("code") for run in b.runs for r in run.results]
    dirty = sum(1 for c in rows if isinstance(c, Mapping) and c.get("dirty") is not False
                and c.get("commit") != provenance.UNKNOWN)
    unknown = sum(1 for c in rows if not isinstance(c, Mapping) or c.get("commit") == provenance.UNKNOWN)
    return dirty, unknown


@dataclass(frozen=True)
class Preview:
    """What a bundle would change about a host the results folder already holds."""

    held: bool  # the folder holds runs of the bundle's host
    changes: changes.Changes
    advice_before: tuple[str, ...]
    advice_after: tuple[str, ...]

    @property
    def advice_flips(self) -> list[str]:
        gone = [f"- {ln}" for ln in self.advice_before if ln not in self.advice_after]
        new = [f"+ {ln}" for ln in self.advice_after if ln not in self.advice_before]
        return gone + new

    @property
    def flips(self) -> bool:
        """Whether writing the bundle changes what the page or the advice says of a host already here: a verdict,
        a figure (a note, a metric, evidence, the host's facts or a cell's versions) or an advice line."""
        return self.held and bool(self.changes.flips or self.changes.figures or self.advice_flips)


def preview(b: bundle.Bundle, results_dir: Path, advice_of: AdviceOf | None) -> Preview:
    """The bundle's runs against the host's runs already under ``results_dir``: verdict changes, and the advice
    lines that would go or come (when ``advice_of`` is given); nothing is written."""
    folder = results_dir / b.host_id
    here: dict[str, reader.Run] = {}
    if folder.is_dir() and not folder.is_symlink():
        here = reader.read_host(folder, [])
    after = {**here, **{r.run_id: r for r in b.runs if r.run_id not in here}}
    found = changes.compare({b.host_id: here} if here else {}, {b.host_id: after})
    before_lines: list[str] = []
    after_lines: list[str] = []
    if advice_of is not None and here:
        before_lines = _advice_text(advice_of(hostresults.from_runs(b.host_id, here)))
        after_lines = _advice_text(advice_of(hostresults.from_runs(b.host_id, after)))
    return Preview(bool(here), found, tuple(before_lines), tuple(after_lines))


_RUN_ID = re.compile(r"[0-9]{8}T[0-9]{6}Z-[0-9a-f]{4}")
_REFS = re.compile(r" \[\d+(?:,\d+)*\]")  # a line's references into the list of result ids


def _advice_text(lines: list[str]) -> list[str]:
    """Advice lines as compared across an import: which run a result came from (run ids, the list of result
    ids, the references into it) is not advice, so a bundle that only repeats the host's verdicts changes nothing
    and one that changes advice shows only the lines whose words change."""
    out = []
    for ln in lines:
        if ln.strip() == "ids:" or ln.startswith("  ["):
            continue
        out.append(_REFS.sub("", _RUN_ID.sub("<run>", ln)))
    return out


def _say_preview(p: Preview, b: bundle.Bundle) -> None:
    for line in p.changes.lines():
        print(f"  {line}", file=sys.stderr)
    flips = p.advice_flips
    if flips:
        print(f"  advice for {b.host_id} would change ({len(flips)} line(s); - now, + after):", file=sys.stderr)
        for line in flips:
            print(f"    {reader.shown(line)}", file=sys.stderr)


def import_bundles(opts: ImportOptions, advice_of: AdviceOf | None = None) -> int:
    """Import each bundle. A bundle that would change a verdict or an advice line of a host the folder already
    holds is printed (every flip) and written only with ``opts.accept_flips``; otherwise none of its runs is
    written (exit 1)."""
    code = 0
    own = hostfacts.own_host_id()
    current = provenance.current_probe_hashes()
    for path in opts.bundles:
        b, problems = bundle.read(path)
        _warn(problems)
        if b is None:
            code = 2
            continue
        code = max(code, 1 if problems else 0)
        for w in b.code.get("warnings") or []:
            print(f"note: {reader.shown(path)}: {reader.shown(str(w)[:300])}", file=sys.stderr)
        if not b.runs:
            print(f"checks import: {reader.shown(path)}: no run to import (every run was left out above)",
                  file=sys.stderr)
            code = max(code, 1)
            continue
        same, total = claims_current(b, current)
        cls = (f"hardware class {reader.shown(hwclass.of(b.host).label)}: one column of the table with the other "
               "hosts of it" if b.host.get("gpu_count") is not None else "hardware class unknown: the bundle names "
               "no GPU count")
        print(f"{reader.shown(path)}: contributed results of host {b.host_id} ({cls}), measured by stackprobe "
              f"{_commits(b)}; {same} of {total} claim this checkout's probe code (a claim a bundle can "
              "copy: the page marks every imported result for a rerun)", file=sys.stderr)
        dirty, unknown = unclean(b)
        if dirty or unknown:
            print(f"note: {reader.shown(path)}: of {total} result(s), {dirty} were made by a checkout with "
                  f"uncommitted changes (dirty true or unknown) and {unknown} by code of no known commit: no commit "
                  "names the code that made them, and the page marks them for a rerun", file=sys.stderr)
        if (claim := bundle.claim_problem(b, opts.results, own)) is not None:
            _warn([claim])
            code = max(code, 1)
            continue
        seen = preview(b, opts.results, advice_of)
        if not seen.changes.empty or seen.advice_flips:
            print(f"what {reader.shown(path)} changes under {reader.shown(opts.results)}:", file=sys.stderr)
            _say_preview(seen, b)
        if seen.flips and not opts.accept_flips:
            n, f, m = len(seen.changes.flips), len(seen.changes.figures), len(seen.advice_flips)
            print(f"checks import: {reader.shown(path)}: not imported: it would change {n} verdict(s), the figures "
                  f"of {f} result(s) or host fact(s) and {m} advice line(s) of host {b.host_id}, which "
                  f"{reader.shown(opts.results)} already holds (listed above); give --accept-flips to apply them",
                  file=sys.stderr)
            code = max(code, 1)
            continue
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
        print(f"next: `checks validate {reader.shown(opts.results)}` and `checks report --results "
              f"{reader.shown(opts.results)}`", file=sys.stderr)
    return code


def _commits(b: bundle.Bundle) -> str:
    """The commits (12 digits) the bundle says made its runs, escaped for a terminal."""
    made = b.code.get("runs")
    commits = sorted({str(c.get("commit"))[:12] for c in made if isinstance(c, Mapping)}) if isinstance(made, list) \
        else []
    return reader.shown(", ".join(commits[:5]) or "of unknown commit")


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
