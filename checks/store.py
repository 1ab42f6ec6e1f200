"""The results store: ``results/<host_id>/<run_id>.jsonl`` plus ``<run_id>.manifest.json`` (host side).

Each append writes the whole file anew (its whole lines plus the new one) to a temporary file, fsyncs it
and renames it over the old one, under an exclusive ``flock`` on the current file. A rename is atomic and
a ``write`` interrupted by SIGKILL can stop part-way, so this is what makes a killed runner leave only whole
lines; a torn last line from an older writer (power loss) is dropped by the next append. One run at a
time per results host folder (a run lock), since two runs on the same GPUs would distort each other's
numbers.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from checks import atomic
from checks.result import ProbeResult, ResultError


class StoreBusy(RuntimeError):
    pass


def new_run_id(now: datetime | None = None) -> str:
    now = now or datetime.now(UTC)
    return now.strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(2)


def _whole_lines(fd: int) -> bytes:
    """The file's content up to its last newline: an unterminated last line (a crash mid-write) is dropped."""
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    data = b"".join(chunks)
    return data[: data.rfind(b"\n") + 1]


@dataclass
class RunStore:
    root: Path
    host_id: str
    run_id: str

    @property
    def folder(self) -> Path:
        return self.root / self.host_id

    @property
    def results_path(self) -> Path:
        return self.folder / f"{self.run_id}.jsonl"

    @property
    def manifest_path(self) -> Path:
        return self.folder / f"{self.run_id}.manifest.json"

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        atomic.write_json(self.manifest_path, manifest)

    def append(self, result: ProbeResult) -> None:
        self.append_all([result])

    def append_all(self, results: list[ProbeResult]) -> None:
        """Append whole lines in one rewrite (a run carrying hundreds of earlier results writes the file once,
        not once per result). Safe from several threads or processes: each call opens the file anew, so
        each holds its own flock."""
        if not results:
            return
        line = b"".join((json.dumps(r.to_json(), sort_keys=True, default=str, separators=(",", ":")) + "\n").encode()
                        for r in results)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.results_path
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if os.fstat(fd).st_ino != os.stat(path).st_ino:
                    continue  # another writer renamed a new file in while we waited: lock that one
                atomic.write_bytes(path, _whole_lines(fd) + line)
                return
            finally:
                os.close(fd)  # closing releases the lock

    def recorded(self) -> set[tuple[str, str, str]]:
        if not self.results_path.exists():
            return set()
        results, _ = read_file(self.results_path)
        return {r.key for r in results}


class RunLock:
    """Exclusive lock on a host's results folder for the duration of a run (flock on the folder itself,
    so no lock file lands among the results)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.fd: int | None = None

    def __enter__(self) -> RunLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreBusy(f"another `checks run` is writing to {self.folder}; wait for it to finish") from None
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def latest_run(folder: Path) -> str | None:
    runs = sorted(p.name[: -len(".jsonl")] for p in folder.glob("*.jsonl")) if folder.is_dir() else []
    return runs[-1] if runs else None


def read_file(path: Path) -> tuple[list[ProbeResult], list[str]]:
    """Valid results of one JSONL file (either schema) and a warning (file:line: why) for each line that is not."""
    results: list[ProbeResult] = []
    warnings: list[str] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if not raw.endswith(b"\n"):
                warnings.append(f"{path}:{n}: unterminated last line (a run was interrupted mid-write); skipped")
                continue
            try:
                obj = json.loads(raw)
            except ValueError as exc:
                warnings.append(f"{path}:{n}: not valid JSON ({exc.msg}); skipped")
                continue
            try:
                results.append(ProbeResult.from_json(obj))
            except ResultError as exc:
                warnings.append(f"{path}:{n}: {exc}; skipped")
    return results, warnings


def iter_runs(root: Path) -> Iterator[tuple[str, str, Path]]:
    """(host_id, run_id, jsonl path) for every run under a results directory, sorted."""
    if not root.is_dir():
        return
    for host in sorted(p for p in root.iterdir() if p.is_dir()):
        for f in sorted(host.glob("*.jsonl")):
            yield host.name, f.name[: -len(".jsonl")], f


def read_manifest(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None, f"{path}: missing (host facts unknown)"
    except (OSError, ValueError) as exc:
        return None, f"{path}: unreadable ({exc})"
    return (data, None) if isinstance(data, dict) else (None, f"{path}: not a JSON object")
