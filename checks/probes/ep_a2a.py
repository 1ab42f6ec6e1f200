"""ep-a2a: flashinfer's MoE all-to-all (dispatch + combine) with exact routing checks.

``mode=sim``: every EP rank simulated on one GPU, each on its own CUDA stream over one shared workspace
(flashinfer's own single-GPU pattern); the kernels spin-wait on each other, so all blocks must be resident
at once and the variant needs at least tokens x ranks SMs. ``mode=gpus``: one process per GPU through
``MoeAlltoAll`` with a torch.distributed handle exchange (no MNNVL fabric needed, fds over a Unix socket).

Routing is deterministic: token g picks two distinct experts; a token goes once to each distinct target rank.
Dispatch check: every rank receives exactly the token ids expected from each source, with their hidden rows
bit-exact. Combine check: rank r multiplies what it received by (r + 1) and sends it back; token g must come
back as hidden(g) x sum of (t + 1) over its distinct target ranks t, exactly (small integers in bf16).
The workspace size per rank is recorded.
"""

from __future__ import annotations

from typing import Any

from checks.probe import HostView, ProbeSpec, RankContext, Variant, gpu_shortfall, outcome
from checks.probes import _data, _device, _dist
from checks.probes import _flashinfer as fi
from checks.probes._lockstep import Lockstep, Stopped

SPEC = ProbeSpec(
    id="ep-a2a",
    title="MoE expert-parallel all-to-all (flashinfer)",
    feature="Does flashinfer's MoE all-to-all dispatch and combine route tokens exactly, with simulated ranks "
    "on one GPU and across GPUs, and how large is its workspace per rank?",
    ranks=(2, 4, 8),
    min_ranks=2,  # an all-to-all over one rank only copies locally
    # mode=sim simulates its ``ep`` ranks in one process (each on its own stream), so it runs as one rank
    min_ranks_by_param=(("mode", "sim", 1),),
    distinct_gpus=True,
    requires=("flashinfer",),
    timeout_s=600.0,
)

TOP_K = 2
EXPERTS_PER_RANK = 2
SIM_TOKENS = 16  # per rank; 8 ranks x 16 tokens fits in 132 SMs
GPU_TOKENS = 64
SIM_HIDDEN = 7168


def variants(host: HostView) -> list[Variant]:
    out: list[Variant] = []
    for ep in SPEC.ranks:
        out.append(Variant(SPEC.id, 1, params=(("mode", "sim"), ("ep", str(ep))), skip=gpu_shortfall(host, 1)))
    for n in SPEC.ranks:
        out.append(Variant(SPEC.id, n, params=(("mode", "gpus"),), skip=gpu_shortfall(host, n)))
    return out


def routing(ep: int, tokens_per_rank: int) -> list[list[int]]:
    """Two distinct experts per global token id; experts ``[r*E/ep, (r+1)*E/ep)`` live on rank r."""
    experts = ep * EXPERTS_PER_RANK
    out = []
    for g in range(ep * tokens_per_rank):
        e1 = (g * 3 + 1) % experts
        e2 = (e1 + 1 + g % (experts - 1)) % experts
        out.append([e1, e2])
    return out


