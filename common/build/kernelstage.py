"""The long part of `provision build`'s kernel stage, run after the command returns, so the first table does
not wait for it (host side, shared by provision and checks).

`provision build` carries the quick comm module in its own run (what `checks run`'s quick pass loads), then
starts the long modules' builds as one process of their own (``python -m provision.kernels JOB``) and returns.
That process says where it is in a log; this module is how the others find it: :func:`running` names it while
it lives, and :func:`wait` waits for it and shows its lines as they come (at least one line a ``tick_s``). A
later `provision build` waits for it before it starts, and `checks run` before the variants of its full level that
need a module it builds (:func:`building`: the rest run beside it), so those load what the stage carried instead
of compiling it a second time.

One stage runs per folder: its process holds the folder's lock (:func:`take_lock`, an flock on ``stage.lock``)
from before its log is opened until it ends, so a second `provision build` started at the same moment finds it
taken and waits for the first (:class:`StageBusy`) instead of truncating the same log. The state file is read
as untrusted: its log must be a regular file directly in the folder (a link, a FIFO or a device named there is
refused with one line, never opened), and its pid a live stage of this folder (the process's command line names
the stage's module and this folder's job file). Every line of the log reaches the terminal escaped.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common import escape
from common.home import CACHE_ROOT
from common.progress import duration
from inenv import atomic

FOLDER = CACHE_ROOT / "kernels"
STATE = "stage.json"  # {pid, started, log, builds}: written by provision.kernels.start while it runs
JOB = "stage-job.json"  # what the stage builds: its path is on the stage's command line
LOCK = "stage.lock"  # held by the running stage (and by whoever is starting one)
LOG = "stage.log"
MARKER = "provision.kernels"  # in the process's command line: a reused pid is not taken for the stage
TICK_S = 30.0
MAX_STATE_BYTES = 1 << 16
MAX_JOB_BYTES = 1 << 20


@dataclass(frozen=True)
class Stage:
    pid: int
    started: float  # time.time() when it started
    log: Path
    builds: int  # module builds it was given (most are found done when nothing changed)


class StageBusy(OSError):
    """Another process holds the folder's stage lock: a stage is running or being started."""


def state_path(folder: Path | None = None) -> Path:
    return (folder or FOLDER) / STATE


def job_path(folder: Path | None = None) -> Path:
    return (folder or FOLDER) / JOB


def take_lock(folder: Path | None = None) -> int:
    """The folder's stage lock, taken without waiting: an open descriptor holding it (the stage's process
    inherits it and holds it until it ends). StageBusy when another process holds it."""
    folder = folder or FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StageBusy(f"{folder / LOCK}: another `provision build` runs the kernel stage") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def locked(folder: Path | None = None) -> bool:
    """Whether a stage holds (or is taking) the folder's lock now; a folder without a lock file has none (and
    is not made)."""
    if not ((folder or FOLDER) / LOCK).is_file():
        return False
    try:
        fd = take_lock(folder)
    except StageBusy:
        return True
    except OSError:
        return False
    os.close(fd)
    return False


def _cmdline(pid: int) -> list[bytes] | None:
    """The process's arguments, or None when it is gone or a zombie."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None if state == "Z" else cmdline.split(b"\0")


def _alive(pid: int, folder: Path | None = None, settle_s: float = 2.0) -> bool:
    """Whether ``pid`` is a live kernel stage of ``folder``: its command line names the stage's module and this
    folder's job file. A process that has just started shows an empty command line for a moment: it is read
    again for up to ``settle_s``."""
    wanted = os.fsencode(job_path(folder).absolute())
    deadline = time.monotonic() + settle_s
    while True:
        args = _cmdline(pid)
        if args is None:
            return False
        if any(args) or time.monotonic() >= deadline:
            return MARKER.encode() in args and wanted in args
        time.sleep(0.05)


def _read_object(path: Path, limit: int) -> dict | None:
    """The JSON object in ``path``, read without following a link and only from a regular file of at most
    ``limit`` bytes; None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        raw = f.read(limit + 1)
    try:
        data = json.loads(raw) if len(raw) <= limit else None
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _read_state(folder: Path) -> dict | None:
    """The state file's object (:func:`_read_object`)."""
    return _read_object(state_path(folder), MAX_STATE_BYTES)


def building(folder: Path | None = None) -> dict[str, tuple[str, ...]]:
    """What the kernel stage running now builds: cell id -> the modules it builds in that cell, from its job file
    (read as untrusted: only text cell ids and module names count); {} when no stage runs or its job cannot be
    read. The modules a cell's build record already holds are in it too: the stage finds them done."""
    folder = folder or FOLDER
    if running(folder) is None:
        return {}
    job = _read_object(job_path(folder), MAX_JOB_BYTES) or {}
    cells, modules = job.get("cells"), job.get("modules")
    if not isinstance(cells, list) or not isinstance(modules, list):
        return {}
    mods = tuple(m for m in modules if isinstance(m, str) and m)
    return {c: mods for c in cells if isinstance(c, str) and c} if mods else {}


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def log_problem(log: Path, folder: Path) -> str | None:
    """Why ``log`` may not be read as the stage's log: not directly in ``folder``, missing, a link, or not a
    regular file (a FIFO would block the reader, a device fill the terminal); None when it may."""
    if log.parent.absolute() != folder.absolute() or log.name in ("", ".", ".."):
        return f"is not in {escape.terminal(folder)}"
    try:
        st = log.lstat()
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a link"
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or \
            stat.S_ISBLK(st.st_mode) else "not a regular file"
        return f"is {kind}"
    return None


