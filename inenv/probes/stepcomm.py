"""The allreduce backends the step and load probes drive, each behind one adapter (Comm), made by make_comm.

Not a probe (no SPEC): the probes that import it carry it in their hash. ``comm_input(numel)`` is where a
block's matmul writes (the backend's own buffer where it needs one); ``reduce(inp, out)`` is one allreduce (out
is inp when in place); a fused backend instead does ``fused_op(inp, residual_in, gamma, residual_out,
norm_out)``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Mapping
from typing import Any

from inenv.kit import _dist
from inenv.kit._data import EPS
from inenv.probe import RankContext, outcome

BACKENDS = (
    "nccl",
    "symm-mem-one-shot",
    "flashinfer-custom-ar",
    "sgl-custom-ar",
    "flashinfer-pcie-ipc",
    "flashinfer-fusion",
)
# What each backend imports (sgl-kernel's custom allreduce lives in flashinfer's shared IPC buffers).
NEEDS = {"flashinfer-custom-ar": ("flashinfer",), "flashinfer-pcie-ipc": ("flashinfer",),
         "flashinfer-fusion": ("flashinfer",), "sgl-custom-ar": ("sgl_kernel", "flashinfer")}
OVERLAP_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"  # torch's switch for symmetric memory on one device


def missing(backend: str, needs: Mapping[str, tuple[str, ...]] = NEEDS) -> dict[str, Any] | None:
    """A skip when a library ``backend`` imports (``needs``) is not installed in this environment."""
    for need in needs.get(backend, ()):
        if importlib.util.find_spec(need) is None:
            return outcome("skip", f"{need} is not installed in this environment", "missing-package")
    return None


def begin(ctx: RankContext, name: str,
          needs: Mapping[str, tuple[str, ...]] = NEEDS) -> tuple[dict[str, Any] | None, RankContext]:
    """What a rank does before it drives backend ``name`` (the step and the load probe alike): the library check,
    NCCL's refusal of ranks sharing a GPU, torch's overlap switch for ranks that share one, flashinfer's modules
    made ready, flashinfer's PCIe IPC API read, the GPU pre-check. An outcome that ends the variant here, or None
    and the context the rest runs with (device 0 for ranks sharing one GPU)."""
    if (skipped := missing(name, needs)) is not None:
        return skipped, ctx
    shared = ctx.variant.share_gpu  # ranks on one GPU: a gloo process group, nothing timed
    if shared and name == "nccl":
        return outcome("skip", "NCCL refuses two ranks on one GPU", "too-few-gpus"), ctx
    if shared:
        os.environ[OVERLAP_ENV] = "1"
    if "flashinfer" in needs.get(name, ()):
        from inenv.kit import _flashinfer

        _flashinfer.prepare_env()  # the modules fi-jit built or the cell carries, not a compile in this turn
    if name == "flashinfer-pcie-ipc":
        from inenv.kit import _api, _fi_pcie

        found = _fi_pcie.detect("all-reduce")
        if isinstance(found, _api.ApiUnknown):
            return found.outcome(), ctx
    if (skipped := _dist.gpu_precheck(ctx, shared)) is not None:
        return skipped, ctx
    return None, dataclasses.replace(ctx, device_index=0) if shared else ctx


class Comm:
    name = ""
    in_place = False
    fused = False
    dtypes: tuple[str, ...] = ("bf16",)  # what the agreement check sends it (``_agree``)

    def comm_input(self, numel: int) -> Any:
        return self.flat_in[:numel]

    def reduce(self, inp: Any, out: Any) -> None:
        raise NotImplementedError

    def fused_op(self, inp: Any, res_in: Any, gamma: Any, res_out: Any, norm_out: Any) -> None:
        raise NotImplementedError

    def for_model(self, hidden: int) -> None:
        """Set up what depends on the model's hidden size (a fused workspace)."""

    def before_capture(self, inp: Any) -> dict[str, Any] | None:
        """Eager, collective preparation for one shape; a refusal ``{"refused": why}`` skips the case."""
        return None

    def after_capture(self) -> None:
        """Register the captured addresses with the peers (custom allreduce)."""

    def shape_facts(self) -> dict[str, Any]:
        return {}

    def evidence(self) -> dict[str, Any]:
        return {}


class Nccl(Comm):
    name, in_place = "nccl", True
    dtypes = ("bf16", "fp16")

    def __init__(self, device: Any, group: Any, max_numel: int) -> None:
        import torch

        self.group = group
        self.flat_in = torch.empty(max_numel, device=device, dtype=torch.bfloat16)

    def reduce(self, inp: Any, out: Any) -> None:
        import torch.distributed as dist

        dist.all_reduce(inp, group=self.group)


class SymmOneShot(Comm):
    name = "symm-mem-one-shot"

    def __init__(self, device: Any, group: Any, max_numel: int) -> None:
        import torch
        import torch.distributed._symmetric_memory as symm_mem

        self.op = _dist.symm_op("one_shot_all_reduce_out")
        if self.op is None:
            raise LookupError("torch.ops.symm_mem.one_shot_all_reduce_out is not in this torch")
        self.group_name = group.group_name
        self.flat_in = symm_mem.empty(max_numel, dtype=torch.bfloat16, device=device)
        self.handle, self.enabled_here = _dist.symm_rendezvous(self.flat_in, group)

    def reduce(self, inp: Any, out: Any) -> None:
        self.op(inp, "sum", self.group_name, out)

    def evidence(self) -> dict[str, Any]:
        return {"multicast_ptr": int(getattr(self.handle, "multicast_ptr", 0) or 0)}


