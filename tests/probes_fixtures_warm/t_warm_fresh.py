"""Declares that its variants need rank processes of their own (ProbeSpec.fresh_ranks)."""

import os

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-warm-fresh", title="fresh ranks", feature="a probe opts out of kept ranks", ranks=(2,),
                 needs_gpu=False, timeout_s=60, fresh_ranks=True)


def run(ctx: RankContext) -> dict:
    return outcome("pass", metrics={"pid": os.getpid()})
