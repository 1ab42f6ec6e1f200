"""Allreduce latency at decode sizes, against NCCL on the same host (docs/probes.md, ar-latency).

One variant per backend. Each size is measured the way serving runs it: K calls captured in one CUDA
graph after an eager warm-up, R replays timed with CUDA events after an on-stream barrier, the
slowest rank per replay, median and p99 over replays divided by K. The graph that is timed is first
replayed on integer-valued inputs and checked exactly (twice, with different inputs, so a stale or
no-op result is caught): a backend with wrong numbers is ``fail`` and is not timed. Non-NCCL
variants also time NCCL in the same processes, size by size, for ``ratio_vs_nccl``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from inenv.kit import _agree, _data, _device, _dist, _errors, _nccl, _timing
from inenv.probe import OMIT, HostView, ProbeSpec, RankContext, Variant, at_level, multi_rank, outcome

SPEC = ProbeSpec(
    id="ar-latency",
    title="Allreduce latency vs NCCL",
    feature="How fast is a captured decode-size allreduce (hidden 7168 bf16, 1..128 tokens and 4x for "
    "speculative verify) with each working backend, against NCCL on the same host?",
    ranks=(2, 4, 8),
    min_ranks=2,  # over one rank an allreduce returns its input: there is nothing to time
    distinct_gpus=True,  # latency of ranks time-slicing one GPU means nothing
    requires=("torch",),
    timeout_s=420.0,  # with the rank agreement check
    preload=_dist.PRELOAD_DIST,
)

BACKENDS = (
    "nccl",
    "nccl-direct",
    "symm-mem-one-shot",
    "symm-mem-two-shot",
    "flashinfer-custom-ar",
    "flashinfer-pcie-ipc",
)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # 14 KiB .. 1.75 MiB, then 3.5 and 7 MiB (4x verify)
CALLS_PER_GRAPH = 20
REPLAYS = 40
OP_DEADLINE_S = 30.0


def variants(host: HostView) -> list[Variant]:
    # Timings only, so at the deep world sizes only (inenv.probe.deep_sizes: a latency at a size engines seldom
    # serve answers nothing a set-up check does not; step checks every backend's set-up at the other sizes);
    # beyond the host's GPU count a planned skip (a latency of ranks time-slicing one GPU means nothing)
    why = "a latency of ranks time-slicing one GPU means nothing; step checks agreement on shared GPUs"
    return multi_rank(SPEC, host, ((("backend", backend),) for backend in BACKENDS), why=why, other_sizes=OMIT)


def _no_flashinfer(backend: str) -> dict[str, Any] | None:
    if backend.startswith("flashinfer-") and importlib.util.find_spec("flashinfer") is None:
        return outcome("skip", "flashinfer is not installed in this environment", "missing-package")
    return None


def preflight(variant: Variant) -> dict[str, Any] | None:
    """A flashinfer backend's verdict before any rank starts (so it takes no turn on the GPUs): flashinfer is
    not installed, or its files show it has no PCIe IPC all-reduce (``_fi_pcie.unknown_without_import``).
    Every other variant launches."""
    backend = variant.param("backend") or "nccl"
    if (missing := _no_flashinfer(backend)) is not None:
        return missing
    if backend != "flashinfer-pcie-ipc":
        return None
    from inenv.kit import _fi_pcie

    unknown = _fi_pcie.unknown_without_import("all-reduce")
    return unknown.outcome() if unknown else None


def sizes_bytes(hidden: int = _data.HIDDEN, tokens: tuple[int, ...] = TOKENS) -> list[int]:
    return [t * hidden * 2 for t in tokens]


def expected_after(calls: int, world: int, in_place: bool) -> int:
    """Factor on the plain sum after ``calls`` back-to-back calls: an in-place allreduce feeds its
    output to the next call (world**(calls-1) times the sum: exact in bf16 for power-of-two worlds)."""
    return world ** (calls - 1) if in_place else 1


# --------------------------------------------------------------------------------------------------
# Backends: each gives static buffers and one step; the step is what gets captured K times.


class Backend:
    name = ""
    in_place = False
    dtypes: tuple[str, ...] = ("bf16",)  # what the agreement check sends it (``_agree``)

    def prepare(self, max_numel: int) -> None: ...

    def buffers(self, numel: int) -> tuple[Any, Any]:
        """(input, output) views for ``numel`` elements; output is input for in-place backends."""
        raise NotImplementedError

    def step(self, inp: Any, out: Any) -> Callable[[], None]:
        raise NotImplementedError

    def after_capture(self) -> None:
        """Hook for backends that register the captured addresses with their peers."""

    def evidence(self) -> dict[str, Any]:
        return {}


class Nccl(Backend):
    name = "nccl"
    in_place = True
    dtypes = ("bf16", "fp16")

    def __init__(self, device: Any, group: Any) -> None:
        self.device, self.group, self.buf = device, group, None

    def prepare(self, max_numel: int) -> None:
        import torch

        self.buf = torch.empty(max_numel, device=self.device, dtype=torch.bfloat16)

    def buffers(self, numel: int) -> tuple[Any, Any]:
        view = self.buf[:numel]
        return view, view

    def step(self, inp: Any, out: Any) -> Callable[[], None]:
        import torch.distributed as dist

        return lambda: dist.all_reduce(inp, group=self.group)


class NcclDirect(Backend):
    """NCCL called through ctypes on torch's stream, as serving engines capture it (see _nccl)."""

    name = "nccl-direct"
    in_place = True

    def __init__(self, rank: int, world: int, device: Any, gloo: Any) -> None:
        self.rank, self.world, self.device, self.gloo = rank, world, device, gloo
        self.comm: Any = None
        self.buf: Any = None

    def prepare(self, max_numel: int) -> None:
        import torch

        from inenv.kit import _nccl

        self.comm = _nccl.DirectComm(self.rank, self.world, self.gloo)
        self.buf = torch.empty(max_numel, device=self.device, dtype=torch.bfloat16)

    def buffers(self, numel: int) -> tuple[Any, Any]:
        view = self.buf[:numel]
        return view, view

    def step(self, inp: Any, out: Any) -> Callable[[], None]:
        return lambda: self.comm.all_reduce_bf16(inp)

    def evidence(self) -> dict[str, Any]:
        return {"nccl_direct_library": self.comm.path, "nccl_direct_version": self.comm.version}


