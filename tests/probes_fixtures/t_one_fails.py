"""Rank 1 gives up at once; rank 0 then waits forever for it (as in a rendezvous). Must be `fail` with rank
1's reason, soon, not a `hang` after the full timeout."""

import time

from inenv.probe import ProbeSpec, RankContext

SPEC = ProbeSpec(id="t-one-fails", title="one rank fails", feature="peer failure", ranks=(2,), needs_gpu=False,
                 timeout_s=120)


def run(ctx: RankContext) -> dict:
    if ctx.rank == 1:
        raise RuntimeError("Connection refused by the rendezvous store")
    while True:
        time.sleep(60)
