"""Leaves with a non-zero status without reporting (as a library calling exit() would)."""

import os

from inenv.probe import ProbeSpec, RankContext

SPEC = ProbeSpec(id="t-exit", title="exit", feature="failure classification", ranks=(1,), needs_gpu=False,
                 timeout_s=30)


def run(ctx: RankContext) -> dict:
    os._exit(7)
