"""A real multi-process all_reduce over gloo, checked exactly (integer inputs)."""

import os

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-gloo-allreduce", title="gloo all_reduce", feature="torch.distributed on CPU",
                 ranks=(2, 3), min_ranks=2, needs_gpu=False, requires=("torch", "torch.distributed"),
                 timeout_s=120)


def run(ctx: RankContext) -> dict:
    import torch

    dist = ctx.init_process_group("gloo")
    x = torch.full((1024,), float(ctx.rank + 1))
    dist.all_reduce(x)
    want = ctx.world_size * (ctx.world_size + 1) / 2
    ok = bool((x == want).all())
    evidence = {"env_probe": os.environ.get("STACKPROBE_TEST_ENV", "<unset>"), "device": ctx.device_index,
                "master_port": ctx.master_port}
    if not ok:
        return outcome("fail", note=f"sum {x[0].item()} != {want}", evidence=evidence)
    return outcome("pass", metrics={"sum": want}, evidence=evidence)
