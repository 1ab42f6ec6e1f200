"""Serving workers for one cell (host side): ``python -m inenv.warm`` processes kept between variants, so a
cell's variants run on rank processes that have imported their libraries already (inenv.warm says which
variants share ranks and when a group of them ends).

Each variant is still bounded as an isolated one-shot worker is (checks.run.isolate): the host's hard timeout,
Ctrl-C (isolate.STOP) and a server that dies all end that server whole (its process group, or its container)
and sweep what carries its token; the variant's verdict is then made by classify.from_process from exactly what
a one-shot worker would have left (its exit, its stdout and stderr of this variant, the result line). A server
is started by its executor's :class:`Launcher`: a process of this host (:func:`popen_launcher`, started from
one long-lived thread, so its parent-death signal, inenv.lifetime.die_with_parent, which follows the thread
that forked it, fires when this process ends, not when the variant's thread does) or a container
(checks.run.containerserver).

A pool serves one executor: a variant takes an idle server (one that ran the same kind of variant first),
else starts one. Idle servers are kept across every pool of the process up to MAX_IDLE_SERVERS, the least
recently used ended first; a pool whose variants hold no GPU (``keep_one``: a host without GPUs, where a run
goes from cell to cell) keeps its last idle server past that count, up to MAX_KEPT_SERVERS in all, so cells
whose variants alternate do not end each other's servers. :meth:`ServerPool.close` ends them all (the end of a
run).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, Protocol

from checks.run import isolate
from checks.run.isolate import ProcessOutcome
from inenv.lifetime import SCRATCH_ENV, die_with_parent
from inenv.probe import RESULT_MARKER, Variant
from inenv.warm import LEFTOVERS_KEY, request_line
from inenv.worker import ENV_PARAM_PREFIX

MAX_IDLE_SERVERS = 3  # the variants a runner has in flight on one cell: one running, GATE_DEPTH waiting
# servers kept idle in all where pools keep their last one (ServerPool.keep_one); each holds a rank process that
# imported torch (300-600 MB of host memory), no GPU memory
MAX_KEPT_SERVERS = 8
POLL_S = 0.01
CLOSE_WAIT_S = 3.0  # a server told to end (stdin closed) ends its ranks and leaves within this


class _Spawner:
    """One daemon thread that starts every server (see the module docstring)."""

    def __init__(self) -> None:
        self.jobs: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = queue.Queue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def call(self, fn: Callable[[], Any]) -> Any:
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._loop, name="stackprobe-server-spawner", daemon=True)
                self.thread.start()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.jobs.put((fn, done))
        return done.result()

    def _loop(self) -> None:
        while True:
            fn, done = self.jobs.get()
            try:
                done.set_result(fn())
            except BaseException as exc:
                done.set_exception(exc)


_SPAWNER = _Spawner()


class ServerProcess(Protocol):
    """A running server as the pool drives it: what ``subprocess.Popen`` offers of it (a container's server
    offers the same: checks.run.containerserver)."""

    stdin: IO[bytes] | None
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


@dataclass
class Launched:
    """A server as its :class:`Launcher` started it."""

    proc: ServerProcess
    stop: Callable[[], None]  # ends it and everything it started, at once (its process group, its container)
    name: str = ""  # where it runs, for the evidence (a container's name)
    lost: Callable[[], str] = lambda: ""  # why it vanished under its variant from outside ("" when it did not)


# Starts ``python -m inenv.warm`` for a pool: (the server's own variables: its token and scratch folder; the
# variant's environment over the pool's, "" unsets; its stdout file; its stderr file) -> the server
Launcher = Callable[[dict[str, str], tuple[tuple[str, str], ...], IO[bytes], IO[bytes]], Launched]


def popen_launcher(python: str, env: Callable[[], dict[str, str]]) -> Launcher:
    """Servers that are processes of this host: ``python`` with ``env()``, each in a session of its own."""

    def launch(own: dict[str, str], extra: tuple[tuple[str, str], ...], out: IO[bytes], err: IO[bytes]) -> Launched:
        full = {**env(), **own}
        for name, value in extra:  # "" unsets, as the executor's run environment does
            if value:
                full[name] = value
            else:
                full.pop(name, None)
        proc = _SPAWNER.call(lambda: subprocess.Popen(
            [python, "-m", "inenv.warm"], env=full, stdin=subprocess.PIPE, stdout=out, stderr=err,
            start_new_session=True, preexec_fn=die_with_parent))

        def stop() -> None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

        return Launched(proc, stop, f"pid {proc.pid}")

    return launch


@dataclass
class Server:
    """One serving worker: its process, token, scratch folder and output files."""

    launched: Launched
    token: str
    scratch: str
    out: IO[bytes]
    err: IO[bytes]
    kind: tuple[Any, ...] = ()  # the kind of variant it ran last (kind_of)
    pool: ServerPool | None = None
    env: tuple[tuple[str, str], ...] = ()  # set over its pool's environment when it started (its own GPUs)

    @property
    def proc(self) -> ServerProcess:
        return self.launched.proc

    def end(self, wait_s: float = 0.0) -> int:
        """End it (stdin closed, then it is stopped whole) and every process carrying its token; how many of
        those outlived it."""
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        if wait_s:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)
        self.launched.stop()
        self.proc.wait()
        left = isolate.sweep(self.token)
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.out.close()
        self.err.close()
        return left


def kind_of(variant: Variant) -> tuple[Any, ...]:
    """What decides whether a server's kept ranks can serve ``variant`` (inenv.warm.group_key, as far as the
    host can tell without the probe's module): a server that ran the same kind first is preferred."""
    env = tuple(sorted(p for p in variant.params if p[0].startswith(ENV_PARAM_PREFIX)))
    return variant.ranks, variant.share_gpu, variant.gpus, env


