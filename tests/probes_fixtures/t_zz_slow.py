"""Takes 60 s (sorts last): a run can be interrupted while it is in flight."""

import time

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-zz-slow", title="slow", feature="interruption", needs_gpu=False, timeout_s=120)


def run(ctx: RankContext) -> dict:
    time.sleep(60)
    return outcome("pass")
