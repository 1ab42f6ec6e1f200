"""fi-fusion: flashinfer's fused allreduce + residual add + RMSNorm (trtllm backend), functionally.

Workspace creation, then the fused op at hidden 7168 bf16 for 1..128 tokens, eager and replayed from a CUDA
graph. Inputs are small integers, so the allreduce and the residual add are exact and are compared
exactly; the RMSNorm output is compared with a reference computed as the kernel does (fp32, then one
rounding to bf16): the count of bit-exact elements is reported and within one bf16 ulp is the pass level.
Outputs start as a sentinel, so a kernel that wrote nothing is told apart from one that wrote wrong numbers.
The graph check refills inputs and outputs after capture, so only a real replay can produce the result.

Ranks on separate GPUs use NCCL for the process group; ``placement=shared`` puts every rank on GPU 0 (the
layout flashinfer's SM12x work was verified with) and exchanges handles over gloo, since NCCL refuses two
ranks on one device; those variants also run the step probe's shallow selection on the fusion
(``stepmodel.shallow_agreement``: rank agreement and one exact case per dtype at the largest model hidden size), so
the step leaves those world sizes to them. The backend is always ``trtllm``: ``auto`` can choose ``mnnvl``, which
creates NVLink multicast objects, and those are never created by stackprobe.

Every token count runs at the deep world sizes (``inenv.probe.deep_sizes``); elsewhere a variant runs the shallow
selection (:func:`checked`: the workspace and one exact call each way), with a GPU per rank (``depth=setup``) at
the other world sizes up to the host's GPU count, with every rank on GPU 0 (``placement=shared``) beyond it.

``case=engine`` (the full level, at the deep world sizes, or two ranks on GPU 0 on a one-GPU host) runs what the
engines run instead: ``launch_with_pdl`` on, decode and prefill token counts (:data:`ENGINE_TOKENS`, up to a
2048-token prefill chunk), and besides residual + RMSNorm the quant-fused patterns vLLM enables (FP8, and NVFP4 on
compute capability 10 and up, where its FP4 conversions exist). Each pattern and count is called eagerly and
replayed from a CUDA graph: the residual is compared exactly, the RMSNorm output within one bf16 ulp, a quantized
output must be written and hold the same bits on every rank and in the graph as eagerly. A call that raises at a
count (flashinfer's "invalid argument" at prefill sizes) is ``fail`` naming the pattern and the count. The
residual + RMSNorm graph of each count is then timed (a GPU per rank only), so a flashinfer release pair shows a
latency change in ``checks diff`` through the variant's headline.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from inenv.kit import _agree, _data, _device, _dist, _errors, _timing
from inenv.kit import _flashinfer as fi
from inenv.kit._data import EPS, norm_check, reference
from inenv.kit._fi_build import classify_jit_error
from inenv.kit._lockstep import Lockstep, Stopped
from inenv.probe import (
    QUICK,
    SETUP,
    HostView,
    ProbeSpec,
    RankContext,
    Skip,
    Variant,
    at_level,
    deep_sizes,
    multi_rank,
    outcome,
    shallow,
)
from inenv.probes import stepmodel

SPEC = ProbeSpec(
    id="fi-fusion",
    title="flashinfer allreduce + residual + RMSNorm fusion",
    feature="Does flashinfer's fused allreduce+residual+RMSNorm (trtllm backend) create its workspace and give "
    "exact results at decode sizes, eagerly and under CUDA graphs, across GPUs and with ranks sharing a GPU?",
    ranks=(2, 4, 8),
    min_ranks=2,  # over one rank the allreduce part returns its input
    distinct_gpus=False,  # placement=shared puts every rank on GPU 0
    requires=("flashinfer",),
    timeout_s=900.0,
    preload=_dist.PRELOAD_DIST,
)

HIDDEN = _data.HIDDEN
AGREEMENT_BACKEND = "flashinfer-fusion"  # the step's name for this fusion (inenv.probes.stepcomm)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
GRAPH_TOKENS = (1, 16, 128)
GRAPH_CALLS = 3


SHALLOW_WHAT = "the workspace and one exact case (1 token, eager and graph)"


def checked(setup_only: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(eager token counts, graph token counts) at this level: the shallow selection (``setup_only``: ranks sharing
    a GPU or ``depth=setup``) the first of each (the workspace, where a world size is refused, and one exact call
    each way; every size is checked at the deep world sizes). Every graph size is an eager size: the graph reuses
    its buffers."""
    if setup_only:
        return TOKENS[:1], GRAPH_TOKENS[:1]
    return at_level(TOKENS), at_level(GRAPH_TOKENS)