class SymmMem(Backend):
    def __init__(self, device: Any, group: Any, kind: str) -> None:
        self.device, self.group, self.kind = device, group, kind
        self.name = f"symm-mem-{kind}"
        self.in_place = kind == "two-shot"
        self.buf = self.out = None
        self.enabled_here = False
        op_name = "one_shot_all_reduce_out" if kind == "one-shot" else "two_shot_all_reduce_"
        self.op = _dist.symm_op(op_name)
        if self.op is None:
            raise LookupError(f"torch.ops.symm_mem.{op_name} is not in this torch")

    def prepare(self, max_numel: int) -> None:
        import torch
        import torch.distributed._symmetric_memory as symm_mem

        self.buf = symm_mem.empty(max_numel, dtype=torch.bfloat16, device=self.device)
        self.handle, self.enabled_here = _dist.symm_rendezvous(self.buf, self.group)
        self.out = torch.empty(max_numel, device=self.device, dtype=torch.bfloat16)

    def buffers(self, numel: int) -> tuple[Any, Any]:
        inp = self.buf[:numel]
        return (inp, inp) if self.in_place else (inp, self.out[:numel])

    def step(self, inp: Any, out: Any) -> Callable[[], None]:
        name = self.group.group_name
        if self.in_place:
            return lambda: self.op(inp, "sum", name)
        return lambda: self.op(inp, "sum", name, out)

    def evidence(self) -> dict[str, Any]:
        return {
            "multicast_ptr": int(getattr(self.handle, "multicast_ptr", 0) or 0),
            "enable_symm_mem_for_group_called": self.enabled_here,
        }


class FlashinferCustomAR(Backend):
    """flashinfer's vLLM-style custom allreduce through the _flashinfer adapter; graph-registered mode."""

    name = "flashinfer-custom-ar"
    in_place = False
    dtypes = ("bf16", "fp16")  # its kernels are instantiated for half, bfloat16 and float

    def __init__(self, rank: int, device: Any, group: Any) -> None:
        from inenv.kit import _flashinfer

        self.fi = _flashinfer
        self.rank, self.device, self.group = rank, device, group
        self.ar: Any = None
        self.full_nvlink = True  # for > 2 ranks the kernel launches nothing otherwise; 2 ranks ignore it

    def prepare(self, max_numel: int) -> None:
        import torch

        if max_numel * 2 > self.fi.VllmCustomAR.MAX_BYTES:
            raise ValueError(f"{max_numel * 2} bytes exceed the custom allreduce buffer")
        self.ar = self.fi.VllmCustomAR(self.rank, self.group, self.device, self.full_nvlink)
        self.inp = torch.empty(max_numel, device=self.device, dtype=torch.bfloat16)
        self.out = torch.empty(max_numel, device=self.device, dtype=torch.bfloat16)

    def buffers(self, numel: int) -> tuple[Any, Any]:
        return self.inp[:numel], self.out[:numel]

    def step(self, inp: Any, out: Any) -> Callable[[], None]:
        import torch

        def call() -> None:
            if torch.cuda.is_current_stream_capturing():
                self.ar.all_reduce_graph(inp, out)  # address recorded, registered after capture
            else:
                self.ar.all_reduce_staged(inp, out)

        return call

    def after_capture(self) -> None:
        self.ar.register_graph_buffers()

    def evidence(self) -> dict[str, Any]:
        return {"flashinfer": self.fi.version(), "full_nvlink": self.full_nvlink}


