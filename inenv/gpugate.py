"""One GPU variant at a time on a host, while the next one's ranks start beside it.

A GPU variant's launch is two kinds of work: starting its rank processes (the interpreter and ``import
torch``: 1.3-1.5 s of CPU per variant on 2x H200, about a third of a typical variant) and then using the
GPUs. The runner starts the next GPU variant's worker while the current one still runs. Its ranks import
what their probe declares (``ProbeSpec.preload``), say so on a second pipe, and then block on the first; the
worker asks for this host's GPU lock only once every rank said it is ready, and opens the gate (closes the
first pipe's write end) once it holds the lock, an exclusive ``flock`` on one file, which the
running variant's worker lets go as soon as its last outcome is in. So the GPUs still serve one variant at a
time, every variant still runs in fresh processes, and the start-up of the next one costs no time.

A variant that times nothing (``inenv.probe.untimed``: ranks sharing a GPU, a GPU each at a world size that runs
only its set-up and one agreement case, or a probe that never times) takes the lock *shared*: such variants run
side by side (each checks exact numbers, which another process on the GPU cannot change), while a variant that
times anything takes it exclusive and so has the GPUs alone, with no shared holder beside it.

The lock is a file the host names in ``STACKPROBE_GPU_LOCK`` (a container gets it mounted): flock locks are
shared by every process on one kernel that opens the same file, so two ``checks run`` on one host also take
turns on the GPUs. ``flock`` is released by the kernel when its holder dies, however it dies.

In-environment side: standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import time
from collections.abc import Callable
from dataclasses import dataclass

ENV = "STACKPROBE_GPU_LOCK"
ALONE_ENV = "STACKPROBE_GPU_ALONE"  # "1": every variant takes the lock exclusive (`checks run --gpu-alone`)
LOCK_NAME = "stackprobe-gpu.lock"  # in the host's temporary folder: every checkout and user on the host
GO_FD_ENV = "STACKPROBE_GO_FD"  # in a rank: the read end of its worker's go pipe
READY_FD_ENV = "STACKPROBE_READY_FD"  # in a rank: the write end of its worker's ready pipe
# How long a worker waits for the lock when the runner did not say: another run on the host may hold it
# for one variant (the probes' own timeouts are 300 s).
DEFAULT_QUEUE_S = 360.0
POLL_S = 0.005


class GateError(RuntimeError):
    """The lock file cannot be used: the worker says so instead of running beside another variant."""


@dataclass
class Gate:
    """The worker's side: the lock file, how long it may wait, and the go pipe it opens for its ranks."""

    path: str
    queue_s: float = DEFAULT_QUEUE_S
    shared: bool = False  # a variant that times nothing: it holds the lock beside others of its kind
    _read: int | None = None
    _write: int | None = None
    _ready_read: int | None = None
    _ready_write: int | None = None
    _lock: int | None = None
    _since: float | None = None  # when the wait began (the ranks' ready wait, then the lock's)
    waited_s: float = 0.0

    def rank_fd(self) -> int:
        """The go pipe's read end, to be inherited by every rank (pass_fds)."""
        if self._read is None:
            self._read, self._write = os.pipe()
            os.set_inheritable(self._read, True)
        return self._read

    def ready_fd(self) -> int:
        """The ready pipe's write end, to be inherited by every rank (pass_fds): each writes one byte once its
        preload is done (:func:`say_ready`)."""
        if self._ready_write is None:
            self._ready_read, self._ready_write = os.pipe()
            os.set_inheritable(self._ready_write, True)
        return self._ready_write

    def close_rank_end(self) -> None:
        """After the ranks are started: only they hold the go pipe's read end and the ready pipe's write end, so
        their reads end when this worker closes the go pipe or dies, and the ready pipe ends when they all
        closed theirs (said ready, or died)."""
        for name in ("_read", "_ready_write"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)

    def await_ready(self, ranks: int, alive: Callable[[], bool] = lambda: True) -> int:
        """Wait (within ``queue_s``) until every rank said its preload is done, the ready pipe ended or
        ``alive`` says a rank is gone (its peers may wait for it in a rendezvous); how many said so. The lock
        is asked for only then, so a variant whose ranks still import never holds the GPUs idle while another
        one that is ready waits. The time it takes is the variant's own (``waited_s`` is the lock's wait)."""
        self._since = time.monotonic()
        got = 0
        if self._ready_read is None:
            return got
        deadline = self._since + self.queue_s
        try:
            while got < ranks:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if not select.select([self._ready_read], [], [], min(left, 0.25))[0]:
                    if not alive():
                        break
                    continue
                data = os.read(self._ready_read, 64)
                if not data:
                    break
                got += len(data)
        except OSError:
            pass
        finally:
            os.close(self._ready_read)
            self._ready_read = None
        return got

    def start_wait(self) -> None:
        """The ranks' ready wait begins now, for a launcher that waits for them itself (inenv.warm): the lock's
        wait in :meth:`open` is bounded by what is left of ``queue_s`` from here."""
        self._since = time.monotonic()

    def open(self) -> bool:
        """Wait for the lock (at most what is left of ``queue_s`` after :meth:`await_ready`), then let the ranks
        go; ``waited_s`` is the lock's wait alone. False: another variant held the GPUs all that time; the
        ranks are still held. Raises GateError when the file cannot be locked."""
        started = time.monotonic()
        until = (self._since if self._since is not None else started) + self.queue_s
        try:
            # read-only is enough for flock, so another user's lock file still serves
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise GateError(f"cannot open the GPU lock {self.path}: {exc}") from None
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise GateError(f"cannot lock the GPU lock {self.path}: {exc}") from None
            if time.monotonic() >= until:
                os.close(fd)
                self.waited_s = round(time.monotonic() - started, 3)
                return False
            time.sleep(POLL_S)
        self._lock = fd
        self.waited_s = round(time.monotonic() - started, 3)
        if self._write is not None:
            os.close(self._write)
            self._write = None
        return True

    def release(self) -> None:
        """Let the next variant have the GPUs (this one's ranks may still be exiting)."""
        if self._lock is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock, fcntl.LOCK_UN)
            os.close(self._lock)
            self._lock = None

    def close(self) -> None:
        self.close_rank_end()
        if self._ready_read is not None:
            os.close(self._ready_read)
            self._ready_read = None
        if self._write is not None:
            os.close(self._write)
            self._write = None
        self.release()


def say_ready(env: dict[str, str]) -> None:
    """In a rank: tell the worker this rank's preload is done (one byte), and close the pipe's end."""
    raw = env.get(READY_FD_ENV, "")
    if not raw:
        return
    fd = int(raw)
    try:
        os.write(fd, b"r")
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def wait_for_go(env: dict[str, str]) -> bool:
    """In a rank: block until the worker opens the gate (or dies). False when the rank was not gated."""
    raw = env.get(GO_FD_ENV, "")
    if not raw:
        return False
    fd = int(raw)
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    return True
