"""Stand-in of the NVLink one-sided kernel module: the exported functions with the real module's positional
arguments, checked by type, so an adapter that passes them in another order fails here."""

from types import SimpleNamespace
from typing import Any

import _a2a_fabric as fab
import torch

_ALIGN = 128
_I = SimpleNamespace(
    NUM_METAINFO_FIELDS=8,
    WORKSPACE_SIZE_INDEX=0,
    MAX_NUM_TOKENS_INDEX=1,
    EP_SIZE_INDEX=2,
    TOP_K_INDEX=3,
    DISPATCH_PAYLOAD_OFFSET_INDEX=4,
    COMBINE_INPUT_OFFSET_INDEX=5,
    MAX_PAYLOADS=8,
    WORKSPACE_ALIGNMENT=_ALIGN,
    MAX_RANKS=64,
)


def _round(x: int) -> int:
    return -(-x // _ALIGN) * _ALIGN


def _types(values: tuple, kinds: str) -> None:
    """t: tensor, l: list, i: int, b: bool, n: None."""
    check = {
        "t": lambda v: isinstance(v, torch.Tensor),
        "l": lambda v: isinstance(v, list),
        "i": lambda v: type(v) is int,
        "b": lambda v: type(v) is bool,
        "n": lambda v: v is None,
    }
    assert len(values) == len(kinds), f"{len(values)} arguments, the module takes {len(kinds)}"
    for pos, (v, k) in enumerate(zip(values, kinds, strict=True)):
        assert check[k](v), f"argument {pos}: {type(v).__name__} where the module takes kind {k!r}"


def _get_workspace_layout(*a: Any) -> None:
    _types(a, "iiiiiiibt")
    ep, max_tokens, top_k, dispatch_bytes, combine_bytes, recv_bytes, _eplb, _cft, meta = a
    meta[_I.DISPATCH_PAYLOAD_OFFSET_INDEX] = _ALIGN
    meta[_I.COMBINE_INPUT_OFFSET_INDEX] = _round(_ALIGN + dispatch_bytes)
    meta[_I.WORKSPACE_SIZE_INDEX] = _round(_ALIGN + dispatch_bytes) + _round(combine_bytes)
    meta[_I.MAX_NUM_TOKENS_INDEX], meta[_I.EP_SIZE_INDEX], meta[_I.TOP_K_INDEX] = max_tokens, ep, top_k


def _initialize(*a: Any) -> None:
    _types(a, "ttii")
    ws, meta, rank, ep = a
    fab.initialised(ws, rank)
    assert ws.dim() == 2 and ws.shape[0] == ep and ws.shape[1] >= int(meta[_I.WORKSPACE_SIZE_INDEX]) and rank < ep


def _offsets(meta: torch.Tensor, payloads: list[torch.Tensor], ep: int, tpr: int) -> list[int]:
    off, out = int(meta[_I.DISPATCH_PAYLOAD_OFFSET_INDEX]), []
    for p in payloads:
        out.append(off)
        off = _round(off + ep * tpr * p.shape[1] * p.element_size())
    return out


def _dispatch(*a: Any) -> tuple[list[int], int, int]:
    _types(a, "tlttiiiiinbiibbnib")
    experts, payloads, ws, meta, tpr, rank, ep, top_k, num_experts = a[:9]
    use_cft, expert_index, invalid, use_lamport = a[10], a[11], a[12], a[13]
    assert experts.dtype == torch.int32 and experts.shape[1] == top_k and not use_cft and not use_lamport
    assert expert_index == -1 and invalid < 0 and tpr <= int(meta[_I.MAX_NUM_TOKENS_INDEX])
    fab.fabric(ws, ep, num_experts).launch("dispatch", rank)
    offsets = _offsets(meta, payloads, ep, tpr)
    for t in range(ep):
        views = [
            ws[t].narrow(0, o, ep * tpr * p.shape[1] * p.element_size()).view(p.dtype).view(ep, tpr, p.shape[1])
            for o, p in zip(offsets, payloads, strict=True)
        ]
        slots = [i for i, ranks in enumerate(fab.targets_of(experts, ep, num_experts)) if t in ranks]
        fab.fill_received(views, rank, payloads, slots)
    fab.fabric(ws, ep, num_experts).dispatched(rank, experts)
    return offsets, int(meta[_I.COMBINE_INPUT_OFFSET_INDEX]), -1


def _sanitize(*a: Any) -> None:
    _types(a, "tttiib")
    ids, ws, _meta, rank, invalid, _pdl = a
    assert ids.dim() == 3 and ids.dtype == torch.int32
    fab.queued(f"rank {rank}'s moe_a2a_sanitize_expert_ids", ws)
    fab.FABRICS[ws.data_ptr()].sanitize_later(ids, rank, invalid)


def _combine(*a: Any) -> None:
    _types(a, "tittiiiiibbbbntibb")
    payload, local, ws, meta, tpr, rank, ep, _top_k, combine_offset = a[:9]
    out = a[14]
    f = fab.FABRICS[ws.data_ptr()]
    f.launch("combine", rank)  # queued whatever its offset: a combine before its dispatch hangs first
    assert payload.dim() == 3 and tuple(payload.shape[:2]) == (ep, tpr)
    assert combine_offset == int(meta[_I.COMBINE_INPUT_OFFSET_INDEX]) and tuple(out.shape) == (local, payload.shape[2])
    f.combine_later(rank, payload, out, local)


_MODULE = SimpleNamespace(
    moe_a2a_get_workspace_layout=_get_workspace_layout,
    moe_a2a_initialize=_initialize,
    moe_a2a_dispatch=_dispatch,
    moe_a2a_sanitize_expert_ids=_sanitize,
    moe_a2a_combine=_combine,
)


def get_nvlink_one_sided_alltoall_module() -> Any:
    return _MODULE


def layout_constants() -> SimpleNamespace:
    return _I
