"""From what came back from an isolated worker to a verdict with a reason (pure functions)."""

from __future__ import annotations

from pathlib import Path

from checks.results import provenance
from checks.results.result import ResultError, Verdict, is_number
from checks.run.isolate import ProcessOutcome
from common.reasons import GENERIC, Catalogue, last_error_line
from inenv.status import ORDER, Status

VERDICT_ROLE = "classifier of a worker that gave no verdict"  # what provenance.VERDICT_CODE reads this file as
CLASSIFIED = frozenset(ORDER) - {Status.PASS}  # every verdict but pass gets a reason


def _texts(v: Verdict, stderr: str) -> list[str]:
    """Text to match, most telling first. A crash is judged only by its own rank's output: the others
    usually just report that their peer vanished."""
    ev = v.evidence
    texts = [v.note, str(ev.get("traceback", "")), str(ev.get("rank_log", "")), stderr]
    if v.status is not Status.CRASH:
        texts.extend(str(t) for _, t in sorted((ev.get("log_tail") or {}).items()))
    return texts


def annotate(v: Verdict, catalogue: Catalogue, stderr: str = "", fallback: str = GENERIC) -> Verdict:
    """Fill reason_code (matched when the probe set none), the reason's message and remediation.
    `fallback` is the code of a failure nothing in the catalogue recognises."""
    if v.status not in CLASSIFIED:
        return v
    texts = _texts(v, stderr)
    code, note = v.reason_code, v.note
    if not code and v.status in (Status.FAIL, Status.CRASH):
        for text in texts:  # earlier texts win; within one text, catalogue order
            hit = catalogue.match([text])
            if hit:
                code = hit.code
                break
        else:
            code = "signal" if v.status is Status.CRASH else fallback
            note = note or last_error_line(texts) or "failed without an error message"
    evidence, remediation = dict(v.evidence), v.remediation
    reason = catalogue.get(code) if code else None
    if reason is not None:
        evidence["reason"] = reason.message
        remediation = remediation or reason.remediation
    if code == fallback:
        note = note or last_error_line(texts)
    return v.replace(reason_code=code, note=note, remediation=remediation, evidence=evidence)


def decided(status: Status, reason_code: str, note: str, catalogue: Catalogue) -> Verdict:
    """A verdict reached without running anything (a planned skip, an image that did not build)."""
    return annotate(Verdict(status, reason_code, note), catalogue)


def from_process(p: ProcessOutcome, catalogue: Catalogue, timeout_s: float) -> Verdict:
    """The verdict for one isolated worker run, whatever happened to it. One this classifier decided (the worker
    gave none it could read) records its version (provenance.judged_evidence): a change of it stales it."""
    tails = {"stdout_tail": p.stdout_tail[-1500:], "stderr_tail": p.stderr_tail[-1500:]}
    fallback = GENERIC
    decided_here = True
    if p.timed_out:
        v = Verdict(Status.HANG, "hang", f"host watchdog: no result within {timeout_s:.0f}s; the process group "
                    "was killed", evidence=tails)
    elif p.result is not None:
        try:
            v = Verdict.from_outcome(p.result)
        except ResultError:
            v = Verdict(Status.FAIL, "bad-result", f"the worker returned status {p.result.get('status')!r}",
                        evidence=tails)
        else:
            decided_here = False
            if "duration_s" in p.result:  # the worker's own clock; the verdict's duration is the host's
                v = v.with_evidence(worker_duration_s=v.duration_s)
    elif p.returncode is not None and p.returncode < 0:
        sig = p.signal_name
        v = Verdict(Status.CRASH, "killed" if sig == "SIGKILL" else "", f"worker killed by {sig}",
                    evidence={**tails, "signal": sig})
    elif p.result_error:
        v = Verdict(Status.FAIL, "bad-result", p.result_error, evidence=tails)
    elif p.returncode:
        v = Verdict(Status.FAIL, "", last_error_line([p.stderr_tail]) or f"worker exited with code {p.returncode}",
                    evidence={**tails, "exit_code": p.returncode})
        fallback = "nonzero-exit"
    else:
        v = Verdict(Status.FAIL, "no-result", "the worker exited without a result line on stdout", evidence=tails)
    v = annotate(v, catalogue, p.stderr_tail, fallback=fallback)
    if decided_here:
        v = v.with_evidence(**provenance.judged_evidence(Path(__file__)))
    if p.leftovers:
        v = v.with_evidence(leftover_processes_killed=p.leftovers)
    # A variant that waited at the GPU gate (inenv.gpugate) spent that wait beside the one before it.
    evidence = p.result.get("evidence") if p.result else None
    phases = evidence.get("phases") if isinstance(evidence, dict) else None
    queued = phases.get("queued") if isinstance(phases, dict) else None
    waited = float(queued) if is_number(queued) else 0.0
    return v.replace(duration_s=round(max(0.0, p.duration_s - waited), 3))
