"""load: every allreduce backend the probes reach, replayed under load the way serving engines run it
(docs/probes.md, load).

A backend can pass every short exact check and then hang or drift after minutes of serving: after thousands of
CUDA graph replays while the batch size changes, with PDL on, or with two streams on one communicator. Each
variant runs one backend in one pattern through the load engine (``inenv.load_engine``): one graph per token
count, captured once and replayed back to back while the count walks across the backend's one-shot/two-shot
switch, outputs checked while it runs (exactly, and bitwise across ranks), latency per count recorded, every
rank's position kept in its progress record so a stall is a ``hang`` that names the replay, the count, the PDL
setting and the stream at which each rank stopped.

Backends: NCCL (the control), torch symmetric memory one-shot and two-shot, flashinfer's custom allreduce, PCIe
IPC all-reduce and trtllm fusion (residual + RMSNorm with the FP8 and, on compute capability 10 and up, NVFP4
quant-fused patterns in the same graph, as a model's layers use them), sgl-kernel's custom allreduce, and where
the cell has them SGLang's custom allreduce V2 and vLLM's custom allreduce. Patterns: ``replay`` at every world
size planned; PDL off, ``two-streams`` and ``two-comms`` at 2 ranks (the question they ask does not change with
the world size, and each variant costs a worker). The fusion runs ``mode=auto`` (flashinfer chooses one-shot or
two-shot by size: within the sizes walked it switches at 4 ranks and more only) and ``mode=crossing`` (one-shot up
to 128 tokens, two-shot above, so every world size crosses). NCCL has no two-streams variant: one NCCL
communicator in two graphs replayed at once is outside NCCL's contract, so its answer would say nothing of NCCL.

Placement: a GPU per rank at the deep world sizes (``inenv.probe.deep_sizes``), timed; on a host of more than 4
GPUs at 2 ranks and at the GPU count only (the tensor-parallel sizes such a host serves at and the smallest; a
replay's failure shows at either, and each variant is minutes of replays), the sizes between planned ``not-run`` +
``narrowed-world-size``, saying so; beyond the host's GPU count the ranks share one GPU at 2 and 4 ranks (every
backend but NCCL), checked, not timed: that exercises the code paths on a one-GPU host, not the links. Only the
``replay`` pattern records latency, so ``two-streams`` and ``two-comms`` take the GPUs as checks that time nothing
do (``ProbeSpec.untimed_params``): beside other such variants, not alone.

The quick level plans no load variant: a load verdict needs thousands of replays (the failures it looks for
show after them), a few hundred would pass where the full level hangs, and the quick pass's question, whether a
backend works at all, is answered by the backends' own probes; the full pass that follows runs these.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import Any

from inenv import load_engine as engine
from inenv.kit import _device, _dist
from inenv.probe import (
    NARROWED,
    OMIT,
    QUICK,
    HostView,
    ProbeSpec,
    RankContext,
    Skip,
    Variant,
    combine_worst,
    multi_rank,
)
from inenv.probes import stepcomm
from inenv.status import Status

SPEC = ProbeSpec(
    id="load",
    title="Allreduce backends under load",
    feature="Does each allreduce backend keep giving exact, rank-identical results when its CUDA graphs are replayed "
    "thousands of times while the batch size crosses its one-shot/two-shot switch, with PDL on and off, from two "
    "streams on one communicator and from two communicators, and how long does each size take?",
    ranks=(2, 4),
    min_ranks=2,  # over one rank an allreduce returns its input
    distinct_gpus=False,  # beyond the GPU count the ranks share one GPU (checked, not timed)
    requires=("torch",),
    timeout_s=300.0,
    stall_s=30.0,
    quick_shallow=False,  # nothing of it runs in a quick pass (see the module's docstring)
    sustained=True,
    # two streams and two communicators ask whether replays stay exact; only ``replay`` records latency
    # (inenv.load_engine), so those variants share the GPUs with other checks that time nothing
    untimed_params=(("pattern", engine.TWO_STREAMS), ("pattern", engine.TWO_COMMS)),
    preload=_dist.PRELOAD_DIST,
    loads=(("backend", "flashinfer-custom-ar", ("vllm_comm",)), ("backend", "flashinfer-pcie-ipc", ("pcie_ipc",)),
           ("backend", "flashinfer-fusion", ("trtllm_comm",))),
)

REPLAY, TWO_STREAMS, TWO_COMMS = engine.REPLAY, engine.TWO_STREAMS, engine.TWO_COMMS
# backend -> the patterns it runs at 2 ranks besides replay
EXTRA: dict[str, tuple[str, ...]] = {
    "nccl": (TWO_COMMS,),
    "symm-mem-one-shot": (TWO_STREAMS, TWO_COMMS),
    "symm-mem-two-shot": (),
    "flashinfer-custom-ar": (TWO_STREAMS, TWO_COMMS),
    "sgl-custom-ar": (TWO_STREAMS, TWO_COMMS),
    "sglang-custom-ar-v2": (TWO_STREAMS, TWO_COMMS),
    "vllm-custom-ar": (TWO_STREAMS, TWO_COMMS),
    "flashinfer-pcie-ipc": (),
    "flashinfer-fusion": (TWO_STREAMS, TWO_COMMS),
}
BACKENDS = tuple(EXTRA)
# What each backend imports: the step's backends as their adapters say, and the engines' own custom allreduces
NEEDS = {**stepcomm.NEEDS, "sglang-custom-ar-v2": ("sglang",), "vllm-custom-ar": ("vllm",)}
TAKES_PDL = frozenset({"flashinfer-fusion"})  # launch_with_pdl is a switch of its API
FUSION_MODES = ("auto", "crossing")  # planned; "oneshot" and "twoshot" run each path alone, by hand
SHARED_SIZES = (2, 4)  # world sizes run with ranks sharing one GPU beyond the host's GPU count
WIDE_HOST = 4  # on a host of more GPUs, a GPU per rank at 2 ranks and at the GPU count only (:func:`narrows`)
ONLY_ENV = "STACKPROBE_LOAD_ONLY"  # planning filter: "nccl,flashinfer-custom-ar" plans only those backends


def param_sets(backend: str, ranks: int) -> list[tuple[tuple[str, str], ...]]:
    """The params of ``backend``'s variants at ``ranks`` ranks (pure): replay everywhere; the other patterns and
    PDL off at 2 ranks only."""
    first = ranks == 2
    b = (("backend", backend),)
    if backend == "flashinfer-fusion":
        out = [(*b, ("pattern", REPLAY), ("pdl", "on"), ("mode", m)) for m in FUSION_MODES]
        if first:
            out.append((*b, ("pattern", REPLAY), ("pdl", "off"), ("mode", "crossing")))
            out += [(*b, ("pattern", p), ("pdl", "on"), ("mode", "crossing")) for p in EXTRA[backend]]
        return out
    return [(*b, ("pattern", p)) for p in (REPLAY, *(EXTRA[backend] if first else ()))]


def variants(host: HostView) -> list[Variant]:
    if host.level == QUICK:
        return []  # see the module's docstring
    only = {b.strip() for b in os.environ.get(ONLY_ENV, "").split(",") if b.strip()}
    every = [p for b in BACKENDS if not only or b in only for p in param_sets(b, 2)]
    planned = multi_rank(SPEC, host, every, lambda p: dict(p)["backend"] != "nccl", shared_gpus=1,
                         why="NCCL refuses two ranks on one GPU", other_sizes=OMIT)
    out = []
    for v in planned:
        beyond = v.share_gpu or (v.skip is not None and v.skip.code == "too-few-gpus")
        if beyond and v.ranks not in SHARED_SIZES:
            continue
        if (not only or v.param("backend") in only) and v.params in param_sets(str(v.param("backend")), v.ranks):
            out.append(dataclasses.replace(v, skip=narrowed(v.ranks, host)) if narrows(v, host) else v)
    return out


def narrows(v: Variant, host: HostView) -> bool:
    """Whether ``v``, a GPU per rank on a host of more than :data:`WIDE_HOST` GPUs, is at a world size between 2
    and the GPU count: planned not-run (the module docstring)."""
    return (host.gpu_count > WIDE_HOST and v.skip is None and not v.share_gpu
            and v.ranks not in (2, host.gpu_count))


def narrowed(n: int, host: HostView) -> Skip:
    return Skip(NARROWED, f"{n} ranks on a host of {host.gpu_count} GPUs: load runs a GPU per rank at 2 and "
                f"{host.gpu_count} ranks only (the smallest size and the one the host serves at; each variant is "
                "minutes of replays, and a replay's failure shows at either)", Status.NOT_RUN.value)


def preflight(variant: Variant) -> dict[str, Any] | None:
    """A backend whose library is absent is decided before any rank takes the GPUs."""
    return stepcomm.missing(variant.param("backend") or "nccl", NEEDS)


def run(ctx: RankContext) -> dict[str, Any]:
    multicast_env = _dist.keep_multicast_off()
    name = ctx.param("backend", "nccl") or "nccl"
    ended, ctx = stepcomm.begin(ctx, name, NEEDS)
    if ended is not None:
        return ended
    result = engine.run(ctx, backend=name, pattern=ctx.param("pattern") or REPLAY, pdl=ctx.param("pdl") == "on",
                        mode=ctx.param("mode") or "", stall_s=SPEC.stall_s)
    result["evidence"]["multicast_env"] = multicast_env
    return result


def combine(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """The worst rank's outcome, with every rank's last position (a rank that hung names where it stopped)."""
    merged = combine_worst(outcomes)
    positions = {str(i): p for i, o in enumerate(outcomes) if (p := (o.get("evidence") or {}).get("position"))}
    if positions:
        merged = {**merged, "evidence": {**(merged.get("evidence") or {}), "positions": positions}}
    return merged


# --------------------------------------------------------------------------------------------------
# The GPU backends (inenv.load_engine.Backend), registered by name below


class _Gpu:
    """What the GPU backends share: lane buffers made in ``prepare``, graphs captured after one eager warm-up, no
    work queued off the engine's streams."""

    name = ""
    takes_pdl = False

    def __init__(self, s: engine.Setup) -> None:
        self.s = s
        self.lanes: list[engine.Buffers] = []

    def switches(self, hidden: int) -> tuple[int, ...]:
        return ()

    def buffers(self, lane: int) -> engine.Buffers:
        return self.lanes[lane]

    def sync(self, deadline_s: float) -> None:
        pass

    def facts(self) -> dict[str, Any]:
        return {}

    def graph(self, step: Callable[[], None], warmup: int = 1) -> Callable[[], None]:
        """One CUDA graph of ``step``, after ``warmup`` eager calls; on a CPU device (the tests' gloo ranks, where
        CUDA graphs do not exist) the step itself, called at each replay."""
        if getattr(self.s.device, "type", "cuda") != "cuda":
            return step
        return _device.capture(step, calls=1, warmup=warmup).replay

    def empty(self, max_tokens: int, hidden: int, dtype: Any = None) -> Any:
        import torch

        return torch.empty(max_tokens, hidden, dtype=dtype or torch.bfloat16, device=self.s.device)


