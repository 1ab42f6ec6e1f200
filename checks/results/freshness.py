"""Whether a recorded verdict was made by the probe code of this checkout, and how to refresh it (pure).

A verdict is *stale* when the hash of its probe's source recorded with it differs from the hash of the
probe's source now (the probe or a helper it imports changed since), or when it records no code at all
(results written before results named their code). It is *unidentified* when no commit names the code that
made it: ``commit: unknown`` (run outside a git checkout) or ``dirty`` true or unknown (checks/ differed from
the commit, or nobody could tell); both are marked and refreshed alike. A verdict that host-side code decided
or shaped (the requirement judge, the classifier of a worker that gave none, provenance.VERDICT_CODE) is stale
too when the version it records of that code is not this checkout's, or when it records none. Verdicts decided
without running a probe (``not-run``: the image did not build; ``unavailable``: the cell cannot be
provisioned) are never stale for these reasons. A verdict of a run imported from another machine (``checks
import``) is stale too: the code it names is the bundle's claim, which this checkout cannot check (a bundle can
copy any hash).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from checks.results import provenance
from checks.results.result import ProbeResult
from common import escape
from inenv.status import Status

UNRECORDED = "unrecorded"
CHANGED = "changed"
JUDGE_CHANGED = "judge-changed"
UNKNOWN_COMMIT = "unknown-commit"
DIRTY = "dirty"
CONTRIBUTED = "contributed"
NOT_BY_PROBE = frozenset({Status.NOT_RUN, Status.UNAVAILABLE})
_PHRASE = {
    UNRECORDED: "recorded before results named the code that made them",
    CHANGED: "the probe's source changed since",
    JUDGE_CHANGED: "judged on the host by another version of its host-side judge (the judge's file and the modules "
                   "it imports: provenance.VERDICT_CODE) than this checkout's, or with other versions of the libraries "
                   "it uses, or by one no result recorded",
    UNKNOWN_COMMIT: "made by code outside a git checkout (commit unknown)",
    DIRTY: "made by code with uncommitted changes, or changes nobody recorded (dirty true or unknown)",
    CONTRIBUTED: "measured elsewhere and imported: the probe code it names is the bundle's claim, which this "
                 "checkout cannot check",
}
_ORDER = (UNRECORDED, CHANGED, JUDGE_CHANGED, CONTRIBUTED, UNKNOWN_COMMIT, DIRTY)


def why(reasons: frozenset[str]) -> str:
    """One phrase for a group of stale verdicts' reasons."""
    if reasons == {UNRECORDED, CHANGED}:
        return "made by older or unrecorded probe code"
    return "; ".join(_PHRASE[r] for r in _ORDER if r in reasons)


def judged_by(result: ProbeResult) -> dict[str, str] | None:
    """The host-side code that shaped ``result`` after its probe ran, file name -> version, as it recorded it;
    {} when it names none but was shaped (the requirement judge's counts in its evidence, written before
    results named the judge's version); None when no host-side code shaped it."""
    recorded = result.verdict.evidence.get(provenance.JUDGED_BY)
    if isinstance(recorded, dict):  # untrusted: only a known file with a hash-shaped version counts
        return {k: v for k, v in recorded.items() if k in provenance.VERDICT_CODE and isinstance(v, str)
                and len(v) == provenance.HASH_CHARS and v.isalnum() and v.isascii()}
    installed = result.verdict.evidence.get("installed")
    return {} if isinstance(installed, dict) and "requirements_read" in installed else None


def judged_with(result: ProbeResult) -> dict[str, str] | None:
    """The third-party versions the judge recorded it judged ``result`` with (provenance.JUDGED_WITH), None when
    it recorded none."""
    recorded = result.verdict.evidence.get(provenance.JUDGED_WITH)
    if not isinstance(recorded, dict):
        return None
    return {k: v for k, v in recorded.items() if isinstance(k, str) and isinstance(v, str)}