class FlashinferPcieIpc(Backend):
    """flashinfer's PCIe IPC all-reduce (flashinfer >= 0.7, ``_fi_pcie``) with the launch configuration it
    resolves itself: this machine's tuned one when its tuning cache holds the shape, else its seed."""

    name = "flashinfer-pcie-ipc"
    in_place = False

    def __init__(self, group: Any, device: Any) -> None:
        self.group, self.device = group, device
        self.coll: Any = None

    def prepare(self, max_numel: int) -> None:
        import torch

        from inenv.kit import _fi_pcie

        self.coll = _fi_pcie.Collective("all-reduce", self.group, max_numel)
        self.inp = torch.empty(max_numel, device=self.device, dtype=torch.bfloat16)
        self.out = torch.empty(max_numel, device=self.device, dtype=torch.bfloat16)
        self.configs: dict[int, Any] = {}

    def buffers(self, numel: int) -> tuple[Any, Any]:
        return self.inp[:numel], self.out[:numel]

    def step(self, inp: Any, out: Any) -> Callable[[], None]:
        # Resolved here, eagerly and on every rank (flashinfer agrees on it with a collective): a capture
        # then records the call with no collective inside it.
        config = self.coll.resolved(inp)
        if config is None:
            refusal = self.coll.refusal(inp, out)
            raise ValueError(refusal.message if refusal else f"flashinfer has no configuration for {inp.numel()}")
        self.configs[inp.numel()] = config
        return lambda: self.coll.run(inp, out, config)

    def evidence(self) -> dict[str, Any]:
        return {"pcie_ipc_workspace": self.coll.evidence()}

    def metrics(self) -> dict[str, Any]:
        from inenv.kit import _fi_pcie

        return {"configs": {str(n * 2): _fi_pcie.describe(c) for n, c in sorted(self.configs.items())}}


def make_backend(name: str, rank: int, world: int, device: Any, group: Any, gloo: Any) -> Backend:
    if name == "nccl":
        return Nccl(device, group)
    if name == "nccl-direct":
        return NcclDirect(rank, world, device, gloo)
    if name.startswith("symm-mem-"):
        return SymmMem(device, group, name[len("symm-mem-") :])
    if name == "flashinfer-custom-ar":
        return FlashinferCustomAR(rank, device, group)
    if name == "flashinfer-pcie-ipc":
        return FlashinferPcieIpc(group, device)
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")


# --------------------------------------------------------------------------------------------------
# Measurement


def measure(
    backend: Backend, numel: int, rank: int, world: int, device: Any, gloo: Any, barrier: Callable[[], None]
) -> dict[str, Any]:
    """Capture K calls, check the graph exactly on two inputs, then time it, all on a side stream
    (see ``_timing.side_stream``). Never raises."""
    with _timing.side_stream(device):
        return _measure(backend, numel, rank, world, device, gloo, barrier)


def _measure(
    backend: Backend, numel: int, rank: int, world: int, device: Any, gloo: Any, barrier: Callable[[], None]
) -> dict[str, Any]:
    inp, out = backend.buffers(numel)
    factor = expected_after(CALLS_PER_GRAPH, world, backend.in_place)

    def load(seed: int) -> None:
        inp.copy_(_data.pattern((numel,), rank, seed, device))
        if out is not inp:
            out.fill_(_data.SENTINEL)

    graph, error = None, ""
    try:
        load(1)
        graph = _device.capture(backend.step(inp, out), CALLS_PER_GRAPH, warmup=2)
        backend.after_capture()
    except Exception as exc:
        error = _errors.error_tail(exc)
    if (stopped := _dist.settle_ok(graph is not None, error, gloo, "a peer rank failed to capture")) is not None:
        return stopped
    assert graph is not None
    for seed in (2, 3):
        local: dict[str, Any] = {"verdict": "ok"}
        try:
            load(seed)
            graph.replay()
            _device.wait_device(OP_DEADLINE_S)
            # The reference is made on the GPU and compared there; the host-side comparison, which names a
            # mismatch, runs only for one (reference and comparison on the host cost 5.5 s per backend).
            expected = _data.pattern_sum((numel,), world, seed, device, dtype=_float64()) * factor
            if not _data.equal_exactly(out, expected):
                chk = _data.check_exact(out, expected, prior=_data.filled((numel,)),
                                        own_input=_own(numel, rank, seed))
                if not chk.ok:
                    local = {"verdict": chk.verdict, "detail": chk.detail}
        except Exception as exc:
            local = _dist.raised(exc)
        # Reached by every rank for every seed, so the ranks stay in step whatever failed where.
        if (stopped := _dist.settle(local, gloo)) is not None:
            return stopped
    try:
        inp.zero_()  # timing on zeros: repeated in-place sums stay finite
        timing = _timing.timed_across_ranks(graph.replay, REPLAYS, CALLS_PER_GRAPH, barrier, gloo)
    except Exception as exc:
        return {"verdict": "error", "error": _errors.error_tail(exc)}
    return {"verdict": "ok", "timing": timing.to_json()}