class StepComm(_Gpu):
    """A backend of the step probe (its adapter, ``inenv.probes.stepcomm``: NCCL, symmetric memory one-shot, PCIe
    IPC): its own input buffer, one slice per lane, and ``reduce(inp, out)`` (in place for NCCL)."""

    def __init__(self, s: engine.Setup, name: str) -> None:
        super().__init__(s)
        self.name = name
        self.comm: Any = None

    def prepare(self, max_tokens: int, hidden: int) -> int:
        per = max_tokens * hidden
        self.comm = stepcomm.make_comm(self.name, self.s.rank, self.s.world, self.s.device, self.s.group,
                                       per * self.s.lanes)
        for lane in range(self.s.lanes):
            inp = self.comm.comm_input(per * (lane + 1))[per * lane:].view(max_tokens, hidden)
            out = inp if self.comm.in_place else self.empty(max_tokens, hidden)
            self.lanes.append(engine.Buffers(inp, {"sum": engine.Output(out, engine.SUM)}))
        return max_tokens

    def capture(self, size: int, pdl: bool, lane: int) -> Callable[[], None]:
        b = self.lanes[lane]
        inp, out = b.inp[:size], b.outputs["sum"].tensor[:size]
        refused = self.comm.before_capture(inp)
        if refused is not None:
            raise engine.SizeRefused(refused["refused"])
        replay = self.graph(lambda: self.comm.reduce(inp, out))
        self.comm.after_capture()
        return replay

    def facts(self) -> dict[str, Any]:
        return self.comm.evidence() if self.comm is not None else {}


