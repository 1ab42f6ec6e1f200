"""Ranks that go through a probe's steps together.

A step that fails on one rank leaves its peers blocked in the next collective, and the variant would read
as a hang instead of the failure that stopped it. So after every step each rank learns every rank's early
outcome (None: go on), and either all ranks stop with the worst of them or all go on.

    lock = Lockstep(ctx.rank, group, evidence)
    try:
        with lock.step("workspace creation", "fi-workspace-failed"):
            ws = make_workspace()            # an exception here is this rank's early `fail`
        with lock.step("eager call", "fi-fusion-error") as step:
            results = run_eagerly(ws)
            step.early = judge(results)      # or a wrong result: None goes on
        ...
        return lock.finish(outcome("pass"))
    except Stopped as stop:
        return stop.outcome                  # the same worst outcome on every rank

In-environment side: torch (through ``_dist``) inside the functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from inenv.kit import _dist
from inenv.kit._errors import error_tail, last_line
from inenv.probe import combine_worst, outcome


class Stopped(Exception):
    """Raised on every rank when a step ended the probe on some rank; ``outcome`` is what they all return."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__(result.get("note", ""))
        self.outcome = result


def stop_together(local: dict[str, Any] | None, group: Any = None) -> dict[str, Any] | None:
    """Every rank learns every rank's early outcome (None = go on): the worst of them, or None when all go on."""
    verdicts = [o for o in _dist.gather_objects(local, group) if o is not None]
    return combine_worst(verdicts) if verdicts else None


@dataclass
class Step:
    """What the body of one step found: set ``early`` to an outcome to stop every rank (a wrong result, say)."""

    early: dict[str, Any] | None = None


@dataclass
class Lockstep:
    rank: int
    group: Any  # the group every rank of the probe is in (None: the default group)
    evidence: dict[str, Any]  # what an early outcome carries; the probe may keep adding to it
    metrics: dict[str, Any] = field(default_factory=dict)

    @contextlib.contextmanager
    def step(
        self,
        what: str,
        code: str | Callable[[str], str],
        *,
        status: str = "fail",
        prefix: str = "",
        extra: dict[str, Any] | None = None,
    ) -> Iterator[Step]:
        """Run the body on this rank, then stop together or go on together (raises :class:`Stopped`).

        An exception in the body becomes this rank's early outcome: ``status`` with ``code`` (or ``code(error
        text)``), the note ``{prefix}rank R: {what} failed: <last error line>``, the evidence plus ``extra``
        plus the error."""
        found = Step()
        try:
            yield found
        except Stopped:
            raise
        except Exception as exc:
            err = error_tail(exc)
            found.early = outcome(
                status,
                note=f"{prefix}rank {self.rank}: {what} failed: {last_line(err)}",
                reason_code=code(err) if callable(code) else code,
                metrics=self.metrics,
                evidence={**self.evidence, **(extra or {}), "error": err},
            )
        self.check(found.early)

    def check(self, early: dict[str, Any] | None) -> None:
        """Stop every rank with the worst early outcome, if any rank has one."""
        worst = stop_together(early, self.group)
        if worst is not None:
            raise Stopped(worst)

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        """The outcome every rank returns at the end: the worst of all ranks' final outcomes."""
        return stop_together(result, self.group) or result
