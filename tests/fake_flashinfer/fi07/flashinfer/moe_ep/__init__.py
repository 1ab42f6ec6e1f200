"""Stand-in of flashinfer.moe_ep (0.7.4 names and signatures) with the NVLink one-sided backend on CPU tensors.

As the real backend's contract allows, a received token's picks of experts owned by other ranks come back as
the invalid expert id, and padding rows carry the invalid id in every pick."""

from dataclasses import dataclass, field
from typing import Any

import _a2a_fabric as fab
import torch


@dataclass(frozen=True)
class MoEEpCommParams:
    num_experts: int
    top_k: int
    max_tokens_per_rank: int
    hidden_size: int
    dtype: Any = None
    dispatch_format: Any = None
    invalid_expert_id: int = -1


@dataclass
class BootstrapConfig:
    world_size: int
    rank: int
    stream: int = 0
    auto_bootstrap: bool = True
    device: int | None = field(default=None, kw_only=True)
    nccl_comm: int | None = None
    process_group: Any = None
    tcp_store: Any = None


@dataclass
class NVLinkOneSidedConfig:
    backend_name: str = "nvlink_one_sided"
    extra_payload_bytes_per_token: int = 0
    comm_backend: Any = None
    cft: bool | None = None
    lamport: bool | None = None
    timeout_sec: int = 300
    enable_pdl: bool | None = None


@dataclass(frozen=True)
class MoEEpDispatchResult:
    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor | None
    tokens_per_rank: int


class _NVLinkOneSided:
    backend_name = "nvlink_one_sided"

    def __init__(self, bootstrap: BootstrapConfig, params: MoEEpCommParams, config: NVLinkOneSidedConfig) -> None:
        assert params.num_experts % bootstrap.world_size == 0
        self.group, self.ep_rank, self.ep_size = bootstrap.process_group, bootstrap.rank, bootstrap.world_size
        self.params = params
        self.lamport_max_tokens = 0
        self.workspace = torch.zeros(self.ep_size, 4096, dtype=torch.uint8)

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor | None = None,
        *,
        hidden_states_scale: Any = None,
        runtime_max_tokens_per_rank: int | None = None,
        eplb_local_stats: Any = None,
        active_rank_mask: Any = None,
    ) -> MoEEpDispatchResult:
        p = self.params
        tpr = runtime_max_tokens_per_rank or p.max_tokens_per_rank
        payloads = [hidden_states, topk_ids.to(torch.int32)] + ([topk_weights] if topk_weights is not None else [])
        views, self._experts = fab.ranks_dispatch(
            self.group, self.ep_rank, self.ep_size, p.num_experts, payloads[1], payloads, tpr
        )
        self._local = hidden_states.shape[0]
        place = fab.placement(self._experts, self.ep_size, p.num_experts)
        fab.sanitize(views[1], {s: len(place[(self.ep_rank, s)]) for s in range(self.ep_size)}, p.invalid_expert_id)
        per = p.num_experts // self.ep_size
        ids = views[1]
        mine = (ids >= self.ep_rank * per) & (ids < (self.ep_rank + 1) * per)
        ids.masked_fill_(~mine, p.invalid_expert_id)
        flat = [v.flatten(0, 1) for v in views]
        return MoEEpDispatchResult(flat[0], flat[1], flat[2] if topk_weights is not None else None, tpr)

    def combine(self, expert_output: torch.Tensor, *, output: Any = None, active_rank_mask: Any = None) -> torch.Tensor:
        payload = expert_output.view(self.ep_size, -1, expert_output.shape[-1])
        return fab.ranks_combine(
            self.group, self.ep_rank, self.ep_size, self.params.num_experts, self._experts, payload, self._local
        )


def create_communication(bootstrap: BootstrapConfig, params: MoEEpCommParams, backend: Any, **options: Any) -> Any:
    assert getattr(backend, "backend_name", backend) == "nvlink_one_sided"
    return _NVLinkOneSided(bootstrap, params, backend if not isinstance(backend, str) else NVLinkOneSidedConfig())