class SymmTwoShot(_Gpu):
    """torch symmetric memory's two-shot allreduce (``two_shot_all_reduce_out``, or the in-place op and a copy)."""

    name = "symm-mem-two-shot"

    def prepare(self, max_tokens: int, hidden: int) -> int:
        import torch
        import torch.distributed._symmetric_memory as symm_mem

        self.out_op = _dist.symm_op("two_shot_all_reduce_out")
        self.inplace_op = _dist.symm_op("two_shot_all_reduce_")
        if self.out_op is None and self.inplace_op is None:
            raise LookupError("torch.ops.symm_mem has no two-shot allreduce in this torch")
        per = max_tokens * hidden
        flat = symm_mem.empty(per * self.s.lanes, dtype=torch.bfloat16, device=self.s.device)
        self.handle, _ = _dist.symm_rendezvous(flat, self.s.group)
        for lane in range(self.s.lanes):
            inp = flat[per * lane: per * (lane + 1)].view(max_tokens, hidden)
            self.lanes.append(engine.Buffers(inp, {"sum": engine.Output(self.empty(max_tokens, hidden), engine.SUM)}))
        return max_tokens

    def capture(self, size: int, pdl: bool, lane: int) -> Callable[[], None]:
        b = self.lanes[lane]
        inp, out = b.inp[:size], b.outputs["sum"].tensor[:size]
        group = self.s.group.group_name

        def step() -> None:
            if self.out_op is not None:
                self.out_op(inp, "sum", group, out)
            else:
                self.inplace_op(inp, "sum", group)
                out.copy_(inp)

        return self.graph(step)


