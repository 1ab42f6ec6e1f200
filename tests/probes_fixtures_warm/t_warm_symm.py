"""Passes after importing torch symmetric memory, whose registrations outlive a process group: no later variant
may run in this process."""

import os

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-warm-symm", title="imports symmetric memory", feature="stateful modules end a group",
                 ranks=(2,), needs_gpu=False, requires=("torch",), timeout_s=60)


def run(ctx: RankContext) -> dict:
    import torch.distributed._symmetric_memory  # noqa: F401

    return outcome("pass", metrics={"pid": os.getpid()})
