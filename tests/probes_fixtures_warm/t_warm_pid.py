"""Says which process ran it, how many variants that process ran, whether torch was imported before this run
began and how many CPU threads torch uses in it; then forms a gloo group and sums the ranks over it (exactly)."""

import os
import sys

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-warm-pid", title="warm pid", feature="rank processes kept between variants", ranks=(2,),
                 needs_gpu=False, requires=("torch",), timeout_s=60)

_RUNS = []  # one entry per run of this module in this process


def run(ctx: RankContext) -> dict:
    torch_before = "torch" in sys.modules
    _RUNS.append(ctx.variant.key)
    import torch

    dist = ctx.init_process_group("gloo")
    value = torch.tensor([ctx.rank + 1], dtype=torch.int64)
    dist.all_reduce(value)
    want = ctx.world_size * (ctx.world_size + 1) // 2
    metrics = {"pid": os.getpid(), "runs_here": len(_RUNS), "torch_before": torch_before,
               "env": os.environ.get("STACKPROBE_TEST_ENV", "<unset>"), "port": ctx.master_port,
               "cpu_threads": torch.get_num_threads()}
    if int(value.item()) != want:
        return outcome("fail", note=f"sum {int(value.item())} != {want}", metrics=metrics)
    return outcome("pass", metrics=metrics)
