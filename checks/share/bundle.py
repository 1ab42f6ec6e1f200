"""Bundles: one host's runs in one file for another machine (``checks share``), read back as untrusted input
(``checks import``, ``checks validate``).

A bundle is one UTF-8 JSON document (ASCII only: every other character is a ``\\u`` escape, so no control or
bidirectional character reaches a terminal that shows it), keys sorted, one space of indentation::

    {"schema": "stackprobe.bundle/1",
     "host_id": "h200x2-5bce98f7",
     "host": {GPU model and count, compute capability, interconnect, topology, driver, CUDA of the driver,
              NCCL, peer access, multicast, CPU, OS: from the newest run's manifest},
     "code": {"runs": [{version, commit, dirty}, ...], "shared_by": {version, commit, dirty},
              "clean": true when every run names a commit and none was dirty, "warnings": [...]},
     "scrubbed": {kind: count},
     "runs": [{"run_id": ..., "manifest": {...}, "results": [result, ...]}, ...]}

``results`` are the lines of ``results/<host>/<run>.jsonl`` as JSON objects and ``manifest`` the run's
manifest, both scrubbed (checks.share.scrub), so an import writes the same files back. A run without a
manifest is neither shared nor imported: its host facts, the GPUs that tell one host from another included,
could not be checked against the host it names. Building goes through the
same strict reader as importing (checks.results.reader): a bundle never carries an item an import would refuse.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from checks.results import ids, reader
from checks.results.provenance import UNKNOWN, Checkout
from checks.results.reader import Problem, Run
from checks.results.store import RunLock
from checks.share.scrub import Scrubber
from inenv import atomic

SCHEMA = "stackprobe.bundle/1"
SCHEMA_PREFIX = "stackprobe.bundle/"
KEYS = frozenset({"schema", "host_id", "host", "code", "scrubbed", "runs"})
RUN_KEYS = frozenset({"run_id", "manifest", "results"})
HOST_FACTS = ("gpu_name", "gpu_count", "compute_capability", "interconnect", "topology", "driver", "driver_cuda",
              "nccl", "peer_access", "multicast", "cpu", "cpu_count", "os")


class BundleError(ValueError):
    """A bundle that cannot be made (no such host, nothing to share); one line."""


# --- making one ---------------------------------------------------------------------------------------------
def code_of(runs: Sequence[Run], shared_by: Checkout) -> dict[str, Any]:
    """The checkouts that made the runs, whether all were clean and known, and a warning for each that was not."""
    seen: dict[tuple[str, str, Any], None] = {}
    warnings: list[str] = []
    for run in runs:
        code = (run.manifest or {}).get("code")
        made = [code] if isinstance(code, Mapping) else []
        made += [r["code"] for r in run.results if isinstance(r.get("code"), Mapping)]
        if not made:
            warnings.append(f"run {run.run_id}: the code that made it is unknown (it names no commit)")
        for c in made:
            seen.setdefault((str(c.get("version")), str(c.get("commit")), c.get("dirty")), None)
    for version, commit, dirty in seen:
        if commit == UNKNOWN:
            warnings.append(f"stackprobe {version} from an unknown commit (not a git checkout) made some runs")
        elif dirty is not False:
            state = "a dirty checkout" if dirty else "a checkout whose state is unknown"
            warnings.append(f"stackprobe {version} from {state} of commit {commit} made some runs")
    warnings = list(dict.fromkeys(warnings))
    return {"runs": [{"version": v, "commit": c, "dirty": d} for v, c, d in sorted(seen, key=str)],
            "shared_by": {"version": shared_by.version, "commit": shared_by.commit, "dirty": shared_by.dirty},
            "clean": not warnings, "warnings": warnings}


def host_facts(runs: Sequence[Run]) -> dict[str, Any]:
    """The host facts of the newest run whose manifest has them, and the host's peer-to-peer answer."""
    out: dict[str, Any] = {k: None for k in HOST_FACTS}
    for run in reversed(runs):
        facts = (run.manifest or {}).get("facts")
        if isinstance(facts, Mapping) and facts:
            out = {k: facts.get(k) for k in HOST_FACTS}
            break
    out["host_p2p"] = p2p_summary(runs)
    return out


P2P_PROBE = "host-p2p"
P2P_KEEP = ("variant", "status", "reason_code", "note")


