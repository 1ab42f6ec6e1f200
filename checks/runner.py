"""Executes a planned run: one variant at a time, each result appended to the store as it arrives."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from checks import classify
from checks.executor import Executor, ExecutorError
from checks.plan import WorkItem
from checks.probe import SCHEMA
from checks.reasons import Catalogue
from checks.store import RunStore


@dataclass
class RunReport:
    results: list[dict[str, Any]] = field(default_factory=list)
    resumed: int = 0  # variants skipped because --resume found them recorded
    interrupted: bool = False


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def assemble(item: WorkItem, outcome: dict[str, Any], run_id: str, host_id: str, started_at: str) -> dict[str, Any]:
    """A ProbeResult (DESIGN.md contract) from one outcome."""
    return {
        "schema": SCHEMA,
        "run_id": run_id,
        "host_id": host_id,
        "cell_id": item.cell.cell_id,
        "probe_id": item.spec.id,
        "variant": item.variant.key,
        "status": outcome.get("status", "fail"),
        "reason_code": outcome.get("reason_code", "") or "",
        "note": outcome.get("note", "") or "",
        "remediation": outcome.get("remediation", "") or "",
        "metrics": outcome.get("metrics") or {},
        "evidence": outcome.get("evidence") or {},
        "started_at": started_at,
        "duration_s": outcome.get("duration_s", 0.0),
    }


def preset_outcome(item: WorkItem, catalogue: Catalogue) -> dict[str, Any]:
    assert item.preset is not None
    p = item.preset
    return classify.annotate({"status": p.status, "reason_code": p.reason_code, "note": p.note, "metrics": {},
                              "evidence": {}, "duration_s": 0.0}, catalogue)


def execute(items: list[WorkItem], executors: dict[str, Executor], store: RunStore, catalogue: Catalogue,
            gpus: int, resume: bool = False, on_result: Callable[[WorkItem, dict[str, Any]], None] | None = None,
            on_start: Callable[[WorkItem], None] | None = None) -> RunReport:
    """Run every item not yet recorded. Ctrl-C stops after cleanup; what finished stays in the store."""
    report = RunReport()
    done = store.recorded() if resume else set()
    broken: dict[str, str] = {}  # cell -> why its executor cannot start (e.g. image vanished)
    try:
        for item in items:
            if item.key in done:
                report.resumed += 1
                continue
            if on_start:
                on_start(item)
            started = now_iso()
            if item.preset is not None:
                outcome = preset_outcome(item, catalogue)
            elif item.cell.cell_id in broken:
                outcome = classify.annotate({"status": "not-run", "reason_code": "image-missing",
                                             "note": broken[item.cell.cell_id]}, catalogue)
            else:
                try:
                    outcome = executors[item.cell.cell_id].run(item.variant, gpus, item.timeout_s, catalogue)
                except ExecutorError as exc:
                    broken[item.cell.cell_id] = str(exc)
                    outcome = classify.annotate({"status": "not-run", "reason_code": "image-missing",
                                                 "note": str(exc)}, catalogue)
            result = assemble(item, outcome, store.run_id, store.host_id, started)
            store.append(result)
            report.results.append(result)
            if on_result:
                on_result(item, result)
    except KeyboardInterrupt:
        report.interrupted = True
        print("interrupted: results finished so far are kept in " + str(store.results_path), file=sys.stderr)
    return report
