"""step: a model's decode step and speculative verify step per allreduce backend (docs/probes.md, step).

One variant per backend and world size. For every model shape of ``inenv.models`` and every case (a decode step
of ``batch`` tokens; a verify step of ``batch x (1 + draft)`` tokens), one CUDA graph holds every layer's two
row-parallel blocks as the model runs them under tensor parallelism: the block's matmul at the model's widths
(``tokens x width/tp`` by ``width/tp x hidden``), its allreduce through the backend, then the residual add and
RMSNorm (one fused kernel for a backend that has it, torch's otherwise). The same graph without the allreduce is
the baseline, timed in the same processes, so the communication share of the step and the time per allreduce
inside it are measured, not estimated; the allreduces alone (the same calls, one graph) are timed beside them.

Exactness: inputs are small integers and each weight has one 1 per column, so a matmul picks elements of its
input and every sum is exact in bf16. Blocks alternate the sign of their inputs layer by layer, so the residual
stream stays small and its final value is known in closed form from the ranks' inputs: one allreduce that
returns a wrong, stale or no result anywhere in the graph changes the final residual. The reference is computed
from the input formula (``_data.pattern_sum``), never by the backend under test; a fused RMSNorm output is
compared within one bf16 ulp of an fp32 reference, as fi-fusion does.

Which kernel ran: one replay of each graph is profiled and the kernels the backend's graph launched beyond the
baseline's are recorded per case; a non-NCCL backend whose kernels are NCCL's fell back, and flashinfer's PCIe
IPC all-reduce records the launch configuration its own policy chose (or its refusal) per shape.

The model shapes and steps run, timed, at the deep world sizes (``inenv.probe.deep_sizes``: powers of two and the
host's GPU count), every rank on a GPU of its own. Elsewhere a variant runs the shallow selection: the backend's
set-up at that world size (where a feature refuses it) and one agreement case per dtype (``_agree.shallow_cases``:
random inputs compared bit for bit across ranks, then the same captured call on integer inputs into a
sentinel-filled output, checked exactly, and one replay profiled for the kernels it launched; a quick run the first
dtype only), untimed. Two placements run it: ranks sharing one GPU (``placement=shared``, world sizes over the
host's GPU count: each allreduce there waits for the other processes' turns, 2-9 ms a call on an H200, so a shared
result has no times for anything to rank or plot; the process group is gloo, NCCL refusing two ranks on one GPU),
and a GPU per rank at the other world sizes up to the GPU count (``depth=setup``: NCCL's process group and every
backend as served).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inenv import models
from inenv.kit import _agree, _data, _device, _dist, _errors, _timing
from inenv.probe import SETUP, HostView, ProbeSpec, RankContext, Variant, at_level, multi_rank, outcome, shallow
from inenv.probes.fi_fusion import EPS, norm_check

SPEC = ProbeSpec(
    id="step",
    title="Decode and verify step per allreduce backend",
    feature="How long do a model's decode step and speculative verify step take with each allreduce backend "
    "on this host, against the same step without communication, and which kernel actually ran?",
    ranks=(2, 4, 8),
    min_ranks=2,  # over one rank an allreduce returns its input
    distinct_gpus=False,  # the placement=shared variants put every rank on one GPU (checked, not timed)
    requires=("torch",),
    timeout_s=900.0,
    preload=_dist.PRELOAD_DIST,
    loads=(("backend", "flashinfer-custom-ar", ("vllm_comm",)), ("backend", "flashinfer-pcie-ipc", ("pcie_ipc",)),
           ("backend", "flashinfer-fusion", ("trtllm_comm",))),
    # its shallow variants check what custom-ar, pcie-ipc, fi-fusion and symm-mem check in the quick pass, on the
    # same backends; the step's own answer is its times, measured with a GPU per rank
    quick_shallow=False,
)

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
DECODE_BATCHES = (1, 8, 32)
VERIFY = ((8, 3), (8, 7), (32, 3), (32, 7))  # (batch, draft): EAGLE-3 / MTP draft lengths
REPLAYS = 20
OP_DEADLINE_S = 60.0
OVERLAP_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"  # torch's switch for symmetric memory on one device


@dataclass(frozen=True)
class Case:
    phase: str  # decode | verify
    batch: int
    draft: int = 0

    @property
    def tokens(self) -> int:
        return self.batch * (1 + self.draft)

    @property
    def key(self) -> str:
        return f"decode:{self.batch}" if self.phase == "decode" else f"verify:{self.batch}x{self.draft}"


CASES = (*(Case("decode", b) for b in DECODE_BATCHES), *(Case("verify", b, d) for b, d in VERIFY))
MAX_TOKENS = max(c.tokens for c in CASES)
ONLY_ENV = "STACKPROBE_STEP_ONLY"  # planning filter: "nccl,flashinfer-fusion" plans only those backends


def variants(host: HostView) -> list[Variant]:
    only = {b.strip() for b in os.environ.get(ONLY_ENV, "").split(",") if b.strip()}
    backends = [b for b in BACKENDS if not only or b in only]
    # Beyond the host's GPU count every backend but NCCL (which refuses two ranks on one GPU) runs with its
    # ranks on one GPU; at the other world sizes below it (not deep) with a GPU per rank, depth=setup: both the
    # shallow selection, checked and compared across ranks, not timed
    return multi_rank(SPEC, host, ((("backend", b),) for b in backends), lambda p: dict(p)["backend"] != "nccl",
                      shared_gpus=1, why="NCCL refuses two ranks on one GPU", other_sizes=SETUP)


def _missing(backend: str) -> dict[str, Any] | None:
    for need in NEEDS.get(backend, ()):
        if importlib.util.find_spec(need) is None:
            return outcome("skip", f"{need} is not installed in this environment", "missing-package")
    return None


def preflight(variant: Variant) -> dict[str, Any] | None:
    """A backend whose library is absent is decided before any rank takes the GPUs."""
    return _missing(variant.param("backend") or "nccl")


# --------------------------------------------------------------------------------------------------
# Backends: ``comm_input(numel)`` is where a block's matmul writes (the backend's own buffer where it needs
# one); ``reduce(inp, out)`` is one allreduce (out is inp when in place); a fused backend instead does
# ``fused(inp, residual_in, gamma, residual_out, norm_out)``.


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
    """flashinfer's fused allreduce + residual add + RMSNorm (trtllm backend): one kernel per block."""

    name, fused = "flashinfer-fusion", True

    def __init__(self, rank: int, world: int, device: Any, group: Any, max_numel: int) -> None:
        import torch

        from inenv.kit import _flashinfer as fi

        self.fi, self.rank, self.world, self.group = fi, rank, world, group
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
        self.fusion.create_workspace(self.rank, self.world, MAX_TOKENS, hidden, torch.bfloat16, self.group)
        self.hidden = hidden

    def fused_op(self, inp: Any, res_in: Any, gamma: Any, res_out: Any, norm_out: Any) -> None:
        self.fusion.ar_residual_rmsnorm(inp, res_in, gamma, EPS, res_out, norm_out, self.rank, self.world)

    def evidence(self) -> dict[str, Any]:
        return {"fusion_api": self.fusion.api if self.fusion is not None else None}


