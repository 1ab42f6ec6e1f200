"""Needs a GPU: on a host without one it must be `skip` without launching anything; on a GPU host it
checks that rank i was given device i and can compute there."""

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-gpu", title="gpu", feature="skip rules and device assignment", ranks=(1, 2),
                 requires=("torch",), timeout_s=120)


def run(ctx: RankContext) -> dict:
    import torch

    torch.cuda.set_device(ctx.device_index)
    x = torch.arange(1024, device="cuda", dtype=torch.float32)
    ok = ctx.device_index == ctx.rank and int(x.sum().item()) == 1023 * 1024 // 2
    return outcome("pass" if ok else "fail", note="" if ok else f"rank {ctx.rank} got device {ctx.device_index}",
                   metrics={"device": ctx.device_index, "gpus_visible": torch.cuda.device_count()})
