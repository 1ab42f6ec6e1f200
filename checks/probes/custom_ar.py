"""custom-ar: the vLLM-style one-/two-stage custom allreduce (flashinfer's copy; sgl-kernel's when importable).

``full_nvlink=topology`` passes what the hardware says (every pair of ranks joined by NVLink, read from NVML);
``full_nvlink=forced`` passes True, as SGLang's own test does. The kernel launches nothing at all for 4, 6 or 8
ranks when ``full_nvlink`` is False, without an error: outputs start as a sentinel, so that silent no-op is
caught and named ``custom-ar-silent-noop``. Eager (staged through the registered IPC buffer) and graph mode
(buffers recorded during capture, registered afterwards, then inputs refilled so only a real replay can give
the result) are checked exactly. Latency is measured against NCCL at decode sizes, both captured in a graph.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

from checks.probe import HostView, ProbeSpec, RankContext, Variant, gpu_shortfall, outcome
from checks.probes import _dist
from checks.probes import _flashinfer as fi

SPEC = ProbeSpec(
    id="custom-ar",
    title="Custom allreduce (vLLM-style, flashinfer / sgl-kernel)",
    feature="Does the vLLM-style custom allreduce give exact results eagerly and in CUDA graphs with the "
    "topology's full_nvlink and with it forced, does it silently do nothing, and how fast is it against NCCL?",
    ranks=(2, 4, 8),
    requires=("torch",),  # plus flashinfer or sgl_kernel, per variant: checked in run()
    timeout_s=600.0,
)

IMPLS = ("flashinfer", "sgl_kernel")
MODES = ("topology", "forced")
TOKENS = (1, 8, 32, 128)  # x 7168 bf16: 14 KiB .. 1.75 MiB
LATENCY_TOKENS = (1, 16, 128)
GRAPH_SHAPES = ((8, 7168), (128, 7168))
K_CALLS = 20
REPLAYS = 30


def variants(host: HostView) -> list[Variant]:
    out: list[Variant] = []
    for n in SPEC.ranks:
        for impl in IMPLS:
            for mode in MODES:
                params = (("impl", impl), ("full_nvlink", mode))
                out.append(Variant(SPEC.id, n, params=params, skip=gpu_shortfall(host, n)))
    return out


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


def _graph_capture(ar: Any, rank: int, device: Any) -> tuple[Any, list[Any], list[Any]]:
    """Capture two allreduces on two buffers (recorded for registration after the capture)."""
    import torch

    inps = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in GRAPH_SHAPES]
    outs = [torch.empty_like(x) for x in inps]
    for i, x in enumerate(inps):
        x.copy_(_dist.pattern(GRAPH_SHAPES[i], rank, 200 + i, device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, o in zip(inps, outs, strict=True):
            ar.all_reduce_graph(x, o)
    return graph, inps, outs


def _graph_replay(ar: Any, captured: tuple[Any, list[Any], list[Any]], rank: int, world: int, device: Any) -> dict:
    """Register the captured buffers on every rank, refill, replay, check both exactly."""
    graph, inps, outs = captured
    registered = ar.register_graph_buffers()
    for i, (x, o) in enumerate(zip(inps, outs, strict=True)):
        x.copy_(_dist.pattern(GRAPH_SHAPES[i], rank, 300 + i, device))
        o.fill_(_dist.SENTINEL)
    _dist.wait_device(30)
    graph.replay()
    _dist.wait_device(60)
    checks = {}
    for i, (x, o) in enumerate(zip(inps, outs, strict=True)):
        ref = _dist.pattern_sum(GRAPH_SHAPES[i], world, 300 + i, device)
        prior = _dist.filled(GRAPH_SHAPES[i])
        checks[str(GRAPH_SHAPES[i][0])] = _dist.check_exact(o, ref, prior=prior, own_input=x).to_json()
    return {"registered_buffers": registered, "checks": checks}


def _latency(ar: Any, device: Any, group: Any) -> dict[str, dict[str, float]]:
    """Median/p99 per call of K graph-captured calls, slowest rank per replay; custom AR and NCCL alike,
    both on a side stream (see ``_dist.side_stream``)."""
    with _dist.side_stream(device):
        return _timed_latency(ar, device, group)


def _timed_latency(ar: Any, device: Any, group: Any) -> dict[str, dict[str, float]]:
    import torch
    import torch.distributed as dist

    barrier = _dist.stream_barrier(device, group)
    custom: dict[str, float] = {}
    nccl: dict[str, float] = {}
    custom_p99: dict[str, float] = {}
    nccl_p99: dict[str, float] = {}
    for tokens in LATENCY_TOKENS:
        size = str(tokens * _dist.HIDDEN * 2)
        x = torch.ones((tokens, _dist.HIDDEN), dtype=torch.bfloat16, device=device)
        y = torch.empty_like(x)
        g = torch.cuda.CUDAGraph()
        failed = None
        try:
            with torch.cuda.graph(g):
                for _ in range(K_CALLS):
                    ar.all_reduce_graph(x, y)
        except Exception as exc:
            failed = _dist.error_tail(exc)
        if not _dist.agree(failed is None, group):
            raise RuntimeError(f"capture for timing failed on a rank: {failed or 'a peer'}")
        ar.register_graph_buffers()
        for _ in range(3):
            g.replay()
        t = _dist.timed_across_ranks(g.replay, REPLAYS, K_CALLS, barrier, group)
        custom[size], custom_p99[size] = round(t.median_us, 2), round(t.p99_us, 2)
        z = torch.zeros_like(x)  # in-place sums of zeros stay finite over K calls
        gn = _dist.capture(lambda z=z: dist.all_reduce(z, group=group), calls=K_CALLS, warmup=2)
        for _ in range(3):
            gn.replay()
        t = _dist.timed_across_ranks(gn.replay, REPLAYS, K_CALLS, barrier, group)
        nccl[size], nccl_p99[size] = round(t.median_us, 2), round(t.p99_us, 2)
    return {
        "latency_us": custom,
        "latency_p99_us": custom_p99,
        "nccl_latency_us": nccl,
        "nccl_latency_p99_us": nccl_p99,
    }


def run(ctx: RankContext) -> dict[str, Any]:
    impl = ctx.param("impl") or "flashinfer"
    mode = ctx.param("full_nvlink") or "topology"
    needed = "flashinfer" if impl == "flashinfer" else "sgl_kernel"
    for mod in {needed, "flashinfer"}:  # the IPC buffer helper is flashinfer's in both cases
        if importlib.util.find_spec(mod) is None:
            return outcome("skip", note=f"{mod} is not installed in this environment", reason_code="missing-package")
    fi.prepare_env()
    device = _dist.init_dist(ctx)
    import torch.distributed as dist

    group = dist.group.WORLD
    devices = _dist.gather_objects(ctx.device_index, group)
    topo, how = nvlink_matrix([d for d in devices if d is not None])
    full_nvlink = True if mode == "forced" else bool(topo)
    evidence: dict[str, Any] = {
        "impl": impl,
        "full_nvlink_passed": full_nvlink,
        "topology_full_nvlink": topo,
        "topology_source": how,
        "devices": devices,
        "flashinfer": fi.version(),
    }
    early: dict[str, Any] | None = None
    try:
        ar = _make(impl, ctx.rank, group, device, full_nvlink)
    except Exception as exc:
        err = _dist.error_tail(exc)
        early = outcome(
            "fail",
            note=f"rank {ctx.rank}: init failed: {err.splitlines()[-1][:300]}",
            reason_code="custom-ar-init-failed",
            evidence={**evidence, "error": err},
        )
    stop = fi.stop_together(early, group)
    if stop:
        return stop
    eager: dict[str, Any] = {}
    import torch

    try:
        for i, tokens in enumerate(TOKENS):
            shape = (tokens, _dist.HIDDEN)
            x = _dist.pattern(shape, ctx.rank, i, device)
            out = torch.full(shape, _dist.SENTINEL, dtype=torch.bfloat16, device=device)
            ar.all_reduce_staged(x, out)
            _dist.wait_device(60)
            ref = _dist.pattern_sum(shape, ctx.world_size, i, device)
            eager[str(tokens * _dist.HIDDEN * 2)] = _dist.check_exact(
                out, ref, prior=_dist.filled(shape), own_input=x
            ).to_json()
    except Exception as exc:
        err = _dist.error_tail(exc)
        early = outcome(
            "fail",
            note=f"rank {ctx.rank}: eager call failed: {err.splitlines()[-1][:300]}",
            reason_code="custom-ar-error",
            evidence={**evidence, "eager": eager, "error": err},
        )
    evidence["eager"] = eager
    verdicts = {c["verdict"] for c in eager.values()}
    if early is None and verdicts & {"no-op", "zero"}:
        note = (
            f"kernel launched nothing at {ctx.world_size} ranks with full_nvlink={full_nvlink}: outputs kept "
            "their prior contents, no error raised"
        )
        early = outcome("fail", note=note, reason_code="custom-ar-silent-noop", evidence=evidence)
    elif early is None and verdicts != {"exact"}:
        early = outcome(
            "fail", note="eager results differ from the exact sum", reason_code="custom-ar-wrong", evidence=evidence
        )
    stop = fi.stop_together(early, group)
    if stop:
        return stop
    captured = None
    try:
        captured = _graph_capture(ar, ctx.rank, device)
    except Exception as exc:
        err = _dist.error_tail(exc)
        early = outcome(
            "partial",
            note=f"eager exact; rank {ctx.rank}: graph capture failed: {err.splitlines()[-1][:250]}",
            reason_code="custom-ar-graph-failed",
            evidence={**evidence, "error": err},
        )
    stop = fi.stop_together(early, group)
    if stop:
        return stop
    try:
        g = _graph_replay(ar, captured, ctx.rank, ctx.world_size, device)
    except Exception as exc:
        err = _dist.error_tail(exc)
        return outcome(
            "partial",
            note=f"eager exact; graph registration/replay failed: {err.splitlines()[-1][:250]}",
            reason_code="custom-ar-graph-failed",
            evidence={**evidence, "error": err},
        )
    evidence["graph"] = g
    graph_ok = {c["verdict"] for c in g["checks"].values()} == {"exact"}
    if not _dist.agree(graph_ok, group):
        return outcome(
            "partial",
            note="eager exact; graph replay not exact on at least one rank",
            reason_code="custom-ar-graph-wrong",
            evidence=evidence,
        )
    metrics: dict[str, Any] = {}
    try:
        metrics = _latency(ar, device, group)
    except Exception as exc:
        evidence["latency_error"] = _dist.error_tail(exc)
    return outcome("pass", metrics=metrics, evidence=evidence)
