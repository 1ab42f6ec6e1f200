"""Sleeps ``seconds`` (a param) and passes with the param ``n`` as its metric: several variants run at once
must each get back their own result."""

import time

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-echo", title="echo", feature="one result per variant", needs_gpu=False, timeout_s=60)


def run(ctx: RankContext) -> dict:
    time.sleep(float(ctx.variant.param("seconds", "0") or 0))
    print(f"echo {ctx.variant.param('n')}", flush=True)
    return outcome("pass", metrics={"n": int(ctx.variant.param("n", "0") or 0)})
