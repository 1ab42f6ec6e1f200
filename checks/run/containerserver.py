"""A serving worker in a container (host side): ``python -m inenv.warm`` as the command of a container of the
cell's image, its stdin, stdout and stderr through the daemon's attach stream, driven by checks.run.serving as
a serving worker of this host is.

The container is created with its stdin open and closed after the first attach (``StdinOnce``), attached before
it starts (so nothing it writes is missed), then started. One thread per server reads the attach stream and
appends stdout and stderr to the server's two files, which the pool reads by position. Closing stdin is a
half-close of the attach socket: the server sees the end of its requests, ends its ranks and exits. Stopping it
removes the container (force), which ends every process in it at once. Lost means the container is gone
(removed outside this process) while its variant ran.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import IO, Any

ATTACH = {"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
EXIT_WAIT_S = 10.0  # the daemon's answer for the exit status of a container whose stream ended
KILLED = 137  # the exit status of a container whose process was sent SIGKILL (by `docker rm -f` too)
REMOVAL_WAIT_S = 2.0  # after a SIGKILL: how long the daemon is asked whether a removal follows it


class _Input:
    """The server's stdin: writes go to the attach socket, close half-closes it."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def write(self, data: bytes) -> int:
        self.raw.sendall(data)
        return len(data)

    def flush(self) -> None:
        """Nothing is buffered: each write is sent whole."""

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.raw.shutdown(socket.SHUT_WR)


class ContainerProcess:
    """A started, attached container as :class:`checks.run.serving.ServerProcess`: ``poll`` answers once its
    stream ended (every byte it wrote is in the files by then), with the container's exit status as
    subprocess reports one (death by signal N: -N)."""

    def __init__(self, api: Any, name: str, sock: Any, out: IO[bytes], err: IO[bytes],
                 returncode_of: Callable[[int], int]) -> None:
        self.api, self.name, self.sock = api, name, sock
        self._raw = getattr(sock, "_sock", sock)  # the SDK hands a SocketIO over a Unix socket, a socket over TLS
        self.stdin: _Input | None = _Input(self._raw)
        self.returncode: int | None = None
        self.gone = ""  # why the daemon could not say how it ended: the container is gone, removed under it
        self._returncode_of = returncode_of
        self._reader = threading.Thread(target=self._read, args=(out, err), name=f"stackprobe-attach-{name}",
                                        daemon=True)
        self._reader.start()

    def _read(self, out: IO[bytes], err: IO[bytes]) -> None:
        # lazy: the Docker SDK (170 ms) loads only when a run uses Docker
        from docker.utils.socket import STDERR, frames_iter

        with contextlib.suppress(OSError, ValueError):  # the socket closed under it: the stream ended
            for stream, data in frames_iter(self.sock, False):
                f = err if stream == STDERR else out
                f.write(data)
                f.flush()

    def poll(self) -> int | None:
        if self._reader.is_alive():
            return None
        if self.returncode is None:
            self.returncode = self._exit_status()
        return self.returncode

    def _exit_status(self) -> int:
        # lazy: the Docker SDK (170 ms) loads only when a run uses Docker
        import docker.errors
        import requests.exceptions

        try:
            code = int(self.api.wait(self.name, timeout=EXIT_WAIT_S).get("StatusCode", -1))
            if code == KILLED:
                self._removal(time.monotonic() + REMOVAL_WAIT_S)
            return -1 if self.gone else self._returncode_of(code)
        except docker.errors.NotFound as exc:
            self.gone = str(getattr(exc, "explanation", None) or exc).splitlines()[0][:300]
        except (docker.errors.APIError, requests.exceptions.RequestException) as exc:
            self.gone = f"the daemon did not say how it ended: {str(exc).splitlines()[0][:300] if str(exc) else exc}"
        return -1

    def _removal(self, until: float) -> None:
        """A container killed (SIGKILL) is being removed from outside when the daemon, asked until ``until``,
        says it is gone or going (``docker rm -f`` kills first, then removes): then ``gone`` says so."""
        # lazy: the Docker SDK (170 ms) loads only when a run uses Docker
        import docker.errors

        while True:
            try:
                state = self.api.inspect_container(self.name).get("State") or {}
            except docker.errors.NotFound as exc:
                self.gone = str(getattr(exc, "explanation", None) or exc).splitlines()[0][:300]
                return
            except docker.errors.APIError:
                return
            if state.get("Dead") or state.get("Status") in ("removing", "dead"):
                self.gone = f"its state is {state.get('Status')}"
                return
            if state.get("OOMKilled") or time.monotonic() >= until:
                return
            time.sleep(0.1)

    def wait(self, timeout: float | None = None) -> int:
        self._reader.join(timeout)
        if self._reader.is_alive():
            raise subprocess.TimeoutExpired(f"container {self.name}", timeout or 0.0)
        code = self.poll()
        assert code is not None
        return code

    def kill(self) -> None:
        """Remove the container (force): every process in it ends and its stream ends."""
        # lazy: the Docker SDK (170 ms) loads only when a run uses Docker
        import docker.errors
        import requests.exceptions

        with contextlib.suppress(docker.errors.APIError, requests.exceptions.RequestException):
            self.api.remove_container(self.name, force=True)
        # the stream ends here even when the daemon did not answer: a shut socket wakes the reader's blocked read
        with contextlib.suppress(OSError):
            self._raw.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()

    def lost(self) -> str:
        """Why the container vanished under its variant, "" when it did not (it ended, or runs still)."""
        if self.poll() is None:
            return ""
        return f"container {self.name} is gone: removed outside this run while it served ({self.gone})" \
            if self.gone else ""