def agreement_bind(backend: Backend, rank: int, world: int) -> Callable[[_agree.Case], _agree.Bound]:
    """How the agreement check (``_agree``) drives a backend: its own buffers viewed in the case's dtype, one
    call per step. A dtype it does not take, or a size it refuses, raises: that case is recorded unsupported."""

    def bind(case: _agree.Case) -> _agree.Bound:
        if case.dtype not in backend.dtypes:
            raise TypeError(f"{backend.name} is checked in {', '.join(backend.dtypes)} only")
        dtype = _agree.torch_dtype(case.dtype)
        inp, out = backend.buffers(case.numel)
        inp = inp.view(dtype)
        out = inp if backend.in_place else out.view(dtype)
        return _agree.allreduce_bound(case, inp, out, backend.step(inp, out), rank, world, backend.after_capture)

    return bind


def _float64() -> Any:
    import torch

    return torch.float64


def _own(numel: int, rank: int, seed: int) -> Any:
    return _data.pattern((numel,), rank, seed)


def summarize(
    backend: str, results: dict[int, dict[str, Any]], nccl: dict[int, dict[str, Any]] | None
) -> dict[str, Any]:
    """Metrics and the verdict from per-size results (pure); ``nccl`` is the baseline from the same processes."""
    lat = {str(b): r["timing"]["median_us"] for b, r in results.items() if r.get("verdict") == "ok"}
    p99 = {str(b): r["timing"]["p99_us"] for b, r in results.items() if r.get("verdict") == "ok"}
    metrics: dict[str, Any] = {"latency_us": lat, "p99_us": p99}
    if nccl is not None:
        base = {str(b): r["timing"]["median_us"] for b, r in nccl.items() if r.get("verdict") == "ok"}
        metrics["nccl_latency_us"] = base
        metrics["ratio_vs_nccl"] = {k: round(v / base[k], 4) for k, v in lat.items() if base.get(k)}
    evidence = {"per_size": {str(b): r for b, r in results.items()}}
    bad = {b: r for b, r in results.items() if r.get("verdict") != "ok"}
    if not bad:
        return outcome("pass", metrics=metrics, evidence=evidence)
    size, first = min(bad.items())
    verdict = first.get("verdict")
    if verdict in ("wrong", "no-op", "zero"):
        return outcome(
            "fail",
            f"{backend}: wrong result at {size} bytes ({verdict}: {first.get('detail', '')}); not timed",
            "ar-wrong-result",
            metrics,
            evidence,
        )
    if len(bad) < len(results):
        sizes = ", ".join(str(b) for b in sorted(bad))
        return outcome(
            "partial",
            f"{backend}: fails at {sizes} bytes ({first.get('error', verdict)[:200]})",
            "ar-size-unsupported",
            metrics,
            evidence,
        )
    return outcome("fail", f"{backend}: {first.get('error', verdict)[:300]}", "ar-backend-failed", metrics, evidence)


def _clocks(device_index: int) -> dict[str, Any]:
    """Recorded, never changed."""
    try:
        import torch

        return {"sm_clock_mhz": torch.cuda.clock_rate(device_index)}
    except Exception as exc:
        return {"clock_error": _errors.error_tail(exc, 120)}


