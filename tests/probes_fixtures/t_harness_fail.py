"""Passes, but the rank's own outcome write then fails (as on a full disk): the harness's failure, not the
feature's."""

import errno

from inenv import atomic
from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-harness-fail", title="harness failure", feature="failure classification", needs_gpu=False,
                 timeout_s=30)


def _full_disk(*_args: object, **_kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def run(ctx: RankContext) -> dict:
    atomic.write_json = _full_disk  # what the rank calls next, after this returns
    return outcome("pass")
