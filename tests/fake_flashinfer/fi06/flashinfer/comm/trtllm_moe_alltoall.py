"""Stand-in of flashinfer.comm.trtllm_moe_alltoall (0.6.18 signatures) on CPU tensors.

Payload i of a dispatch lands in every target rank's workspace slice at a fixed offset; the functional calls
of simulated ranks share one workspace tensor of shape [ep_size, bytes per rank]."""

from typing import Any

import _a2a_fabric as fab
import torch

_ALIGN = 128


def _round(x: int) -> int:
    return -(-x // _ALIGN) * _ALIGN


def moe_a2a_get_workspace_size_per_rank(
    ep_size: int,
    max_num_tokens: int,
    total_dispatch_payload_size_per_token: int,
    combine_payload_size_per_token: int,
    eplb_stats_num_experts: int = 0,
) -> int:
    return _round(ep_size * max_num_tokens * (total_dispatch_payload_size_per_token + 3 * _ALIGN)) + _round(
        ep_size * max_num_tokens * combine_payload_size_per_token
    )


def moe_a2a_initialize(
    workspace: torch.Tensor, ep_rank: int, ep_size: int, max_num_tokens: int, eplb_stats_num_experts: int = 0
) -> torch.Tensor:
    assert workspace.dtype == torch.uint8 and workspace.shape[0] == ep_size and 0 <= ep_rank < ep_size
    fab.initialised(workspace, ep_rank)
    return torch.tensor([ep_size, max_num_tokens], dtype=torch.int64)


def _views(workspace: torch.Tensor, rank: int, payloads: list[torch.Tensor], tpr: int) -> list[torch.Tensor]:
    ep, off, out = workspace.shape[0], 0, []
    for p in payloads:
        n = ep * tpr * p.shape[1] * p.element_size()
        out.append(workspace[rank].narrow(0, off, n).view(p.dtype).view(ep, tpr, p.shape[1]))
        off = _round(off + n)
    return out


def moe_a2a_dispatch(
    token_selected_experts: torch.Tensor,
    input_payloads: list[torch.Tensor],
    workspace: torch.Tensor,
    metainfo: torch.Tensor,
    runtime_max_tokens_per_rank: int,
    ep_rank: int,
    ep_size: int,
    top_k: int,
    num_experts: int,
    enable_pdl: Any = None,
    eplb_local_stats: Any = None,
    enable_rank_mask: bool = False,
    active_rank_mask: Any = None,
) -> tuple[list[torch.Tensor], int, Any]:
    assert token_selected_experts.dtype == torch.int32 and token_selected_experts.shape[1] == top_k
    assert all(p.shape[0] == token_selected_experts.shape[0] for p in input_payloads)
    assert runtime_max_tokens_per_rank <= int(metainfo[1]) and ep_size == int(metainfo[0])
    f = fab.fabric(workspace, ep_size, num_experts)
    f.launch("dispatch", ep_rank)
    for t in range(ep_size):
        slots = [
            i for i, ranks in enumerate(fab.targets_of(token_selected_experts, ep_size, num_experts)) if t in ranks
        ]
        fab.fill_received(
            _views(workspace, t, input_payloads, runtime_max_tokens_per_rank), ep_rank, input_payloads, slots
        )
    f.dispatched(ep_rank, token_selected_experts)
    return _views(workspace, ep_rank, input_payloads, runtime_max_tokens_per_rank), 0, None


def moe_a2a_sanitize_expert_ids(
    expert_ids: torch.Tensor,
    workspace: torch.Tensor,
    metainfo: torch.Tensor,
    ep_rank: int,
    invalid_expert_id: int,
    enable_pdl: Any = None,
) -> None:
    assert expert_ids.dim() == 3 and expert_ids.dtype == torch.int32
    fab.queued(f"rank {ep_rank}'s moe_a2a_sanitize_expert_ids", workspace)
    fab.FABRICS[workspace.data_ptr()].sanitize_later(expert_ids, ep_rank, invalid_expert_id)


def moe_a2a_combine(
    payload: torch.Tensor,
    local_num_tokens: int,
    workspace: torch.Tensor,
    metainfo: torch.Tensor,
    runtime_max_tokens_per_rank: int,
    ep_rank: int,
    ep_size: int,
    top_k: int,
    combine_payload_offset: int,
    payload_in_workspace: bool = False,
    output_dtype: Any = None,
    output_scales: Any = None,
    output_scalar_scale: float = 1.0,
    sf_layout: Any = None,
    output: Any = None,
    *,
    use_low_precision: bool = False,
    enable_pdl: Any = None,
    enable_rank_mask: bool = False,
    active_rank_mask: Any = None,
) -> torch.Tensor:
    assert tuple(payload.shape[:2]) == (ep_size, runtime_max_tokens_per_rank) and payload_in_workspace is False
    out = torch.empty(local_num_tokens, payload.shape[-1], dtype=payload.dtype)
    f = fab.FABRICS[workspace.data_ptr()]
    f.launch("combine", ep_rank)
    f.combine_later(ep_rank, payload, out, local_num_tokens)
    return out


class MoeAlltoAll:
    """Across processes: the stand-in exchanges through the gloo group of its comm backend."""

    def __init__(
        self,
        mapping: Any,
        max_num_tokens: int,
        top_k: int,
        num_experts: int,
        workspace_size_per_rank: int | None = None,
        hidden_size: int | None = None,
        mnnvl_config: Any = None,
        eplb_stats_num_experts: int = 0,
        enable_rank_mask: bool = False,
    ) -> None:
        assert workspace_size_per_rank is not None or hidden_size is not None
        self.group = mnnvl_config.comm_backend.group
        self.ep_size, self.ep_rank = mapping.moe_ep_size, mapping.moe_ep_rank
        self.max_num_tokens, self.top_k, self.num_experts = max_num_tokens, top_k, num_experts
        self.workspace_size_per_rank = workspace_size_per_rank

    def dispatch(
        self,
        token_selected_experts: torch.Tensor,
        input_payloads: list[torch.Tensor],
        runtime_max_tokens_per_rank: int,
        invalid_token_expert_id: int | None = None,
        expert_id_payload_index: int | None = None,
        eplb_local_stats: Any = None,
        active_rank_mask: Any = None,
    ) -> list[torch.Tensor]:
        views, self._experts = fab.ranks_dispatch(
            self.group,
            self.ep_rank,
            self.ep_size,
            self.num_experts,
            token_selected_experts,
            input_payloads,
            runtime_max_tokens_per_rank,
        )
        self._local = token_selected_experts.shape[0]
        if invalid_token_expert_id is not None:
            place = fab.placement(self._experts, self.ep_size, self.num_experts)
            counts = {s: len(place[(self.ep_rank, s)]) for s in range(self.ep_size)}
            fab.sanitize(views[expert_id_payload_index], counts, invalid_token_expert_id)
        return views

    def combine(
        self, payload: torch.Tensor, runtime_max_tokens_per_rank: int, payload_in_workspace: bool = False, **_: Any
    ) -> torch.Tensor:
        assert tuple(payload.shape[:2]) == (self.ep_size, runtime_max_tokens_per_rank)
        return fab.ranks_combine(
            self.group, self.ep_rank, self.ep_size, self.num_experts, self._experts, payload, self._local
        )
