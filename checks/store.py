"""The results store: ``results/<host_id>/<run_id>.jsonl`` plus ``<run_id>.manifest.json`` (host side).

Writing: each append adds whole lines at the end of the file with one ``O_APPEND`` write under an exclusive
``flock``, so its cost does not grow with the run. A writer killed mid-``write`` (or a power cut) can leave
a torn last line; the next writer repairs it under the lock before it appends (a tail that is a complete
JSON line gets its newline, anything else is cut), and the reader keeps a complete last line that lacks its
newline and skips a torn one with a warning. When a write fails (a full disk), the results stay in memory
in :attr:`RunStore.unstored` so the caller can say what was not stored. One run at a time per results host
folder (a run lock), since two runs on the same GPUs would distort each other's numbers; the run that takes
the lock removes the temporary files a killed writer left. A killed writer loses nothing it wrote (the
kernel holds it); against a power cut an append is fsynced when SYNC_EVERY_S has passed since this store's
last fsync, so a cut loses at most about that much of a run, not every line's fsync time (thousands of
decided-without-running lines are recorded in seconds).

Reading: every results folder is untrusted input (folders are copied between hosts). Anything that cannot be
read (a folder or file name outside its id grammar, a dangling link, a FIFO or folder named ``*.jsonl``,
undecodable bytes, a line too long or nested too deep, a lone surrogate, an id outside its grammar) is
skipped with one warning naming the file and line; nothing is dropped without a word and nothing blocks.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import stat
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from checks import atomic, ids
from checks.result import ProbeResult, ResultError

MAX_LINE = 1 << 20  # bytes in one results line (the largest recorded is under 8 KB)
MAX_MANIFEST = 16 << 20  # bytes in one manifest
MAX_FILE = 1 << 32  # bytes in one results file
SYNC_EVERY_S = 1.0  # an append reaches the disk within this of the one before it (see the module's note)
MAX_DEPTH = 32  # nesting of objects and arrays in one line or manifest (results use under 6)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
LEFTOVER = re.compile(r"\..+\.(jsonl|manifest\.json)\..+\.tmp")  # atomic.write_bytes' temporary files


class StoreBusy(RuntimeError):
    pass


class Unreadable(Exception):
    """A file that cannot be read as results; the message says why, without the path."""


def new_run_id(now: datetime | None = None) -> str:
    now = now or datetime.now(UTC)
    return now.strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(2)


def where(path: Path, line: int | None = None) -> str:
    """A path (and line) for a warning, printable whatever bytes its name holds."""
    return ids.shown(str(path)) + (f":{line}" if line is not None else "")


def _line(result: ProbeResult) -> bytes:
    return (json.dumps(result.to_json(), sort_keys=True, default=str, separators=(",", ":")) + "\n").encode()


def _complete_json(data: bytes) -> bool:
    try:
        return isinstance(json.loads(data.decode("utf-8")), dict)
    except (ValueError, RecursionError):
        return False


def _repair_tail(fd: int) -> int:
    """Make the file end in a whole line (the caller holds the lock): a torn tail is cut, a complete JSON
    line without its newline gets one. Reads only the tail. Returns the size afterwards."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    pos, tail = size, b""
    while pos > 0 and b"\n" not in tail:
        step = min(1 << 16, pos)
        pos -= step
        tail = os.pread(fd, step, pos) + tail
    cut = tail.rfind(b"\n") + 1  # 0 when the file has no newline at all
    start = pos + cut
    if _complete_json(tail[cut:]):
        os.write(fd, b"\n")
        return size + 1
    os.ftruncate(fd, start)
    return start


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