def targets(choice: list[int]) -> list[int]:
    return sorted({e // EXPERTS_PER_RANK for e in choice})


def hidden_rows(ids: Any, hidden: int, device: Any) -> Any:
    """Row of token g: small integers in -4..4 that differ per token and per column."""
    import torch

    col = torch.arange(hidden, device=device, dtype=torch.int64)
    vals = (ids.to(torch.int64).unsqueeze(1) * 7 + col * 3 + col // 5) % 9 - 4
    return vals.to(torch.bfloat16)


def check_dispatch(recv_ids: Any, recv_hidden: Any, rank: int, ep: int, tpr: int, route: list[list[int]]) -> str:
    """'' when rank ``rank`` received exactly the tokens routed to it from every source, else a reason."""
    import torch

    for src in range(ep):
        want = sorted(g + 1 for g in range(src * tpr, (src + 1) * tpr) if rank in targets(route[g]))
        got_ids = recv_ids[src, : len(want)].reshape(-1).to("cpu", torch.int64)
        if sorted(got_ids.tolist()) != want:
            return f"rank {rank} from {src}: ids {sorted(got_ids.tolist())[:8]}... expected {want[:8]}..."
        rows = recv_hidden[src, : len(want)]
        ref = hidden_rows(got_ids.to(rows.device) - 1, rows.shape[-1], rows.device)
        if not torch.equal(rows, ref):
            bad = int((rows != ref).any(dim=1).sum())
            return f"rank {rank} from {src}: {bad} of {len(want)} hidden rows differ"
    return ""


def combine_reference(rank: int, tpr: int, hidden: int, route: list[list[int]], device: Any) -> Any:
    import torch

    ids = torch.arange(rank * tpr, (rank + 1) * tpr, device=device)
    scale = torch.tensor([sum(t + 1 for t in targets(route[g])) for g in ids.tolist()], device=device)
    return (hidden_rows(ids, hidden, device).float() * scale.unsqueeze(1)).to(torch.bfloat16)


def _inputs(rank: int, tpr: int, hidden: int, route: list[list[int]], device: Any) -> tuple[Any, Any, Any]:
    import torch

    ids = torch.arange(rank * tpr, (rank + 1) * tpr, device=device, dtype=torch.int32)
    experts = torch.tensor(route[rank * tpr : (rank + 1) * tpr], dtype=torch.int32, device=device)
    return experts, hidden_rows(ids, hidden, device), (ids + 1).unsqueeze(1).contiguous()


def run_sim(ctx: RankContext) -> dict[str, Any]:
    import torch

    ep = int(ctx.param("ep") or "2")
    if ep < 2:
        note = f"ep={ep}: an all-to-all needs at least 2 simulated ranks"
        return outcome("skip", note=note, reason_code="too-few-ranks")
    tpr, hidden = SIM_TOKENS, SIM_HIDDEN
    torch.cuda.set_device(ctx.device_index or 0)
    device = torch.device("cuda", ctx.device_index or 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if sms < tpr * ep:
        return outcome(
            "skip",
            note=f"needs {tpr * ep} SMs for {ep} co-resident simulated ranks, GPU has {sms}",
            reason_code="too-few-sms",
        )
    mod = fi.moe_a2a()
    route = routing(ep, tpr)
    payload_bytes = hidden * 2 + 4
    ws_bytes = mod.moe_a2a_get_workspace_size_per_rank(ep, tpr * ep, payload_bytes, hidden * 2)
    metrics: dict[str, Any] = {"workspace_bytes_per_rank": int(ws_bytes), "sm_count": sms}
    ws = torch.zeros(ep, ws_bytes, dtype=torch.uint8, device=device)
    meta = [mod.moe_a2a_initialize(ws, r, ep, tpr * ep) for r in range(ep)]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(ep)]
    inputs = [_inputs(r, tpr, hidden, route, device) for r in range(ep)]
    torch.cuda.synchronize()
    outs: list[Any] = [None] * ep
    offsets = [0] * ep
    for r in range(ep):
        with torch.cuda.stream(streams[r]):
            experts, hid, ids = inputs[r]
            outs[r], offsets[r] = fi.moe_dispatch(
                mod,
                token_selected_experts=experts,
                input_payloads=[hid, ids],
                workspace=ws,
                metainfo=meta[r],
                runtime_max_tokens_per_rank=tpr,
                ep_rank=r,
                ep_size=ep,
                top_k=TOP_K,
                num_experts=ep * EXPERTS_PER_RANK,
            )
    _device.wait_device(60)
    for r in range(ep):
        problem = check_dispatch(outs[r][1], outs[r][0], r, ep, tpr, route)
        if problem:
            return outcome(
                "fail", note=f"dispatch routed wrongly: {problem}", reason_code="ep-a2a-wrong", metrics=metrics
            )
    payloads = [(outs[r][0].float() * (r + 1)).to(torch.bfloat16).contiguous() for r in range(ep)]
    torch.cuda.synchronize()
    combined: list[Any] = [None] * ep
    for r in range(ep):
        with torch.cuda.stream(streams[r]):
            combined[r] = mod.moe_a2a_combine(
                payloads[r], tpr, ws, meta[r], tpr, r, ep, TOP_K, offsets[r], payload_in_workspace=False
            )
    _device.wait_device(60)
    for r in range(ep):
        ref = combine_reference(r, tpr, hidden, route, device)
        c = _data.check_exact(combined[r], ref)
        if not c.ok:
            return outcome(
                "fail",
                note=f"combine on simulated rank {r}: {c.verdict}, {c.detail}",
                reason_code="ep-a2a-wrong",
                metrics=metrics,
                evidence={"combine": c.to_json()},
            )
    return outcome(
        "pass",
        metrics=metrics,
        evidence={"ep": ep, "tokens_per_rank": tpr, "hidden": hidden, "flashinfer": fi.version()},
    )


def run_gpus(ctx: RankContext) -> dict[str, Any]:
    fi.prepare_env()
    device = _dist.init_dist(ctx)
    import torch
    import torch.distributed as dist

    ep, r, tpr, hidden = ctx.world_size, ctx.rank, GPU_TOKENS, SIM_HIDDEN
    route = routing(ep, tpr)
    evidence: dict[str, Any] = {"ep": ep, "tokens_per_rank": tpr, "hidden": hidden, "flashinfer": fi.version()}
    lock = Lockstep(r, dist.group.WORLD, evidence)
    metrics = lock.metrics
    try:
        with lock.step("MoeAlltoAll creation", "ep-a2a-workspace-failed"):
            a2a = fi.moe_alltoall_object(
                r, ep, tpr, TOP_K, ep * EXPERTS_PER_RANK, hidden * 2 + 4, hidden * 2, dist.group.WORLD
            )
            metrics["workspace_bytes_per_rank"] = int(a2a.workspace_size_per_rank)
        experts, hid, ids = _inputs(r, tpr, hidden, route, device)
        with lock.step("dispatch", "ep-a2a-error") as found:  # combine is collective: all ranks go on or none
            recv = a2a.dispatch(experts, [hid, ids], tpr)
            _device.wait_device(60)
            problem = check_dispatch(recv[1], recv[0], r, ep, tpr, route)
            if problem:
                note = f"dispatch routed wrongly: {problem}"
                found.early = outcome("fail", note, "ep-a2a-wrong", metrics=metrics, evidence=evidence)
        with lock.step("combine", "ep-a2a-error") as found:
            payload = (recv[0].float() * (r + 1)).to(torch.bfloat16).contiguous()
            combined = a2a.combine(payload, tpr)
            _device.wait_device(60)
            c = _data.check_exact(combined, combine_reference(r, tpr, hidden, route, device))
            evidence["combine"] = c.to_json()
            if not c.ok:
                note = f"combine {c.verdict}: {c.detail}"
                found.early = outcome("fail", note, "ep-a2a-wrong", metrics=metrics, evidence=evidence)
    except Stopped as stop:
        return stop.outcome
    return outcome("pass", metrics=metrics, evidence=evidence)


def run(ctx: RankContext) -> dict[str, Any]:
    fi.prepare_env()
    if ctx.param("mode") == "sim":
        return run_sim(ctx)
    return run_gpus(ctx)
