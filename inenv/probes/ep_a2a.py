"""ep-a2a: flashinfer's MoE all-to-all (dispatch + combine) with exact routing checks, on both of its API
generations through one adapter (``epmoe``): ``flashinfer.comm.trtllm_moe_alltoall`` up to 0.6 and
``flashinfer.moe_ep``'s NVLink one-sided backend from 0.7. A flashinfer with neither is ``skip`` with
``probe-api-unknown`` (the feature was not reached), never ``fail``.

``mode=sim``: every EP rank simulated on one GPU, each on its own CUDA stream over one shared workspace
(flashinfer's own single-GPU pattern); the kernels spin-wait on each other, so all blocks must be resident
at once and the variant needs at least tokens x ranks SMs, and nothing but the ranks' all-to-all calls may
be queued until the last rank's is (``epmoe.dispatch_all`` says why). ``mode=gpus``: one process per GPU, the
workspace's memory handles exchanged through torch.distributed (no MNNVL fabric needed, fds over a Unix socket).

Routing is deterministic: token g picks two distinct experts; a token goes once to each distinct target rank.
Dispatch check: from every source, a rank receives exactly the token ids routed to it, once each, with their
hidden rows bit-exact and their expert ids intact; padding rows carry no token. Combine check: rank r
multiplies what it received by (r + 1) and sends it back; token g must come back as hidden(g) x sum of
(t + 1) over its distinct target ranks t, exactly (small integers in bf16). The workspace size per rank is
recorded.
"""

from __future__ import annotations

from typing import Any

from inenv.kit import _api, _data, _device, _dist
from inenv.kit import _flashinfer as fi
from inenv.kit._lockstep import Lockstep, Stopped
from inenv.probe import HostView, ProbeSpec, RankContext, Variant, gpu_shortfall, multi_rank, outcome
from inenv.probes import epmoe

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
    preload=_dist.PRELOAD_DIST,
    timed=False,  # routing and workspace checks: nothing is timed, so it shares the GPUs with other such checks
)

TOP_K = 2
EXPERTS_PER_RANK = 2
SIM_TOKENS = 16  # per rank; 8 ranks x 16 tokens fits in 132 SMs
GPU_TOKENS = 64
SIM_HIDDEN = 7168
WAIT_S = 60.0  # for device work (trtllm 0.6's kernels themselves wait 300 s for a peer before they trap)


def variants(host: HostView) -> list[Variant]:
    out: list[Variant] = []
    for ep in SPEC.ranks:
        out.append(Variant(SPEC.id, 1, params=(("mode", "sim"), ("ep", str(ep))), skip=gpu_shortfall(host, 1)))
    out += multi_rank(SPEC, host, [(("mode", "gpus"),)], why="the all-to-all is checked with a GPU per rank")
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