def judge_changed(result: ProbeResult, judges: Mapping[str, str] | None = None) -> bool:
    """Whether host-side code shaped ``result`` in a version other than this checkout's (``judges``: file
    name -> version; default provenance.verdict_code_versions()), or in one it did not record, or with
    third-party versions other than those installed here, or recording none."""
    shaped = judged_by(result)
    if shaped is None:
        return False
    now = provenance.verdict_code_versions() if judges is None else judges
    used = judged_with(result)
    return not shaped or any(now.get(name) != version or used != provenance.verdict_code_with(name)
                             for name, version in shaped.items())


def staleness(result: ProbeResult, current: Mapping[str, str], judges: Mapping[str, str] | None = None,
              contributed: bool = False) -> str:
    """"" when ``result`` was made by the current source of its probe (``current``: probe id -> hash) at a
    known, clean commit, and judged by this checkout's host-side code where that shaped it (``judges``: file
    name -> version; default provenance.verdict_code_versions()), else UNRECORDED, CHANGED, JUDGE_CHANGED,
    CONTRIBUTED (``contributed``: its run was imported, so its code is a claim), UNKNOWN_COMMIT or DIRTY (the
    first that applies)."""
    if result.verdict.status in NOT_BY_PROBE:
        return ""
    if result.code is None:
        return UNRECORDED
    if not provenance.same_code(result.code.probe_hash, current.get(result.probe_id)):
        return CHANGED
    if judge_changed(result, judges):
        return JUDGE_CHANGED
    if contributed:
        return CONTRIBUTED
    if result.code.commit == "unknown":
        return UNKNOWN_COMMIT
    return "" if result.code.dirty is False else DIRTY


@dataclass(frozen=True)
class Refresh:
    """Probes whose verdicts on some cells are stale, for the same reason, and the command that reruns them."""

    probes: tuple[str, ...]
    cells: tuple[str, ...]
    variants: int
    why: str
    command: str
    local: bool  # made with --local: the command reruns them in the environment the cell names


EXECUTORS = ("local", "venv", "slurm", "docker")  # the back ends a manifest may name, each one a --backend


def command(probes: tuple[str, ...], cells: tuple[str, ...], executor: str) -> str:
    """`checks run --backend B` for exactly these probes on these cells, B the backend that made them (a local
    cell is the environment it ran in, so no cell is named; venv cells are rebuilt and run as venvs; docker
    when the run did not say). Probes are named one by one, never as --all, so the table does not change when
    a probe is added."""
    picks = [w for p in probes for w in ("--probe", p)]
    backend = executor if executor in EXECUTORS else "docker"
    if backend == "local":
        return escape.command(["checks", "run", "--backend", "local", *picks])
    return escape.command(["checks", "run", "--backend", backend, *(w for c in cells for w in ("--only", c)),
                               *picks])


def refresh_list(stale: list[tuple[ProbeResult, str]], executors: Mapping[str, str]) -> list[Refresh]:
    """Group stale results (with their staleness) by executor, cells and reason, one command per group.
    ``executors``: the executor each run id was made with (local, docker, venv; docker when unknown)."""
    per_probe: dict[tuple[str, str], list[tuple[ProbeResult, str]]] = defaultdict(list)
    for r, reason in stale:
        per_probe[(executors.get(r.run_id, "docker"), r.probe_id)].append((r, reason))
    groups: dict[tuple[str, tuple[str, ...], str], list[tuple[str, int]]] = defaultdict(list)
    for (executor, pid), rs in sorted(per_probe.items()):
        cells = tuple(sorted({r.cell_id for r, _ in rs}))
        groups[(executor, cells, why(frozenset(w for _, w in rs)))].append((pid, len(rs)))
    out = []
    for (executor, cells, reason), members in sorted(groups.items(),
                                                     key=lambda kv: (kv[0][0] == "local", kv[1][0][0])):
        probes = tuple(p for p, _ in members)
        out.append(Refresh(probes, cells, sum(n for _, n in members), reason, command(probes, cells, executor),
                           executor == "local"))
    return out