@dataclass
class RunStore:
    root: Path
    host_id: str
    run_id: str
    unstored: list[ProbeResult] = field(default_factory=list)  # results a write failed for, in order
    write_error: str = ""  # the first failed write, as one line
    _synced_at: float = field(default=float("-inf"), repr=False)

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
        """Append whole lines in one write. Safe from several threads or processes: each call opens the file
        anew, so each holds its own flock. A failed write leaves the file as it was and keeps ``results`` in
        :attr:`unstored` (said once on stderr); the run goes on, and its caller says what was lost."""
        if not results:
            return
        data = b"".join(_line(r) for r in results)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.results_path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                         atomic.new_file_mode())
        except OSError as exc:
            self._failed(results, exc)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{self.results_path} is not a regular file")
            size = _repair_tail(fd)
            try:
                _write_all(fd, data)
                if time.monotonic() - self._synced_at >= SYNC_EVERY_S:
                    os.fdatasync(fd)
                    self._synced_at = time.monotonic()
            except OSError:
                os.ftruncate(fd, size)  # no half-written line stays behind
                raise
        except OSError as exc:
            self._failed(results, exc)
        finally:
            os.close(fd)  # closing releases the lock

    def _failed(self, results: list[ProbeResult], exc: OSError) -> None:
        if not self.write_error:
            self.write_error = f"cannot write {where(self.results_path)}: {exc.strerror or exc}"
            print(f"checks: {self.write_error}; results are kept in memory and listed at the end",
                  file=sys.stderr, flush=True)
        self.unstored.extend(results)

    def recorded(self) -> set[tuple[str, str, str]]:
        if not self.results_path.exists():
            return set()
        results, _ = read_file(self.results_path)
        return {r.key for r in results}


