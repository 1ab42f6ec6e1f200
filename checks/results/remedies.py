"""Which next step a result that did not pass is offered (pure; host side): a reason's remedies per NCCL release range
(common/reasons.py), each only where results on the same NCCL release show its exact setting passing and none
failing. A setting is what an nccl-graphs variant ran (``inenv.probes.nccl_graphs.setting_of``: NCCL_ALGO and
NCCL_PROTO): the probe that runs each setting engines use on every collective they issue at warm-up, eagerly and
in a CUDA graph. Results are untrusted data: they choose among the catalogue's texts, never supply one."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from checks.results.result import ProbeResult
from common import reasons
from common.reasons import Catalogue, Setting
from inenv.probes import nccl_graphs
from inenv.status import Status

PROBE = nccl_graphs.SPEC.id
# A result with the setting that says it does not work: the feature was reached and failed, hung or crashed, or
# worked only in part
AGAINST = frozenset({Status.FAIL, Status.PARTIAL, Status.HANG, Status.CRASH})
_RELEASE = re.compile(r"^\d+\.\d+(?:\.\d+)*$")


def nccl_release(r: ProbeResult) -> str | None:
    """The NCCL release a result ran on: the worker's record of the environment (``evidence.env.nccl``), else what
    the probe read from torch (``evidence.nccl_version``), else the release an NCCL-axis cell id names."""
    ev = r.verdict.evidence
    env = ev.get("env") if isinstance(ev.get("env"), Mapping) else {}
    for value in (env.get("nccl"), ev.get("nccl_version"), r.cell.nccl if r.cell else None):
        if isinstance(value, str) and _RELEASE.match(value):
            return value
    return None


def setting(r: ProbeResult) -> Setting | None:
    """The exact NCCL setting an nccl-graphs result ran under, as the catalogue spells one; None for another
    probe's result or a variant this checkout's probe does not plan."""
    if r.probe_id != PROBE:
        return None
    found = nccl_graphs.setting_of(r.params)
    return tuple(sorted(found.items())) if found is not None else None


@dataclass(frozen=True)
class Shown:
    """What results show of each (NCCL release, setting): passing somewhere, and failing somewhere."""

    passed: frozenset[tuple[str, Setting]] = frozenset()
    failed: frozenset[tuple[str, Setting]] = frozenset()

    def holds(self, release: str, wanted: Setting) -> bool:
        """The setting passed on the release and no result there shows it failing."""
        return (release, wanted) in self.passed and (release, wanted) not in self.failed


def shown(results: Iterable[ProbeResult]) -> Shown:
    """A partial saying how far its host could check (the catalogue's ``host_bound``: a one-rank set-up whose
    setting NCCL accepted) shows its setting neither passing nor failing."""
    neutral = reasons.default().host_bound_codes
    passed: set[tuple[str, Setting]] = set()
    failed: set[tuple[str, Setting]] = set()
    for r in results:
        found, release = setting(r), nccl_release(r)
        if found is None or release is None:
            continue
        if r.verdict.status is Status.PASS:
            passed.add((release, found))
        elif r.verdict.status in AGAINST and r.verdict.reason_code not in neutral:
            failed.add((release, found))
    return Shown(frozenset(passed), frozenset(failed))


def offered(r: ProbeResult, catalogue: Catalogue, seen: Shown) -> str | None:
    """The catalogue's next step for ``r``, chosen for its NCCL release (``reasons.offered``); None when the
    catalogue does not know its code."""
    reason = catalogue.get(r.verdict.reason_code)
    return reasons.offered(reason, nccl_release(r), seen.holds) if reason is not None else None
