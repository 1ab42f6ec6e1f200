"""The verdict vocabulary, shared by the host side and the in-environment side (standard library only).

Members are ``str`` values, so a status compares equal to its JSON spelling and serialises as it.
Declaration order is best to worst: the worst of several rank outcomes is the verdict of the variant.

- ``pass``; ``partial``: works with a named limitation (the note names it);
- ``skip``: not applicable here (too few GPUs, a package absent in this cell);
- ``fail``: the feature was reached and was wrong or refused;
- ``crash``: killed by a signal or the CUDA runtime; ``hang``: a watchdog fired (the host's, or a probe's own
  deadline on device work it keeps queuing, which then reports the hang itself);
- ``not-run``: a prerequisite failed (the image did not build); ``unavailable``: the cell cannot be provisioned.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum


class Status(StrEnum):
    PASS = "pass"
    PARTIAL = "partial"
    SKIP = "skip"
    FAIL = "fail"
    CRASH = "crash"
    HANG = "hang"
    NOT_RUN = "not-run"
    UNAVAILABLE = "unavailable"

    @property
    def severity(self) -> int:
        """0 for pass, growing towards the worst verdict."""
        return ORDER.index(self)


ORDER: tuple[Status, ...] = tuple(Status)
RUN_STATUSES = frozenset({Status.PASS, Status.PARTIAL, Status.FAIL, Status.SKIP, Status.HANG})  # a probe may return
GOOD = frozenset({Status.PASS, Status.PARTIAL, Status.SKIP})  # a rank reporting one of these did not fail


def parse(value: object) -> Status | None:
    """The status spelled ``value``, or None when it is not one."""
    try:
        return Status(value)
    except ValueError:
        return None


def worst(statuses: Iterable[str]) -> Status:
    """The worst of ``statuses`` (an unknown spelling counts as ``fail``); ``fail`` for none at all."""
    known = [parse(s) or Status.FAIL for s in statuses]
    return max(known, key=ORDER.index) if known else Status.FAIL
