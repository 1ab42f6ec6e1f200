"""flashinfer's MoE all-to-all (dispatch + combine) across its two API generations, behind one interface.

- ``moe-ep`` (flashinfer >= 0.7): ``flashinfer.moe_ep``'s NVLink one-sided backend. Across processes through
  ``create_communication`` (its workspace is MNNVL memory shared over torch.distributed); simulated ranks on
  one GPU through the backend's kernel module directly, every rank a slice of one device tensor. Token ids
  travel in ``topk_weights`` (float32 holds them exactly), since dispatch carries no other extra payload.
- ``trtllm`` (flashinfer 0.6): ``flashinfer.comm.trtllm_moe_alltoall``, ``MoeAlltoAll`` across processes and
  the functional ``moe_a2a_*`` calls for simulated ranks. Token ids and expert ids travel as payloads.

Both generations deliver a :class:`Received`: per source rank, ``tokens_per_rank`` rows holding token id + 1,
the hidden row and the token's expert ids, padding rows marked with ``INVALID_EXPERT`` in every expert id
(each generation's own sanitising step does that). Which row a token lands in is the backend's choice.

Simulated ranks go through :func:`dispatch_all` and :func:`combine_all`, which own the order of the device
work (see there); the simulation classes only say how one rank stages, dispatches, marks padding, combines.

Not a probe (no SPEC): a part of ep-a2a, which imports it and carries it in its hash. In-environment side:
standard library at import time; torch and flashinfer inside functions.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from inenv.kit import _api, _device

PACKAGE = "flashinfer-python"
DISTRIBUTIONS = ("flashinfer-python", "flashinfer")
INVALID_EXPERT = -1
TIMEOUT_S = 60  # moe-ep: a wait on a peer longer than this traps the kernel instead of hanging the rank
SIM_TIMEOUT_S = 20  # simulated ranks: below the probe's own 60 s wait, so a stuck handshake ends in its message
# flashinfer.moe_ep has no single-process entry point for several ranks; the simulation drives its kernel module
# directly. Every simulated rank's dispatch must be queued before any rank's sanitising kernel (dispatch_all):
# queued the other way, the dispatch waits on peers whose kernels sit behind it on the one GPU, and never ends
# (seen on 2x H200 with 0.6.18 and 0.7.4). In that order both generations passed at ep=2/4/8 on an H200.

_OLD = "flashinfer.comm.trtllm_moe_alltoall"
_KERNELS = "flashinfer.moe_ep.backends.split.comm.nvlink_one_sided.kernels"
MOE_EP = _api.Generation(
    "moe-ep",
    (
        "flashinfer.moe_ep:create_communication",
        "flashinfer.moe_ep:NVLinkOneSidedConfig",
        "flashinfer.moe_ep:MoEEpCommParams",
        "flashinfer.moe_ep:BootstrapConfig",
        f"{_KERNELS}:get_nvlink_one_sided_alltoall_module",
        f"{_KERNELS}:layout_constants",
    ),
)
TRTLLM = _api.Generation(
    "trtllm",
    (
        f"{_OLD}:MoeAlltoAll",
        f"{_OLD}:moe_a2a_initialize",
        f"{_OLD}:moe_a2a_dispatch",
        f"{_OLD}:moe_a2a_combine",
        f"{_OLD}:moe_a2a_sanitize_expert_ids",
        f"{_OLD}:moe_a2a_get_workspace_size_per_rank",
    ),
)
GENERATIONS = (MOE_EP, TRTLLM)


def detect() -> _api.Generation | _api.ApiUnknown:
    """The MoE all-to-all API this flashinfer has (newest first), or what was looked for."""
    return _api.detect(GENERATIONS, PACKAGE, DISTRIBUTIONS)


@dataclass(frozen=True)
class Shape:
    ep: int
    tokens_per_rank: int
    hidden: int
    top_k: int
    num_experts: int

    @property
    def dispatch_bytes_per_token(self) -> int:
        """Hidden row (bf16), token id (int32) and expert ids (int32), as the trtllm generation sends them."""
        return self.hidden * 2 + 4 + 4 * self.top_k


@dataclass(frozen=True)
class Received:
    """What one rank got from a dispatch: ``[ep, tokens_per_rank, ...]`` views of the receive buffers. Read it
    after the device work is done (the views fill in as the kernels run)."""

    raw_ids: Any  # token id + 1 as it arrived (int32 or float32); meaningless in padding rows
    hidden: Any  # bf16 rows
    experts: Any  # int32 global expert ids of each row's token; all INVALID_EXPERT in padding rows

    @property
    def ids(self) -> Any:
        """int64 token id + 1 per row, 0 in padding rows (every expert id invalid)."""
        import torch

        valid = (self.experts != INVALID_EXPERT).any(dim=-1)
        return torch.where(valid, self.raw_ids.round().to(torch.int64), torch.zeros_like(valid, dtype=torch.int64))


def _received(ids: Any, hidden: Any, experts: Any, shape: Shape) -> Received:
    lead = (shape.ep, shape.tokens_per_rank)
    return Received(ids.reshape(lead), hidden.reshape(*lead, shape.hidden), experts.reshape(*lead, shape.top_k))


# --- trtllm generation (flashinfer 0.6) ----------------------------------------------------------------
def _dispatch_views(res: Any) -> list[Any]:
    """``moe_a2a_dispatch`` returns 2 values in early 0.6 releases and 3 (with EPLB stats) later."""
    return list(res[0])


class TrtllmSim:
    """Every EP rank simulated on one GPU over one shared workspace (flashinfer's single-GPU test pattern)."""

    def __init__(self, shape: Shape, device: Any) -> None:
        import torch

        self.mod = importlib.import_module(_OLD)
        self.shape = shape
        ep, tokens = shape.ep, shape.tokens_per_rank * shape.ep
        self.workspace_bytes = int(
            self.mod.moe_a2a_get_workspace_size_per_rank(ep, tokens, shape.dispatch_bytes_per_token, shape.hidden * 2)
        )
        self.ws = torch.zeros(ep, self.workspace_bytes, dtype=torch.uint8, device=device)
        self.meta = [self.mod.moe_a2a_initialize(self.ws, r, ep, tokens) for r in range(ep)]
        self.staged: dict[int, tuple[Any, list[Any]]] = {}
        self.expert_views: dict[int, Any] = {}
        self.offsets = [0] * ep

    def stage(self, rank: int, experts: Any, hidden: Any, ids: Any) -> None:
        """Token ids and expert ids travel as payloads beside the hidden rows (no device work here)."""
        self.staged[rank] = (experts, [hidden, ids, experts])

    def dispatch(self, rank: int) -> Received:
        s = self.shape
        experts, payloads = self.staged[rank]
        res = self.mod.moe_a2a_dispatch(
            experts,
            payloads,
            self.ws,
            self.meta[rank],
            s.tokens_per_rank,
            rank,
            s.ep,
            s.top_k,
            s.num_experts,
        )
        views = _dispatch_views(res)
        self.offsets[rank] = int(res[1])
        self.expert_views[rank] = views[2]
        return _received(views[1], views[0], views[2], s)

    def mark_padding(self, rank: int) -> None:
        """Expert ids of the padding rows become ``INVALID_EXPERT`` (in place, in the received views)."""
        self.mod.moe_a2a_sanitize_expert_ids(self.expert_views[rank], self.ws, self.meta[rank], rank, INVALID_EXPERT)

    def combine(self, rank: int, payload: Any) -> Any:
        s = self.shape
        return self.mod.moe_a2a_combine(
            payload,
            s.tokens_per_rank,
            self.ws,
            self.meta[rank],
            s.tokens_per_rank,
            rank,
            s.ep,
            s.top_k,
            self.offsets[rank],
            False,
        )


class TrtllmRanks:
    """``MoeAlltoAll`` across processes, its memory handles exchanged through torch.distributed."""

    def __init__(self, shape: Shape, rank: int, group: Any) -> None:
        mod = importlib.import_module(_OLD)
        from flashinfer.comm.mapping import Mapping
        from flashinfer.comm.mnnvl import MnnvlConfig

        try:
            from flashinfer.comm.comm_backend import TorchDistBackend
        except ImportError:  # before comm_backend.py existed
            from flashinfer.comm.mnnvl import TorchDistBackend  # type: ignore[no-redef]

        self.shape = shape
        ep = shape.ep
        mapping = Mapping(world_size=ep, rank=rank, gpus_per_node=ep, tp_size=ep, moe_ep_size=ep)
        size = mod.moe_a2a_get_workspace_size_per_rank(
            ep, shape.tokens_per_rank, shape.dispatch_bytes_per_token, shape.hidden * 2
        )
        self.a2a = mod.MoeAlltoAll(
            mapping,
            shape.tokens_per_rank,
            shape.top_k,
            shape.num_experts,
            workspace_size_per_rank=size,
            mnnvl_config=MnnvlConfig(comm_backend=TorchDistBackend(group)),
        )
        self.workspace_bytes = int(self.a2a.workspace_size_per_rank)

    def dispatch(self, experts: Any, hidden: Any, ids: Any) -> Received:
        recv = self.a2a.dispatch(
            experts,
            [hidden, ids, experts],
            self.shape.tokens_per_rank,
            invalid_token_expert_id=INVALID_EXPERT,
            expert_id_payload_index=2,
        )
        return _received(recv[1], recv[0], recv[2], self.shape)

    def combine(self, payload: Any) -> Any:
        return self.a2a.combine(payload, self.shape.tokens_per_rank)


# --- moe-ep generation (flashinfer >= 0.7) -------------------------------------------------------------
def _weights(ids: Any, top_k: int) -> Any:
    """Token id + 1 as float32 routing weights: the one per-token payload dispatch forwards as is."""
    import torch

    return ids.to(torch.float32).reshape(-1, 1).expand(-1, top_k).contiguous()


class MoeEpSim:
    """Simulated ranks through the NVLink one-sided kernel module: one workspace layout, ``ep`` rank slices
    of one device tensor, the fence path (no CFT counted writes, no Lamport transport, no PDL)."""

    def __init__(self, shape: Shape, device: Any) -> None:
        import torch

        kernels = importlib.import_module(_KERNELS)
        self.mod = kernels.get_nvlink_one_sided_alltoall_module()
        idx = kernels.layout_constants()
        self.shape = shape
        ep, tpr, top_k = shape.ep, shape.tokens_per_rank, shape.top_k
        tokens = ep * tpr
        # Same sizing as the backend: each payload (hidden, expert ids, weights) on its own aligned start.
        dispatch_bytes = tokens * (shape.hidden * 2 + 2 * top_k * 4) + idx.MAX_PAYLOADS * idx.WORKSPACE_ALIGNMENT
        self.meta = torch.empty(idx.NUM_METAINFO_FIELDS, dtype=torch.int64)
        self.mod.moe_a2a_get_workspace_layout(
            ep, tpr, top_k, dispatch_bytes, tokens * shape.hidden * 2, 0, 0, False, self.meta
        )
        self.workspace_bytes = int(self.meta[idx.WORKSPACE_SIZE_INDEX])
        stride = -(-self.workspace_bytes // 4096) * 4096  # every rank slice starts cache-line aligned
        self.ws = torch.zeros(ep, stride, dtype=torch.uint8, device=device)
        for r in range(ep):
            self.mod.moe_a2a_initialize(self.ws, self.meta, r, ep)
        self.staged: dict[int, tuple[Any, list[Any]]] = {}
        self.outs: dict[int, Any] = {}
        self.expert_views: dict[int, Any] = {}
        self.combine_offset = [0] * ep

    def _view(self, rank: int, offset: int, dtype: Any, cols: int) -> Any:
        s = self.shape
        nbytes = s.ep * s.tokens_per_rank * cols * dtype.itemsize
        return self.ws[rank].narrow(0, offset, nbytes).view(dtype).view(s.ep, s.tokens_per_rank, cols)

    def stage(self, rank: int, experts: Any, hidden: Any, ids: Any) -> None:
        """Token ids become float32 weights and the combine output is allocated here, before any rank's
        all-to-all is in flight (both are device work)."""
        import torch

        s = self.shape
        self.staged[rank] = (experts, [hidden, experts, _weights(ids, s.top_k)])
        self.outs[rank] = torch.empty(s.tokens_per_rank, s.hidden, dtype=hidden.dtype, device=hidden.device)

    def dispatch(self, rank: int) -> Received:
        s = self.shape
        experts, payloads = self.staged[rank]
        offsets, combine_offset, _ = self.mod.moe_a2a_dispatch(
            experts,
            payloads,
            self.ws,
            self.meta,
            s.tokens_per_rank,
            rank,
            s.ep,
            s.top_k,
            s.num_experts,
            None,
            False,
            -1,
            INVALID_EXPERT,
            False,
            False,
            None,
            SIM_TIMEOUT_S,
            False,
        )
        self.combine_offset[rank] = int(combine_offset)
        views = [self._view(rank, int(o), p.dtype, p.shape[1]) for o, p in zip(offsets, payloads, strict=True)]
        self.expert_views[rank] = views[1]
        return _received(views[2][..., 0], views[0], views[1], s)

    def mark_padding(self, rank: int) -> None:
        self.mod.moe_a2a_sanitize_expert_ids(self.expert_views[rank], self.ws, self.meta, rank, INVALID_EXPERT, False)

    def combine(self, rank: int, payload: Any) -> Any:
        s = self.shape
        out = self.outs[rank]
        self.mod.moe_a2a_combine(
            payload,
            s.tokens_per_rank,
            self.ws,
            self.meta,
            s.tokens_per_rank,
            rank,
            s.ep,
            s.top_k,
            self.combine_offset[rank],
            False,
            False,
            False,
            False,
            None,
            out,
            SIM_TIMEOUT_S,
            False,
            False,
        )
        return out


class MoeEpRanks:
    """``flashinfer.moe_ep``'s NVLink one-sided communication across processes. CFT counted writes and the
    Lamport transport are left to the backend's own decision (both need compute capability 10.x)."""

    def __init__(self, shape: Shape, rank: int, group: Any) -> None:
        import flashinfer.moe_ep as ep_mod
        import torch

        self.shape = shape
        boot_kwargs: dict[str, Any] = {"world_size": shape.ep, "rank": rank, "process_group": group}
        if torch.cuda.is_available() and "device" in inspect.signature(ep_mod.BootstrapConfig).parameters:
            boot_kwargs["device"] = torch.cuda.current_device()
        params = ep_mod.MoEEpCommParams(
            num_experts=shape.num_experts,
            top_k=shape.top_k,
            max_tokens_per_rank=shape.tokens_per_rank,
            hidden_size=shape.hidden,
            dtype=torch.bfloat16,
            invalid_expert_id=INVALID_EXPERT,
        )
        config = ep_mod.NVLinkOneSidedConfig(timeout_sec=TIMEOUT_S)
        self.comm = ep_mod.create_communication(ep_mod.BootstrapConfig(**boot_kwargs), params, config)
        self.workspace_bytes = int(self.comm.workspace.shape[1])
        self.evidence = {
            "backend": getattr(self.comm, "backend_name", ""),
            "lamport_max_tokens": int(getattr(self.comm, "lamport_max_tokens", 0) or 0),
        }

    def dispatch(self, experts: Any, hidden: Any, ids: Any) -> Received:
        s = self.shape
        res = self.comm.dispatch(hidden, experts, _weights(ids, s.top_k), runtime_max_tokens_per_rank=s.tokens_per_rank)
        return _received(res.topk_weights[:, 0], res.hidden_states, res.topk_ids, s)

    def combine(self, payload: Any) -> Any:
        return self.comm.combine(payload.reshape(-1, self.shape.hidden))


def open_sim(gen: _api.Generation, shape: Shape, device: Any) -> TrtllmSim | MoeEpSim:
    return MoeEpSim(shape, device) if gen is MOE_EP else TrtllmSim(shape, device)


# --- simulated ranks: the order of the device work ---------------------------------------------------
# A rank's all-to-all kernel spins until every other rank's kernel has written its flags, so a round (every
# rank's dispatch, or every rank's combine) finishes only once all of its kernels are in flight at the same
# time. Between the first rank's launch and the last one's nothing else may be queued: on the same stream it
# waits behind a kernel that cannot finish yet, and anywhere else a kernel's first launch can wait for the
# whole device to go idle (CUDA loads kernels lazily by default since 12.2, and loading may synchronise the
# context). On an H200 with flashinfer 0.6.18, launching only each rank's dispatch passed at ep=2, 4 and 8;
# queueing each rank's sanitising kernel right after its dispatch, before the next rank's, hung at all three
# (in a venv cell with prebuilt modules, where the passing runs used a JIT-built local install). So a
# round launches only its all-to-all calls, everything a rank needs is staged before, and the per-rank
# padding marks run after every rank's dispatch has finished (flashinfer's own single-GPU test does the same).
def dispatch_all(
    sim: TrtllmSim | MoeEpSim, inputs: list[tuple[Any, Any, Any]], lanes: _device.Lanes, deadline_s: float
) -> list[Received]:
    """Every simulated rank's dispatch of ``inputs[rank]`` (expert ids, hidden rows, token id + 1), each rank
    on its own lane; :class:`_device.Hung` when the device work does not finish within ``deadline_s``."""
    for rank, staged in enumerate(inputs):
        sim.stage(rank, *staged)
    lanes.wait(deadline_s)  # staged on the current stream; the lanes read it
    recv = []
    for rank in range(len(inputs)):
        with lanes.on(rank):
            recv.append(sim.dispatch(rank))
    lanes.wait(deadline_s)
    for rank in range(len(inputs)):
        with lanes.on(rank):
            sim.mark_padding(rank)
    lanes.wait(deadline_s)
    return recv


def combine_all(sim: TrtllmSim | MoeEpSim, payloads: list[Any], lanes: _device.Lanes, deadline_s: float) -> list[Any]:
    """Every simulated rank's combine of ``payloads[rank]`` ([ep, tokens_per_rank, hidden]), each on its lane."""
    lanes.wait(deadline_s)  # payloads computed on the current stream
    out = []
    for rank, payload in enumerate(payloads):
        with lanes.on(rank):
            out.append(sim.combine(rank, payload))
    lanes.wait(deadline_s)
    return out


def open_ranks(gen: _api.Generation, shape: Shape, rank: int, group: Any) -> TrtllmRanks | MoeEpRanks:
    return MoeEpRanks(shape, rank, group) if gen is MOE_EP else TrtllmRanks(shape, rank, group)