def check_received(recv: epmoe.Received, rank: int, ep: int, tpr: int, route: list[list[int]]) -> str:
    """'' when rank ``rank`` received, from every source, exactly the tokens routed to it (once each, hidden
    rows bit-exact, this rank's expert picks intact) and nothing in its padding rows; else the first problem.
    The row a token lands in is the backend's choice, so rows are matched by the token id they carry."""
    import torch

    ids = recv.ids.to("cpu")
    experts = recv.experts.to("cpu", torch.int64)
    for src in range(ep):
        want = sorted(g + 1 for g in range(src * tpr, (src + 1) * tpr) if rank in targets(route[g]))
        rows = [i for i in range(tpr) if int(ids[src, i])]
        got = sorted(int(ids[src, i]) for i in rows)
        if got != want:
            return f"rank {rank} from {src}: ids {got[:8]}... expected {want[:8]}..."
        if not rows:
            continue
        index = torch.tensor(rows)
        hid = recv.hidden[src].index_select(0, index.to(recv.hidden.device))
        ref = hidden_rows(ids[src, index].to(hid.device) - 1, hid.shape[-1], hid.device)
        if not torch.equal(hid, ref):
            bad = int((hid != ref).any(dim=1).sum())
            return f"rank {rank} from {src}: {bad} of {len(rows)} hidden rows differ"
        for i in rows:
            g = int(ids[src, i]) - 1
            picks = {int(e) for e in experts[src, i] if int(e) != epmoe.INVALID_EXPERT}
            mine = {e for e in route[g] if e // EXPERTS_PER_RANK == rank}
            if not mine <= picks <= set(route[g]):
                return f"rank {rank} from {src}: token {g} arrived with experts {sorted(picks)}, routed to {route[g]}"
    return ""


def shape(ep: int, tpr: int) -> epmoe.Shape:
    return epmoe.Shape(ep, tpr, SIM_HIDDEN, TOP_K, ep * EXPERTS_PER_RANK)


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

    api = epmoe.detect()
    if isinstance(api, _api.ApiUnknown):
        return api.outcome()
    ep = int(ctx.param("ep") or "2")
    if ep < 2:
        note = f"ep={ep}: an all-to-all needs at least 2 simulated ranks"
        return outcome("skip", note=note, reason_code="too-few-ranks")
    torch.cuda.set_device(ctx.device_index or 0)
    device = torch.device("cuda", ctx.device_index or 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if sms < SIM_TOKENS * ep:
        return outcome(
            "skip",
            note=f"needs {SIM_TOKENS * ep} SMs for {ep} co-resident simulated ranks, GPU has {sms}",
            reason_code="too-few-sms",
        )
    return simulate(api, ep, device, _device.Lanes.open(ep), {"sm_count": sms})


def simulate(
    api: _api.Generation, ep: int, device: Any, lanes: _device.Lanes, metrics: dict[str, Any]
) -> dict[str, Any]:
    """The simulated ranks' dispatch and combine, checked; device work in the order of ``epmoe.dispatch_all``
    and ``combine_all``, one lane per rank."""
    import torch

    tpr, hidden = SIM_TOKENS, SIM_HIDDEN
    route = routing(ep, tpr)
    a2a = epmoe.open_sim(api, shape(ep, tpr), device)
    metrics = {"workspace_bytes_per_rank": a2a.workspace_bytes, **metrics}
    evidence: dict[str, Any] = {"ep": ep, "tokens_per_rank": tpr, "hidden": hidden, "api": api.name}
    evidence["flashinfer"] = _version()
    step = "dispatch"
    try:
        recv = epmoe.dispatch_all(a2a, [_inputs(r, tpr, hidden, route, device) for r in range(ep)], lanes, WAIT_S)
        for r in range(ep):
            problem = check_received(recv[r], r, ep, tpr, route)
            if problem:
                note = f"dispatch routed wrongly: {problem}"
                return outcome("fail", note=note, reason_code="ep-a2a-wrong", metrics=metrics, evidence=evidence)
        step = "combine"
        payloads = [(recv[r].hidden.float() * (r + 1)).to(torch.bfloat16).contiguous() for r in range(ep)]
        combined = epmoe.combine_all(a2a, payloads, lanes, WAIT_S)
    except _device.Hung as exc:
        note = f"{step} of {ep} simulated ranks: {exc}"
        return outcome("fail", note=note, reason_code=_device.REASON, metrics=metrics, evidence=evidence)
    for r in range(ep):
        ref = combine_reference(r, tpr, hidden, route, device)
        c = _data.check_exact(combined[r], ref)
        if not c.ok:
            note = f"combine on simulated rank {r}: {c.verdict}, {c.detail}"
            evidence["combine"] = c.to_json()
            return outcome("fail", note=note, reason_code="ep-a2a-wrong", metrics=metrics, evidence=evidence)
    return outcome("pass", metrics=metrics, evidence=evidence)


def run_gpus(ctx: RankContext) -> dict[str, Any]:
    api = epmoe.detect()  # before any collective: every rank finds the same
    if isinstance(api, _api.ApiUnknown):
        return api.outcome()
    device = _dist.init_dist(ctx)
    import torch
    import torch.distributed as dist

    ep, r, tpr, hidden = ctx.world_size, ctx.rank, GPU_TOKENS, SIM_HIDDEN
    route = routing(ep, tpr)
    evidence: dict[str, Any] = {"ep": ep, "tokens_per_rank": tpr, "hidden": hidden, "api": api.name}
    evidence["flashinfer"] = _version()
    lock = Lockstep(r, dist.group.WORLD, evidence)
    metrics = lock.metrics
    try:
        with lock.step("all-to-all creation", "ep-a2a-workspace-failed"):
            a2a = epmoe.open_ranks(api, shape(ep, tpr), r, dist.group.WORLD)
            metrics["workspace_bytes_per_rank"] = a2a.workspace_bytes
            evidence.update(getattr(a2a, "evidence", {}))
        experts, hid, ids = _inputs(r, tpr, hidden, route, device)
        with lock.step("dispatch", _a2a_error) as found:  # combine is collective: all ranks go on or none
            recv = a2a.dispatch(experts, hid, ids)
            _device.wait_device(WAIT_S)
            problem = check_received(recv, r, ep, tpr, route)
            if problem:
                note = f"dispatch routed wrongly: {problem}"
                found.early = outcome("fail", note, "ep-a2a-wrong", metrics=metrics, evidence=evidence)
        with lock.step("combine", _a2a_error) as found:
            payload = (recv.hidden.float() * (r + 1)).to(torch.bfloat16).contiguous()
            combined = a2a.combine(payload)
            _device.wait_device(WAIT_S)
            c = _data.check_exact(combined, combine_reference(r, tpr, hidden, route, device))
            evidence["combine"] = c.to_json()
            if not c.ok:
                note = f"combine {c.verdict}: {c.detail}"
                found.early = outcome("fail", note, "ep-a2a-wrong", metrics=metrics, evidence=evidence)
    except Stopped as stop:
        return stop.outcome
    return outcome("pass", metrics=metrics, evidence=evidence)


def _a2a_error(error: str) -> str:
    return _device.reason(error, "ep-a2a-error")


def run(ctx: RankContext) -> dict[str, Any]:
    fi.prepare_env()
    if ctx.param("mode") == "sim":
        return run_sim(ctx)
    return run_gpus(ctx)


def _version() -> str | None:
    return _api.package_version(*epmoe.DISTRIBUTIONS)


# --- declared fields: what this probe records, and the roles checks report and checks advise read them by
# (inenv.probe.Field: name, unit, meaning, role). Left out of the probe hash: it changes no verdict.
METRICS = (
    ("workspace_bytes_per_rank", "bytes", "all-to-all workspace each rank allocates", "workspace"),
    ("sm_count", "count", "streaming multiprocessors of the GPU a simulated rank set runs on", None),
)