class CustomAR(Comm):
    """vLLM-style custom allreduce (flashinfer's copy, or sgl-kernel's), graph-registered as engines run it."""

    dtypes = ("bf16", "fp16")  # its kernels are instantiated for half, bfloat16 and float

    def __init__(self, impl: str, rank: int, device: Any, group: Any, max_numel: int, full_nvlink: bool) -> None:
        import torch

        from inenv.kit import _flashinfer as fi

        if impl == "flashinfer":
            self.ar: Any = fi.VllmCustomAR(rank, group, device, full_nvlink)
            self.name = "flashinfer-custom-ar"
        else:
            from inenv.probes.custom_ar import _SglAR

            self.ar = _SglAR(rank, group, device, full_nvlink)
            self.name = "sgl-custom-ar"
        if max_numel * 2 > self.ar.MAX_BYTES:
            raise ValueError(f"{max_numel * 2} bytes exceed the custom allreduce buffer ({self.ar.MAX_BYTES})")
        self.full_nvlink = full_nvlink
        self.flat_in = torch.empty(max_numel, device=device, dtype=torch.bfloat16)

    def reduce(self, inp: Any, out: Any) -> None:
        import torch

        if torch.cuda.is_current_stream_capturing():
            self.ar.all_reduce_graph(inp, out)
        else:
            self.ar.all_reduce_staged(inp, out)

    def after_capture(self) -> None:
        self.ar.register_graph_buffers()

    def evidence(self) -> dict[str, Any]:
        return {"full_nvlink": self.full_nvlink}


class PcieIpc(Comm):
    """flashinfer's PCIe IPC all-reduce with the configuration its own policy resolves for each shape (this
    machine's tuned one when flashinfer's tuning cache holds the shape, else its seed)."""

    name = "flashinfer-pcie-ipc"

    def __init__(self, device: Any, group: Any, max_numel: int) -> None:
        import torch

        from inenv.kit import _fi_pcie

        self.pcie = _fi_pcie
        self.coll = _fi_pcie.Collective("all-reduce", group, max_numel)
        self.flat_in = torch.empty(max_numel, device=device, dtype=torch.bfloat16)
        self.config: Any = None
        self.facts: dict[str, Any] = {}

    def before_capture(self, inp: Any) -> dict[str, Any] | None:
        self.config = self.coll.resolved(inp)  # collective: every rank asks for the same shape
        seed = self.coll.seed(inp)
        self.facts = {"config": self.pcie.describe(self.config), "seed": self.pcie.describe(seed),
                      "tuned": self.config is not None and self.pcie.describe(self.config) != self.pcie.describe(seed)}
        if self.config is None:
            refusal = self.coll.refusal(inp, inp.clone())
            why = refusal.message if refusal else "flashinfer resolved no configuration"
            return {"refused": f"flashinfer's PCIe IPC policy has no configuration for {tuple(inp.shape)}: {why}"[:300]}
        return None

    def reduce(self, inp: Any, out: Any) -> None:
        self.coll.run(inp, out, self.config)

    def shape_facts(self) -> dict[str, Any]:
        return dict(self.facts)

    def evidence(self) -> dict[str, Any]:
        return {"pcie_ipc_workspace": self.coll.evidence()}


class Fusion(Comm):
    """flashinfer's fused allreduce + residual add + RMSNorm (trtllm backend): one kernel per block; its workspace
    holds ``max_tokens`` tokens of the model's hidden size."""

    name, fused = "flashinfer-fusion", True

    def __init__(self, rank: int, world: int, device: Any, group: Any, max_numel: int, max_tokens: int) -> None:
        import torch

        from inenv.kit import _flashinfer as fi

        self.fi, self.rank, self.world, self.group = fi, rank, world, group
        self.max_tokens = max_tokens
        self.flat_in = torch.empty(max_numel, device=device, dtype=torch.bfloat16)
        self.fusion: Any = None
        self.hidden = 0

    def for_model(self, hidden: int) -> None:
        import torch

        if self.fusion is not None and self.hidden == hidden:
            return
        if self.fusion is not None:
            self.fusion.destroy(self.group)
        self.fusion = self.fi.Fusion()
        self.fusion.create_workspace(self.rank, self.world, self.max_tokens, hidden, torch.bfloat16, self.group)
        self.hidden = hidden

    def fused_op(self, inp: Any, res_in: Any, gamma: Any, res_out: Any, norm_out: Any) -> None:
        self.fusion.ar_residual_rmsnorm(inp, res_in, gamma, EPS, res_out, norm_out, self.rank, self.world)

    def evidence(self) -> dict[str, Any]:
        return {"fusion_api": self.fusion.api if self.fusion is not None else None}


def make_comm(name: str, rank: int, world: int, device: Any, group: Any, max_numel: int,
              max_tokens: int = 0) -> Comm:
    """Backend ``name``'s adapter on this rank, its input buffer ``max_numel`` elements; ``max_tokens``: the most
    tokens one call carries, what a fused backend sizes its workspace by (required for it)."""
    if name == "nccl":
        return Nccl(device, group, max_numel)
    if name == "symm-mem-one-shot":
        return SymmOneShot(device, group, max_numel)
    if name in ("flashinfer-custom-ar", "sgl-custom-ar"):
        # full_nvlink: the one-stage kernel for every world size, as engines run it on NVLink hosts; on ranks
        # sharing a GPU there is no link at all, and over 2 ranks the kernel launches nothing otherwise
        impl = "flashinfer" if name.startswith("flashinfer") else "sgl_kernel"
        return CustomAR(impl, rank, device, group, max_numel, True)
    if name == "flashinfer-pcie-ipc":
        return PcieIpc(device, group, max_numel)
    if name == "flashinfer-fusion":
        if max_tokens <= 0:
            raise ValueError("flashinfer-fusion needs max_tokens, the most tokens one call carries")
        return Fusion(rank, world, device, group, max_numel, max_tokens)
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
