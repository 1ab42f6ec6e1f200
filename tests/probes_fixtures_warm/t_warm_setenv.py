"""Passes after setting an NCCL variable in its own process's environment, as the NCCL probes set theirs from
their params: a library may have read it, so no later variant may run in this process."""

import os

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-warm-setenv", title="sets its environment", feature="environment changes end a group",
                 ranks=(2,), needs_gpu=False, timeout_s=60)


def run(ctx: RankContext) -> dict:
    os.environ["NCCL_ALGO"] = "Tree"
    return outcome("pass", metrics={"pid": os.getpid()})