def run(ctx: RankContext) -> dict[str, Any]:
    multicast_env = _dist.keep_multicast_off()
    name = ctx.param("backend", "nccl") or "nccl"
    if (missing := _no_flashinfer(name)) is not None:
        return missing
    if name.startswith("flashinfer-"):
        from inenv.kit import _flashinfer

        _flashinfer.prepare_env()  # the modules fi-jit built for this GPU, not a compile in this turn
    if name == "flashinfer-pcie-ipc":
        from inenv.kit import _api, _fi_pcie

        found = _fi_pcie.detect("all-reduce")
        if isinstance(found, _api.ApiUnknown):
            return found.outcome()

    import torch

    if (skipped := _dist.gpu_precheck(ctx)) is not None:
        return skipped

    device = _dist.init_dist(ctx, "nccl")
    import torch.distributed as dist

    gloo = _dist.cpu_group()
    group = dist.group.WORLD
    barrier = _timing.stream_barrier(device, group)
    max_numel = max(max(TOKENS) * _data.HIDDEN, _agree.max_numel())
    evidence: dict[str, Any] = {
        "backend": name,
        "hidden": _data.HIDDEN,
        "tokens": list(at_level(TOKENS)),
        "calls_per_graph": CALLS_PER_GRAPH,
        "replays": REPLAYS,
        "multicast_env": multicast_env,
        "torch": torch.__version__,
        "nccl_version": _nccl.runtime_version(torch),
        "clocks": _clocks(device.index),
        "method": "K calls per CUDA graph replayed on a side stream, CUDA events per replay after an on-stream "
        "barrier, max over ranks",
    }
    ok, err = True, ""
    try:
        backend = make_backend(name, ctx.rank, ctx.world_size, device, group, gloo)
        backend.prepare(max_numel)
    except Exception as exc:
        ok, err = False, _errors.error_tail(exc)
    if not _dist.agree(ok, gloo):
        why = err if not ok else "a peer rank failed to set the backend up"
        code = "missing-package" if "No module named" in why else "ar-backend-failed"
        return outcome("skip" if code == "missing-package" else "fail", f"{name}: {why[:300]}", code, evidence=evidence)
    evidence.update(backend.evidence())
    nccl = None
    if name != "nccl":
        nccl = Nccl(device, group)
        nccl.prepare(max_numel)
    results: dict[int, dict[str, Any]] = {}
    baseline: dict[int, dict[str, Any]] = {}
    for numel in (t * _data.HIDDEN for t in at_level(TOKENS)):
        nbytes = numel * 2
        if nccl is not None:
            baseline[nbytes] = measure(nccl, numel, ctx.rank, ctx.world_size, device, gloo, barrier)
        results[nbytes] = measure(backend, numel, ctx.rank, ctx.world_size, device, gloo, barrier)
        ctx.log(f"{name} {nbytes} B: {results[nbytes].get('verdict')} {results[nbytes].get('timing', {})}")
        if results[nbytes].get("verdict") in ("hang", "wrong", "no-op", "zero"):
            break  # a hung stream blocks everything after it; a wrong backend is not timed further
    hung = any(r.get("verdict") == "hang" for r in results.values())
    with _timing.side_stream(device):
        agreed = {} if hung else _agree.run_cases(agreement_bind(backend, ctx.rank, ctx.world_size),
                                                  _agree.cases(backend.dtypes), gloo, ctx.log)
    result = summarize(name, results, baseline if nccl is not None else None)
    if isinstance(backend, FlashinferPcieIpc):
        result["metrics"].update(backend.metrics())
    result["evidence"].update(evidence)
    result["evidence"]["agreement"] = agreed
    if baseline:
        result["evidence"]["nccl_per_size"] = {str(b): r for b, r in baseline.items()}
    return _agree.apply(result, _agree.summarize(agreed), name)


# --- declared fields: what this probe records, and the roles checks report and checks advise read them by
# (inenv.probe.Field: name, unit, meaning, role). Left out of the probe hash: it changes no verdict.
METRICS = (
    ("latency_us", "µs by message bytes", "median time of one captured call, slowest rank per replay", "latency"),
    ("p99_us", "µs by message bytes", "99th percentile of the same replays", None),
    ("nccl_latency_us", "µs by message bytes", "NCCL timed the same way in the same processes", "nccl-latency"),
    ("ratio_vs_nccl", "ratio by message bytes", "latency_us / nccl_latency_us at each size", "ratio-vs-nccl"),
    ("configs", "record", "flashinfer PCIe IPC configs chosen per message bytes", None),
    ("agreement", "record", "rank agreement on random bf16/fp16 data (inenv/kit/_agree.py): ranks identical, "
     "differing elements, max ulp between ranks, deterministic, max ulp vs the float64 sum, divergent cases",
     "agreement"),
)
EVIDENCE = (
    ("hidden", "elements", "hidden size of the timed messages (tokens x hidden bf16 elements)", "hidden"),
)
ALLREDUCE_PATH = True
