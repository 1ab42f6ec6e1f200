"""Incremental runs (host side): a variant whose inputs match the result this host recorded last for it is not
run again; that result is carried into the new run as a copy marked with the run that measured it.

A verdict's inputs: the host (its results folder), the cell, the cell's environment (a Docker image's id, below
its kernel layer where it has one; for a venv or a local interpreter, its installed distributions, toolkit, host
compiler and the run-shaping environment variables the ranks inherit) and the digest of each carried kernel
module the variant loads, the probe's source hash, the variant (its key holds its params),
the host facts the probe can read (the GPUs and their driver for every probe, since compile and inventory
probes look at the local GPU too; the cross-compile targets for CPU-only probes) and the run's level.

Only verdicts a rerun would repeat are carried: what a probe itself decided (pass, partial, fail, skip),
never a hang, a crash, a not-run, a worker that died without an answer, or a result made by code that
differed from its commit (``code.dirty`` true or unknown). A full run never carries a result marked quick:
only a variant the quick level shortens (one whose probe needs a GPU: its ranks measure fewer sizes) is
marked; every other variant of a quick run does the same work as at the full level and answers it. The full
pass of a `checks run` without --level carries every unmarked result its own quick pass made, whatever the
verdict and the code's state (see :func:`why_not`).

Everything here is pure but :func:`latest`, which reads the results folder (each executor's ``fingerprint``
asks its cell's environment what it is).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checks.results import freshness, provenance
from checks.results.result import ProbeResult, Verdict
from checks.results.store import LEVEL, REUSED_FROM, latest_results, level_of
from checks.run.executor import EnvPrint, digest
from checks.run.plan import WorkItem, jit_modules
from common import reasons
from inenv.probe import FULL, QUICK
from inenv.status import Status

Key = tuple[str, str, str]
INPUTS = "inputs"  # evidence key: the Inputs a result was made from
CARRIED = frozenset({Status.PASS, Status.PARTIAL, Status.FAIL, Status.SKIP})


@dataclass(frozen=True)
class Inputs:
    """The inputs of one variant's verdict beyond its host, cell, key and probe hash (which the result holds)."""

    env: str  # the cell environment's fingerprint
    host: str  # digest of the host facts the probe can read

    def to_json(self) -> dict[str, str]:
        return {"env": self.env, "host": self.host}


def host_inputs(needs_gpu: bool, facts: Mapping[str, Any], target_archs: tuple[str, ...]) -> str:
    """The host facts a probe's verdict can depend on, digested."""
    gpus = [str(g.get("name")) for g in facts.get("gpus") or [] if isinstance(g, Mapping)]
    seen: dict[str, Any] = {"gpus": gpus, "gpu_count": facts.get("gpu_count"), "driver": facts.get("driver"),
                            "compute_capability": facts.get("compute_capability")}
    if not needs_gpu:
        seen["target_archs"] = list(target_archs)  # the compile probes build for every one of them
    return digest(seen)


def inputs_for(item: WorkItem, env: EnvPrint | None, facts: Mapping[str, Any],
               target_archs: tuple[str, ...]) -> Inputs | None:
    """None when the environment's fingerprint is unknown or the probe reads host state no input captures
    (``ProbeSpec.reusable``): such a result can never be matched. The environment counts as the variant sees
    it: the cell's environment less its carried kernel set, and the digests of the carried modules the
    variant loads (plan.jit_modules), so a set that gains or changes a module reruns only what loads it."""
    if env is None or not env.base or not item.spec.reusable:
        return None
    return Inputs(env.of(jit_modules(item)), host_inputs(item.spec.needs_gpu, facts, target_archs))


