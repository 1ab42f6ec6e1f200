"""fi-fusion: flashinfer's fused allreduce + residual add + RMSNorm (trtllm backend), functionally.

Workspace creation, then the fused op at hidden 7168 bf16 for 1..128 tokens, eager and replayed from a CUDA
graph. Inputs are small integers, so the allreduce and the residual add are exact and are compared
exactly; the RMSNorm output is compared with a reference computed as the kernel does (fp32, then one
rounding to bf16): the count of bit-exact elements is reported and within one bf16 ulp is the pass level.
Outputs start as a sentinel, so a kernel that wrote nothing is told apart from one that wrote wrong numbers.
The graph check refills inputs and outputs after capture, so only a real replay can produce the result.

Ranks on separate GPUs use NCCL for the process group; ``placement=shared`` puts every rank on GPU 0 (the
layout flashinfer's SM12x work was verified with) and exchanges handles over gloo, since NCCL refuses two
ranks on one device. The backend is always ``trtllm``: ``auto`` can choose ``mnnvl``, which creates NVLink
multicast objects, and those are never created by stackprobe.

Every token count runs at the deep world sizes (``inenv.probe.deep_sizes``); elsewhere a variant runs the shallow
selection (:func:`checked`: the workspace and one exact call each way), with a GPU per rank (``depth=setup``) at
the other world sizes up to the host's GPU count, with every rank on GPU 0 (``placement=shared``) beyond it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from inenv.kit import _agree, _data, _device, _dist
from inenv.kit import _flashinfer as fi
from inenv.kit._fi_build import classify_jit_error
from inenv.kit._lockstep import Lockstep, Stopped
from inenv.probe import SETUP, HostView, ProbeSpec, RankContext, Variant, at_level, multi_rank, outcome, shallow

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
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
GRAPH_TOKENS = (1, 16, 128)
GRAPH_CALLS = 3
EPS = 1e-6


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
    return out


def reference(inp_sum: Any, residual: Any, gamma: Any) -> tuple[Any, Any]:
    """(residual_out, norm_out) as the kernel computes them: bf16 sum, then RMSNorm in fp32."""
    import torch

    res_out = (inp_sum.float() + residual.float()).to(torch.bfloat16)
    x = res_out.float()
    rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS)
    return res_out, (x * rms * gamma.float()).to(torch.bfloat16)


def norm_check(got: Any, ref: Any) -> dict[str, Any]:
    """Bit-exact fraction, and the pass level: every element within one bf16 ulp of the reference."""
    import torch

    g = got.float().cpu()
    r = ref.float().cpu()
    diff = (g - r).abs()
    ulp = torch.clamp(r.abs(), min=2.0**-10) * 2.0**-7
    sentinel = bool((g == _data.SENTINEL).all())
    return {
        "exact_fraction": round(float((diff == 0).float().mean()), 6),
        "max_abs_err": float(diff.max()),
        "within_1ulp": bool((diff <= ulp).all()) and not sentinel,
        "untouched": sentinel,
    }


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
    except Stopped as stop:
        return stop.outcome
    return _wrong(graph, "partial", "eager exact; graph replay", metrics, evidence) or outcome(
        "pass", metrics=metrics, evidence=evidence
    )


# --- declared fields: what this probe records, and the roles checks report and checks advise read them by
# (inenv.probe.Field: name, unit, meaning, role). Left out of the probe hash: it changes no verdict.
METRICS = (
    ("workspace_bytes", "bytes", "fusion workspace allocated for the whole group", None),
    ("norm_exact_fraction", "fraction", "worst rank's share of RMSNorm outputs equal to the unfused reference", None),
    ("norm_max_abs_err", "absolute", "largest RMSNorm output difference from the unfused reference", None),
)
ALLREDUCE_PATH = True
