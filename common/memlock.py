"""Whether a run's containers got the unlimited memlock they ask for, in words a user can act on (pure).

Containers ask for memlock unlimited (NCCL and CUDA IPC pin host memory). A Docker daemon that itself
runs under a memlock cap without the right to raise it (dockerd inside a container, or a systemd unit
with a LimitMEMLOCK) refuses at container start; the executor then runs without the request and records
``evidence.memlock``. Older records carry the daemon's error with its quoting (``unknown"))``); ``clean``
reads those too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

UNLIMITED = "unlimited"
_NOT_RAISED = "not raised: "
_REFUSED = _NOT_RAISED + "the Docker daemon refused"
FIX = ("give dockerd an unlimited hard memlock limit: a dockerd inside a container needs that container started "
       "with --ulimit memlock=-1 (or CAP_SYS_RESOURCE); a rootless dockerd needs LimitMEMLOCK=infinity in its "
       "systemd unit")


def daemon_reason(daemon_text: str) -> str:
    """The telling end of a daemon's refusal, without the API's quoting or the trailing 'unknown'."""
    text = " ".join(daemon_text.split()).rstrip('")\'. ').strip()
    text = re.sub(r":\s*unknown$", "", text)
    m = re.search(r"error setting rlimit.*", text)
    return (m.group(0) if m else text[-160:]).strip(" :")


def refused(daemon_text: str) -> str:
    """The evidence note for a daemon that refused memlock unlimited with ``daemon_text``."""
    return f"{_REFUSED} ({daemon_reason(daemon_text)})"


def clean(note: str) -> str:
    """A recorded note as :func:`refused` writes it today, whatever quoting an older run left in it."""
    note = " ".join(str(note).split())
    if note.startswith(_REFUSED + " ("):
        return refused(note[len(_REFUSED) + 2:])
    return note


def why(note: str) -> str:
    """Why memlock was not raised, as a clause: ``the Docker daemon refused (...)``."""
    c = clean(note)
    return c[len(_NOT_RAISED):] if c.startswith(_NOT_RAISED) else c


def not_raised(notes: Iterable[object]) -> list[str]:
    """Why memlock was not unlimited, each distinct reason once, in first-seen order."""
    out: list[str] = []
    for n in notes:
        if n and str(n) != UNLIMITED:
            c = why(str(n))
            if c not in out:
                out.append(c)
    return out


def summary(notes: Iterable[tuple[str, object]], newest: str | None = None) -> str:
    """For the table's host section, from (run id, memlock note) of the results it shows: '' when every
    container got memlock unlimited (or none ran). It names the runs it describes, and says so when the
    host's newest run (``newest``) ran nothing in a container."""
    seen = [(run, str(n)) for run, n in notes if n]
    reasons = not_raised(n for _, n in seen)
    if not reasons:
        return ""
    capped = [(run, n) for run, n in seen if n != UNLIMITED]
    runs = sorted({run for run, _ in capped})
    which = f"run {runs[0]}" if len(runs) == 1 else f"runs {', '.join(runs)}"
    text = (f"containers did not get memlock unlimited, {'; '.join(reasons)} ({len(capped)} of {len(seen)} "
            f"variants run in containers, in {which}); they ran with the daemon's own limit. To fix: {FIX}")
    if newest and newest not in {run for run, _ in seen}:
        text += f". The newest run, {newest}, ran no variant in a container"
    return text


def console_line(note: str) -> str:
    """Said once per run when containers ran without memlock unlimited."""
    return (f"memlock: containers of this run do not get memlock unlimited, {why(note)}; they run with the "
            f"daemon's own limit, which large NCCL or CUDA IPC buffers may exceed. To fix: {FIX}")