def p2p_summary(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """The host-p2p verdicts of the newest run that has any (its variant, status, reason and note: the links,
    bridges, IOMMU mode and pair checks as the probe worded them; the bundle is scrubbed after)."""
    for run in reversed(runs):
        rows = [r for r in run.results if isinstance(r, Mapping) and r.get("probe_id") == P2P_PROBE]
        if rows:
            return [{k: str(r.get(k) or "")[:600] for k in P2P_KEEP} for r in rows[:64]]
    return []


def build(results_dir: Path, host_id: str, scrubber: Scrubber, shared_by: Checkout) -> tuple[dict[str, Any],
                                                                                         list[Problem]]:
    """The bundle of ``host_id``'s runs under ``results_dir`` and the problems met reading them (those items
    are left out)."""
    if why := ids.problem("host id", host_id):
        raise BundleError(f"checks share: --host: {why}")
    folder = results_dir / host_id
    if not folder.is_dir():
        known = sorted(p.name for p in results_dir.iterdir() if p.is_dir()) if results_dir.is_dir() else []
        raise BundleError(f"checks share: no results for host {host_id} under {results_dir} "
                          f"(hosts there: {', '.join(known) or 'none'})")
    problems: list[Problem] = []
    runs = []
    for r in reader.read_host(folder, problems).values():
        if r.results and r.manifest is None:
            problems.append(Problem(f"{reader.shown(folder)}/{r.run_id}", "no readable manifest: left out of the "
                                    "bundle (an import refuses a run whose host facts cannot be checked)"))
        elif r.results:
            runs.append(r)
    if not runs:
        raise BundleError(f"checks share: {folder} holds no readable result")
    body = {"host": host_facts(runs), "code": code_of(runs, shared_by),
            "runs": [{"run_id": r.run_id, "manifest": r.manifest, "results": list(r.results)} for r in runs]}
    clean = scrubber.scrub(body)
    bundle = {"schema": SCHEMA, "host_id": host_id, **clean, "scrubbed": dict(sorted(scrubber.counts.items()))}
    return bundle, problems


def dumps(bundle: Mapping[str, Any]) -> bytes:
    """The bytes of a bundle file: exactly what ``checks share --show`` prints."""
    return (json.dumps(bundle, indent=1, sort_keys=True, ensure_ascii=True) + "\n").encode("ascii")


# --- reading one --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bundle:
    path: str
    host_id: str
    host: Mapping[str, Any]
    code: Mapping[str, Any]
    runs: tuple[Run, ...]
    problems: tuple[Problem, ...] = field(default=())


def read(path: Path) -> tuple[Bundle | None, list[Problem]]:
    """A bundle file read strictly: (None, [a fatal problem]) when it is not a bundle at all; else the bundle
    with every well-formed run and result, and a problem for each item left out."""
    where = reader.shown(path)
    data, why = reader.read_bytes(path, reader.MAX_FILE)
    obj = None
    if data is not None:
        obj, why = reader.parse_json(data, None)  # each run, manifest and result is checked on its own below
    if why:
        return None, [Problem(where, why, fatal=True)]
    fatal = _top_problem(obj)
    if fatal:
        return None, [Problem(where, fatal, fatal=True)]
    host_id = obj["host_id"]
    problems: list[Problem] = []
    for key in ("host", "code"):
        if why := reader.check_value(obj[key]):
            problems.append(Problem(f"{where}: {key}", f"{why}; left out"))
            obj[key] = {}
    runs: list[Run] = []
    seen: set[str] = set()
    for n, raw in enumerate(obj["runs"][: reader.MAX_RUNS], 1):
        run, why = _run(raw, host_id, f"{where}: run {n}", problems)
        if why:
            problems.append(Problem(f"{where}: run {n}", f"{why}; skipped"))
        elif run is not None and run.run_id in seen:
            problems.append(Problem(f"{where}: run {n}", f"run {run.run_id} appears twice; the second skipped"))
        elif run is not None:
            seen.add(run.run_id)
            runs.append(run)
    if len(obj["runs"]) > reader.MAX_RUNS:
        problems.append(Problem(where, f"more than {reader.MAX_RUNS} runs; the rest skipped"))
    return Bundle(where, host_id, obj["host"], obj["code"], tuple(runs), tuple(problems)), problems


def _top_problem(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return "not a stackprobe bundle (not a JSON object)"
    schema = obj.get("schema")
    if not isinstance(schema, str) or not schema.startswith(SCHEMA_PREFIX):
        return "not a stackprobe bundle (no schema stackprobe.bundle/N)"
    if schema != SCHEMA:
        return f"schema {schema[:40]!r}: this stackprobe reads {SCHEMA} only; update stackprobe"
    if missing := sorted(KEYS - set(obj)):
        return f"missing field(s) {', '.join(missing)}"
    if extra := sorted(set(obj) - KEYS):
        return f"unknown field(s) {', '.join(map(repr, extra[:5]))}"
    if why := ids.problem("host id", obj["host_id"]):
        return why
    for key in ("host", "code", "scrubbed"):
        if not isinstance(obj[key], dict):
            return f"{key} is not an object"
    if not isinstance(obj["runs"], list):
        return "runs is not a list"
    warnings = obj["code"].get("warnings", [])
    if not (isinstance(warnings, list) and all(isinstance(w, str) for w in warnings)):
        return "code.warnings is not a list of strings"
    return None


def _run(raw: Any, host_id: str, where: str, problems: list[Problem]) -> tuple[Run | None, str | None]:
    if not isinstance(raw, dict):
        return None, "not a JSON object"
    if set(raw) != RUN_KEYS:
        return None, f"fields {sorted(raw)[:6]}, expected {sorted(RUN_KEYS)}"
    run_id = raw["run_id"]
    if why := ids.problem("run id", run_id):
        return None, why
    if not isinstance(raw["results"], list):
        return None, "results is not a list"
    manifest = raw["manifest"]
    if manifest is None:  # without one the GPU identity of the host it names cannot be checked
        return None, f"run {run_id} has no manifest (its host facts, GPUs included, cannot be checked)"
    if why := reader.check_value(manifest) or reader.check_manifest(manifest, host_id, run_id):
        return None, f"run {run_id}: manifest: {why}"
    manifest, bad = reader.manifest_fields(manifest)
    problems.extend(reader.Problem(f"{where} ({run_id}) manifest", why) for why in bad)
    lines = [(f"{where} ({run_id}) result {i}", json.dumps(r, ensure_ascii=True).encode())
             for i, r in enumerate(raw["results"], 1)]
    results = reader.results_of(lines, host_id, run_id, problems)
    if not results:
        return None, "no well-formed result"
    return Run(run_id, manifest, tuple(results)), None


# --- importing one ------------------------------------------------------------------------------------------
def result_lines(results: Sequence[Mapping[str, Any]]) -> bytes:
    """A run's results file, each result serialised as the results store writes it."""
    return b"".join((json.dumps(r, sort_keys=True, default=str, separators=(",", ":")) + "\n").encode()
                    for r in results)


@dataclass(frozen=True)
class Outcome:
    imported: tuple[str, ...] = ()  # host/run written
    present: tuple[str, ...] = ()  # host/run already there with the same content
    refused: tuple[Problem, ...] = ()  # a run id that collides with different content
    error: str = ""  # why writing stopped (the disk's error); the runs before it are in ``imported``


IDENTITY = ("gpu_name", "gpu_count", "compute_capability")  # the facts that tell one host's GPUs from another's


def _identity(manifests: Iterable[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """The identity facts of the newest manifest that has them (manifests oldest first)."""
    for m in reversed(list(manifests)):
        facts = m.get("facts") if isinstance(m, Mapping) else None
        if isinstance(facts, Mapping):
            return {k: facts.get(k) for k in IDENTITY}
    return None


def claim_problem(b: Bundle, results_dir: Path, own_host: str) -> Problem | None:
    """Why ``b`` may not be imported under its host id: it names this machine (its runs would pass for this
    machine's own: the target of --resume, reuse and this host's advice), or a host already under
    ``results_dir`` whose GPUs its facts contradict."""
    if b.host_id == own_host:
        return Problem(b.path, f"the bundle names this machine's own host id {b.host_id}: its runs would pass "
                               "for runs made here (--resume, reuse, this host's advice); refused, nothing written")
    folder = results_dir / b.host_id
    if not folder.is_dir() or folder.is_symlink():
        return None
    problems: list[Problem] = []
    here = reader.read_host(folder, problems)
    mine = _identity(here[r].manifest for r in sorted(here))
    theirs = _identity(run.manifest for run in b.runs)
    if mine is not None and theirs is not None and mine != theirs:
        said = ", ".join(f"{k} {theirs[k]!r} here {mine[k]!r}" for k in IDENTITY if mine[k] != theirs[k])
        return Problem(b.path, f"the bundle names host {b.host_id}, already under {reader.shown(results_dir)}, "
                               f"with other GPUs ({said[:200]}); refused, nothing written")
    return None


def import_bundle(b: Bundle, results_dir: Path, own_host: str = "") -> Outcome:
    """Write each run of ``b`` under ``results_dir/<host>/``, holding the host folder's lock (the one `checks
    run` holds): new runs are written (atomically), runs already there with the same results are skipped, a
    run id there with different results is refused; a bundle naming this machine (``own_host``) or
    contradicting the GPUs of the host it names is refused whole (claim_problem). A run is all or nothing:
    when its manifest cannot be written its results file is removed again, and the import stops there with
    what it wrote so far and the error (``Outcome.error``). StoreBusy, and an OSError making or locking the
    host folder, propagate."""
    if (claim := claim_problem(b, results_dir, own_host)) is not None:
        return Outcome(refused=(claim,))
    folder = results_dir / b.host_id
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        return Outcome(refused=(Problem(reader.shown(folder), "not a plain folder; nothing written there"),))
    imported: list[str] = []
    present: list[str] = []
    refused: list[Problem] = []
    with RunLock(folder):  # a folder that cannot be made or locked propagates: nothing written
        try:
            for run in b.runs:
                _import_run(b, run, folder, results_dir, imported, present, refused)
        except OSError as exc:
            return Outcome(tuple(imported), tuple(present), tuple(refused), exc.strerror or str(exc))
    return Outcome(tuple(imported), tuple(present), tuple(refused))


def _import_run(b: Bundle, run: reader.Run, folder: Path, results_dir: Path, imported: list[str],
                present: list[str], refused: list[Problem]) -> None:
    name = f"{b.host_id}/{run.run_id}"
    path = folder / f"{run.run_id}{reader.RESULTS_SUFFIX}"
    mpath = folder / f"{run.run_id}{reader.MANIFEST_SUFFIX}"
    if os.path.dirname(os.path.normpath(path)) != os.path.normpath(folder):  # ids forbid it; kept as a guard
        refused.append(Problem(b.path, f"run {run.run_id[:30]!r} would land outside {folder}"))
        return
    if os.path.lexists(path):
        if why := _not_plain(path):
            refused.append(Problem(b.path, f"run {name}: its results file under {results_dir} is {why}; refused "
                                           "(nothing of it written): remove that file, then import again"))
            return
        have: list[Problem] = []
        existing = reader.read_run(folder, b.host_id, run.run_id, have)
        if not _same(existing.results, run.results):
            refused.append(Problem(b.path, f"run {name} is already under {results_dir} with different "
                                           "results; refused (nothing of it written)"))
            return
        present.append(name)
        if run.manifest is not None and not os.path.lexists(mpath):  # an earlier import cut short: completed
            atomic.write_json(mpath, run.manifest)
        return
    opath = folder / f"{run.run_id}{reader.ORIGIN_SUFFIX}"
    atomic.write_bytes(path, result_lines(run.results))
    wrote_manifest = False
    try:
        if run.manifest is not None and not os.path.lexists(mpath):
            atomic.write_json(mpath, run.manifest)
            wrote_manifest = True
        atomic.write_json(opath, origin(b, run))
    except BaseException:
        path.unlink(missing_ok=True)  # the run is written whole or not at all
        if wrote_manifest:
            mpath.unlink(missing_ok=True)
        raise
    imported.append(name)


def _not_plain(path: Path) -> str | None:
    """What ``path`` is when it is not a regular file (a link is said as one, never followed), else None."""
    mode = os.lstat(path).st_mode
    if stat.S_ISREG(mode):
        return None
    return "a symbolic link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode) else "not a regular file"


def origin(b: Bundle, run: Run) -> dict[str, Any]:
    """The origin record of a run imported from ``b``: the bundle's file name, when, who shared it and the code
    that measured the run (its manifest's and results' version, commit and dirty flag), as the bundle says."""
    made: dict[str, dict[str, Any]] = {}
    codes = [(run.manifest or {}).get("code"), *(r.get("code") for r in run.results)]
    for c in codes:
        if isinstance(c, Mapping):
            entry = {k: c.get(k) if isinstance(c.get(k), str | bool) else None for k in ("version", "commit", "dirty")}
            made.setdefault(json.dumps(entry, sort_keys=True), entry)
    shared = b.code.get("shared_by")
    return {"schema": reader.ORIGIN_SCHEMA, "run_id": run.run_id, "host_id": b.host_id,
            "imported_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "bundle": os.path.basename(b.path)[:200], "measured_by": list(made.values())[:20],
            "shared_by": {k: shared.get(k) for k in ("version", "commit", "dirty")} if isinstance(shared, Mapping)
            else {}}


def _same(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> bool:
    def canon(rs: Sequence[Mapping[str, Any]]) -> list[str]:
        return sorted(json.dumps(r, sort_keys=True) for r in rs)

    return canon(a) == canon(b)
