"""Rank processes forked from a serving worker that imported torch once (inenv.warm), instead of each starting an
interpreter and importing torch again: a rank's start drops from seconds (the interpreter, ``import torch``,
``torch.distributed``: 1.5-2.5 s on a 16-core H100 VM, 6-11 s when a full level runs many ranks at once) to a
fork. In-environment side: standard library only; torch is imported by name, never required.

A fork is safe only from a process with no CUDA context (CUDA does not survive a fork) and no Python thread of
its own beside the main one: :func:`prepare` imports :data:`PRELOAD` and says why forking cannot be used when
either holds, and the caller
then starts ranks as new interpreters, as it would without this. The child becomes ``python -m inenv.rank``
with the given environment: its stdin the request pipe, stdout and stderr its log, the reply pipe at a fixed
descriptor, every other descriptor of the worker closed (a rank holding another rank's request pipe would keep
that rank from ever seeing its end), the interpreter's bytecode settings taken from the environment, and it
dies with the worker (inenv.lifetime.die_with_parent). What differs from a new interpreter: modules the worker
imported are already imported, and ``/proc/<pid>/environ`` shows the worker's environment at its start (the
process's own environment is the rank's, as ``os.environ`` and every library see it).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time
from typing import IO

from inenv import rank
from inenv.lifetime import die_with_parent

PRELOAD = ("torch", "torch.distributed")  # what every rank of a GPU probe imports first (inenv.kit._dist)
DISABLE_ENV = "STACKPROBE_FORK_RANKS"  # "0": every rank a new interpreter
REPLY_FD = 3  # where a forked rank finds its reply pipe (inenv.rank.ENV_REPLY_FD names it)


def enabled(env: dict[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(DISABLE_ENV, "1") != "0"


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def prepare(modules: tuple[str, ...] = PRELOAD) -> str:
    """Import ``modules`` (those that are installed) into this process for its forked ranks to share: "" when
    ranks may be forked from it now, else why not."""
    if not hasattr(os, "fork"):
        return "this platform has no fork"
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # not installed or broken: each rank meets it in its own probe, as without this
            break
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is not None and cuda.is_initialized():
            return "CUDA was initialized in the serving worker"
    except Exception as exc:
        return f"torch.cuda cannot say whether CUDA started: {type(exc).__name__}"
    if threading.active_count() != 1:
        return f"the serving worker runs {threading.active_count()} Python threads"
    return ""


def native_threads() -> int:
    """This process's threads as the kernel counts them: a BLAS library's pool (numpy's OpenBLAS starts one per
    core when it loads, and shuts it down around a fork with its own fork handler) shows here, not in Python."""
    return _threads()


class Forked:
    """A forked rank as ``subprocess.Popen`` shows a process: ``pid``, ``stdin`` (its request pipe), ``poll``,
    ``wait``, ``send_signal``, ``kill`` and ``returncode`` (negative: the signal that ended it)."""

    def __init__(self, pid: int, stdin: IO[bytes]) -> None:
        self.pid = pid
        self.stdin: IO[bytes] | None = stdin
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        until = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if until is not None and time.monotonic() > until:
                raise TimeoutError(f"process {self.pid} still running after {timeout} s")
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _open_fds() -> list[int]:
    try:
        return [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, 256))


def fork_rank(env: dict[str, str], log_path: str, reply_fd: int) -> Forked:
    """A warm rank (``inenv.rank``'s loop) forked from this process, given the environment ``env``, its log and
    the write end of its reply pipe; the caller keeps ``reply_fd`` and closes it as after a spawn."""
    read, write = os.pipe()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the rank: nothing here may return into the worker's code
        try:
            _become_rank(env, read, log, reply_fd)
        finally:
            os._exit(rank.HARNESS_EXIT)
    os.close(read)
    os.close(log)
    return Forked(pid, os.fdopen(write, "wb"))


def _become_rank(env: dict[str, str], requests: int, log: int, reply: int) -> None:
    die_with_parent()
    os.dup2(requests, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.dup2(reply, REPLY_FD)
    os.closerange(REPLY_FD + 1, max(_open_fds(), default=REPLY_FD) + 1)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update({**env, rank.ENV_REPLY_FD: str(REPLY_FD)})
    sys.pycache_prefix = env.get("PYTHONPYCACHEPREFIX") or None
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    sys.argv = [rank.__file__]
    rank.main()  # the rank's loop ends the process itself
