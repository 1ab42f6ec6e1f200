"""The long part of `provision build`'s kernel stage, run after the command returns, so the first table does
not wait for it (host side, shared by provision and checks).

`provision build` carries the quick comm module in its own run (what `checks run`'s quick pass loads), then
starts the long modules' builds as one process of their own (``python -m provision.kernels JOB``) and returns.
That process says where it is in a log; this module is how the others find it: :func:`running` names it while
it lives, and :func:`wait` waits for it and shows its lines as they come (at least one line a ``tick_s``). A
later `provision build` waits for it before it starts, and `checks run` before its full pass, so the full pass
loads what the stage carried instead of compiling it a second time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.home import CACHE_ROOT
from common.progress import duration
from inenv import atomic

FOLDER = CACHE_ROOT / "kernels"
STATE = "stage.json"  # {pid, started, log, builds}: written by provision.kernels.start while it runs
MARKER = "provision.kernels"  # in the process's command line: a reused pid is not taken for the stage
TICK_S = 30.0


@dataclass(frozen=True)
class Stage:
    pid: int
    started: float  # time.time() when it started
    log: Path
    builds: int  # module builds it was given (most are found done when nothing changed)


def state_path(folder: Path | None = None) -> Path:
    return (folder or FOLDER) / STATE


def _alive(pid: int, settle_s: float = 2.0) -> bool:
    """Whether ``pid`` is a live kernel-stage process (its command line names the stage's module). A process
    that has just started shows an empty command line for a moment: it is read again for up to ``settle_s``."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        if state == "Z":
            return False
        if cmdline or time.monotonic() >= deadline:
            return MARKER.encode() in cmdline
        time.sleep(0.05)


def running(folder: Path | None = None) -> Stage | None:
    """The kernel stage running now, or None (no state file, a stale one, or one that cannot be read)."""
    folder = folder or FOLDER
    try:
        data = json.loads(state_path(folder).read_text())
        stage = Stage(int(data["pid"]), float(data["started"]), Path(str(data["log"])), int(data.get("builds", 0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return stage if _alive(stage.pid) else None


def wait(say: Callable[[str], None], folder: Path | None = None, tick_s: float = TICK_S, poll_s: float = 1.0) -> bool:
    """Wait for the running kernel stage, saying each line its log gains and, when it is silent for ``tick_s``,
    that it is still running and for how long; True when there was one to wait for. Ctrl-C stops the wait
    (KeyboardInterrupt), never the stage."""
    stage = running(folder)
    if stage is None:
        return False
    say(f"waiting for the kernel stage `provision build` started (pid {stage.pid}, {stage.builds} module "
        f"build(s), running for {duration(time.time() - stage.started)}; its log: {_shown(stage.log)})")
    seen = _size(stage.log)
    last = time.monotonic()
    while _alive(stage.pid):
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


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _new_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """The complete lines ``path`` gained past ``offset``, and the offset after them."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read(1 << 20)
    except OSError:
        return [], offset
    end = chunk.rfind(b"\n")
    if end < 0:
        return [], offset
    text = chunk[: end + 1].decode(errors="replace")
    return [ln for ln in text.splitlines() if ln.strip()], offset + end + 1


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
    try:
        if json.loads(state_path(folder).read_text()).get("pid") == pid:
            state_path(folder).unlink()
    except (OSError, ValueError, AttributeError):
        pass
