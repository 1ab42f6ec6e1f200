"""Progress of a long command (`checks run`, `provision build`), host side: durations as people read them,
the time left estimated from durations recorded by earlier runs, a console that never wraps a line, and a
ticker that says what is still running and for how long.

Output that is not a terminal (a log file, CI) gets one event per line: never wrapped, never redrawn, so
a line can be grepped and a log read top to bottom; a live bar is only drawn on a terminal.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rich.console import Console

TICK_S = 60.0  # how often a long-running step is mentioned again on a non-terminal


def duration(seconds: float) -> str:
    """``0.4 s``, ``42 s``, ``8m02s``, ``1h05m``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


@dataclass(frozen=True)
class Estimate:
    """Time left for some steps: the sum of their recorded durations, and how many have none."""

    seconds: float
    unknown: int = 0
    steps: int = 0

    def text(self) -> str:
        """``about 14m10s``; ``about 2m00s + 3 never timed``; ``unknown (3 never timed)``."""
        if self.steps == 0:
            return "nothing left"
        if self.unknown == self.steps:
            return f"unknown ({self.unknown} never timed)"
        more = f" + {self.unknown} never timed" if self.unknown else ""
        return f"about {duration(self.seconds)}{more}"


def estimate(recorded: Iterable[float | None]) -> Estimate:
    """The estimate for steps whose last recorded durations are ``recorded`` (None: never recorded)."""
    values = list(recorded)
    known = [v for v in values if v is not None]
    return Estimate(sum(known), len(values) - len(known), len(values))


def console(stderr: bool = True) -> Console:
    """A rich console that never wraps (soft_wrap) or highlights: a non-terminal gets each event on one line
    however long, with no colour codes."""
    return Console(stderr=stderr, highlight=False, soft_wrap=True)


class Ticker:
    """Calls ``say(describe(elapsed))`` every ``interval`` seconds for each step still running.

    One daemon thread for all steps; ``start``/``stop`` may be called from any thread. Used as a context
    manager, the thread ends on exit."""

    def __init__(self, say: Callable[[str], None], interval: float = TICK_S) -> None:
        self.say, self.interval = say, interval
        self._running: dict[str, tuple[float, float, Callable[[float], str]]] = {}  # key -> (start, next, describe)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="progress-ticker", daemon=True)

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def start(self, key: str, describe: Callable[[float], str]) -> None:
        now = time.monotonic()
        with self._lock:
            self._running[key] = (now, now + self.interval, describe)

    def stop(self, key: str) -> None:
        with self._lock:
            self._running.pop(key, None)

    def _loop(self) -> None:
        while not self._stop.wait(min(1.0, self.interval / 4)):
            now = time.monotonic()
            due = []
            with self._lock:
                for key, (began, nxt, describe) in self._running.items():
                    if now >= nxt:
                        self._running[key] = (began, now + self.interval, describe)
                        due.append((describe, now - began))
            for describe, elapsed in due:
                self.say(describe(elapsed))
