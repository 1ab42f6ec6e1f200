"""What a run shows while it executes (host side): a line when a cell comes up and one per variant that ran
(with done/total and the time left). A terminal also gets a live bar with the running variant and its time;
anything else gets a line when a variant starts and again every TICK_S while it runs."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
from rich.text import Text

from checks.results.result import ProbeResult
from checks.run import runprogress
from checks.run.plan import WorkItem
from checks.run.runner import Hooks, RunReport
from common import escape, memlock, progress
from common.progress import TICK_S
from inenv.status import Status

STATUS_STYLE = {Status.PASS: "green", Status.PARTIAL: "yellow", Status.SKIP: "dim", Status.FAIL: "red",
                Status.CRASH: "bold red", Status.HANG: "magenta", Status.NOT_RUN: "cyan", Status.UNAVAILABLE: "blue"}


def shown(text: str) -> str:
    """Lines for the terminal: a verdict's note or a package's version (recorded text) moves no cursor and
    reorders nothing (common.escape); the line breaks the text was composed with stay."""
    return "\n".join(escape.terminal(line) for line in text.split("\n"))


def with_progress(con: Any, view: runprogress.RunView, run: Callable[[Hooks], RunReport]) -> RunReport:
    """``run`` (a backend's run of the work) with hooks that say what happens on ``con``."""
    live = con.is_terminal
    said_memlock: list[str] = []

    def say(text: str) -> None:
        con.print(shown(text), markup=False, highlight=False)

    say(view.opening())
    with contextlib.ExitStack() as stack:
        ticker = stack.enter_context(progress.Ticker(say, TICK_S))
        bar = stack.enter_context(_live_bar(con, view.total)) if live else None

        def started(item: WorkItem) -> None:
            header = view.cell_header(item)
            if header:
                say(header)
            if not item.runs:
                return
            if bar is not None:
                bar.start(item, view)
            else:
                say(view.start_line(item))
                ticker.start(view.label(item), lambda elapsed: view.tick_line(item, elapsed))

        def finished(item: WorkItem, result: ProbeResult) -> None:
            view.finish(item, result)
            ticker.stop(view.label(item))
            if bar is not None:
                bar.advance(view)
            if item.runs:
                con.print(shown(view.result_line(item, result)), markup=False,
                          style=STATUS_STYLE[result.verdict.status])
            note = result.verdict.evidence.get("memlock")
            if note and note != memlock.UNLIMITED and not said_memlock:
                said_memlock.append(str(note))
                say(memlock.console_line(str(note)))

        return run(Hooks(on_start=started, on_result=finished, say=say))


class _Bar:
    """The live bar of a terminal: the running variant, how long it has run, done/total, time left."""

    def __init__(self, progress: Any, total: int) -> None:
        self.progress = progress
        self.task = progress.add_task("starting", total=total, since=None, left="")

    def start(self, item: WorkItem, view: runprogress.RunView) -> None:
        cell = view.cells.index(item.cell.cell_id) + 1
        self.progress.update(self.task, description=f"cell {cell}/{len(view.cells)} {item.spec.id} "
                             f"{item.variant.key}", since=time.monotonic())

    def advance(self, view: runprogress.RunView) -> None:
        est = view.left()
        self.progress.update(self.task, advance=1, since=None, left=f"{est.text()} left" if est.steps else "")


class _Running(ProgressColumn):
    def render(self, task: Any) -> Text:
        since = task.fields.get("since")
        return Text(progress.duration(time.monotonic() - since) if since else "")


@contextlib.contextmanager
def _live_bar(con: Any, total: int) -> Iterator[_Bar]:
    # transient: the bar goes when the run ends, so the summary is not printed under a half-drawn bar
    with Progress(TextColumn("{task.description}"), _Running(), BarColumn(bar_width=20), MofNCompleteColumn(),
                  TextColumn("{task.fields[left]}"), console=con, transient=True) as p:
        yield _Bar(p, total)
