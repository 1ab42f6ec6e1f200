"""Run one command so that nothing it starts survives it (host side).

The command gets its own session (process group) and a unique token in its environment. Output goes
to files, not pipes, so a probe printing gigabytes cannot block; only bounded tails are kept. At the
end (normal exit, timeout or Ctrl-C) the group is killed, then every process still carrying the token
is found in /proc and killed too, which catches grandchildren that called setsid().
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from inenv.lifetime import SCRATCH_ENV, die_with_parent, end_all_with_env
from inenv.probe import RESULT_MARKER

TOKEN_ENV = "STACKPROBE_RUN_TOKEN"
# Set when the run is cancelled (Ctrl-C, SIGTERM): each thread waiting on a variant's process or container
# checks it every POLL_S and ends that variant as Ctrl-C would (its process group killed, its container
# removed), then raises KeyboardInterrupt from its own code. No exception is ever injected into a thread.
STOP = threading.Event()
POLL_S = 0.2
TAIL_BYTES = 4000
KILL_ROUNDS = 50


@dataclass(frozen=True)
class ProcessOutcome:
    returncode: int | None  # None when it had to be killed at the timeout
    timed_out: bool
    result: dict[str, Any] | None  # the parsed result line, if one came back
    result_error: str  # the result line was there but not valid JSON
    stdout_tail: str
    stderr_tail: str
    duration_s: float
    leftovers: int  # processes still alive after the command ended, killed by the sweep
    where: str = ""  # what ran it, when that outlives one variant (a serving worker: its container or pid)
    lost: str = ""  # why what ran it vanished under it from outside (a container removed), "" when it did not

    @property
    def signal_name(self) -> str | None:
        if self.returncode is None or self.returncode >= 0:
            return None
        try:
            return signal.Signals(-self.returncode).name
        except ValueError:
            return f"signal {-self.returncode}"


def _tail(f: Any, limit: int = TAIL_BYTES) -> str:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - limit))
    return f.read().decode(errors="replace")


def _find_result(f: Any) -> tuple[dict[str, Any] | None, str]:
    """The last result line on stdout, read line by line (stdout may be huge)."""
    f.seek(0)
    found: bytes | None = None
    marker = RESULT_MARKER.encode()
    for line in f:
        if line.startswith(marker):
            found = line
    if found is None:
        return None, ""
    return parse_result(found)


def parse_result(line: bytes) -> tuple[dict[str, Any] | None, str]:
    """One result line (it starts with the marker): its object, or None and what is wrong with it."""
    try:
        data = json.loads(line[len(RESULT_MARKER.encode()):])
    except ValueError as exc:
        return None, f"invalid JSON after the result marker: {exc}"
    if not isinstance(data, dict):
        return None, "the result line is not a JSON object"
    return data, ""


def sweep(token: str) -> int:
    """Stop, then kill, every live process carrying the token; repeat until none is left (forks race)."""
    return end_all_with_env(TOKEN_ENV, token, rounds=KILL_ROUNDS)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@contextlib.contextmanager
def _removed(folder: str) -> Iterator[None]:
    try:
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_isolated(cmd: list[str], env: dict[str, str], timeout_s: float, cwd: str | None = None,
                 on_start: Callable[[subprocess.Popen[bytes]], None] | None = None) -> ProcessOutcome:
    """Run `cmd` in its own session with a hard timeout. Ctrl-C (KeyboardInterrupt here, or STOP set while a
    worker thread waits) ends it and is raised after cleanup."""
    token = uuid.uuid4().hex
    # the worker's scratch folders go in one this side removes after the process ends, however it ends: a
    # worker killed by SIGKILL (Ctrl-C, a timeout) cannot remove its own
    scratch = tempfile.mkdtemp(prefix="stackprobe-scratch-")
    env = {**env, TOKEN_ENV: token, SCRATCH_ENV: scratch}
    started = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, _removed(scratch):
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                start_new_session=True, preexec_fn=die_with_parent)
        if on_start:
            on_start(proc)
        timed_out = interrupted = False
        deadline = started + timeout_s
        try:
            while True:
                try:
                    proc.wait(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    if STOP.is_set():
                        interrupted = True
                        break
                    if time.monotonic() >= deadline:
                        timed_out = True
                        break
        except KeyboardInterrupt:
            interrupted = True
        finally:
            _kill_group(proc.pid)
            proc.wait()
            leftovers = sweep(token)
        duration = time.monotonic() - started
        if interrupted:
            raise KeyboardInterrupt
        result, result_error = _find_result(out)
        return ProcessOutcome(
            returncode=None if timed_out else proc.returncode,
            timed_out=timed_out,
            result=result,
            result_error=result_error,
            stdout_tail=_tail(out),
            stderr_tail=_tail(err),
            duration_s=round(duration, 3),
            leftovers=leftovers,
        )
