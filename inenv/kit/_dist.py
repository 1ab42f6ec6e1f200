"""The ranks' process group: joining it, exchanging small values, and agreeing on a decision.

In-environment side: standard library at module level; torch is imported inside the functions that
need it, so the host-side planner can import the probe modules without torch. The data the probes
send, the exact checks, timing and NCCL's logs live in their own modules (``_data``, ``_timing``,
``_nccl``); torch symmetric memory's rendezvous and ops across torch versions are at the end here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from inenv.kit import _device, _errors
from inenv.probe import RankContext, outcome

# NVLink multicast can take a shared host's GPUs out of service; these stay set in every rank.
# A user who wants multicast probed on their own NVSwitch machine opts in explicitly.
MULTICAST_OFF: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
ALLOW_MULTICAST_ENV = "STACKPROBE_ALLOW_MULTICAST"
# What a rank of a probe that starts with torch may import before the GPUs are its (ProbeSpec.preload): torch
# reads no variable a probe sets at import (NCCL and the caching allocator read theirs when first used).
PRELOAD_TORCH = ("torch", "torch.distributed")
# ... and, for a probe that joins its process group with init_dist, the rendezvous too: the store is a TCP
# server in rank 0 and a client in each other rank, loopback only. Joined at the gate, every rank is let go at
# once, so the clients no longer retry against a server that is not yet listening (0.24-0.6 s per variant).
PRELOAD_DIST = (*PRELOAD_TORCH, "inenv.kit._dist:prepare_rendezvous")

# The store prepare_rendezvous joined, for this process's init_dist (a rank runs one variant).
_prepared: dict[str, Any] = {}


def keep_multicast_off(env: dict[str, str] | None = None) -> dict[str, str]:
    """Make sure the multicast-off variables are set in this process (never unsets anything).

    Returns the values in force, for the evidence. Call before torch initialises CUDA or NCCL.
    """
    target = os.environ if env is None else env
    if target.get(ALLOW_MULTICAST_ENV) != "1":
        for key, value in MULTICAST_OFF.items():
            target.setdefault(key, value)
    return {key: target.get(key, "") for key in MULTICAST_OFF}


def gpu_precheck(ctx: RankContext, shared: bool = False) -> dict[str, Any] | None:
    """A `skip` outcome when this rank has no GPU, or too few are visible for one GPU per rank."""
    import torch

    if not torch.cuda.is_available() or ctx.device_index is None:
        return outcome("skip", "no CUDA device in this rank", "no-gpu")
    if not shared and torch.cuda.device_count() < ctx.world_size:
        return outcome("skip", f"needs {ctx.world_size} GPUs, {torch.cuda.device_count()} visible", "too-few-gpus")
    return None


def _master_env(ctx: RankContext) -> None:
    os.environ.setdefault("MASTER_ADDR", ctx.master_addr)
    if ctx.master_port:
        os.environ.setdefault("MASTER_PORT", str(ctx.master_port))


def prepare_rendezvous(ctx: RankContext, timeout_s: float = 120.0) -> None:
    """Join the env:// rendezvous store now, before this rank has the GPUs (a ``preload`` step): it is the
    store ``init_process_group`` would have made, by torch's own ``rendezvous``, and uses no GPU. A failure is
    left for init_dist, which then joins as it would have without this."""
    import datetime

    import torch.distributed as dist

    _master_env(ctx)
    store, _, _ = next(dist.rendezvous(
        "env://", rank=ctx.rank, world_size=ctx.world_size, timeout=datetime.timedelta(seconds=timeout_s)))
    _prepared["store"] = store


def rendezvous_store(ctx: RankContext, timeout_s: float = 120.0) -> Any:
    """The rendezvous store this rank's init_dist will join (prepare_rendezvous's, joined now when the rank's
    preload did not), kept for init_dist: a channel between the ranks that works whatever NCCL then does (rank 0
    serves it from a thread of its own)."""
    if "store" not in _prepared:
        prepare_rendezvous(ctx, timeout_s)
    return _prepared["store"]


def init_dist(ctx: RankContext, backend: str = "nccl", timeout_s: float = 120.0) -> Any:
    """Bind this rank to its GPU (if any) and join the env:// rendezvous; returns the torch device.

    With NCCL the communicator is created eagerly (``device_id``) so that the first collective a
    probe issues, possibly inside a graph capture, is the first *collective*, not the first init.
    A store joined before the gate (prepare_rendezvous) is used as init_process_group uses its own:
    with this timeout and under the default group's key prefix.
    """
    import datetime

    import torch
    import torch.distributed as dist

    keep_multicast_off()
    if ctx.device_index is not None and torch.cuda.is_available():
        torch.cuda.set_device(ctx.device_index)
        device = torch.device("cuda", ctx.device_index)
    else:
        device = torch.device("cpu")
    _master_env(ctx)
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = device
    store = _prepared.pop("store", None)
    if store is not None:
        store.set_timeout(timeout)
        kwargs["store"] = dist.PrefixStore("default_pg", store)
    else:
        kwargs["init_method"] = "env://"
    dist.init_process_group(backend=backend, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout, **kwargs)
    return device


def cpu_group() -> Any:
    """A gloo group beside the main one: host-side exchanges that must not touch NCCL's state."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def gather_objects(value: Any, group: Any = None) -> list[Any]:
    """Every rank's JSON-able ``value``, in rank order. Unlike ``all_gather_object`` this needs no
    numpy (cell images may lack it): JSON bytes travel as uint8 tensors."""
    import json

    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    on_gpu = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    data = json.dumps(value).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(max(longest, 1), dtype=torch.uint8, device=device)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [json.loads(bytes(b[: int(s.item())].cpu().tolist())) for b, s in zip(bufs, sizes, strict=True)]


