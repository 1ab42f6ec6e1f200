"""A verdict and the ProbeResult that records it: the one typed shape of a result, and its JSON (host side).

A probe's rank returns a plain dict over the JSON protocol (built with ``inenv.probe.outcome``); the host
turns what came back into a :class:`Verdict` once (:mod:`checks.run.classify`), the runner wraps it into a
:class:`ProbeResult` with where and when it ran and which code made it, and the store, the report and the
command line read only these types. Their JSON lives here and nowhere else.

The JSON of a ProbeResult, one object per line of ``results/<host_id>/<run_id>.jsonl``: ``schema``,
``run_id``, ``host_id``, ``cell_id``, ``probe_id``, ``variant``, ``status``, ``reason_code``, ``note``,
``remediation``, ``metrics``, ``evidence``, ``started_at``, ``duration_s`` and, since schema 2, ``code``:
``{version, commit, dirty, probe_hash}``. Lines of schema 1 have no ``code`` and still read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from checks.results.provenance import Provenance
from common import cellid
from common.cellid import CellId
from inenv.probe import SHARED, Params, key_parts
from inenv.status import Status, parse

SCHEMA = "stackprobe.result/2"
SCHEMA_V1 = "stackprobe.result/1"  # before results recorded the code that made them
SCHEMAS = (SCHEMA_V1, SCHEMA)
FIELDS = ("schema", "run_id", "host_id", "cell_id", "probe_id", "variant", "status", "reason_code", "note",
          "remediation", "metrics", "evidence", "started_at", "duration_s")
_IDS = ("run_id", "host_id", "cell_id", "probe_id", "variant", "started_at")
KEY_FIELDS = ("ranks", "placement", "gpus")  # parts of a variant key the worker sets, not the probe's own params


def shows_over(newer: str, older: str) -> bool:
    """Whether a newer run's result with status ``newer`` is what the table shows in place of an older run's with
    status ``older`` (status values as results spell them): always, except that a ``not-run`` (a quick pass's
    deferral, a budget's cut, an interrupt) says only that the newer run did not ask, so an earlier verdict stays."""
    return newer != Status.NOT_RUN.value or older == Status.NOT_RUN.value


def table_view(results: Iterable[ProbeResult]) -> dict[tuple[str, str, str], ProbeResult]:
    """Per (cell, probe, variant), the result the table shows among ``results`` in run order (run ids sort by
    time; :func:`shows_over`)."""
    best: dict[tuple[str, str, str], ProbeResult] = {}
    for r in sorted(results, key=lambda r: (r.run_id, r.started_at)):
        prev = best.get(r.key)
        if prev is None or shows_over(r.verdict.status.value, prev.verdict.status.value):
            best[r.key] = r
    return best


class ResultError(ValueError):
    """A JSON object that is not a ProbeResult; the message says why."""


def is_number(value: Any) -> bool:
    """An int or float that is not a bool (JSON numbers as a metric or duration may hold them)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class Verdict:
    """What one variant came to: the status, why, what to do about it, and what was measured."""

    status: Status
    reason_code: str = ""
    note: str = ""
    remediation: str = ""
    duration_s: float = 0.0
    metrics: Mapping[str, Any] = field(default_factory=dict)
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def replace(self, **changes: Any) -> Verdict:
        return dataclasses.replace(self, **changes)

    def with_evidence(self, **items: Any) -> Verdict:
        return self.replace(evidence={**self.evidence, **items})

    @classmethod
    def from_outcome(cls, data: Mapping[str, Any]) -> Verdict:
        """From the dict a worker printed or a probe's ``outcome()``; an unknown status raises ResultError."""
        status = parse(data.get("status"))
        if status is None:
            raise ResultError(f"unknown status {data.get('status')!r}")
        duration, metrics, evidence = data.get("duration_s"), data.get("metrics"), data.get("evidence")
        return cls(status=status, reason_code=str(data.get("reason_code") or ""), note=str(data.get("note") or ""),
                   remediation=str(data.get("remediation") or ""),
                   duration_s=float(duration) if is_number(duration) else 0.0,
                   metrics=dict(metrics) if isinstance(metrics, Mapping) else {},
                   evidence=dict(evidence) if isinstance(evidence, Mapping) else {})


@dataclass(frozen=True)
class ProbeResult:
    """One (cell, probe, variant) verdict as recorded: where it ran, when, and which code made it."""

    run_id: str
    host_id: str
    cell_id: str
    probe_id: str
    variant: str  # Variant.key, e.g. ranks=2,algo=allreduce:tree,mode=graph
    verdict: Verdict
    started_at: str
    code: Provenance | None = None  # None: recorded before results named their code (schema 1)
    schema: str = SCHEMA
    # Read once from ``variant`` and ``cell_id`` (inenv.probe.key_parts, common.cellid), for every reader:
    parts: Params = field(init=False, repr=False, compare=False)  # the variant key's (name, value) pairs
    params: Mapping[str, str] = field(init=False, repr=False, compare=False)  # the probe's own params
    ranks: int | None = field(init=False, repr=False, compare=False)  # None: a key without a rank count
    shared_gpu: bool = field(init=False, repr=False, compare=False)  # ranks shared GPUs
    cell: CellId | None = field(init=False, repr=False, compare=False)  # None: an id cellid did not make

    def __post_init__(self) -> None:
        parts = key_parts(self.variant)
        named = dict(parts)
        ranks = named.get("ranks", "")
        object.__setattr__(self, "parts", parts)
        object.__setattr__(self, "params", MappingProxyType({k: v for k, v in parts if k not in KEY_FIELDS}))
        object.__setattr__(self, "ranks", int(ranks) if ranks.isdigit() else None)
        # ranks on shared GPUs: ``placement=shared``, or ``gpus=shared`` as keys recorded before the GPU count
        object.__setattr__(self, "shared_gpu", SHARED in (named.get("placement"), named.get("gpus")))
        object.__setattr__(self, "cell", cellid.parse(self.cell_id))

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.cell_id, self.probe_id, self.variant)

    @property
    def result_id(self) -> str:
        """The stable name of this result, ``<run_id>/<cell_id>/<probe_id>/<variant>``: a run holds one result
        per (cell, probe, variant), and none of the parts contains a slash."""
        return "/".join((self.run_id, self.cell_id, self.probe_id, self.variant))

    def to_json(self) -> dict[str, Any]:
        v = self.verdict
        out: dict[str, Any] = {
            "schema": self.schema, "run_id": self.run_id, "host_id": self.host_id, "cell_id": self.cell_id,
            "probe_id": self.probe_id, "variant": self.variant, "status": v.status.value,
            "reason_code": v.reason_code, "note": v.note, "remediation": v.remediation, "metrics": dict(v.metrics),
            "evidence": dict(v.evidence), "started_at": self.started_at, "duration_s": v.duration_s,
        }
        if self.code is not None:
            out["code"] = self.code.to_json()
        return out

    @classmethod
    def from_json(cls, obj: Any) -> ProbeResult:
        """Read one parsed line of either schema; ResultError says what is wrong with it."""
        if not isinstance(obj, dict):
            raise ResultError("not a JSON object")
        missing = [f for f in FIELDS if f not in obj]
        if missing:
            raise ResultError(f"missing field(s) {', '.join(missing)}")
        if obj["schema"] not in SCHEMAS:
            raise ResultError(f"schema {obj['schema']!r}, expected one of {', '.join(SCHEMAS)}")
        status = parse(obj["status"])
        if status is None:
            raise ResultError(f"unknown status {obj['status']!r}")
        if not all(isinstance(obj[k], str) for k in _IDS):
            raise ResultError("an id field is not a string")
        if not isinstance(obj["metrics"], dict) or not isinstance(obj["evidence"], dict):
            raise ResultError("metrics and evidence must be objects")
        if not is_number(obj["duration_s"]):
            raise ResultError("duration_s is not a number")
        code = None
        if obj["schema"] != SCHEMA_V1:
            code = Provenance.from_json(obj.get("code"))
            if code is None:
                raise ResultError(f"schema {obj['schema']} needs code {{version, commit, dirty, probe_hash}}")
        verdict = Verdict(status, str(obj["reason_code"] or ""), str(obj["note"] or ""),
                          str(obj["remediation"] or ""), float(obj["duration_s"]), obj["metrics"], obj["evidence"])
        return cls(obj["run_id"], obj["host_id"], obj["cell_id"], obj["probe_id"], obj["variant"], verdict,
                   obj["started_at"], code, obj["schema"])