def make_comm(name: str, rank: int, world: int, device: Any, group: Any, max_numel: int) -> Comm:
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
        return Fusion(rank, world, device, group, max_numel)
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")


# --------------------------------------------------------------------------------------------------
# The model's blocks


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    attn_in: int  # this rank's o_proj input width (attn_out / tp)
    mlp_in: int  # this rank's down_proj input width (mlp_out / tp)

    @property
    def blocks(self) -> int:
        return 2 * self.layers


def shapes(world: int) -> list[Shape]:
    out = []
    for name, d in models.SHAPES.items():
        if d.get("dtype") != "bf16":
            continue
        attn, mlp = int(str(d["attn_out"])), int(str(d["mlp_out"]))
        out.append(Shape(name, int(str(d["hidden"])), int(str(d["layers"])), max(1, attn // world),
                         max(1, mlp // world)))
    return out


def _perm(width: int, hidden: int, mul: int, add: int, device: Any) -> Any:
    """Column j of a one-hot weight picks input element ``(j * mul + add) % width``."""
    import torch

    return (torch.arange(hidden, device=device, dtype=torch.int64) * mul + add) % width


def _one_hot(perm: Any, width: int, hidden: int, device: Any) -> Any:
    import torch

    w = torch.zeros(width, hidden, dtype=torch.bfloat16, device=device)
    w[perm, torch.arange(hidden, device=device)] = 1
    return w


class Model:
    """One rank's weights, inputs and outputs for one shape; ``load(seed)`` rewrites the inputs and resets every
    output to the sentinel, ``expected(seed)`` is the exact final residual from the input formula."""

    def __init__(self, shape: Shape, rank: int, world: int, device: Any, comm: Comm | None,
                 flat: dict[str, Any]) -> None:
        import torch

        self.s, self.rank, self.world, self.device = shape, rank, world, device
        h = shape.hidden
        self.perm_a = _perm(shape.attn_in, h, 7, 1, device)
        self.perm_m = _perm(shape.mlp_in, h, 5, 3, device)
        self.w_a = _one_hot(self.perm_a, shape.attn_in, h, device)
        self.w_m = _one_hot(self.perm_m, shape.mlp_in, h, device)
        self.x_a = torch.empty(MAX_TOKENS, shape.attn_in, dtype=torch.bfloat16, device=device)
        self.x_m = torch.empty(MAX_TOKENS, shape.mlp_in, dtype=torch.bfloat16, device=device)
        self.nx_a, self.nx_m = torch.empty_like(self.x_a), torch.empty_like(self.x_m)
        self.gamma = (1 + torch.arange(h, device=device) % 3).to(torch.bfloat16)
        self.flat = flat
        self.comm = comm
        self.tokens = 0

    def view(self, name: str, tokens: int) -> Any:
        return self.flat[name][: tokens * self.s.hidden].view(tokens, self.s.hidden)

    def load(self, tokens: int, seed: int) -> None:
        self.tokens = tokens
        self.x_a[:tokens].copy_(_data.pattern((tokens, self.s.attn_in), self.rank, seed, self.device))
        self.x_m[:tokens].copy_(_data.pattern((tokens, self.s.mlp_in), self.rank, seed + 1, self.device))
        self.nx_a[:tokens].copy_(-self.x_a[:tokens])
        self.nx_m[:tokens].copy_(-self.x_m[:tokens])
        self.view("res0", tokens).copy_(_data.pattern((tokens, self.s.hidden), 0, seed + 1000, self.device))
        for name in ("res_a", "res_b", "norm", "out"):
            self.view(name, tokens).fill_(_data.SENTINEL)

    def sums(self, tokens: int, seed: int, world: int) -> tuple[Any, Any]:
        """(attention block sum, MLP block sum) over ``world`` ranks of the positive-sign layers, as int64."""
        import torch

        a = _data.pattern_sum((tokens, self.s.attn_in), world, seed, self.device, torch.int64)[:, self.perm_a]
        m = _data.pattern_sum((tokens, self.s.mlp_in), world, seed + 1, self.device, torch.int64)[:, self.perm_m]
        return a, m

    def expected(self, tokens: int, seed: int, with_comm: bool) -> tuple[Any, Any, Any]:
        """(final residual, the residual before the last block, the last block's sum): layer l adds
        ``(-1)**l * (attention + MLP)``, so after an odd layer count the residual is res0 + attention + MLP."""
        import torch

        if with_comm:
            a, m = self.sums(tokens, seed, self.world)
        else:  # the baseline: each rank's own block outputs, no allreduce
            a = _data.pattern((tokens, self.s.attn_in), self.rank, seed, self.device, torch.int64)[:, self.perm_a]
            m = _data.pattern((tokens, self.s.mlp_in), self.rank, seed + 1, self.device, torch.int64)[:, self.perm_m]
        res0 = _data.pattern((tokens, self.s.hidden), 0, seed + 1000, self.device, torch.int64)
        if self.s.layers % 2:  # the last layer adds: res0 before it, + attention, then + MLP
            before_last, last = res0 + a, m
        else:  # the last layer subtracts: res0 + attention + MLP before it, - attention, then - MLP
            before_last, last = res0 + m, -m
        final = before_last + last
        return final.to(torch.bfloat16), before_last.to(torch.bfloat16), last.to(torch.bfloat16)

    def step(self, tokens: int, with_comm: bool) -> Callable[[], None]:
        """The graph body: every block's matmul, allreduce (skipped for the baseline), residual add and RMSNorm."""
        import torch

        comm = self.comm
        fused = with_comm and comm is not None and comm.fused
        inp = comm.comm_input(tokens * self.s.hidden).view(tokens, self.s.hidden) if comm else None
        local = self.view("out", tokens) if inp is None else inp
        out = self.view("out", tokens)
        res = [self.view("res_a", tokens), self.view("res_b", tokens)]
        res0, norm, gamma = self.view("res0", tokens), self.view("norm", tokens), self.gamma
        rms = getattr(torch.nn.functional, "rms_norm", None)
        blocks = [(x, w) for layer in range(self.s.layers)
                  for x, w in (((self.x_a, self.w_a), (self.x_m, self.w_m)) if layer % 2 == 0
                               else ((self.nx_a, self.w_a), (self.nx_m, self.w_m)))]

        def body() -> None:
            res_in = res0
            for i, (x, w) in enumerate(blocks):
                res_out = res[i % 2]
                torch.matmul(x[:tokens], w, out=local)
                if fused:
                    comm.fused_op(local, res_in, gamma, res_out, norm)  # type: ignore[union-attr]
                else:
                    summed = local
                    if with_comm and comm is not None:
                        summed = local if comm.in_place else out
                        comm.reduce(local, summed)
                    torch.add(summed, res_in, out=res_out)
                    if rms is not None:
                        norm.copy_(rms(res_out, (self.s.hidden,), gamma, EPS))
                    else:
                        xf = res_out.float()
                        norm.copy_(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * gamma.float())
                res_in = res_out

        return body

    def comm_only(self, tokens: int) -> Callable[[], None]:
        """The same allreduces back to back, nothing between them (the fused op for a fused backend)."""
        comm = self.comm
        assert comm is not None
        inp = comm.comm_input(tokens * self.s.hidden).view(tokens, self.s.hidden)
        out = inp if comm.in_place else self.view("out", tokens)
        res = [self.view("res_a", tokens), self.view("res_b", tokens)]
        norm, gamma = self.view("norm", tokens), self.gamma

        def body() -> None:
            for i in range(self.s.blocks):
                if comm.fused:
                    comm.fused_op(inp, res[i % 2], gamma, res[(i + 1) % 2], norm)
                else:
                    comm.reduce(inp, out)

        return body

    def final(self, tokens: int) -> Any:
        return self.view("res_b" if self.s.blocks % 2 == 0 else "res_a", tokens)


# --------------------------------------------------------------------------------------------------
# Measurement


def kernel_names(replay: Callable[[], None]) -> Counter[str] | str:
    """The GPU kernels one replay launched, by name and count (torch's profiler); the error text when the
    profiler cannot say."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            replay()
            torch.cuda.synchronize()
        names: Counter[str] = Counter()
        for evt in prof.events():
            if str(getattr(evt, "device_type", "")).endswith("CUDA") and "memcpy" not in evt.name.lower() \
                    and "memset" not in evt.name.lower():
                names[evt.name] += 1
        return names
    except Exception as exc:
        return _errors.error_tail(exc, 200)


def comm_kernels(backend_run: Counter[str] | str, baseline_run: Counter[str] | str) -> dict[str, Any]:
    """What the backend's graph launched beyond the baseline's: its communication kernels (pure)."""
    if isinstance(backend_run, str) or isinstance(baseline_run, str):
        return {"error": backend_run if isinstance(backend_run, str) else baseline_run}
    extra = {name: n - baseline_run.get(name, 0) for name, n in backend_run.items() if n > baseline_run.get(name, 0)}
    return {"kernels": dict(sorted(extra.items())), "nccl": any("nccl" in name.lower() for name in extra)}


def _check(model: Model, tokens: int, seed: int, with_comm: bool, fused: bool) -> dict[str, Any]:
    final, before_last, last = model.expected(tokens, seed, with_comm)
    got = model.final(tokens)
    chk = _data.check_exact(got, final, prior=_data.filled((tokens, model.s.hidden)))
    out: dict[str, Any] = {"verdict": "ok" if chk.ok else chk.verdict, "residual": chk.to_json()}
    if chk.ok and fused:
        from inenv.probes.fi_fusion import reference

        _, ref_norm = reference(last, before_last, model.gamma)
        norm = norm_check(model.view("norm", tokens), ref_norm)
        out["norm"] = norm
        if not norm["within_1ulp"]:
            out["verdict"] = "wrong"
            out["detail"] = f"RMSNorm output off by up to {norm['max_abs_err']}"
    if not chk.ok:
        out["detail"] = chk.detail
    return out


def run_case(model: Model, case: Case, gloo: Any, barrier: Callable[[], None] | None, timed: bool) -> dict[str, Any]:
    """Capture, check on two inputs, profile and (``timed``) time one case. Every rank reaches every agreement
    point whatever failed where, so the ranks stay in step. Never raises."""
    tokens = case.tokens
    comm = model.comm
    assert comm is not None
    res: dict[str, Any] = {"tokens": tokens, "message_bytes": tokens * model.s.hidden * 2}
    refused, error = None, ""
    graphs: dict[str, Any] = {}
    try:
        model.load(tokens, 1)
        refused = comm.before_capture(comm.comm_input(tokens * model.s.hidden).view(tokens, model.s.hidden))
        res.update(comm.shape_facts())
        if refused is None:
            graphs["step"] = _device.capture(model.step(tokens, True), calls=1, warmup=1)
            comm.after_capture()
            graphs["baseline"] = _device.capture(model.step(tokens, False), calls=1, warmup=1)
    except Exception as exc:
        error = _errors.error_tail(exc)
    if not _dist.agree(refused is None and not error, gloo):
        if refused is not None:
            return {**res, "verdict": "refused", "detail": refused["refused"]}
        return {**res, "verdict": "error", "error": error or "a peer rank failed to capture"}
    local: dict[str, Any] = {"verdict": "ok"}
    for seed in (2, 3):
        try:
            for name, with_comm in (("step", True), ("baseline", False)):
                model.load(tokens, seed)
                graphs[name].replay()
                _device.wait_device(OP_DEADLINE_S)
                found = _check(model, tokens, seed, with_comm, with_comm and comm.fused)
                if found["verdict"] != "ok":
                    local = {**found, "graph": name, "seed": seed}
                    break
        except Exception as exc:
            local = _dist.raised(exc)
        if (stopped := _dist.settle(local, gloo)) is not None:
            return {**res, **stopped}
    try:
        res["launched"] = comm_kernels(kernel_names(graphs["step"].replay), kernel_names(graphs["baseline"].replay))
        if not timed:  # ranks time-slicing one GPU: each allreduce waits for the other process's turn
            return {**res, "verdict": "ok"}
        timing = {name: _timing.timed_across_ranks(graphs[name].replay, REPLAYS, 1, barrier, gloo)
                  for name in ("step", "baseline")}
        model.load(tokens, 4)
        graphs["comm"] = _device.capture(model.comm_only(tokens), calls=1, warmup=1)
        comm.after_capture()
        comm.comm_input(tokens * model.s.hidden).zero_()  # repeated in-place sums of zeros stay finite
        timing["comm"] = _timing.timed_across_ranks(graphs["comm"].replay, REPLAYS, model.s.blocks, barrier, gloo)
    except Exception as exc:
        return {**res, "verdict": "error", "error": _errors.error_tail(exc)}
    res["timing"] = {name: {k: t.to_json()[k] for k in ("median_us", "p99_us", "min_us")} for name, t in timing.items()}
    return {**res, "verdict": "ok"}


def agreement_bind(comm: Comm, rank: int, world: int, flat: dict[str, Any],
                   refusals: dict[str, str] | None = None) -> Callable[[_agree.Case], _agree.Bound]:
    """How the agreement check (``_agree``) drives this backend: its own input buffer viewed in the case's dtype,
    one allreduce per call; a fused backend's residual and RMSNorm outputs both compared, against the float64
    sum plus residual and its float64 RMSNorm. A dtype the backend does not take, or a shape its policy
    refuses, raises: that case is recorded as unsupported (a refusal also in ``refusals``, by case key)."""

    def bind(case: _agree.Case) -> _agree.Bound:
        if case.dtype not in comm.dtypes:
            raise TypeError(f"{comm.name} is checked in {', '.join(comm.dtypes)} only")
        dtype = _agree.torch_dtype(case.dtype)
        shape = (case.tokens, case.hidden)
        comm.for_model(case.hidden)
        inp = comm.comm_input(case.numel).view(dtype).view(shape)
        if not comm.fused:
            refused = comm.before_capture(inp)
            if refused is not None:
                if refusals is not None:
                    refusals[case.key] = refused["refused"]
                raise ValueError(refused["refused"])
            out = inp if comm.in_place else flat["out"][: case.numel].view(dtype).view(shape)
            return _agree.allreduce_bound(case, inp.view(-1), out.view(-1), lambda: comm.reduce(inp, out), rank,
                                          world, comm.after_capture)
        return _fused_bound(case, comm, inp, rank, world, flat)

    return bind


def _fused_bound(case: _agree.Case, comm: Comm, inp: Any, rank: int, world: int,
                 flat: dict[str, Any]) -> _agree.Bound:
    """A fused allreduce + residual add + RMSNorm: the residual stream and gamma are the same on every rank."""
    import torch

    shape = (case.tokens, case.hidden)
    res_in, res_out, norm = (flat[k][: case.numel].view(shape) for k in ("res0", "res_a", "norm"))
    gamma = _agree.random_input((case.hidden,), -1, 99, case.dtype, inp.device)

    def load(seed: int) -> None:
        inp.copy_(_agree.random_input(shape, rank, seed, case.dtype, inp.device))
        res_in.copy_(_agree.random_input(shape, -1, seed + 1, case.dtype, inp.device))
        res_out.fill_(_agree.UNTOUCHED)
        norm.fill_(_agree.UNTOUCHED)

    def residual(seed: int) -> Any:
        return _agree.exact_sum(shape, world, seed, case.dtype) + _agree.random_input(
            shape, -1, seed + 1, case.dtype).to(torch.float64)

    def reference(seed: int) -> dict[str, Any]:
        res = residual(seed)
        return {"residual": res, "norm": _agree.rms_norm64(res, gamma.cpu(), EPS)}

    def scale(seed: int) -> dict[str, Any]:
        # the residual's terms' magnitude; the norm's is that magnitude carried through the same row scaling
        # (an element the norm leaves near zero still carries the rounding of terms of that size)
        magnitude = _agree.exact_sum(shape, world, seed, case.dtype, magnitude=True) + _agree.random_input(
            shape, -1, seed + 1, case.dtype).to(torch.float64).abs()
        res = residual(seed)
        row = torch.rsqrt(res.pow(2).mean(dim=-1, keepdim=True) + EPS)
        return {"residual": magnitude, "norm": magnitude * row * gamma.cpu().to(torch.float64).abs()}

    def load_exact(seed: int) -> None:
        inp.copy_(_data.pattern(shape, rank, seed, inp.device, inp.dtype))
        res_in.copy_(_data.pattern(shape, 0, seed + 1000, inp.device, inp.dtype))
        res_out.fill_(_data.SENTINEL)
        norm.fill_(_data.SENTINEL)

    def verify(seed: int) -> dict[str, Any]:
        # the residual is an integer sum, exact; the norm within one ulp of the fp32 RMSNorm of it, as fi-fusion
        total = _data.pattern_sum(shape, world, seed, inp.device, inp.dtype)
        want_res = (total.double() + res_in.double()).to(inp.dtype)
        want_norm = _rms_norm32(want_res, gamma)
        res = _data.check_exact(res_out, want_res, prior=_data.filled(shape)).to_json()
        if res["verdict"] != "exact":
            return res
        checked = norm_check(norm, want_norm)
        if checked["within_1ulp"]:
            return {**res, "norm": checked}
        verdict = "no-op" if checked["untouched"] else "wrong"
        return {**res, "verdict": verdict, "norm": checked,
                "detail": f"RMSNorm output off by up to {checked['max_abs_err']}"}

    return _agree.Bound(load, lambda: comm.fused_op(inp, res_in, gamma, res_out, norm),
                        lambda: {"residual": res_out, "norm": norm}, reference, comm.after_capture, scale,
                        _agree.Exact(load_exact, verify))


def _rms_norm32(x: Any, gamma: Any) -> Any:
    """RMSNorm over the last dimension in fp32, rounded once to ``x``'s dtype: what a fused kernel computes."""
    import torch

    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + EPS) * gamma.float()).to(x.dtype)


def summarize(backend: str, per_model: dict[str, dict[str, dict[str, Any]]], blocks: dict[str, int],
              shared: bool) -> dict[str, Any]:
    """Metrics and the verdict from the per-case results (pure). Shared-GPU times stay in the evidence."""
    metrics: dict[str, Any] = {}
    step_us: dict[str, dict[str, float]] = {}
    base_us: dict[str, dict[str, float]] = {}
    share: dict[str, dict[str, float]] = {}
    per_ar: dict[str, dict[str, float]] = {}
    comm_us: dict[str, dict[str, float]] = {}
    fell_back: list[str] = []
    for model, cases in per_model.items():
        for key, r in cases.items():
            if r.get("verdict") == "ok" and backend != "nccl" and r.get("launched", {}).get("nccl"):
                fell_back.append(f"{model} {key}")
            if r.get("verdict") != "ok" or "timing" not in r:
                continue
            t = r["timing"]
            s, b = t["step"]["median_us"], t["baseline"]["median_us"]
            step_us.setdefault(model, {})[key] = round(s, 2)
            base_us.setdefault(model, {})[key] = round(b, 2)
            share.setdefault(model, {})[key] = round(max(0.0, s - b) / s, 4) if s > 0 else 0.0
            per_ar.setdefault(model, {})[key] = round((s - b) / blocks[model], 3)
            comm_us.setdefault(model, {})[key] = round(t["comm"]["median_us"], 3)
    if step_us:
        metrics.update({"step_us": step_us, "baseline_us": base_us, "comm_share": share,
                        "per_allreduce_us": per_ar, "comm_only_us": comm_us})
        headline = _headline(step_us, share)
        if headline:
            metrics["headline"] = headline
    evidence: dict[str, Any] = {"per_case": per_model, "timed": not shared}
    bad = [(m, k, r) for m, cases in per_model.items() for k, r in cases.items() if r.get("verdict") != "ok"]
    wrong = [(m, k, r) for m, k, r in bad if r.get("verdict") in ("wrong", "no-op", "zero")]
    if wrong:
        m, k, r = wrong[0]
        return outcome("fail", f"{backend}: wrong result in the {m} {k} step ({r.get('detail', r['verdict'])})"[:400],
                       "step-wrong-result", metrics, evidence)
    ran = sum(1 for cases in per_model.values() for r in cases.values() if r.get("verdict") == "ok")
    if bad and not ran:
        m, k, r = bad[0]
        code = "step-backend-refused" if r.get("verdict") == "refused" else "step-backend-failed"
        return outcome("fail", f"{backend}: {m} {k}: {r.get('detail') or r.get('error') or r['verdict']}"[:400],
                       code, metrics, evidence)
    if bad or fell_back:
        parts = []
        refused = [f"{m} {k}" for m, k, r in bad if r.get("verdict") == "refused"]
        failed = [f"{m} {k}" for m, k, r in bad if r.get("verdict") != "refused"]
        if refused:
            parts.append(f"refused at {', '.join(refused[:6])}{' ...' if len(refused) > 6 else ''}")
        if failed:
            parts.append(f"failed at {', '.join(failed[:6])}: {bad[0][2].get('error', bad[0][2]['verdict'])[:120]}")
        if fell_back:
            parts.append(f"launched NCCL kernels at {', '.join(fell_back[:6])}")
        code = "step-backend-fallback" if fell_back or refused else "step-backend-failed"
        return outcome("partial", f"{backend}: " + "; ".join(parts), code, metrics, evidence)
    return outcome("pass", metrics=metrics, evidence=evidence)


def _headline(step_us: dict[str, dict[str, float]], share: dict[str, dict[str, float]]) -> str:
    model = models.DEFAULT if models.DEFAULT in step_us else next(iter(step_us), "")
    for key in ("decode:8", "decode:1"):
        if key in step_us.get(model, {}):
            return f"{model} {key}: {step_us[model][key] / 1000:.2f} ms, {share[model][key]:.0%} comm"
    return ""


def checks(setup_only: bool, world: int) -> tuple[tuple[Shape, ...], tuple[Case, ...]]:
    """(model shapes, step cases) a variant runs at this level: every shape and case, or in a quick run the first
    of each, at a deep world size; none for the shallow selection (``setup_only``: ranks sharing a GPU or
    ``depth=setup``; :func:`agreement_cases` is what they check)."""
    if setup_only:
        return (), ()
    return at_level(tuple(shapes(world))), at_level(CASES)


def agreement_cases(setup_only: bool, dtypes: tuple[str, ...]) -> tuple[_agree.Case, ...]:
    """The agreement cases at this level: ``_agree.shallow_cases`` (checked exactly) for the shallow selection
    (``setup_only``), else ``_agree.cases``."""
    return _agree.shallow_cases(dtypes) if setup_only else _agree.cases(dtypes)


def run(ctx: RankContext) -> dict[str, Any]:
    multicast_env = _dist.keep_multicast_off()
    name = ctx.param("backend", "nccl") or "nccl"
    if (missing := _missing(name)) is not None:
        return missing
    shared = ctx.variant.share_gpu  # ranks on one GPU: a gloo process group, nothing timed
    setup_only = shallow(ctx.variant)  # the shallow selection: set-up and one exact case per dtype
    if shared and name == "nccl":
        return outcome("skip", "NCCL refuses two ranks on one GPU", "too-few-gpus")
    if shared:
        os.environ[OVERLAP_ENV] = "1"
    if "flashinfer" in NEEDS.get(name, ()):
        from inenv.kit import _flashinfer

        _flashinfer.prepare_env()  # the modules fi-jit built or the cell carries, not a compile in this turn
    if name == "flashinfer-pcie-ipc":
        from inenv.kit import _api, _fi_pcie

        found = _fi_pcie.detect("all-reduce")
        if isinstance(found, _api.ApiUnknown):
            return found.outcome()

    import torch

    if (skipped := _dist.gpu_precheck(ctx, shared)) is not None:
        return skipped
    if shared:
        ctx = dataclasses.replace(ctx, device_index=0)
    device = _dist.init_dist(ctx, "gloo" if shared else "nccl")
    import torch.distributed as dist

    group = dist.group.WORLD
    gloo = group if shared else _dist.cpu_group()
    barrier = None if setup_only else _timing.stream_barrier(device, group)  # what times a replay
    world = ctx.world_size
    wanted, step_cases = checks(setup_only, world)  # the shapes and cases this level runs, only those in the evidence
    max_numel = max(MAX_TOKENS * max((s.hidden for s in wanted), default=0), _agree.max_numel())
    evidence: dict[str, Any] = {
        "backend": name,
        "placement": f"shared: {world} ranks on one GPU (checked, not timed)" if shared else "one GPU per rank",
        "models": {s.name: dataclasses.asdict(s) for s in wanted},
        "cases": [dataclasses.asdict(c) | {"key": c.key, "tokens": c.tokens} for c in step_cases],
        **({"checked": _agree.shallow_checked(shared)} if setup_only else {}),
        "replays": REPLAYS,
        "multicast_env": multicast_env,
        "torch": torch.__version__,
        "method": "one CUDA graph per case of every layer's two row-parallel blocks (matmul, allreduce, residual "
        "add, RMSNorm), replayed on a side stream; the same graph without the allreduce is the baseline; the "
        "slowest rank per replay, median over replays",
    }
    ok, err = True, ""
    comm: Comm | None = None
    try:
        comm = make_comm(name, ctx.rank, world, device, group, max_numel)
    except Exception as exc:
        ok, err = False, _errors.error_tail(exc)
    if not _dist.agree(ok, gloo):
        why = err or "a peer rank failed to set the backend up"
        return outcome("fail", f"{name}: {why[:300]}", "step-backend-failed", evidence=evidence)
    assert comm is not None
    flat = {k: torch.empty(max_numel, device=device, dtype=torch.bfloat16)
            for k in ("res0", "res_a", "res_b", "norm", "out")}
    if setup_only:
        return run_shallow(ctx, comm, flat, gloo, device, evidence)
    per_model: dict[str, dict[str, dict[str, Any]]] = {}
    with _timing.side_stream(device):
        for shape in wanted:
            ok, err = True, ""
            try:
                comm.for_model(shape.hidden)
                model = Model(shape, ctx.rank, world, device, comm, flat)
            except Exception as exc:
                ok, err = False, _errors.error_tail(exc)
            if not _dist.agree(ok, gloo):
                per_model[shape.name] = {"setup": {"verdict": "error", "error": err or "failed on a peer rank"}}
                continue
            cases = per_model[shape.name] = {}
            for case in step_cases:
                cases[case.key] = r = run_case(model, case, gloo, barrier, timed=True)
                ctx.log(f"{name} {shape.name} {case.key}: {r.get('verdict')} {r.get('timing', {}).get('step', '')}")
                if r.get("verdict") == "hang":
                    break
            del model
            torch.cuda.empty_cache()
        hung = any(r.get("verdict") == "hang" for cases in per_model.values() for r in cases.values())
        agreed = {} if hung else _agree.run_cases(agreement_bind(comm, ctx.rank, world, flat),
                                                  agreement_cases(False, comm.dtypes), gloo, ctx.log)
    evidence.update(comm.evidence())
    result = summarize(name, per_model, {s.name: s.blocks for s in wanted}, False)
    result["evidence"].update(evidence)
    result["evidence"]["agreement"] = agreed
    return _agree.apply(result, _agree.summarize(agreed), name)


def run_shallow(ctx: RankContext, comm: Comm, flat: dict[str, Any], gloo: Any, device: Any,
                evidence: dict[str, Any]) -> dict[str, Any]:
    """The shallow selection (ranks sharing one GPU, or ``depth=setup``), once the backend is set up: what depends
    on the hidden size (a fused workspace), then ``_agree.shallow_cases`` checked exactly and profiled (see the
    module's docstring)."""
    wanted = agreement_cases(True, comm.dtypes)
    ok, err = True, ""
    try:
        comm.for_model(wanted[0].hidden)
    except Exception as exc:
        ok, err = False, _errors.error_tail(exc)
    if not _dist.agree(ok, gloo):
        why = err or "a peer rank failed to set the backend up"
        return outcome("fail", f"{comm.name}: {why[:300]}", "step-backend-failed", evidence=evidence)
    refusals: dict[str, str] = {}
    with _timing.side_stream(device):
        agreed = _agree.run_cases(agreement_bind(comm, ctx.rank, ctx.world_size, flat, refusals), wanted, gloo,
                                  ctx.log, exact=True, profile=lambda call: comm_kernels(kernel_names(call), Counter()))
    evidence.update(comm.evidence())
    result = summarize_shallow(comm.name, agreed, refusals, ctx.variant.share_gpu)
    result["evidence"].update(evidence)
    result["evidence"]["agreement"] = agreed
    return _agree.apply(result, _agree.summarize(agreed), comm.name)


# Where a shallow result's notes name its cases ("... in the shared placement <case>"), and the evidence key of its
# checks, by placement: ranks sharing one GPU, or a GPU per rank at a world size outside the deep ones (depth=setup)
SHARED_LABEL, SHARED_KEY = "shared placement", "shared_checks"
SETUP_LABEL, SETUP_KEY = "set-up check", "setup_checks"


def summarize_shallow(backend: str, agreed: dict[str, dict[str, Any]], refusals: dict[str, str],
                      shared: bool = True) -> dict[str, Any]:
    """The verdict of the shallow selection from its agreement cases (``_agree.run_cases`` with ``exact`` and a
    profile), in :func:`summarize`'s words (pure): a case whose integer-valued call was not the exact sum fails
    ``step-wrong-result``; every case refused by the backend's policy is ``step-backend-refused``, every case
    failed ``step-backend-failed``; some of them, or NCCL's kernels launched, ``partial``. Nothing is timed. Its
    checks are in ``evidence.shared_checks`` (ranks ``shared`` one GPU) or ``evidence.setup_checks`` (a GPU per
    rank, ``depth=setup``), by case."""
    per: dict[str, dict[str, Any]] = {}
    for key, r in agreed.items():
        exact = r.get("exact") or {}
        if r.get("verdict") == "unsupported":
            rec = ({"verdict": "refused", "detail": refusals[key]} if key in refusals
                   else {"verdict": "error", "error": str(r.get("error") or "unsupported")})
        elif r.get("verdict") != "ok":
            rec = {"verdict": str(r.get("verdict") or "error"),
                   "error": str(r.get("error") or r.get("detail") or r.get("verdict"))}
        elif exact.get("verdict") in ("wrong", "no-op", "zero"):
            rec = {"verdict": exact["verdict"], "detail": str(exact.get("detail") or exact["verdict"]),
                   "exact": exact}
        elif exact.get("verdict") != "exact":
            rec = {"verdict": "hang" if exact.get("verdict") == "hang" else "error",
                   "error": f"exact call: {exact.get('error') or exact.get('detail') or exact.get('verdict')}",
                   "exact": exact}
        else:
            rec = {"verdict": "ok", "exact": exact}
        if "launched" in r:
            rec["launched"] = r["launched"]
        per[key] = rec
    if not per:
        per["set-up"] = {"verdict": "error", "error": "no agreement case was run"}
    label, key = (SHARED_LABEL, SHARED_KEY) if shared else (SETUP_LABEL, SETUP_KEY)
    result = summarize(backend, {label: per}, {}, shared=True)  # untimed, as a shared placement is
    result["evidence"][key] = result["evidence"].pop("per_case")[label]
    return result


# --- declared fields: what this probe records, and the roles checks report and checks advise read them by
# (inenv.probe.Field: name, unit, meaning, role). Left out of the probe hash: it changes no verdict.
METRICS = (
    ("step_us", "µs by model and case", "median time of one step (every layer's blocks), slowest rank per replay",
     None),
    ("baseline_us", "µs by model and case", "the same step without its allreduces, same processes", None),
    ("comm_share", "fraction by model and case", "(step - baseline) / step", None),
    ("per_allreduce_us", "µs by model and case", "(step - baseline) / allreduces in the step", None),
    ("comm_only_us", "µs by model and case", "one allreduce of the step's size, the step's calls back to back",
     None),
    ("headline", "text", "the default model's decode step and its communication share", "headline"),
    ("agreement", "record", "rank agreement on random bf16/fp16 data (inenv/kit/_agree.py): ranks identical, "
     "differing elements, max ulp between ranks, deterministic, max ulp vs the float64 sum, divergent cases",
     "agreement"),
)
