"""Tie a child process's life to its parent's (Linux): if the parent dies, even by SIGKILL, the child is
killed too. Standard library only; used by the host runner for workers and by the worker for ranks."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1

# A folder the host side made for this worker and removes once it has ended (however it ended): the worker's
# scratch folders go there, so a worker killed by SIGKILL leaves none behind in the temporary folder.
SCRATCH_ENV = "STACKPROBE_SCRATCH"


def die_with_parent() -> None:
    """For `preexec_fn`: runs in the child between fork and exec. A no-op where prctl is unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)
