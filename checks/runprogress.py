"""What a `checks run` says while it runs (host side): which cell of how many, which variant is running and
for how long, how many are done, and the time left estimated from the durations this host recorded before.

The text is made here from plain values (the clock is an argument), so it can be tested without running
anything; the command line decides where it goes (one line per event, or a live bar on a terminal).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from checks.plan import WorkItem
from checks.progress import Estimate, duration, estimate
from checks.result import ProbeResult

Key = tuple[str, str, str]


def recorded_durations(latest: Mapping[Key, ProbeResult]) -> dict[Key, float]:
    """The duration of every (cell, probe, variant) in the newest run that recorded it
    (checks.incremental.latest reads them)."""
    return {key: r.verdict.duration_s for key, r in latest.items()}


@dataclass(frozen=True)
class Expected:
    """How long a variant should take, and where that comes from."""

    seconds: float | None
    own: bool = False  # this very variant's record (else the mean of its probe's, or nothing)

    def text(self) -> str:
        if self.seconds is None:
            return "never timed here"
        took = duration(self.seconds)
        return f"last time {took}" if self.own else f"about {took} by its probe's record"


def expected_durations(items: Iterable[WorkItem], recorded: dict[Key, float]) -> dict[Key, Expected]:
    """For each item that will run (not decided in advance, not reused): its own recorded duration, else the
    mean of what that probe took on this host, else nothing (never timed)."""
    per_probe: dict[str, list[float]] = defaultdict(list)
    for (_, probe, _), d in recorded.items():
        if d > 0:
            per_probe[probe].append(d)
    out: dict[Key, Expected] = {}
    for it in items:
        if not it.runs:
            continue
        if it.key in recorded:
            out[it.key] = Expected(recorded[it.key], own=True)
        elif per_probe.get(it.spec.id):
            out[it.key] = Expected(sum(per_probe[it.spec.id]) / len(per_probe[it.spec.id]))
        else:
            out[it.key] = Expected(None)
    return out


@dataclass
class RunView:
    """Counts and text for one run's progress. ``items``: what this invocation will go through (variants a
    --resume found recorded are left out by the caller; reused ones are in it, done as the run starts)."""

    items: list[WorkItem]
    expected: dict[Key, Expected]
    done: set[Key] = field(default_factory=set)
    jobs: int = 1  # CPU-only variants of different cells run this many at once
    cells: list[str] = field(init=False)
    running: set[Key] = field(default_factory=set)
    _shown_cells: set[str] = field(default_factory=set)
    _gpu: set[Key] = field(init=False)

    def __post_init__(self) -> None:
        self.cells = list(dict.fromkeys(it.cell.cell_id for it in self.items))
        self._gpu = {it.key for it in self.items if it.spec.needs_gpu}

    @property
    def total(self) -> int:
        return len(self.items)

    def finish(self, item: WorkItem) -> None:
        self.running.discard(item.key)
        self.done.add(item.key)

    def left(self, running: Key | None = None, elapsed: float = 0.0) -> Estimate:
        """Time left: every item still to run; the running one counts what it has left of its record. GPU
        variants run one at a time; the CPU-only ones share ``jobs`` slots, so their part is divided."""
        gpu, cpu = [], []
        for key, exp in self.expected.items():
            if key in self.done:
                continue
            seconds = exp.seconds
            if key == running and seconds is not None:
                seconds = max(0.0, seconds - elapsed)
            (gpu if key in self._gpu else cpu).append(seconds)
        a, b = estimate(gpu), estimate(cpu)
        return Estimate(a.seconds + b.seconds / max(1, self.jobs), a.unknown + b.unknown, a.steps + b.steps)

    def opening(self) -> str:
        """Said once before the first variant: how many will run and how long that should take."""
        n = len(self.expected)
        if not n:
            how = "reused or decided" if any(it.reused is not None for it in self.items) else "decided"
            return f"nothing to run: all {self.total} variant(s) are {how} without running"
        est = self.left()
        where = "from the durations this host recorded" if est.unknown < n else "no earlier run on this host"
        return f"to run: {n} of {self.total} variant(s), {est.text()} ({where})"

    def cell_header(self, item: WorkItem) -> str | None:
        """``cell 2 of 5 <id>: 6 to run, 23 decided without running`` the first time a cell comes up."""
        cid = item.cell.cell_id
        if cid in self._shown_cells:
            return None
        self._shown_cells.add(cid)
        mine = [it for it in self.items if it.cell.cell_id == cid]
        run = sum(1 for it in mine if it.runs)
        reused = sum(1 for it in mine if it.reused is not None)
        decided = len(mine) - run - reused
        parts = [f"{run} to run" if run else "nothing to run"]
        if reused:
            parts.append(f"{reused} unchanged (reused)")
        if decided:
            parts.append(f"{decided} decided without running")
        return f"cell {self.cells.index(cid) + 1} of {len(self.cells)} {cid}: {', '.join(parts)}"

    def _last(self, item: WorkItem) -> str:
        return self.expected.get(item.key, Expected(None)).text()

    def label(self, item: WorkItem) -> str:
        return f"{item.cell.cell_id} {item.spec.id} {item.variant.key}"

    def start_line(self, item: WorkItem) -> str:
        """Said when ``item`` starts; it counts as running from here until :meth:`finish`."""
        self.running.add(item.key)
        n = len(self.done) + len(self.running)
        return f"  start {self.label(item)} ({n} of {self.total}; {self._last(item)})"

    def tick_line(self, item: WorkItem, elapsed: float) -> str:
        left = self.left(item.key, elapsed)
        return (f"running {self.label(item)}: {duration(elapsed)} so far ({self._last(item)}); "
                f"{len(self.done)} of {self.total} done, {left.text()} left")

    def result_line(self, item: WorkItem, result: ProbeResult) -> str:
        """One line per variant that ran; the caller marks the item done first."""
        v = result.verdict
        reason = f" {v.reason_code}" if v.reason_code else ""
        left = self.left()
        return (f"{v.status:>7} {self.label(item)} {duration(v.duration_s)}{reason} · "
                f"{len(self.done)} of {self.total} done" + (f", {left.text()} left" if left.steps else ""))
