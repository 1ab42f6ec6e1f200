"""Rank 1 segfaults before the collective; rank 0 then waits forever in gloo. Must be `crash`, not `hang`."""

import ctypes

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-peer-crash", title="peer crash", feature="crash classification", ranks=(2,),
                 needs_gpu=False, requires=("torch",), timeout_s=60)


def run(ctx: RankContext) -> dict:
    import torch

    dist = ctx.init_process_group("gloo", timeout_s=600)
    if ctx.rank == 1:
        ctypes.string_at(0)
    x = torch.ones(4)
    dist.all_reduce(x)
    return outcome("pass")
