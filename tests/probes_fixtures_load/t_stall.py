"""Writes progress records, then stands still: with a stall deadline in the record the worker ends it long before
the variant's timeout and says where each rank stopped; in a phase without one (``mode=setup``) it is left to
finish."""

import os
import time

from inenv import progress
from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-stall", title="stall", feature="the stall watchdog", ranks=(2,), needs_gpu=False,
                 timeout_s=60, stall_s=1.0)
STOP = {0: (5, 40), 1: (7, 64)}  # rank -> (replay, tokens) where it stops moving


def run(ctx: RankContext) -> dict:
    rec = progress.Writer(ctx.workdir, ctx.rank, backend="stand-in", pattern="replay")
    if ctx.param("mode") == "setup":  # a long set-up declares no deadline: not a hang
        rec.at("prepare")
        time.sleep(2.5)
        return outcome("pass")
    last, tokens = STOP[ctx.rank]
    for n in range(1, last + 1):
        rec.at("replay", replay=n, size=tokens if n == last else 8, stream=ctx.rank % 2, pdl=True,
               verified=n - 1, stall_s=SPEC.stall_s)
    os.environ["T_STALL_AT"] = str(last)
    while True:
        time.sleep(60)