VERDICT_ORDER = ("ok", "close", "error", "zero", "no-op", "wrong", "hang")


def worst_verdict(verdicts: Sequence[str]) -> str:
    """The most serious of several ranks' verdicts (unknown words rank as errors)."""
    rank = {v: i for i, v in enumerate(VERDICT_ORDER)}
    return max(verdicts, key=lambda v: rank.get(v, rank["error"]), default="ok")


def agree(ok: bool, group: Any = None) -> bool:
    """True only if every rank says True (a verdict must not differ between ranks)."""
    return all(gather_objects(bool(ok), group))


def settle(local: dict[str, Any], group: Any = None) -> dict[str, Any] | None:
    """The rank-verdict protocol of a step every rank runs: each rank gives its own ``{"verdict": ...}``
    (``ok`` to go on) and learns the worst of all. None when every rank says ``ok``; else what this rank
    reports: its own result when it failed, or the worst verdict with ``on a peer rank`` when a peer did.
    Every rank must call it at the same point, whatever happened to it, so the ranks stay in step."""
    worst = worst_verdict(gather_objects(str(local.get("verdict", "error")), group))
    if worst == "ok":
        return None
    return local if local.get("verdict") != "ok" else {"verdict": worst, "detail": "on a peer rank"}


def raised(exc: BaseException) -> dict[str, Any]:
    """This rank's ``local`` for :func:`settle` when its step raised: ``hang`` for device work that outlived its
    deadline (:class:`_device.Hung`), ``error`` with the exception's tail otherwise."""
    if isinstance(exc, _device.Hung):
        return {"verdict": "hang", "error": str(exc)}
    return {"verdict": "error", "error": _errors.error_tail(exc)}


def settle_ok(ok: bool, error: str, group: Any = None, peer: str = "a peer rank failed") -> dict[str, Any] | None:
    """:func:`settle` for a step that either worked or raised ``error``: None when every rank worked, else
    ``{"verdict": "error", "error": ...}`` (this rank's error, or ``peer`` when only a peer failed)."""
    if agree(ok, group):
        return None
    return {"verdict": "error", "error": error or peer}


# --- torch symmetric memory (``torch.distributed._symmetric_memory``) across torch versions ---------------

def symm_rendezvous(tensor: Any, group: Any) -> tuple[Any, bool]:
    """Rendezvous a symmetric tensor over ``group``; the one place that knows torch < 2.11 needs
    ``enable_symm_mem_for_group`` first. Returns the handle and whether that call was made."""
    import torch.distributed._symmetric_memory as symm_mem

    enabled_here = False
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    is_enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
    if enable is not None and (is_enabled is None or not is_enabled(group.group_name)):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated (a no-op need) on newer torch
            enable(group.group_name)
        enabled_here = True
    return symm_mem.rendezvous(tensor, group), enabled_here


def symm_op(name: str) -> Any:
    """``torch.ops.symm_mem.<name>`` or None when this torch does not have it."""
    import torch

    try:
        return getattr(torch.ops.symm_mem, name)
    except (AttributeError, RuntimeError):
        return None
