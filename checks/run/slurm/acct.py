"""What Slurm says about a job, and what that makes of the variants it did not finish (pure, host side).

The queue (``squeue``) says which jobs still live; once a job has left it, how it ended comes from the
first of these that knows it: accounting (``sacct``, with slurmdbd), the job completion log (``sacct
--completion``, which needs no database) and the controller's memory of recent jobs (``scontrol show
job``). A variant whose outcome the node wrote keeps the verdict the worker gave it, as in a local run.
A variant without one gets the job's cause: the one running when Slurm ended the job is ``hang`` at a
time limit, ``crash`` at out-of-memory or a node failure and ``fail`` when the job failed; one that never
started is ``not-run`` with the same cause. Nothing is left unrecorded and nothing becomes a pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from checks.results import provenance
from checks.results.result import Verdict
from common.reasons import Catalogue, last_error_line
from inenv.status import Status

VERDICT_ROLE = "Slurm accounting reader"  # what checks.results.provenance.VERDICT_CODE reads this file as
SQUEUE_FORMAT = "%i|%T|%r|%N"  # job id, state, reason, nodes
SACCT_FIELDS = "JobID,State,ExitCode,Reason,NodeList"
# A job in one of these states has ended; any other state (PENDING, RUNNING, COMPLETING, REQUEUED,
# SUSPENDED, CONFIGURING...) may still run variants.
TERMINAL = frozenset({"COMPLETED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "CANCELLED", "PREEMPTED",
                      "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"})
OOM = "slurm-oom"  # its catalogue patterns are slurmstepd's own words in the job's output


@dataclass(frozen=True)
class Queued:
    job_id: str
    state: str
    reason: str
    nodes: str

    def describe(self) -> str:
        where = f" on {self.nodes}" if self.state == "RUNNING" and self.nodes else ""
        why = f" ({self.reason})" if self.reason and self.reason != "None" else ""
        return f"{self.state}{where}{why}"


def parse_squeue(text: str) -> dict[str, Queued]:
    """Lines of ``squeue -h -o '%i|%T|%r|%N'``."""
    out = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0]:
            out[parts[0]] = Queued(*parts)
    return out


@dataclass(frozen=True)
class JobEnd:
    """How a job ended, as one source recorded it."""

    job_id: str
    state: str  # first word: sacct writes "CANCELLED by 1000"
    exit_code: int
    signal: int
    reason: str
    nodes: str
    source: str  # sacct | sacct --completion | scontrol

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def to_json(self) -> dict[str, object]:
        return {"job": self.job_id, "state": self.state, "exit_code": self.exit_code, "signal": self.signal,
                "reason": self.reason, "nodes": self.nodes, "source": self.source}


def parse_exit(text: str) -> tuple[int, int]:
    """Slurm's ``code:signal``."""
    code, _, sig = text.partition(":")
    try:
        return int(code or 0), int(sig or 0)
    except ValueError:
        return 0, 0


def parse_sacct(text: str, source: str) -> dict[str, JobEnd]:
    """Lines of ``sacct -n -P -o JobID,State,ExitCode,Reason,NodeList`` (with or without ``--completion``).
    Job steps (``123.batch``) are left out; a job listed twice (requeued after a node failure, then ended
    again) is taken at its last line."""
    out: dict[str, JobEnd] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 5 or not parts[0] or "." in parts[0]:
            continue
        code, sig = parse_exit(parts[2])
        state = parts[1].split()[0] if parts[1].strip() else ""
        out[parts[0]] = JobEnd(parts[0], state, code, sig, parts[3], parts[4], source)
    return out


_KV = re.compile(r"(\S+?)=(\S*)")


def parse_scontrol(text: str) -> dict[str, JobEnd]:
    """Lines of ``scontrol show job -o ID``: one job per line, ``Key=Value`` separated by spaces."""
    out: dict[str, JobEnd] = {}
    for line in text.splitlines():
        kv = dict(_KV.findall(line))
        if "JobId" not in kv or "JobState" not in kv:
            continue
        code, sig = parse_exit(kv.get("ExitCode", "0:0"))
        out[kv["JobId"]] = JobEnd(kv["JobId"], kv["JobState"], code, sig, kv.get("Reason", ""),
                                  kv.get("NodeList", ""), "scontrol")
    return out


def cause(end: JobEnd | None, log_tail: str, catalogue: Catalogue) -> str:
    """The reason code for the variants of a job that ended as ``end`` without an outcome. A job killed
    for its memory by the accounting poller (no cgroups) ends FAILED with signal 9; slurmstepd's words in
    its output say why."""
    if end is None:
        return "slurm-lost"
    oom = catalogue.get(OOM)
    if end.state == "OUT_OF_MEMORY" or (oom is not None and any(p.search(log_tail) for p in oom.patterns)):
        return OOM
    return {"TIMEOUT": "slurm-timeout", "NODE_FAIL": "slurm-node-fail", "BOOT_FAIL": "slurm-node-fail",
            "CANCELLED": "slurm-cancelled", "PREEMPTED": "slurm-cancelled", "DEADLINE": "slurm-cancelled",
            "REVOKED": "slurm-cancelled", "FAILED": "slurm-failed", "COMPLETED": "slurm-lost"}.get(end.state,
                                                                                                 "slurm-ended")


# The verdict of the variant that was running when the job ended; one that never started is not-run.
RUNNING_STATUS = {"slurm-timeout": Status.HANG, OOM: Status.CRASH, "slurm-node-fail": Status.CRASH,
                  "slurm-failed": Status.FAIL}


def _state_words(end: JobEnd) -> str:
    words = end.state
    if end.exit_code or end.signal:
        words += f", exit {end.exit_code}" + (f" signal {end.signal}" if end.signal else "")
    if end.reason and end.reason != "None":
        words += f", reason {end.reason}"
    return words


def unfinished(job_id: str, end: JobEnd | None, running: bool, log_tail: str, time_limit_min: int,
               folder: str, catalogue: Catalogue) -> Verdict:
    """The verdict of a variant of job ``job_id`` that has no outcome. ``running``: its start was marked."""
    code = cause(end, log_tail, catalogue)
    if end is None:
        note = (f"Slurm job {job_id} left the queue and neither accounting, the job completion log nor the "
                "controller knows how it ended")
    elif code == "slurm-lost":
        note = f"Slurm job {job_id} ended {end.state} but no outcome for this variant reached {folder}"
    elif code == "slurm-timeout":
        note = f"Slurm ended job {job_id} at its time limit ({time_limit_min} min)"
    else:
        note = f"Slurm job {job_id} ended {_state_words(end)}"
    status = Status.NOT_RUN
    if running and code in RUNNING_STATUS:
        status = RUNNING_STATUS[code]
        note += " while this variant ran"
        if code == "slurm-failed":
            note += f": {last_error_line([log_tail]) or 'no error line in the job output'}"
    elif end is not None and code != "slurm-lost":
        note += " before this variant " + ("finished" if running else "started")
    reason = catalogue.get(code)
    evidence = {"slurm": end.to_json() if end else {"job": job_id}, "slurm_output_tail": log_tail[-1500:]}
    if reason is not None:
        evidence["reason"] = reason.message
    evidence.update(provenance.judged_evidence(Path(__file__)))  # this reader decided it: a change of it stales it
    return Verdict(status, code, note, reason.remediation if reason else "", evidence=evidence)
