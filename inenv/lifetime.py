"""Tie a child process's life to its parent's (Linux): if the parent dies, even by SIGKILL, the child is
killed too. Standard library only; used by the host runner for workers and by the worker for ranks."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time

PR_SET_PDEATHSIG = 1

# A folder the host side made for this worker and removes once it has ended (however it ended): the worker's
# scratch folders go there, so a worker killed by SIGKILL leaves none behind in the temporary folder.
SCRATCH_ENV = "STACKPROBE_SCRATCH"
# A serving worker (inenv.warm) sets a token of its own for each variant in this variable before starting
# anything for it; whatever the variant starts inherits it and is ended once the variant is over.
VARIANT_TOKEN_ENV = "STACKPROBE_VARIANT_TOKEN"


def die_with_parent() -> None:
    """For `preexec_fn`: runs in the child between fork and exec. A no-op where prctl is unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def pids_with_env(name: str, value: str, exclude: frozenset[int] = frozenset()) -> list[int]:
    """Live processes (zombies left out) whose environment at their start held ``name=value``."""
    needle = f"{name}={value}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(") ", 1)[1].startswith("Z"):
                    continue
        except (OSError, IndexError):
            continue
        out.append(int(entry))
    return out


def end_all_with_env(name: str, value: str, exclude: frozenset[int] = frozenset(), rounds: int = 50) -> int:
    """Stop, then kill, every live process started with ``name=value`` in its environment (but ``exclude``),
    until none is left (a forking one races the kill); how many were killed. A variant's processes carry its
    token this way, so what it left running (a grandchild in its own session) ends with it."""
    killed: set[int] = set()
    for _ in range(rounds):
        live = pids_with_env(name, value, exclude)
        if not live:
            break
        for pid in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
        for pid in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        time.sleep(0.01)
    return len(killed)