def stage_of(folder: Path | None = None) -> Stage | str | None:
    """The kernel stage of ``folder`` running now; a line saying why the state file is refused (its log not a
    regular file of the folder); or None (no state file, a stale one, one that cannot be read)."""
    folder = folder or FOLDER
    data = _read_state(folder)
    if data is None:
        return None
    pid, builds, started, log = _int(data.get("pid")), _int(data.get("builds", 0)), data.get("started"), \
        data.get("log")
    if pid is None or pid <= 0 or builds is None or not isinstance(started, (int, float)) \
            or isinstance(started, bool) or not isinstance(log, str) or not log:
        return None
    if not _alive(pid, folder):
        return None
    why = log_problem(Path(log), folder)
    if why:
        return (f"{escape.terminal(state_path(folder))}: its log {escape.terminal(log)} {why}; not read (the stage "
                f"writes {LOG} in {escape.terminal(folder)}): remove {STATE} if no `provision build` of yours "
                "started it")
    return Stage(pid, float(started), Path(log), builds)


def running(folder: Path | None = None) -> Stage | None:
    """The kernel stage running now, or None (no state file, a stale or refused one, one that cannot be read)."""
    stage = stage_of(folder)
    return stage if isinstance(stage, Stage) else None


def wait(say: Callable[[str], None], folder: Path | None = None, tick_s: float = TICK_S, poll_s: float = 1.0,
         start_s: float = 10.0) -> bool:
    """Wait for the running kernel stage, saying the last line its log holds when the wait begins and then each line
    it gains (escaped for the terminal) and, when it
    is silent for ``tick_s``, that it is still running and for how long; True when there was one to wait for. A
    stage being started (its lock taken, its state not yet written) is given ``start_s`` to write it; a refused
    state file is said in one line and not waited on. Ctrl-C stops the wait (KeyboardInterrupt), never the
    stage."""
    folder = folder or FOLDER
    stage = stage_of(folder)
    deadline = time.monotonic() + start_s
    while stage is None and locked(folder) and time.monotonic() < deadline:
        time.sleep(min(poll_s, 0.2))
        stage = stage_of(folder)
    if isinstance(stage, str):
        say(stage)
        return False
    if stage is None:
        return False
    say(f"waiting for the kernel stage `provision build` started (pid {stage.pid}, {stage.builds} module "
        f"build(s), running for {duration(time.time() - stage.started)}; its log: "
        f"{escape.terminal(_shown(stage.log))})")
    standing, seen = _last_line(stage.log)
    if standing:
        say(standing)  # where the stage stands now; then each line it gains
    last = time.monotonic()
    while _alive(stage.pid, folder):
        time.sleep(poll_s)
        lines, seen = _new_lines(stage.log, seen)
        for line in lines:
            say(line)
        if lines:
            last = time.monotonic()
        elif time.monotonic() - last >= tick_s:
            say(f"the kernel stage is still running ({duration(time.time() - stage.started)} so far)")
            last = time.monotonic()
    lines, _ = _new_lines(stage.log, seen)
    for line in lines:
        say(line)
    return True


def _open_regular(path: Path) -> int | None:
    """A descriptor of ``path`` opened for reading without following a link, blocking on a FIFO or taking a
    terminal, kept only when it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _last_line(path: Path, tail: int = 1 << 16) -> tuple[str, int]:
    """The last complete line of ``path`` (escaped for the terminal; "" when none ends in its last ``tail`` bytes)
    and the offset after it, read in one go so a line written meanwhile is neither lost nor shown twice."""
    fd = _open_regular(path)
    if fd is None:
        return "", 0
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = max(0, size - tail)
        f.seek(start)
        chunk = f.read(size - start)
    end = chunk.rfind(b"\n")
    if end < 0:
        return "", start
    parts = chunk[:end].decode(errors="replace").split("\n")[1 if start else 0:]  # a cut first line left out
    lines = [ln for ln in parts if ln.strip()]
    return (escape.terminal(lines[-1].removesuffix("\r")) if lines else ""), start + end + 1


def _new_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """The complete lines ``path`` gained past ``offset``, each escaped for the terminal, and the offset after
    them; nothing from a path that is not a regular file when it is read."""
    fd = _open_regular(path)
    if fd is None:
        return [], offset
    with os.fdopen(fd, "rb") as f:
        f.seek(offset)
        chunk = f.read(1 << 20)
    end = chunk.rfind(b"\n")
    if end < 0:
        return [], offset
    text = chunk[: end + 1].decode(errors="replace")
    lines = (ln.removesuffix("\r") for ln in text.split("\n"))  # a lone \r or \u2028 shows, ends no line
    return [escape.terminal(ln) for ln in lines if ln.strip()], offset + end + 1


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def write_state(stage: Stage, folder: Path | None = None) -> None:
    folder = folder or FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    atomic.write_json(state_path(folder), {"pid": stage.pid, "started": stage.started, "log": str(stage.log),
                                           "builds": stage.builds}, indent=None)


def clear(pid: int, folder: Path | None = None) -> None:
    """Remove the state file when it names ``pid`` (a newer stage's file stays)."""
    data = _read_state(folder or FOLDER)
    if data is not None and _int(data.get("pid")) == pid:
        with contextlib.suppress(OSError):
            state_path(folder).unlink()
