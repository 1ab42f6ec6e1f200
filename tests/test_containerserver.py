"""A serving container's process as the pool drives it (checks.run.containerserver), over a socket pair standing in
for the daemon's attach stream (the stream's framing is Docker's: one byte of stream, three of zero, four of length),
with a stand-in of the daemon's API: demultiplexing, the half-close of stdin, the exit status, a kill that ends the
stream when the daemon does not answer, and what counts as lost. The real daemon: tests/test_checks_docker.py."""

from __future__ import annotations

import socket
import struct
import tempfile
import time
from typing import Any

import pytest

from checks.run.container import exit_to_returncode
from checks.run.containerserver import ContainerProcess


def frame(stream: int, data: bytes) -> bytes:
    return struct.pack(">BxxxL", stream, len(data)) + data


class FakeApi:
    """What the process asks of the daemon: the exit status, the state while a removal may follow, the removal."""

    def __init__(self, status: int = 0, state: dict[str, Any] | None = None, answers: bool = True) -> None:
        self.status, self.state, self.answers = status, state or {"Status": "exited"}, answers
        self.removed: list[str] = []

    def wait(self, name: str, timeout: float) -> dict[str, int]:
        return {"StatusCode": self.status}

    def inspect_container(self, name: str) -> dict[str, Any]:
        return {"State": self.state}

    def remove_container(self, name: str, force: bool) -> None:
        import docker.errors

        if not self.answers:
            raise docker.errors.APIError("the daemon did not answer")
        self.removed.append(name)


@pytest.fixture
def pair() -> Any:
    ours, daemon = socket.socketpair()
    yield ours, daemon
    for s in (ours, daemon):
        s.close()


def started(api: FakeApi, ours: socket.socket) -> tuple[ContainerProcess, Any, Any]:
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115 (read after the process ends)
    return ContainerProcess(api, "stackprobe-x", ours, out, err, exit_to_returncode), out, err


def read(f: Any) -> bytes:
    f.seek(0)
    return f.read()


def test_the_stream_is_split_into_stdout_and_stderr_and_stdin_reaches_the_daemon(pair: Any) -> None:
    ours, daemon = pair
    proc, out, err = started(FakeApi(status=0), ours)
    assert proc.stdin is not None
    proc.stdin.write(b'{"probe": "t"}\n')
    assert daemon.recv(100) == b'{"probe": "t"}\n'
    daemon.sendall(frame(1, b"RESULT {}\n") + frame(2, b"a warning\n") + frame(1, b"more\n"))
    assert proc.poll() is None  # the stream goes on
    proc.stdin.close()  # half-closed: the daemon side reads the end of the requests
    assert daemon.recv(100) == b""
    daemon.close()  # the server exited: its stream ends
    assert proc.wait(timeout=5) == 0
    assert read(out) == b"RESULT {}\nmore\n" and read(err) == b"a warning\n"
    assert proc.lost() == ""


def test_a_container_that_died_by_a_signal_reports_it_as_subprocess_does(pair: Any) -> None:
    ours, daemon = pair
    proc, _, _ = started(FakeApi(status=139), ours)
    daemon.close()
    assert proc.wait(timeout=5) == -11  # SIGSEGV
    assert proc.lost() == ""


def test_a_container_killed_and_removed_from_outside_is_lost(pair: Any) -> None:
    ours, daemon = pair
    proc, _, _ = started(FakeApi(status=137, state={"Status": "removing"}), ours)
    daemon.close()
    assert proc.wait(timeout=5) == -1
    assert "stackprobe-x is gone" in proc.lost() and "removing" in proc.lost()


def test_a_container_killed_but_not_removed_is_a_kill_not_a_loss(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from checks.run import containerserver

    monkeypatch.setattr(containerserver, "REMOVAL_WAIT_S", 0.3)
    ours, daemon = pair
    proc, _, _ = started(FakeApi(status=137, state={"Status": "exited", "OOMKilled": False}), ours)
    daemon.close()
    assert proc.wait(timeout=5) == -9
    assert proc.lost() == ""


def test_kill_ends_the_stream_even_when_the_daemon_does_not_answer(pair: Any) -> None:
    ours, _ = pair  # the daemon side stays open and silent: only the kill can end the reader's read
    api = FakeApi(answers=False)
    proc, _, _ = started(api, ours)
    time.sleep(0.2)
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(timeout=5) == 0  # the stand-in daemon's exit status, asked once the stream ended
    assert api.removed == []
