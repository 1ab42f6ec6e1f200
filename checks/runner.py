"""Executes a planned run: one variant at a time, each result appended to the store as it arrives."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from checks import classify
from checks.executor import Executor, ExecutorError
from checks.plan import WorkItem
from checks.provenance import Provenance
from checks.reasons import Catalogue
from checks.result import ProbeResult, Verdict
from checks.status import Status
from checks.store import RunStore


@dataclass
class RunReport:
    results: list[ProbeResult] = field(default_factory=list)
    resumed: int = 0  # variants skipped because --resume found them recorded
    interrupted: bool = False


def iso(stamp: float) -> str:
    """A POSIX time as the results record it: UTC, to the second."""
    return datetime.fromtimestamp(stamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_iso() -> str:
    return iso(datetime.now(UTC).timestamp())


def assemble(item: WorkItem, verdict: Verdict, run_id: str, host_id: str, started_at: str,
             code: Provenance | None) -> ProbeResult:
    return ProbeResult(run_id, host_id, item.cell.cell_id, item.spec.id, item.variant.key, verdict, started_at, code)


def preset_verdict(item: WorkItem, catalogue: Catalogue) -> Verdict:
    assert item.preset is not None
    p = item.preset
    return classify.decided(p.status, p.reason_code, p.note, catalogue)


def execute(items: list[WorkItem], executors: dict[str, Executor], store: RunStore, catalogue: Catalogue,
            gpus: int, codes: Mapping[str, Provenance], resume: bool = False,
            on_result: Callable[[WorkItem, ProbeResult], None] | None = None,
            on_start: Callable[[WorkItem], None] | None = None) -> RunReport:
    """Run every item not yet recorded. Ctrl-C stops after cleanup; what finished stays in the store.
    ``codes``: the code each probe id runs with, recorded in its results."""
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
                verdict = preset_verdict(item, catalogue)
            elif item.cell.cell_id in broken:
                verdict = classify.decided(Status.NOT_RUN, "image-missing", broken[item.cell.cell_id], catalogue)
            else:
                try:
                    verdict = executors[item.cell.cell_id].run(item.variant, gpus, item.timeout_s, catalogue)
                except ExecutorError as exc:
                    broken[item.cell.cell_id] = str(exc)
                    verdict = classify.decided(Status.NOT_RUN, "image-missing", str(exc), catalogue)
            result = assemble(item, verdict, store.run_id, store.host_id, started, codes.get(item.spec.id))
            store.append(result)
            report.results.append(result)
            if on_result:
                on_result(item, result)
    except KeyboardInterrupt:
        report.interrupted = True
        print("interrupted: results finished so far are kept in " + str(store.results_path), file=sys.stderr)
    return report
