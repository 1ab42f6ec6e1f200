"""From what came back from an isolated worker to a verdict with a reason (pure functions)."""

from __future__ import annotations

from typing import Any

from checks.isolate import ProcessOutcome
from checks.probe import STATUSES
from checks.reasons import GENERIC, Catalogue, last_error_line

CLASSIFIED = frozenset({"fail", "crash", "partial", "skip", "hang", "not-run", "unavailable"})


def _texts(result: dict[str, Any], stderr: str) -> list[str]:
    """Text to match, most telling first. A crash is judged only by its own rank's output: the others
    usually just report that their peer vanished."""
    ev = result.get("evidence") or {}
    texts = [str(result.get("note", "")), str(ev.get("traceback", "")), str(ev.get("rank_log", "")), stderr]
    if result.get("status") != "crash":
        texts.extend(str(v) for _, v in sorted((ev.get("log_tail") or {}).items()))
    return texts


def annotate(result: dict[str, Any], catalogue: Catalogue, stderr: str = "", fallback: str = GENERIC) -> dict[str, Any]:
    """Fill reason_code (matched when the probe set none), the reason's message and remediation.
    `fallback` is the code of a failure nothing in the catalogue recognises."""
    out = dict(result)
    out["evidence"] = dict(out.get("evidence") or {})
    status = out.get("status")
    code = out.get("reason_code") or ""
    if status not in CLASSIFIED:
        return out
    texts = _texts(out, stderr)
    if not code and status in ("fail", "crash"):
        for text in texts:  # earlier texts win; within one text, catalogue order
            hit = catalogue.match([text])
            if hit:
                code = hit.code
                break
        else:
            code = "signal" if status == "crash" else fallback
            if not out.get("note"):
                out["note"] = last_error_line(texts) or "failed without an error message"
    reason = catalogue.get(code) if code else None
    if reason is not None:
        out["evidence"]["reason"] = reason.message
        out["remediation"] = out.get("remediation") or reason.remediation
    if code == fallback:
        out["note"] = out.get("note") or last_error_line(texts)
    out["reason_code"] = code
    out.setdefault("remediation", "")
    return out


def from_process(p: ProcessOutcome, catalogue: Catalogue, timeout_s: float) -> dict[str, Any]:
    """The verdict for one isolated worker run, whatever happened to it."""
    tails = {"stdout_tail": p.stdout_tail[-1500:], "stderr_tail": p.stderr_tail[-1500:]}
    if p.timed_out:
        result = {"status": "hang", "reason_code": "hang",
                  "note": f"host watchdog: no result within {timeout_s:.0f}s; the process group was killed",
                  "evidence": dict(tails)}
    elif p.result is not None:
        result = dict(p.result)
        if result.get("status") not in STATUSES:
            result = {"status": "fail", "reason_code": "bad-result",
                      "note": f"the worker returned status {result.get('status')!r}", "evidence": dict(tails)}
    elif p.returncode is not None and p.returncode < 0:
        sig = p.signal_name
        result = {"status": "crash", "reason_code": "killed" if sig == "SIGKILL" else "",
                  "note": f"worker killed by {sig}", "evidence": {**tails, "signal": sig}}
    elif p.result_error:
        result = {"status": "fail", "reason_code": "bad-result", "note": p.result_error, "evidence": dict(tails)}
    elif p.returncode:
        result = {"status": "fail", "reason_code": "",
                  "note": last_error_line([p.stderr_tail]) or f"worker exited with code {p.returncode}",
                  "evidence": {**tails, "exit_code": p.returncode}}
        return _finish(annotate(result, catalogue, p.stderr_tail, fallback="nonzero-exit"), p)
    else:
        result = {"status": "fail", "reason_code": "no-result",
                  "note": "the worker exited without a result line on stdout", "evidence": dict(tails)}
    return _finish(annotate(result, catalogue, p.stderr_tail), p)


def _finish(result: dict[str, Any], p: ProcessOutcome) -> dict[str, Any]:
    result.setdefault("metrics", {})
    result.setdefault("note", "")
    result["evidence"] = dict(result.get("evidence") or {})
    if p.leftovers:
        result["evidence"]["leftover_processes_killed"] = p.leftovers
    if "duration_s" in result:
        result["evidence"]["worker_duration_s"] = result.pop("duration_s")
    result["duration_s"] = p.duration_s
    return result