class CustomAR(_Gpu):
    """The vLLM-style custom allreduce of flashinfer or sgl-kernel (the step probe's adapter), graph-registered
    as engines run it: each lane's input and output buffers its own, inputs under the 8 MiB the engines send it."""

    def __init__(self, s: engine.Setup, name: str) -> None:
        super().__init__(s)
        self.name = name
        self.comm: Any = None

    def switches(self, hidden: int) -> tuple[int, ...]:
        one = engine.custom_ar_switch(self.s.world, hidden)
        return () if one is None else (one,)

    def prepare(self, max_tokens: int, hidden: int) -> int:
        from inenv.kit import _flashinfer as fi

        limit = min(max_tokens, (fi.VllmCustomAR.MAX_BYTES - 1) // (2 * hidden))
        self.comm = stepcomm.make_comm(self.name, self.s.rank, self.s.world, self.s.device, self.s.group,
                                       limit * hidden)
        for _ in range(self.s.lanes):
            out = self.empty(limit, hidden)
            self.lanes.append(engine.Buffers(self.empty(limit, hidden), {"sum": engine.Output(out, engine.SUM)}))
        return limit

    def capture(self, size: int, pdl: bool, lane: int) -> Callable[[], None]:
        b = self.lanes[lane]
        inp, out = b.inp[:size], b.outputs["sum"].tensor[:size]
        replay = self.graph(lambda: self.comm.reduce(inp, out))
        self.comm.after_capture()  # every rank registers the captured addresses with its peers
        return replay

    def facts(self) -> dict[str, Any]:
        return self.comm.evidence() if self.comm is not None else {}


class Fusion(_Gpu):
    """flashinfer's trtllm fused allreduce: per token count one graph holding one call of each fused pattern (residual
    + RMSNorm, FP8 quant, and NVFP4 quant on compute capability 10 and up: the FP4 conversions need it), all on one
    workspace, with ``launch_with_pdl`` as the variant says and one-shot or two-shot as its mode says."""

    name = "flashinfer-fusion"
    takes_pdl = True
    EPS = 1e-6

    def __init__(self, s: engine.Setup) -> None:
        super().__init__(s)
        self.mode = s.mode or "auto"
        if self.mode not in ("auto", "crossing", "oneshot", "twoshot"):
            raise ValueError(f"fusion mode {self.mode!r}: auto, crossing, oneshot or twoshot")
        self.fusion: Any = None
        self.fuse: tuple[str, ...] = ()
        self.extra: list[dict[str, Any]] = []

    def switches(self, hidden: int) -> tuple[int, ...]:
        if self.mode == "crossing":
            return (engine.CROSSING_TOKENS,)
        if self.mode == "auto":
            one = engine.fusion_switch(self.s.world, hidden)
            return () if one is None else (one,)
        return ()

    def oneshot(self, size: int) -> bool | None:
        """What the call passes as ``use_oneshot``: None lets flashinfer choose; two-shot needs more tokens than
        ranks, so a smaller count runs one-shot in every mode."""
        if size <= self.s.world:
            return True if self.mode != "auto" else None
        return {"auto": None, "crossing": size <= engine.CROSSING_TOKENS, "oneshot": True, "twoshot": False}[self.mode]

    def prepare(self, max_tokens: int, hidden: int) -> int:
        import torch

        from inenv.kit import _flashinfer as fi

        major = torch.cuda.get_device_capability(self.s.device)[0]
        self.fuse = ("rmsnorm", "fp8", *(("nvfp4",) if major >= 10 else ()))
        self.fusion = fi.Fusion()
        self.fusion.create_workspace(self.s.rank, self.s.world, max_tokens, hidden, torch.bfloat16, self.s.group)
        self.gamma = (1 + torch.arange(hidden, device=self.s.device) % 3).to(torch.bfloat16)
        self.scale = torch.ones(1, dtype=torch.float32, device=self.s.device)
        rows = (max_tokens + 127) // 128 * 128
        for _ in range(self.s.lanes):
            outputs: dict[str, engine.Output] = {}
            extra: dict[str, Any] = {"output": self.empty(max_tokens, hidden)}
            for fuse in self.fuse:
                res = self.empty(max_tokens, hidden)
                outputs[f"residual ({fuse})"] = engine.Output(res, engine.SUM_RESIDUAL)
                extra[f"res:{fuse}"] = res
            extra["norm"] = self.empty(max_tokens, hidden)
            outputs["norm (rmsnorm)"] = engine.Output(extra["norm"], engine.BITS)
            extra["fp8"] = self.empty(max_tokens, hidden, torch.float8_e4m3fn)
            outputs["quant (fp8)"] = engine.Output(extra["fp8"], engine.BITS)
            if "nvfp4" in self.fuse:
                extra["nvfp4"] = self.empty(max_tokens, hidden // 2, torch.uint8)
                extra["sf"] = torch.empty(rows * (hidden // 16) * 2, dtype=torch.uint8, device=self.s.device)
                outputs["quant (nvfp4)"] = engine.Output(extra["nvfp4"], engine.BITS)
            self.extra.append(extra)
            self.lanes.append(engine.Buffers(self.empty(max_tokens, hidden), outputs, self.empty(max_tokens, hidden)))
        return max_tokens

    def capture(self, size: int, pdl: bool, lane: int) -> Callable[[], None]:
        b, x = self.lanes[lane], self.extra[lane]
        inp, residual = b.inp[:size], b.residual[:size]
        oneshot = self.oneshot(size)
        calls = []
        for fuse in self.fuse:
            kw: dict[str, Any] = {"residual_out": x[f"res:{fuse}"][:size]}
            if fuse == "rmsnorm":
                kw["norm_out"] = x["norm"][:size]
            elif fuse == "fp8":
                kw.update(quant_out=x["fp8"][:size], scale_factor=self.scale)
            else:
                kw.update(quant_out=x["nvfp4"][:size], scale_out=x["sf"], scale_factor=self.scale)
            calls.append((fuse, kw))

        def step() -> None:
            for fuse, kw in calls:
                self.fusion.fused(inp, pattern=fuse, rank=self.s.rank, world=self.s.world, residual_in=residual,
                                  gamma=self.gamma, eps=self.EPS, output=x["output"][:size], use_oneshot=oneshot,
                                  launch_with_pdl=pdl, **kw)

        return self.graph(step)

    def facts(self) -> dict[str, Any]:
        if self.fusion is None:
            return {}
        return {"fusion_api": self.fusion.api, "fused_patterns": list(self.fuse), "mode": self.mode,
                "workspace_bytes": self.fusion.workspace_bytes()}


class OutOfPlace(_Gpu):
    """An engine's own custom allreduce object whose call returns its output (SGLang's ``CustomAllReduceV2``,
    vLLM's ``CustomAllreduce``), made on the communicator's gloo group as the engines make it; the graph copies
    the returned output into the lane's buffer. A communicator that disables itself here (no full NVLink, ranks
    sharing a GPU) is ``skip``."""

    MAX_BYTES = 8 * 1024 * 1024

    def __init__(self, s: engine.Setup, name: str, module: str, cls: str) -> None:
        super().__init__(s)
        self.name = name
        self.cls = cls
        try:
            found = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError) as exc:
            raise engine.Unavailable("missing-package", f"{module}.{cls}: {exc}"[:300]) from None
        kwargs = {"max_size": self.MAX_BYTES} if name == "vllm-custom-ar" else {}
        self.ar: Any = found(s.cpu, s.device, **kwargs)
        if getattr(self.ar, "disabled", False):
            raise engine.Unavailable("not-applicable", f"{cls} disabled itself for these ranks (it needs full NVLink "
                                     "or peer access between distinct GPUs)")

    def switches(self, hidden: int) -> tuple[int, ...]:
        one = engine.custom_ar_switch(self.s.world, hidden)
        return () if one is None else (one,)

    def prepare(self, max_tokens: int, hidden: int) -> int:
        limit = min(max_tokens, (self.MAX_BYTES - 1) // (2 * hidden))
        for _ in range(self.s.lanes):
            out = self.empty(limit, hidden)
            self.lanes.append(engine.Buffers(self.empty(limit, hidden), {"sum": engine.Output(out, engine.SUM)}))
        return limit

    def capture(self, size: int, pdl: bool, lane: int) -> Callable[[], None]:
        b = self.lanes[lane]
        inp, out = b.inp[:size], b.outputs["sum"].tensor[:size]

        def step() -> None:
            got = self.ar.custom_all_reduce(inp)
            if got is None:
                raise engine.SizeRefused(f"{self.cls} does not take {size} tokens")
            out.copy_(got)

        if self.name == "vllm-custom-ar":  # its warm-up inside capture() launches nothing, as vLLM's own
            with self.ar.capture():
                return self.graph(step)
        step()  # an eager call first, outside capture mode
        _device.wait_device(engine.CAPTURE_WAIT_S)
        with self.ar.capture():
            return self.graph(step, warmup=0)


def _factory(name: str) -> engine.Factory:
    if name in ("nccl", "symm-mem-one-shot", "flashinfer-pcie-ipc"):
        return lambda s: StepComm(s, name)
    if name in ("flashinfer-custom-ar", "sgl-custom-ar"):
        return lambda s: CustomAR(s, name)
    if name == "symm-mem-two-shot":
        return SymmTwoShot
    if name == "flashinfer-fusion":
        return Fusion
    if name == "sglang-custom-ar-v2":
        return lambda s: OutOfPlace(s, name, "sglang.srt.distributed.device_communicators.custom_all_reduce_v2",
                                    "CustomAllReduceV2")
    return lambda s: OutOfPlace(s, name, "vllm.distributed.device_communicators.custom_all_reduce", "CustomAllreduce")


for _name in BACKENDS:
    engine.register(_name, _factory(_name))


# --- declared fields: what this probe records, and the roles checks report and checks advise read them by
# (inenv.probe.Field: name, unit, meaning, role). Left out of the probe hash: it changes no verdict.
METRICS = (
    ("replays", "count", "replays done, every lane's, in the order they were issued", None),
    ("crossings", "count", "replays whose token count was on the other side of the backend's one-shot/two-shot "
     "switch from the replay before on the same lane", None),
    ("checked", "count", "replays whose outputs were checked (sampled)", None),
    ("load_s", "s", "seconds of replaying, the captures left out", None),
    ("latency_p50_us", "µs by tokens", "median time of one replay of the token count's graph, the slowest rank per "
     "replay (pattern=replay with a GPU per rank)", None),
    ("latency_p99_us", "µs by tokens", "99th percentile of the same replays", None),
    ("headline", "text", "replays, sizes and switch crossings, or checked-not-timed", "headline"),
)
ALLREDUCE_PATH = True
# (param, value, distributions): a variant with that param value skips at once (missing-package) in a cell without
# those distributions; the host costs such a variant as a skip where the cell's build record lists what it holds
DISTRIBUTIONS = (("backend", "sglang-custom-ar-v2", ("sglang",)), ("backend", "vllm-custom-ar", ("vllm",)),
                 ("backend", "sgl-custom-ar", ("sgl-kernel",)))
