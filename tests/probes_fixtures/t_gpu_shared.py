"""Ranks that may share one GPU: rank i must get device i % gpu_count with every device visible."""

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-gpu-shared", title="gpu shared", feature="shared-GPU device assignment", ranks=(2,),
                 distinct_gpus=False, requires=("torch",), timeout_s=120)


def run(ctx: RankContext) -> dict:
    import torch

    n = torch.cuda.device_count()
    dist = ctx.init_process_group("gloo")
    t = torch.ones(8, device=f"cuda:{ctx.device_index}")
    dist.all_reduce(t)  # gloo stages CUDA tensors through the host
    want = ctx.rank % n
    ok = ctx.device_index == want and float(t[0].item()) == ctx.world_size
    return outcome("pass" if ok else "fail", note="" if ok else f"rank {ctx.rank}: device {ctx.device_index}",
                   metrics={"device": ctx.device_index, "gpus_visible": n})