def clean_leftovers(folder: Path) -> list[Path]:
    """Remove the temporary files a killed writer left in a host folder (the caller holds its run lock)."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for e in entries:
        if LEFTOVER.fullmatch(e.name) and e.is_file(follow_symlinks=False):
            try:
                os.unlink(e.path)
                removed.append(Path(e.path))
            except OSError:
                pass
    return removed


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
        clean_leftovers(self.folder)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def latest_run(folder: Path) -> str | None:
    runs = sorted(n for p in folder.glob("*.jsonl") if ids.run_ok(n := p.name[: -len(".jsonl")])) \
        if folder.is_dir() else []
    return runs[-1] if runs else None


def read_bytes(path: Path, limit: int) -> bytes:
    """A regular file's bytes, at most ``limit``; never blocks on a FIFO or device. Unreadable says why."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise Unreadable("missing (or a link to nothing)") from None
    except OSError as exc:
        raise Unreadable(f"cannot open ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else \
                "not a regular file"
            raise Unreadable(f"{kind}, not a results file")
        if st.st_size > limit:
            raise Unreadable(f"{st.st_size} bytes, over the limit of {limit}")
        chunks = []
        total = 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise Unreadable(f"over the limit of {limit} bytes")
        return b"".join(chunks)
    except OSError as exc:
        raise Unreadable(f"cannot read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def _bounded(obj: Any) -> str | None:
    """Why a parsed value is refused (nested deeper than MAX_DEPTH, a lone surrogate in a string), or None."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > MAX_DEPTH:
                return f"nested deeper than {MAX_DEPTH} levels"
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                if isinstance(k, str) and _LONE_SURROGATE.search(k):
                    return "a string holds a lone surrogate (not text)"
                stack.append((v, depth + 1))
        elif isinstance(value, str) and _LONE_SURROGATE.search(value):
            return "a string holds a lone surrogate (not text)"
    return None


def parse_json(raw: bytes) -> Any:
    """One JSON document from untrusted bytes, bounded in depth; ValueError says why it is refused."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None
    try:
        obj = json.loads(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({getattr(exc, 'msg', exc)})") from None
    if isinstance(obj, dict | list) and (why := _bounded(obj) if (
            _ESCAPED_SURROGATE.search(raw) or raw.count(b"[") + raw.count(b"{") > MAX_DEPTH) else None):
        raise ValueError(why)
    return obj


def _ids_wrong(r: ProbeResult) -> str | None:
    for name, value, ok in (("run_id", r.run_id, ids.run_ok), ("host_id", r.host_id, ids.host_ok),
                            ("cell_id", r.cell_id, ids.cell_ok), ("probe_id", r.probe_id, ids.probe_ok),
                            ("variant", r.variant, ids.variant_ok),
                            ("reason_code", r.verdict.reason_code, ids.reason_ok)):
        if not ok(value):
            return f"{name} {ids.shown(value)[:80]!r} is outside its grammar (see checks/ids.py)"
    return None


def read_file(path: Path) -> tuple[list[ProbeResult], list[str]]:
    """Valid results of one JSONL file (either schema) and a warning (file:line: why) for each line that is
    not, or one warning for a file that cannot be read at all. A complete last line without its newline is
    kept; a torn one is skipped."""
    results: list[ProbeResult] = []
    warnings: list[str] = []
    try:
        data = read_bytes(path, MAX_FILE)
    except Unreadable as exc:
        return [], [f"{where(path)}: {exc}; skipped"]
    lines = data.split(b"\n")
    last = len(lines)
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        if len(raw) > MAX_LINE:
            warnings.append(f"{where(path, n)}: {len(raw)} bytes, over the line limit of {MAX_LINE}; skipped")
            continue
        try:
            obj = parse_json(raw)
        except ValueError as exc:
            torn = n == last  # no newline after it: an interrupted write
            why = "unterminated last line (a run was interrupted mid-write)" if torn else str(exc)
            warnings.append(f"{where(path, n)}: {why}; skipped")
            continue
        try:
            r = ProbeResult.from_json(obj)
        except ResultError as exc:
            warnings.append(f"{where(path, n)}: {ids.shown(str(exc))[:300]}; skipped")
            continue
        if why := _ids_wrong(r):
            warnings.append(f"{where(path, n)}: {why}; skipped")
            continue
        results.append(r)
    return results, warnings


def scan(root: Path) -> tuple[list[tuple[str, str, Path]], list[str]]:
    """(host_id, run_id, jsonl path) for every run under a results directory, sorted, and a warning for each
    folder or file that is skipped: a name outside its id grammar (or not UTF-8), a folder that cannot be
    listed. Names starting with a dot (temporary files, editors' files) are passed over."""
    found: list[tuple[str, str, Path]] = []
    warnings: list[str] = []
    try:
        hosts = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as exc:
        return [], [f"{where(root)}: cannot list ({exc.strerror or exc}); skipped"]
    for h in hosts:
        if h.name.startswith("."):
            continue
        try:
            is_dir = h.is_dir()
        except OSError:
            is_dir = False
        if not is_dir:
            continue
        if not ids.host_ok(h.name):
            warnings.append(f"{where(Path(h.path))}: folder name is not a host id (<label>-<8 hex digits>); "
                            "skipped")
            continue
        try:
            files = sorted(os.scandir(h.path), key=lambda e: e.name)
        except OSError as exc:
            warnings.append(f"{where(Path(h.path))}: cannot list ({exc.strerror or exc}); skipped")
            continue
        for f in files:
            if f.name.startswith(".") or not f.name.endswith(".jsonl"):
                continue
            run = f.name[: -len(".jsonl")]
            if not ids.run_ok(run):
                warnings.append(f"{where(Path(f.path))}: file name is not a run id (<UTC time>-<4 hex digits>)"
                                ".jsonl; skipped")
                continue
            found.append((h.name, run, Path(f.path)))
    return found, warnings


def iter_runs(root: Path) -> Iterator[tuple[str, str, Path]]:
    """(host_id, run_id, jsonl path) for every readable-named run under a results directory, sorted."""
    yield from scan(root)[0]


def read_manifest(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    try:
        data = parse_json(read_bytes(path, MAX_MANIFEST))
    except Unreadable as exc:
        if str(exc).startswith("missing"):
            return None, f"{where(path)}: missing (host facts unknown)"
        return None, f"{where(path)}: {exc}; skipped"
    except ValueError as exc:
        return None, f"{where(path)}: unreadable ({exc}); skipped"
    return (data, None) if isinstance(data, dict) else (None, f"{where(path)}: not a JSON object")