def variants(host: HostView) -> list[Variant]:
    # Beyond the host's GPU count the ranks share GPU 0; at 2 ranks they also do on a host with more; below it,
    # the world sizes that are not deep run depth=setup
    out = multi_rank(SPEC, host, [()], lambda _: True, shared_gpus=1, other_sizes=SETUP)
    if host.gpu_count >= 2:
        out.append(Variant(SPEC.id, 2, share_gpu=True, gpus=1))
    if host.level != QUICK:  # the quick pass's question is the plain one above
        engine = ((CASE, ENGINE),)
        if host.gpu_count == 0:
            out.append(Variant(SPEC.id, 2, params=engine, skip=Skip("no-gpu", "no GPU on this host")))
        elif host.gpu_count == 1:
            out.append(Variant(SPEC.id, 2, params=engine, share_gpu=True, gpus=1))
        out += [Variant(SPEC.id, n, params=engine) for n in deep_sizes(host)]
    return out


class _Case:
    """Buffers for one token count; ``fill`` rewrites inputs (by seed) and resets outputs to the sentinel."""

    def __init__(self, tokens: int, rank: int, world: int, device: Any) -> None:
        import torch

        self.tokens, self.rank, self.world, self.device = tokens, rank, world, device
        shape = (tokens, HIDDEN)
        self.inp = torch.empty(shape, dtype=torch.bfloat16, device=device)
        self.residual = torch.empty_like(self.inp)
        self.res_out = torch.empty_like(self.inp)
        self.norm_out = torch.empty_like(self.inp)
        idx = torch.arange(HIDDEN, device=device)
        self.gamma = (1 + idx % 3).to(torch.bfloat16)

    def fill(self, seed: int) -> None:
        shape = (self.tokens, HIDDEN)
        self.seed = seed
        self.inp.copy_(_data.pattern(shape, self.rank, seed, self.device))
        self.residual.copy_(_data.pattern(shape, 0, seed + 1000, self.device))
        self.res_out.fill_(_data.SENTINEL)
        self.norm_out.fill_(_data.SENTINEL)

    def check(self) -> dict[str, Any]:
        shape = (self.tokens, HIDDEN)
        total = _data.pattern_sum(shape, self.world, self.seed, self.device)
        ref_res, ref_norm = reference(total, self.residual, self.gamma)
        res = _data.check_exact(self.res_out, ref_res, prior=_data.filled(shape), own_input=self.inp)
        norm = norm_check(self.norm_out, ref_norm)
        return {"residual": res.to_json(), "norm": norm, "ok": res.ok and norm["within_1ulp"]}


