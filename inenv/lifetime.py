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


def _proc_stat(pid: str) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) of a process from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[2])
    except (OSError, IndexError, ValueError):
        return None


def below(root: int, group: int | None = None) -> set[int]:
    """Live processes under ``root`` (its children, theirs, ...) and, with ``group``, every live member of that
    process group; ``root`` and this process left out, zombies too."""
    parents: dict[int, list[int]] = {}
    members: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _proc_stat(entry)
        if st is None or st[0] == "Z":
            continue
        parents.setdefault(st[1], []).append(int(entry))
        if group is not None and st[2] == group:
            members.add(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in parents.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return (found | members) - {root, os.getpid()}


def end_below(root: int, group: int | None = None, rounds: int = 50) -> int:
    """Stop every process :func:`below` finds (again until no new one shows: a stopped process forks no more and
    its children stay findable under it), then kill them all; how many were killed."""
    stopped: set[int] = set()
    for _ in range(rounds):
        new = below(root, group) - stopped
        if not new:
            break
        for pid in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
        stopped |= new
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return len(stopped)
