"""A run that did not run a variant (``not-run``: a quick pass's deferral, a budget's cut, an interrupt) does not hide
an earlier run's verdict for it: the table, `checks diff` and the CI gate all show the verdict (one rule,
checks.results.result.shows_over). A newer verdict still replaces an older one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from checks.report.report import latest_results as report_latest
from checks.results import changes
from checks.results.hostresults import HostResults
from checks.results.reader import Run
from checks.results.result import ProbeResult
from checks.results.store import latest_results

HOST = "h100x1-0000aaaa"
CELL = "cu130-torch2.11.0-sglnone-fi0.7.4"
FULL, QUICK, LATER = "20261206T090000Z-aaaa", "20261206T100000Z-bbbb", "20261206T110000Z-cccc"
SHARED4 = "ranks=4,placement=shared,gpus=1"
SHARED2 = "ranks=2,placement=shared,gpus=1"


def _row(run: str, variant: str, status: str, code: str = "") -> dict[str, Any]:
    return {"schema": "stackprobe.result/1", "run_id": run, "host_id": HOST, "cell_id": CELL, "probe_id": "symm-mem",
            "variant": variant, "status": status, "reason_code": code, "note": "", "remediation": "", "metrics": {},
            "evidence": {}, "started_at": "2026-12-06T00:00:00+00:00", "duration_s": 1.0}


def _runs() -> dict[str, list[dict[str, Any]]]:
    return {
        FULL: [_row(FULL, SHARED4, "pass"), _row(FULL, SHARED2, "pass")],
        # the quick rerun: 4 ranks deferred to the full pass, 2 ranks run again and now failing
        QUICK: [_row(QUICK, SHARED4, "not-run", "deferred-world-size"),
                _row(QUICK, SHARED2, "fail", "symm-mem-wrong-result")],
    }


def test_the_table_keeps_a_verdict_a_later_run_did_not_ask_again(tmp_path: Path) -> None:
    folder = tmp_path / HOST
    folder.mkdir()
    for run, rows in _runs().items():
        (folder / f"{run}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    latest = {r.variant: r.verdict.status.value for r in latest_results(folder).values()}
    assert latest == {SHARED4: "pass", SHARED2: "fail"}


def test_the_ci_gate_and_checks_diff_read_it_alike() -> None:
    runs = {run: Run(run, None, tuple(rows)) for run, rows in _runs().items()}
    gate = {k[2]: str(r["status"]) for k, r in changes.latest(runs).items()}
    assert gate == {SHARED4: "pass", SHARED2: "fail"}
    results = tuple(ProbeResult.from_json(r) for rows in _runs().values() for r in rows)
    host = HostResults(HOST, (FULL, QUICK), results, {})
    assert {r.variant: r.verdict.status.value for r in host.latest()} == {SHARED4: "pass", SHARED2: "fail"}
    assert {r.variant: r.verdict.status.value for r in report_latest(list(results))} == {SHARED4: "pass",
                                                                                        SHARED2: "fail"}
    # a variant only ever deferred stays not-run; a later run's verdict replaces an earlier one
    only = (ProbeResult.from_json(_row(QUICK, "ranks=8,placement=shared,gpus=1", "not-run", "deferred-world-size")),
            ProbeResult.from_json(_row(FULL, SHARED4, "fail", "world-size-refused")),
            ProbeResult.from_json(_row(LATER, SHARED4, "pass")))
    got = {r.variant: r.verdict.status.value for r in HostResults(HOST, (FULL, QUICK, LATER), only, {}).latest()}
    assert got == {"ranks=8,placement=shared,gpus=1": "not-run", SHARED4: "pass"}
