"""custom-ar: the vLLM-style one-/two-stage custom allreduce (flashinfer's copy; sgl-kernel's when importable).

``full_nvlink=topology`` passes what the hardware says (every pair of ranks joined by NVLink, read from NVML);
``full_nvlink=forced`` passes True, as SGLang's own test does. The kernel launches nothing at all for 4, 6 or 8
ranks when ``full_nvlink`` is False, without an error: outputs start as a sentinel, so that silent no-op is
caught and named ``custom-ar-silent-noop``. Eager (staged through the registered IPC buffer) and graph mode
(buffers recorded during capture, registered afterwards, then inputs refilled so only a real replay can give
the result) are checked exactly. Latency is measured against NCCL at decode sizes, both captured in a graph;
the timed custom-AR graph runs on integer inputs into a sentinel-filled output, and its output is checked
exactly after the timed replays, so a latency is never reported for a kernel that gave the wrong sum.

Every size, graph shape, agreement case and the latency run at the deep world sizes (``inenv.probe.deep_sizes``).
Elsewhere a variant runs the shallow selection (:func:`checked`): the init, one exact eager size, one exact graph
shape and one exact agreement case per dtype, untimed; with a GPU per rank (``depth=setup``, NCCL beside the
kernel) at the other world sizes up to the host's GPU count, with ranks sharing GPUs (``placement=shared``, gloo)
beyond it.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable
from typing import Any

from inenv.kit import _agree, _data, _device, _dist, _errors, _timing
from inenv.kit import _flashinfer as fi
from inenv.kit._lockstep import Lockstep, Stopped
from inenv.probe import (
    SETUP,
    HostView,
    ProbeSpec,
    RankContext,
    Variant,
    at_level,
    multi_rank,
    outcome,
    shallow,
)

SPEC = ProbeSpec(
    id="custom-ar",
    title="Custom allreduce (vLLM-style, flashinfer / sgl-kernel)",
    feature="Does the vLLM-style custom allreduce give exact results eagerly and in CUDA graphs with the "
    "topology's full_nvlink and with it forced, does it silently do nothing, and how fast is it against NCCL?",
    ranks=(2, 4, 8),
    min_ranks=2,  # over one rank an allreduce returns its input
    # Ranks get a GPU each, except the placement=shared variants (planned below, correctness only): IPC buffers work
    # between processes on one device too, so more ranks than GPUs still test the kernel's result.
    distinct_gpus=False,
    requires=("torch",),  # plus flashinfer or sgl_kernel, per variant: checked in run()
    timeout_s=600.0,
    preload=_dist.PRELOAD_DIST,
)

IMPLS = ("flashinfer", "sgl_kernel")
MODES = ("topology", "forced")
TOKENS = (1, 8, 32, 128)  # x 7168 bf16: 14 KiB .. 1.75 MiB
LATENCY_TOKENS = (1, 16, 128)
GRAPH_SHAPES = ((8, 7168), (128, 7168))
K_CALLS = 20
REPLAYS = 30


def variants(host: HostView) -> list[Variant]:
    # Beyond the host's GPU count only flashinfer's, forced: with full_nvlink False the kernel launches nothing
    # over 2 ranks (the topology variants show that), and shared GPUs have no NVLink between a GPU and itself.
    # Below it, every implementation and mode: deep world sizes in full, the others depth=setup.
    return multi_rank(SPEC, host, ((("impl", impl), ("full_nvlink", mode)) for impl in IMPLS for mode in MODES),
                      lambda p: p == (("impl", "flashinfer"), ("full_nvlink", "forced")),
                      why="this implementation and topology mode is checked with a GPU per rank only",
                      other_sizes=SETUP)


def nvlink_matrix(devices: list[int]) -> tuple[bool | None, str]:
    """Whether every pair of ``devices`` has an NVLink P2P path, from NVML; None when NVML cannot say."""
    try:
        import pynvml
    except ImportError:
        return None, "pynvml not importable"
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(d) for d in devices]
        for i, a in enumerate(handles):
            for b in handles[i + 1 :]:
                status = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                if status != pynvml.NVML_P2P_STATUS_OK:
                    return False, "NVML: a pair without NVLink P2P"
        return True, "NVML: NVLink P2P between every pair"
    except Exception as exc:
        return None, f"NVML query failed: {exc}"[:200]
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


class _SglAR:
    """sgl-kernel's custom AR on the same IPC buffers (the shared-buffer helper is flashinfer's)."""

    MAX_BYTES = fi.VllmCustomAR.MAX_BYTES

    def __init__(self, rank: int, group: Any, device: Any, full_nvlink: bool) -> None:
        import flashinfer.comm as comm
        import sgl_kernel.allreduce as sgl
        import torch

        self.ops, self.rank = sgl, rank
        self.meta_ptrs = comm.create_shared_buffer(sgl.meta_size() + self.MAX_BYTES, group=group)
        self.buffer_ptrs = comm.create_shared_buffer(self.MAX_BYTES, group=group)
        self.rank_data = torch.empty(8 * 1024 * 1024, dtype=torch.uint8, device=device)
        self.group = group
        self.fa = sgl.init_custom_ar(self.meta_ptrs, self.rank_data, rank, full_nvlink)
        sgl.register_buffer(self.fa, self.buffer_ptrs)

    def all_reduce_staged(self, inp: Any, out: Any) -> None:
        self.ops.all_reduce(self.fa, inp, out, self.buffer_ptrs[self.rank], self.MAX_BYTES)

    def all_reduce_graph(self, inp: Any, out: Any) -> None:
        self.ops.all_reduce(self.fa, inp, out, 0, 0)

    def register_graph_buffers(self) -> int:
        handles, offsets = self.ops.get_graph_buffer_ipc_meta(self.fa)
        all_h = _dist.gather_objects(handles, self.group)
        all_o = _dist.gather_objects(offsets, self.group)
        self.ops.register_graph_buffers(self.fa, all_h, all_o)
        return len(offsets)


def _make(impl: str, rank: int, group: Any, device: Any, full_nvlink: bool) -> Any:
    if impl == "flashinfer":
        return fi.VllmCustomAR(rank, group, device, full_nvlink)
    return _SglAR(rank, group, device, full_nvlink)


def _eager(ar: Any, rank: int, world: int, device: Any, checks: dict[str, Any], sizes: tuple[int, ...]) -> None:
    """One staged allreduce per token count of ``sizes`` into a sentinel-filled output, each checked exactly
    (into ``checks``)."""
    import torch

    for i, tokens in enumerate(sizes):
        shape = (tokens, _data.HIDDEN)
        x = _data.pattern(shape, rank, i, device)
        out = torch.full(shape, _data.SENTINEL, dtype=torch.bfloat16, device=device)
        ar.all_reduce_staged(x, out)
        _device.wait_device(60)
        ref = _data.pattern_sum(shape, world, i, device)
        checks[str(tokens * _data.HIDDEN * 2)] = _data.check_exact(
            out, ref, prior=_data.filled(shape), own_input=x
        ).to_json()


def eager_outcome(
    eager: dict[str, Any], world: int, full_nvlink: bool, evidence: dict[str, Any]
) -> dict[str, Any] | None:
    """The early `fail` for eager results that are not all exact (pure); None when they are."""
    verdicts = {c["verdict"] for c in eager.values()}
    if verdicts & {"no-op", "zero"}:
        note = (
            f"kernel launched nothing at {world} ranks with full_nvlink={full_nvlink}: outputs kept "
            "their prior contents, no error raised"
        )
        return outcome("fail", note=note, reason_code="custom-ar-silent-noop", evidence=evidence)
    if verdicts != {"exact"}:
        return outcome(
            "fail", note="eager results differ from the exact sum", reason_code="custom-ar-wrong", evidence=evidence
        )
    return None


def _graph_capture(ar: Any, rank: int, device: Any, shapes: tuple[tuple[int, int], ...]) -> tuple[Any, list[Any],
                                                                                                 list[Any]]:
    """Capture one allreduce per shape, each on its own buffers (recorded for registration after the capture)."""
    import torch

    inps = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in shapes]
    outs = [torch.empty_like(x) for x in inps]
    for i, x in enumerate(inps):
        x.copy_(_data.pattern(shapes[i], rank, 200 + i, device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, o in zip(inps, outs, strict=True):
            ar.all_reduce_graph(x, o)
    return graph, inps, outs


def agreement_bind(ar: Any, rank: int, world: int, device: Any) -> Callable[[_agree.Case], _agree.Bound]:
    """The rank agreement check (``_agree``) of the custom allreduce as engines run it: eager calls staged
    through its IPC buffer, captured calls on their own input registered after the capture; bf16 and fp16."""
    import torch

    bufs: dict[str, tuple[Any, Any]] = {}

    def bind(case: _agree.Case) -> _agree.Bound:
        if case.dtype not in bufs:
            dtype = _agree.torch_dtype(case.dtype)
            bufs[case.dtype] = tuple(torch.empty(_agree.max_numel(), dtype=dtype, device=device) for _ in range(2))
        inp, out = (b[: case.numel] for b in bufs[case.dtype])

        def step() -> None:
            if inp.is_cuda and torch.cuda.is_current_stream_capturing():
                ar.all_reduce_graph(inp, out)
            else:
                ar.all_reduce_staged(inp, out)

        return _agree.allreduce_bound(case, inp, out, step, rank, world, ar.register_graph_buffers)

    return bind


def _graph_replay(ar: Any, captured: tuple[Any, list[Any], list[Any]], rank: int, world: int, device: Any) -> dict:
    """Register the captured buffers on every rank, refill, replay, check both exactly."""
    graph, inps, outs = captured
    registered = ar.register_graph_buffers()
    for i, (x, o) in enumerate(zip(inps, outs, strict=True)):
        x.copy_(_data.pattern(tuple(x.shape), rank, 300 + i, device))
        o.fill_(_data.SENTINEL)
    _device.wait_device(30)
    graph.replay()
    _device.wait_device(60)
    checks = {}
    for i, (x, o) in enumerate(zip(inps, outs, strict=True)):
        shape = tuple(x.shape)
        ref = _data.pattern_sum(shape, world, 300 + i, device)
        checks[str(shape[0])] = _data.check_exact(o, ref, prior=_data.filled(shape), own_input=x).to_json()
    return {"registered_buffers": registered, "checks": checks}


def checked(setup_only: bool) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...], tuple[_agree.Case, ...]]:
    """(eager token counts, graph shapes, agreement cases) a variant checks at this level: the shallow selection
    (``setup_only``: ranks sharing a GPU or ``depth=setup``) one of each and ``_agree.shallow_cases`` (the init is
    where a world size is refused; every shape is checked at the deep world sizes)."""
    if setup_only:
        return TOKENS[:1], GRAPH_SHAPES[:1], _agree.shallow_cases(_agree.DTYPES)
    return at_level(TOKENS), GRAPH_SHAPES, _agree.cases(_agree.DTYPES)


def agreement_outcome(result: dict[str, Any], agreed: dict[str, dict[str, Any]], impl: str) -> dict[str, Any]:
    """``result`` with the agreement summary applied (``_agree.apply``), or ``fail`` when an agreement case's
    integer-valued call was not the exact sum: ``custom-ar-silent-noop`` for outputs left as they were,
    ``custom-ar-wrong`` otherwise (pure). A worse verdict stays."""
    found = _agree.inexact(agreed)
    if found is not None and result.get("status") in ("pass", "partial"):
        key, chk = found
        if chk.get("verdict") in ("no-op", "zero", "wrong"):
            code = "custom-ar-wrong" if chk["verdict"] == "wrong" else "custom-ar-silent-noop"
            note = f"agreement case {key}: integer inputs gave {chk['verdict']} ({chk.get('detail', '')})"
            result = outcome("fail", note[:400], code, result.get("metrics"), result.get("evidence"))
    return _agree.apply(result, _agree.summarize(agreed), f"custom allreduce ({impl})")


LATENCY_METRICS = ("latency_us", "latency_p99_us", "nccl_latency_us", "nccl_latency_p99_us")


def _latency(ar: Any, rank: int, world: int, device: Any, group: Any) -> dict[str, Any]:
    """``{"sizes": {bytes: {"check": ..., <LATENCY_METRICS>...}}}``, or ``{"error": text}``; never raises.
    Custom AR and NCCL alike are timed on a side stream (see ``_timing.side_stream``)."""
    try:
        with _timing.side_stream(device):
            return {"sizes": _timed_latency(ar, rank, world, device, group)}
    except Exception as exc:
        return {"error": _errors.error_tail(exc)}


def _timed_latency(ar: Any, rank: int, world: int, device: Any, group: Any) -> dict[str, dict[str, Any]]:
    """Median/p99 per call of K graph-captured calls, slowest rank per replay, for custom AR and NCCL.

    The custom-AR graph is out of place on integer inputs: every call writes the same exact sum, so its
    output, reset to the sentinel before the timed replays, is checked exactly after them."""
    import torch
    import torch.distributed as dist

    barrier = _timing.stream_barrier(device, group)
    sizes: dict[str, dict[str, Any]] = {}
    for i, tokens in enumerate(at_level(LATENCY_TOKENS)):
        shape = (tokens, _data.HIDDEN)
        seed = 400 + i
        x = torch.empty(shape, dtype=torch.bfloat16, device=device)
        x.copy_(_data.pattern(shape, rank, seed, device))
        y = torch.empty_like(x)
        g = torch.cuda.CUDAGraph()
        failed = None
        try:
            with torch.cuda.graph(g):
                for _ in range(K_CALLS):
                    ar.all_reduce_graph(x, y)
        except Exception as exc:
            failed = _errors.error_tail(exc)
        if not _dist.agree(failed is None, group):
            raise RuntimeError(f"capture for timing failed on a rank: {failed or 'a peer'}")
        ar.register_graph_buffers()
        for _ in range(3):
            g.replay()
        y.fill_(_data.SENTINEL)  # from here only the timed replays can write the sum
        t = _timing.timed_across_ranks(g.replay, REPLAYS, K_CALLS, barrier, group)
        _device.wait_device(60)
        check = _data.check_exact(
            y, _data.pattern_sum(shape, world, seed, device), prior=_data.filled(shape), own_input=x
        )
        entry: dict[str, Any] = {
            "check": check.to_json(),
            "latency_us": round(t.median_us, 2),
            "latency_p99_us": round(t.p99_us, 2),
        }
        z = torch.zeros_like(x)  # in-place sums of zeros stay finite over K calls
        gn = _device.capture(lambda z=z: dist.all_reduce(z, group=group), calls=K_CALLS, warmup=2)
        for _ in range(3):
            gn.replay()
        t = _timing.timed_across_ranks(gn.replay, REPLAYS, K_CALLS, barrier, group)
        entry["nccl_latency_us"], entry["nccl_latency_p99_us"] = round(t.median_us, 2), round(t.p99_us, 2)
        sizes[str(tokens * _data.HIDDEN * 2)] = entry
    return sizes


def latency_outcome(timed: dict[str, Any], evidence: dict[str, Any]) -> dict[str, Any]:
    """The verdict once eager and graph results were exact (pure).

    ``pass`` with the latencies; ``partial`` when timing raised (the feature works, its speed is unknown) or
    when the timed graph's output was not the exact sum at some size (no latency is reported for that size:
    it would be the speed of a kernel that did not compute the sum)."""
    if "error" in timed:
        note = f"eager and graph exact; timing failed: {_errors.last_line(timed['error'])}"
        evidence = {**evidence, "timing_error": timed["error"]}
        return outcome("partial", note, "custom-ar-timing-failed", evidence=evidence)
    sizes: dict[str, dict[str, Any]] = timed["sizes"]
    checks = {size: e["check"] for size, e in sizes.items()}
    exact = [size for size, c in checks.items() if c["verdict"] == "exact"]
    metrics = {name: {size: sizes[size][name] for size in exact} for name in LATENCY_METRICS}
    evidence = {**evidence, "timed_output": checks}
    bad = [(size, c) for size, c in checks.items() if c["verdict"] != "exact"]
    if bad or not sizes:
        size, c = bad[0] if bad else ("-", {"verdict": "nothing", "detail": "no size was timed"})
        note = (
            f"eager and graph exact; the timed graph ({K_CALLS} calls per replay) gave {c['verdict']} output at "
            f"{size} bytes ({c['detail']}); no latency reported for it"
        )
        return outcome("partial", note, "custom-ar-graph-wrong", metrics, evidence)
    return outcome("pass", metrics=metrics, evidence=evidence)


def missing_package(variant: Variant) -> dict[str, Any] | None:
    """`skip` when a package the variant needs is not installed (found without importing anything)."""
    needed = "flashinfer" if (variant.param("impl") or "flashinfer") == "flashinfer" else "sgl_kernel"
    for mod in dict.fromkeys((needed, "flashinfer")):  # the IPC buffer helper is flashinfer's in both cases
        if importlib.util.find_spec(mod) is None:
            return outcome("skip", note=f"{mod} is not installed in this environment", reason_code="missing-package")
    return None


def preflight(variant: Variant) -> dict[str, Any] | None:
    """Decided before any rank starts, so such a variant takes no turn on the GPUs: its package is missing."""
    return missing_package(variant)


def run(ctx: RankContext) -> dict[str, Any]:
    impl = ctx.param("impl") or "flashinfer"
    mode = ctx.param("full_nvlink") or "topology"
    if (missing := missing_package(ctx.variant)) is not None:
        return missing
    fi.prepare_env()
    shared = ctx.variant.share_gpu  # ranks on shared GPUs: a gloo process group, nothing timed
    setup_only = shallow(ctx.variant)  # the shallow selection (checked), untimed
    device = _dist.init_dist(ctx, backend="gloo" if shared else "nccl")  # NCCL refuses two ranks on one GPU
    import torch.distributed as dist

    group = dist.group.WORLD
    devices = _dist.gather_objects(ctx.device_index, group)
    topo, how = nvlink_matrix([d for d in devices if d is not None])
    full_nvlink = True if mode == "forced" else bool(topo)
    eager: dict[str, Any] = {}
    sizes, graph_shapes, agreement_cases = checked(setup_only)
    evidence: dict[str, Any] = {
        **({"checked": _agree.shallow_checked(shared)} if setup_only else {}),
        "impl": impl,
        "full_nvlink_passed": full_nvlink,
        "topology_full_nvlink": topo,
        "topology_source": how,
        "devices": devices,
        "flashinfer": fi.version(),
        "eager": eager,
    }
    lock = Lockstep(ctx.rank, group, evidence)
    try:
        with lock.step("init", "custom-ar-init-failed"):
            ar = _make(impl, ctx.rank, group, device, full_nvlink)
        with lock.step("eager call", "custom-ar-error") as step:
            _eager(ar, ctx.rank, ctx.world_size, device, eager, sizes)
            step.early = eager_outcome(eager, ctx.world_size, full_nvlink, evidence)
        # Graph failures are `partial`: the eager path, which works, is what a server without graphs runs.
        graph_failed, eager_ok = "custom-ar-graph-failed", "eager exact; "
        with lock.step("graph capture", graph_failed, status="partial", prefix=eager_ok):
            captured = _graph_capture(ar, ctx.rank, device, graph_shapes)
        with lock.step("graph registration/replay", graph_failed, status="partial", prefix=eager_ok) as step:
            evidence["graph"] = _graph_replay(ar, captured, ctx.rank, ctx.world_size, device)
            if {c["verdict"] for c in evidence["graph"]["checks"].values()} != {"exact"}:
                note = f"eager exact; graph replay not exact on rank {ctx.rank}"
                step.early = outcome("partial", note, "custom-ar-graph-wrong", evidence=evidence)
        agreed = evidence["agreement"] = _agree.run_cases(agreement_bind(ar, ctx.rank, ctx.world_size, device),
                                                          agreement_cases, group, ctx.log, exact=setup_only)
        if setup_only:  # a latency of ranks time-slicing a GPU means nothing; at depth=setup it is not asked
            n, gpus = ctx.world_size, len(set(devices))
            placed = f"{n} ranks sharing {gpus} GPUs" if shared else f"{n} ranks, a GPU each, set-up check"
            headline = f"exact eagerly and in a graph ({placed}: correctness only)"
            return agreement_outcome(lock.finish(outcome("pass", metrics={"headline": headline}, evidence=evidence)),
                                     agreed, impl)
        result = lock.finish(latency_outcome(_latency(ar, ctx.rank, ctx.world_size, device, group), evidence))
        return agreement_outcome(result, agreed, impl)
    except Stopped as stop:
        return stop.outcome


# --- declared fields: what this probe records, and the roles checks report and checks advise read them by
# (inenv.probe.Field: name, unit, meaning, role). Left out of the probe hash: it changes no verdict.
METRICS = (
    ("headline", "text", "what the table shows for a pass: exactness and the range of times against NCCL", "headline"),
    ("latency_us", "µs by message bytes", "median time of one custom allreduce call, exact sizes only", "latency"),
    ("latency_p99_us", "µs by message bytes", "99th percentile of the same calls", None),
    ("nccl_latency_us", "µs by message bytes", "NCCL allreduce timed the same way in the same processes",
     "nccl-latency"),
    ("nccl_latency_p99_us", "µs by message bytes", "99th percentile of the NCCL calls", None),
    ("agreement", "record", "rank agreement on random bf16/fp16 data (inenv/kit/_agree.py): ranks identical, "
     "differing elements, max ulp between ranks, deterministic, max ulp vs the float64 sum, divergent cases",
     "agreement"),
)
EVIDENCE = (
    ("eager", "record", "per message bytes, the eager call's result against the exact sum", "eager-checks"),
    ("graph", "record", "graph capture and replay, with per-size checks against the exact sum", "graph-checks"),
    ("topology_full_nvlink", "bool", "NVLink between every pair of the ranks' GPUs, as NVML reports", "full-nvlink"),
)
ALLREDUCE_PATH = True
# (param, value, distributions): a variant with that param value skips at once (missing-package) in a cell without
# those distributions; the host costs such a variant as a skip where the cell's build record lists what it holds
DISTRIBUTIONS = (("impl", "sgl_kernel", ("sgl-kernel",)),)