def why_not(result: ProbeResult, inputs: Inputs | None, probe_hash: str | None, level: str,
            same_command: bool = False) -> str:
    """'' when ``result`` answers a variant with these inputs in a run at ``level``; else why it does not.
    ``same_command``: the result was recorded by an earlier pass of this very command: made by the code now
    running even when that code differs from its commit (the probe's hash is still compared), and carried
    whatever its verdict, since running it again minutes later would repeat its cost (a hang's timeout)
    for an answer no fresher. A failure of the harness itself (a reason the catalogue marks ``harness``: a
    worker that gave no answer, a lost container) is never carried, not even from an earlier pass."""
    v = result.verdict
    if v.reason_code in reasons.default().harness_codes:
        return f"its verdict ({v.status} {v.reason_code}) is the harness's failure, not the feature's"
    if not same_command and v.status not in CARRIED:
        return f"its verdict ({v.status} {v.reason_code}) is not one a rerun repeats"
    if result.code is None or (result.code.dirty is not False and not same_command):
        return "made by code that differed from its commit (or by unrecorded code)"
    if not provenance.same_code(result.code.probe_hash, probe_hash):
        return "the probe's source changed"
    if freshness.judge_changed(result):
        return "the host-side code that judged it changed (or it recorded no version of it)"
    if inputs is None:
        return "this cell's environment has no fingerprint"
    if v.evidence.get(INPUTS) != inputs.to_json():
        return "the environment or the host facts changed"
    if level == FULL and level_of(result) == QUICK:
        return "made by a quick run"
    return ""


def decide(items: list[WorkItem], latest: Mapping[Key, ProbeResult], inputs: Mapping[Key, Inputs | None],
           hashes: Mapping[str, str], level: str, this_command: frozenset[str] = frozenset()) -> list[WorkItem]:
    """``items`` with ``reused`` set where the newest recorded result of the same key answers it (variants
    decided without running are decided again: that costs nothing). ``this_command``: the runs an earlier
    pass of this command recorded."""
    out = []
    for it in items:
        r = latest.get(it.key)
        if it.decided is None and r is not None and not why_not(r, inputs.get(it.key), hashes.get(it.spec.id),
                                                                level, r.run_id in this_command):
            it = dataclasses.replace(it, reused=r)
        out.append(it)
    return out


def rechecked(item: WorkItem, latest: Mapping[Key, ProbeResult], hashes: Mapping[str, str]) -> bool:
    """Whether ``item`` runs only to read again the host state no input captures (its probe is not
    ``reusable``) while this host holds its latest record, made by the same probe code. Reading the same facts
    again, it learns nothing and the store records nothing for it (checks.results.store.is_news); so it asks for
    no quick pass before the full one."""
    r = latest.get(item.key)
    return (item.runs and not item.spec.reusable and r is not None and r.code is not None
            and provenance.same_code(r.code.probe_hash, hashes.get(item.spec.id)))


def origin(result: ProbeResult) -> str:
    """The run that measured ``result`` (itself, unless it was carried)."""
    return str(result.verdict.evidence.get(REUSED_FROM) or result.run_id)


def carried(result: ProbeResult, run_id: str) -> ProbeResult:
    """The copy of ``result`` recorded in run ``run_id``: same verdict, code, start time and inputs, naming the
    run that measured it."""
    return dataclasses.replace(result, run_id=run_id,
                               verdict=result.verdict.with_evidence(**{REUSED_FROM: origin(result)}))


def shortened(item: WorkItem, level: str | None) -> bool:
    """Whether ``item`` does less at ``level`` than at the full level: a GPU variant of a quick run."""
    return level == QUICK and item.spec.needs_gpu


def stamped(verdict: Verdict, inputs: Inputs | None, quick: bool) -> Verdict:
    """A fresh verdict with what a later run needs to carry it: its inputs, and the quick level when the
    level shortened it."""
    extra: dict[str, Any] = {INPUTS: inputs.to_json()} if inputs else {}
    if quick:
        extra[LEVEL] = QUICK
    return verdict.with_evidence(**extra) if extra else verdict


def reused_line(items: Iterable[WorkItem]) -> str:
    """``40 unchanged, reused from run X; --fresh reruns them``; '' when nothing is reused."""
    runs = sorted({origin(it.reused) for it in items if it.reused is not None})
    n = sum(1 for it in items if it.reused is not None)
    if not n:
        return ""
    where = f"run {runs[0]}" if len(runs) == 1 else f"runs {', '.join(runs[:3])}" + (
        f" +{len(runs) - 3} more" if len(runs) > 3 else "")
    return f"{n} unchanged, reused from {where}; --fresh reruns them"


# --- the readers -----------------------------------------------------------------------------------------------
def latest(folder: Path) -> dict[Key, ProbeResult]:
    """Per (cell, probe, variant), the result of the newest run in a host's results folder (what the table
    shows)."""
    return latest_results(folder)