_IDLE: list[Server] = []  # every pool's idle servers, least recently used first
_IDLE_LOCK = threading.Lock()


@dataclass
class ServerPool:
    """The serving workers of one executor, started by ``launch``. ``keep_one``: its variants hold no GPU, so
    its last idle server outlives other pools' (the module docstring)."""

    launch: Launcher
    keep_one: bool = False

    def _take(self, kind: tuple[Any, ...], env: tuple[tuple[str, str], ...] = ()) -> Server | None:
        with _IDLE_LOCK:
            mine = [s for s in _IDLE if s.pool is self and s.env == env]  # a server sees only the GPUs it started with
            if not mine:
                return None
            server = next((s for s in reversed(mine) if s.kind == kind), mine[-1])
            _IDLE.remove(server)
        if server.proc.poll() is not None:
            server.end()
            return None
        return server

    def _give_back(self, server: Server) -> None:
        ended: list[Server] = []
        with _IDLE_LOCK:
            if isolate.STOP.is_set():  # the run is being cancelled: nothing is kept for a next variant
                ended.append(server)
            else:
                _IDLE.append(server)
                while len(_IDLE) > MAX_IDLE_SERVERS:
                    gone = _evictable(len(_IDLE) > MAX_KEPT_SERVERS)
                    if gone is None:
                        break
                    _IDLE.remove(gone)
                    ended.append(gone)
        for s in ended:
            s.end(CLOSE_WAIT_S)

    def _start(self, extra: tuple[tuple[str, str], ...] = ()) -> Server:
        token = uuid.uuid4().hex
        scratch = tempfile.mkdtemp(prefix="stackprobe-scratch-")
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115 (the server's, closed by Server.end)
        try:
            launched = self.launch({isolate.TOKEN_ENV: token, SCRATCH_ENV: scratch}, extra, out, err)
        except BaseException:
            out.close()
            err.close()
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        return Server(launched, token, scratch, out, err, pool=self, env=extra)

    def close(self) -> None:
        """End every idle server of this pool (a busy one is ended by its own variant's thread when the run is
        cancelled; a run that ends normally has none)."""
        with _IDLE_LOCK:
            mine = [s for s in _IDLE if s.pool is self]
            for s in mine:
                _IDLE.remove(s)
        _end_all(mine)

    def run(self, variant: Variant, gpus: int, timeout_s: float, queue_s: float, limit_s: float,
            env: tuple[tuple[str, str], ...] = ()) -> ProcessOutcome:
        """One variant on a serving worker, bounded by ``limit_s`` (the hard timeout) and Ctrl-C as
        isolate.run_isolated bounds a one-shot worker; what came back, as it reports a one-shot worker's.
        ``env``: set over the pool's environment (a variant's own GPUs): only a server started with it serves."""
        kind = kind_of(variant)
        server = self._take(kind, env) or self._start(env)
        started = time.monotonic()
        out_at, err_at = _size(server.out), _size(server.err)
        line = request_line(variant, gpus, timeout_s, queue_s if queue_s > 0 else None)
        result: dict[str, Any] | None = None
        result_error = ""
        timed_out = interrupted = False
        reply = b""
        try:
            with contextlib.suppress(OSError, ValueError):  # a server that died is seen below
                assert server.proc.stdin is not None
                server.proc.stdin.write(line.encode())
                server.proc.stdin.flush()
            deadline = started + limit_s
            while True:
                reply = _read_from(server.out, out_at)
                found = _result_line(reply)
                if found is not None:
                    result, result_error = isolate.parse_result(found)
                    break
                if server.proc.poll() is not None:
                    reply = _read_from(server.out, out_at)
                    found = _result_line(reply)
                    if found is not None:
                        result, result_error = isolate.parse_result(found)
                    break
                if isolate.STOP.is_set():
                    interrupted = True
                    break
                if time.monotonic() >= deadline:
                    timed_out = True
                    break
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            interrupted = True
        served = result is not None and not interrupted and not timed_out and server.proc.poll() is None
        lost = ""  # asked only of a server that ended under its variant
        leftovers = 0
        if isinstance(result, dict):
            raw = result.pop(LEFTOVERS_KEY, 0)
            leftovers = raw if isinstance(raw, int) and not isinstance(raw, bool) else 0
        err_tail = _read_from(server.err, err_at)
        if served:
            self._give_back(server)
            returncode: int | None = 0
        else:
            lost = "" if timed_out else server.launched.lost()  # read before the end removes what it asks
            leftovers += server.end()
            returncode = None if timed_out else server.proc.returncode
        duration = time.monotonic() - started
        if interrupted:
            raise KeyboardInterrupt
        return ProcessOutcome(returncode=returncode, timed_out=timed_out, result=result, result_error=result_error,
                              stdout_tail=reply[-isolate.TAIL_BYTES:].decode(errors="replace"),
                              stderr_tail=err_tail[-isolate.TAIL_BYTES:].decode(errors="replace"),
                              duration_s=round(duration, 3), leftovers=leftovers, where=server.launched.name,
                              lost=lost)


def _size(f: IO[bytes]) -> int:
    return os.fstat(f.fileno()).st_size


def _read_from(f: IO[bytes], at: int) -> bytes:
    """What the file holds from ``at`` on (read by position: the server appends to it meanwhile)."""
    size = _size(f)
    return os.pread(f.fileno(), max(0, size - at), at) if size > at else b""


def _result_line(text: bytes) -> bytes | None:
    """The first complete result line of ``text``, if there is one."""
    marker = RESULT_MARKER.encode()
    for line in text.splitlines(keepends=True):
        if line.startswith(marker) and line.endswith(b"\n"):
            return line
    return None


def _evictable(over_kept: bool) -> Server | None:
    """The idle server to end first (the caller holds _IDLE_LOCK): the least recently used, passing over the
    only idle server of a ``keep_one`` pool unless ``over_kept``; None when every one is passed over."""
    for s in _IDLE:
        alone = s.pool is not None and s.pool.keep_one and sum(t.pool is s.pool for t in _IDLE) == 1
        if over_kept or not alone:
            return s
    return None


def _end_all(servers: list[Server]) -> None:
    """End ``servers`` side by side: each may wait CLOSE_WAIT_S for its ranks to leave (a container's end is a
    round trip to the daemon too), and a run ends only after the last."""
    if len(servers) <= 1:
        for s in servers:
            s.end(CLOSE_WAIT_S)
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(servers)) as pool:
        list(pool.map(lambda s: s.end(CLOSE_WAIT_S), servers))
