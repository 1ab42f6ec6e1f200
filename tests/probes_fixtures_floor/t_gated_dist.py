"""A gated probe that joins its process group as the GPU probes do (``_dist.init_dist``, gloo here) with the
rendezvous among its preload steps: says whether the store was joined before the probe began, and sums the
ranks over the group it then forms."""

from inenv.kit import _dist
from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-gated-dist", title="gated rendezvous", feature="the store is joined before the gate",
                 ranks=(2,), timeout_s=60, preload=_dist.PRELOAD_DIST)


def run(ctx: RankContext) -> dict:
    joined_before = "store" in _dist._prepared
    _dist.init_dist(ctx, "gloo")
    import torch
    import torch.distributed as dist

    value = torch.tensor([ctx.rank + 1], dtype=torch.int64)
    dist.all_reduce(value)
    total = int(value.item())
    expected = ctx.world_size * (ctx.world_size + 1) // 2
    return outcome("pass" if total == expected else "fail",
                   evidence={"joined_before": _dist.gather_objects(joined_before), "sum": total})
