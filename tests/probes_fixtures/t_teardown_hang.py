"""Correct result, then a process-group teardown that never returns (as NCCL after graph capture)."""

import time

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-teardown-hang", title="teardown hang", feature="early reporting", ranks=(2,),
                 needs_gpu=False, requires=("torch",), timeout_s=60)


def run(ctx: RankContext) -> dict:
    import torch

    dist = ctx.init_process_group("gloo")
    x = torch.ones(4)
    dist.all_reduce(x)
    dist.destroy_process_group = lambda *a, **k: time.sleep(3600)
    return outcome("pass" if bool((x == ctx.world_size).all()) else "fail", note="")