def _first_bad(results: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    for key, r in results.items():
        if not r["ok"]:
            return key, r
    return None


def _failure_code(r: dict[str, Any]) -> str:
    verdict = r["residual"]["verdict"]
    if verdict in ("no-op", "zero") or r["norm"]["untouched"]:
        return "fi-fusion-noop"
    return "fi-fusion-wrong"


def _workspace_error_code(err: str) -> str:
    """A JIT build failure inside workspace creation keeps its JIT reason (arch gate, nvcc...)."""
    return classify_jit_error(err) if "architectures" in err or "nvcc" in err else "fi-workspace-failed"


def _wrong(results: dict[str, dict[str, Any]], status: str, what: str, metrics: dict[str, Any],
           evidence: dict[str, Any]) -> dict[str, Any] | None:
    """``status`` naming the first token count whose result is not right, or None when all are."""
    bad = _first_bad(results)
    if bad is None:
        return None
    key, r = bad
    return outcome(
        status,
        note=f"{what} wrong at {key} tokens: {r['residual']['detail'] or r['norm']}",
        reason_code=_failure_code(r),
        metrics=metrics,
        evidence=evidence,
    )


def run(ctx: RankContext) -> dict[str, Any]:
    if ctx.param(CASE) == ENGINE:
        return run_engine(ctx)
    fi.prepare_env()
    one_gpu = ctx.variant.share_gpu  # every rank on GPU 0, a gloo process group
    setup_only = shallow(ctx.variant)  # the shallow selection
    if one_gpu:
        ctx = dataclasses.replace(ctx, device_index=0)
    device = _dist.init_dist(ctx, backend="gloo" if one_gpu else "nccl")
    import torch
    import torch.distributed as dist

    eager: dict[str, dict[str, Any]] = {}
    graph: dict[str, dict[str, Any]] = {}
    sizes, graph_sizes = checked(setup_only)
    evidence: dict[str, Any] = {
        "flashinfer": fi.version(),
        "placement": "shared: every rank on GPU 0" if one_gpu else "1 gpu per rank",
        **({"checked": f"{SHALLOW_WHAT}; {_agree.full_grid_at(one_gpu)}"} if setup_only else {}),
        "process_group": dist.get_backend(),
        "multicast_env": _dist.keep_multicast_off(),
        "eager": eager,
        "graph": graph,
    }
    lock = Lockstep(ctx.rank, dist.group.WORLD, evidence)
    metrics = lock.metrics
    try:
        with lock.step("workspace creation", _workspace_error_code):
            fusion = fi.Fusion()
            evidence["api"] = fusion.api
            fusion.create_workspace(ctx.rank, ctx.world_size, max(TOKENS), HIDDEN, torch.bfloat16, dist.group.WORLD)
            metrics["workspace_bytes"] = fusion.workspace_bytes()
        ctx.log(f"workspace ready ({metrics['workspace_bytes']} bytes, api {fusion.api})")

        def step(case: _Case) -> None:
            fusion.ar_residual_rmsnorm(
                case.inp, case.residual, case.gamma, EPS, case.res_out, case.norm_out, ctx.rank, ctx.world_size
            )

        cases: dict[int, _Case] = {}
        with lock.step("eager call", "fi-fusion-error") as found:
            for i, tokens in enumerate(sizes):
                case = cases[tokens] = _Case(tokens, ctx.rank, ctx.world_size, device)
                case.fill(seed=i)
                step(case)
                _device.wait_device(60)
                eager[str(tokens)] = case.check()
            metrics["norm_exact_fraction"] = min(r["norm"]["exact_fraction"] for r in eager.values())
            metrics["norm_max_abs_err"] = max(r["norm"]["max_abs_err"] for r in eager.values())
            found.early = _wrong(eager, "fail", f"rank {ctx.rank}: eager result", metrics, evidence)
        prefix = f"eager exact at {sizes[0]}{f'..{sizes[-1]}' if len(sizes) > 1 else ''} tokens; "
        with lock.step("graph capture/replay", "fi-fusion-graph-failed", status="partial", prefix=prefix):
            for i, tokens in enumerate(graph_sizes):
                case = cases[tokens]
                case.fill(seed=50 + i)
                g = _device.capture(lambda c=case: step(c), calls=GRAPH_CALLS, warmup=2)
                case.fill(seed=80 + i)  # only a real replay can now produce the reference
                _device.wait_device(30)
                g.replay()
                _device.wait_device(60)
                graph[str(tokens)] = case.check()
        result = _wrong(graph, "partial", "eager exact; graph replay", metrics, evidence) or outcome(
            "pass", metrics=metrics, evidence=evidence
        )
        if not one_gpu:
            return result
        # ranks sharing a GPU: the step's shallow selection on the fusion (rank agreement and one exact case per
        # dtype at the largest model hidden size, its kernels read), which the step leaves to this variant
        with lock.step("rank agreement set-up", _workspace_error_code, status="partial", prefix="exact; "):
            agreed, more = stepmodel.shallow_agreement(AGREEMENT_BACKEND, ctx.rank, ctx.world_size, device,
                                                       dist.group.WORLD, ctx.log)
        evidence["agreement"] = agreed
        evidence["agreement_comm"] = more
        return _agree.shallow_outcome(lock.finish(result), agreed, "flashinfer allreduce fusion", "fi-fusion-wrong",
                                      "fi-fusion-noop", "fi-fusion-error")
    except Stopped as stop:
        return stop.outcome


# --- case=engine: what the engines run -------------------------------------------------------------------------
CASE, ENGINE = "case", "engine"
ENGINE_TOKENS = (1, 8, 32, 128, 512, 2048)  # decode, verify, and chunked-prefill token counts
QUANT_SENTINEL = 0x7F  # the byte a quantized output starts as (a NaN in FP8 E4M3): left as it is, nothing was written
TIME_CALLS, TIME_REPLAYS = 10, 20  # calls per timed graph, replays timed


def engine_patterns(major: int) -> tuple[str, ...]:
    """The fused patterns run on a GPU of compute capability ``major``.x: NVFP4's FP4 conversions need 10 and up."""
    return ("rmsnorm", "fp8", *(("nvfp4",) if major >= 10 else ()))


def _digest(t: Any) -> int:
    """The bits of ``t`` as one integer, weighted by position (the same bits give the same digest on every rank)."""
    import torch

    flat = t.reshape(-1).view(torch.uint8).to(torch.int64)
    w = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % 65521 + 1
    return int((flat * w).sum())


class _EngineCase:
    """One pattern's buffers at one token count; ``fill`` rewrites the inputs and resets every output."""

    def __init__(self, tokens: int, pattern: str, rank: int, world: int, device: Any) -> None:
        import torch

        self.tokens, self.pattern, self.rank, self.world, self.device = tokens, pattern, rank, world, device
        shape = (tokens, HIDDEN)
        self.inp = torch.empty(shape, dtype=torch.bfloat16, device=device)
        self.residual, self.res_out, self.norm_out, self.output = (torch.empty_like(self.inp) for _ in range(4))
        self.gamma = (1 + torch.arange(HIDDEN, device=device) % 3).to(torch.bfloat16)
        self.scale = torch.ones(1, dtype=torch.float32, device=device)
        self.quant: Any = None
        self.sf: Any = None
        if pattern == "fp8":
            self.quant = torch.empty(shape, dtype=torch.uint8, device=device)
        elif pattern == "nvfp4":
            self.quant = torch.empty(tokens, HIDDEN // 2, dtype=torch.uint8, device=device)
            self.sf = torch.empty((tokens + 127) // 128 * 128 * (HIDDEN // 16) * 2, dtype=torch.uint8, device=device)

    def fill(self, seed: int) -> None:
        shape = (self.tokens, HIDDEN)
        self.seed = seed
        self.inp.copy_(_data.pattern(shape, self.rank, seed, self.device))
        self.residual.copy_(_data.pattern(shape, 0, seed + 1000, self.device))
        for t in (self.res_out, self.norm_out):
            t.fill_(_data.SENTINEL)
        if self.quant is not None:
            self.quant.fill_(QUANT_SENTINEL)

    def call(self, fusion: Any) -> None:
        import torch

        kw: dict[str, Any] = {}
        if self.pattern == "rmsnorm":
            kw["norm_out"] = self.norm_out
        else:
            quant = self.quant.view(torch.float8_e4m3fn) if self.pattern == "fp8" else self.quant
            kw.update(quant_out=quant, scale_factor=self.scale, **({"scale_out": self.sf} if self.sf is not None
                                                                     else {}))
        fusion.fused(self.inp, pattern=self.pattern, rank=self.rank, world=self.world, residual_in=self.residual,
                     residual_out=self.res_out, gamma=self.gamma, eps=EPS, output=self.output, launch_with_pdl=True,
                     **kw)

    def check(self) -> dict[str, Any]:
        """The residual exactly, the RMSNorm output within one ulp, a quantized output written (its digest is
        compared across ranks and with the eager call's by the caller)."""
        shape = (self.tokens, HIDDEN)
        total = _data.pattern_sum(shape, self.world, self.seed, self.device)
        ref_res, ref_norm = reference(total, self.residual, self.gamma)
        res = _data.check_exact(self.res_out, ref_res, prior=_data.filled(shape), own_input=self.inp)
        out: dict[str, Any] = {"residual": res.to_json(), "ok": res.ok}
        if self.pattern == "rmsnorm":
            out["norm"] = norm_check(self.norm_out, ref_norm)
            out["ok"] = out["ok"] and out["norm"]["within_1ulp"]
        else:
            written = bool((self.quant != QUANT_SENTINEL).any())
            out["quant"] = {"written": written, "digest": _digest(self.quant)}
            out["ok"] = out["ok"] and written
        return out


def engine_verdict(checks: dict[str, dict[str, Any]], failed: dict[str, Any] | None, metrics: dict[str, Any],
                   evidence: dict[str, Any]) -> dict[str, Any]:
    """The engine case's outcome from its checks ("<pattern> <tokens> <eager|graph>" -> check) and the first call
    that raised, if any (pure): a raise is ``fi-fusion-size-failed`` naming the pattern and the count; a wrong
    result ``fi-fusion-wrong`` (``fi-fusion-noop`` when nothing was written); quantized bits that differ between
    ranks or between the graph and the eager call ``fi-fusion-wrong``."""
    if failed is not None:
        return outcome("fail", f"{failed['where']} raised: {failed['error']}"[:500], "fi-fusion-size-failed", metrics,
                       evidence)
    for key, r in checks.items():
        if r["ok"] and not r.get("quant_mismatch"):
            continue
        if r.get("quant_mismatch"):
            return outcome("fail", f"{key}: {r['quant_mismatch']}", "fi-fusion-wrong", metrics, evidence)
        untouched = r["residual"]["verdict"] in ("no-op", "zero") or r.get("norm", {}).get("untouched") or (
            "quant" in r and not r["quant"]["written"])
        detail = r["residual"]["detail"] or r.get("norm") or "quantized output not written"
        return outcome("fail", f"{key}: {detail}"[:500], "fi-fusion-noop" if untouched else "fi-fusion-wrong", metrics,
                       evidence)
    return outcome("pass", metrics=metrics, evidence=evidence)


def engine_headline(p50: dict[str, float]) -> str:
    """The timed graphs in one line, smallest and largest count and one between (pure)."""
    keys = sorted(p50, key=int)
    shown = [keys[0], keys[len(keys) // 2], keys[-1]] if len(keys) > 2 else keys
    return "PDL on, residual+RMSNorm graph: " + ", ".join(f"{k} tok {p50[k]:.1f} µs" for k in dict.fromkeys(shown))


def run_engine(ctx: RankContext) -> dict[str, Any]:
    fi.prepare_env()
    one_gpu = ctx.variant.share_gpu
    if one_gpu:
        ctx = dataclasses.replace(ctx, device_index=0)
    device = _dist.init_dist(ctx, backend="gloo" if one_gpu else "nccl")
    import torch
    import torch.distributed as dist

    group = dist.group.WORLD
    sizes = at_level(ENGINE_TOKENS)
    patterns = engine_patterns(torch.cuda.get_device_capability(device)[0])
    checks: dict[str, dict[str, Any]] = {}
    evidence: dict[str, Any] = {"flashinfer": fi.version(), "case": ENGINE, "launch_with_pdl": True,
                                "patterns": list(patterns), "tokens": list(sizes), "checks": checks,
                                "placement": "shared: every rank on GPU 0 (checked, not timed)" if one_gpu else
                                "1 gpu per rank", "multicast_env": _dist.keep_multicast_off()}
    lock = Lockstep(ctx.rank, group, evidence)
    metrics = lock.metrics
    try:
        with lock.step("workspace creation", _workspace_error_code):
            fusion = fi.Fusion()
            evidence["api"] = fusion.api
            fusion.create_workspace(ctx.rank, ctx.world_size, max(sizes), HIDDEN, torch.bfloat16, group)
            metrics["workspace_bytes"] = fusion.workspace_bytes()
        failed: dict[str, Any] | None = None
        graphs: dict[int, Any] = {}
        for tokens in sizes:
            for pattern in patterns:
                where = f"{pattern} at {tokens} tokens"
                try:
                    case = _EngineCase(tokens, pattern, ctx.rank, ctx.world_size, device)
                    case.fill(seed=tokens)
                    case.call(fusion)
                    _device.wait_device(60)
                    eager = checks[f"{where} eager"] = case.check()
                    case.fill(seed=tokens)
                    g = _device.capture(lambda c=case: c.call(fusion), calls=1, warmup=1)
                    case.fill(seed=tokens)  # only a real replay can now produce the reference
                    g.replay()
                    _device.wait_device(60)
                    graph = checks[f"{where} graph"] = case.check()
                    if "quant" in graph and graph["quant"]["digest"] != eager["quant"]["digest"]:
                        graph["quant_mismatch"] = "the graph's quantized bits differ from the eager call's"
                    if pattern == "rmsnorm":
                        graphs[tokens] = case
                    local = None
                except Exception as exc:
                    local = {"where": where, "error": _errors.error_tail(exc, 300)}
                found = [f for f in _dist.gather_objects(local, group) if f]
                if found:
                    failed = found[0]
                    break
            if failed is not None:
                break
        _agree_quant(checks, group)
        if failed is None and not one_gpu:
            metrics.update(_time_graphs(graphs, fusion, device, group))
        return lock.finish(engine_verdict(checks, failed, metrics, evidence))
    except Stopped as stop:
        return stop.outcome


def _agree_quant(checks: dict[str, dict[str, Any]], group: Any) -> None:
    """Mark every quantized output whose bits differ between ranks (a digest per check, gathered once)."""
    mine = {k: r["quant"]["digest"] for k, r in checks.items() if "quant" in r}
    everyone = _dist.gather_objects(mine, group)
    for key in mine:
        if len({d.get(key) for d in everyone}) > 1:
            checks[key]["quant_mismatch"] = "the quantized bits differ between ranks"


def _time_graphs(graphs: dict[int, Any], fusion: Any, device: Any, group: Any) -> dict[str, Any]:
    """Per token count, one graph of :data:`TIME_CALLS` residual + RMSNorm calls with PDL on, replayed
    :data:`TIME_REPLAYS` times on a side stream: the median and p99 µs of one call, the slowest rank per replay."""
    barrier = _timing.stream_barrier(device, group)
    p50: dict[str, float] = {}
    p99: dict[str, float] = {}
    with _timing.side_stream(device):
        for tokens, case in graphs.items():
            g = _device.capture(lambda c=case: c.call(fusion), calls=TIME_CALLS, warmup=1)
            t = _timing.timed_across_ranks(g.replay, TIME_REPLAYS, TIME_CALLS, barrier, group)
            p50[str(tokens)], p99[str(tokens)] = round(t.median_us, 3), round(t.p99_us, 3)
    return {"latency_us": p50, "latency_p99_us": p99, "engine_headline": engine_headline(p50)} if p50 else {}


# --- declared fields: what this probe records, and the roles checks report and checks advise read them by
# (inenv.probe.Field: name, unit, meaning, role). Left out of the probe hash: it changes no verdict.
METRICS = (
    ("workspace_bytes", "bytes", "fusion workspace allocated for the whole group", None),
    ("norm_exact_fraction", "fraction", "worst rank's share of RMSNorm outputs equal to the unfused reference", None),
    ("norm_max_abs_err", "absolute", "largest RMSNorm output difference from the unfused reference", None),
    ("latency_us", "µs by tokens", "case=engine: median time of one residual + RMSNorm call with PDL on, from a "
     "graph of 10 calls, the slowest rank per replay", None),
    ("latency_p99_us", "µs by tokens", "case=engine: 99th percentile of the same replays", None),
    ("engine_headline", "text", "case=engine: the timed calls at the smallest, a middle and the largest count",
     "headline"),
    ("agreement", "record", "ranks sharing a GPU: rank agreement on random bf16/fp16 data through the step's "
     "adapter (inenv/kit/_agree.py): ranks identical, differing elements, max ulp between ranks, deterministic, "
     "max ulp vs the float64 sum, divergent cases", "agreement"),
)
ALLREDUCE_PATH = True
