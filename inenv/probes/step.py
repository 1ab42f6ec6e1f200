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

Which kernel ran: the allreduces-alone graph (the step's calls on its buffers) is captured keeping CUDA's graph
object, and the kernels its nodes launch are read from it (``inenv.kit._kernels``; no profiler, whose start costs
about 5 s in every rank process) and recorded per case; a non-NCCL backend whose kernels are NCCL's fell back, and
flashinfer's PCIe IPC all-reduce records the launch configuration its own policy chose (or its refusal) per shape.
Cases of one token count are one graph (``stepmodel.same_graph``), measured once.

The model shapes and steps run, timed, at the deep world sizes (``inenv.probe.deep_sizes``: powers of two and the
host's GPU count), every rank on a GPU of its own. Elsewhere a variant runs the shallow selection: the backend's
set-up at that world size (where a feature refuses it) and one agreement case per dtype (``_agree.shallow_cases``:
random inputs compared bit for bit across ranks, then the same captured call on integer inputs into a
sentinel-filled output, checked exactly, and the kernels its graph launches read; a quick run the first
dtype only), untimed. Two placements run it: ranks sharing one GPU (``placement=shared``, world sizes over the
host's GPU count: each allreduce there waits for the other processes' turns, 2-9 ms a call on an H200, so a shared
result has no times for anything to rank or plot; the process group is gloo, NCCL refusing two ranks on one GPU; a
backend whose own probe checks the same there, :data:`AGREED_ELSEWHERE`, is planned ``not-run`` +
``narrowed-world-size`` but at 2 ranks on a one-GPU host), and a GPU per rank at the other world sizes up to the GPU
count (``depth=setup``: NCCL's process group and every backend as served).

The backends' adapters are in ``stepcomm`` (shared with the load probe), the cases, the model's blocks and one
case's measurement in ``stepmodel``; this module plans the variants, runs one and gives its verdict.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from inenv import models
from inenv.kit import _agree, _dist, _errors, _timing
from inenv.probe import (
    NARROWED,
    SETUP,
    HostView,
    ProbeSpec,
    RankContext,
    Skip,
    Variant,
    at_level,
    multi_rank,
    outcome,
    shallow,
)
from inenv.probes import stepcomm
from inenv.probes.stepcomm import BACKENDS, Comm, make_comm
from inenv.probes.stepmodel import (
    CASES,
    MAX_TOKENS,
    REPLAYS,
    Case,
    Model,
    Shape,
    agreement_bind,
    flat_buffers,
    run_case,
    same_graph,
    shallow_checks,
    shapes,
)
from inenv.status import Status

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
ONLY_ENV = "STACKPROBE_STEP_ONLY"  # planning filter: "nccl,flashinfer-fusion" plans only those backends


# The one world size every backend of the step runs at with its ranks sharing a GPU, on a host of one GPU
SHARED_AT = 2
# Backends whose own probe checks, at every world size with ranks sharing a GPU, what the step's shallow selection
# checks there (the set-up and _agree.shallow_cases: rank agreement and one exact call per dtype): custom-ar's
# flashinfer implementation and symm-mem with their own agreement cases, pcie-ipc and fi-fusion by running this
# probe's shallow selection in their variants (stepmodel.shallow_agreement). custom-ar checks sgl-kernel's
# implementation with a GPU per rank only, so the step keeps that one.
AGREED_ELSEWHERE: dict[str, str] = {"flashinfer-custom-ar": "custom-ar", "symm-mem-one-shot": "symm-mem",
                                    "flashinfer-pcie-ipc": "pcie-ipc", "flashinfer-fusion": "fi-fusion"}


def variants(host: HostView) -> list[Variant]:
    only = {b.strip() for b in os.environ.get(ONLY_ENV, "").split(",") if b.strip()}
    backends = [b for b in BACKENDS if not only or b in only]
    # Beyond the host's GPU count every backend but NCCL (which refuses two ranks on one GPU) runs with its
    # ranks on one GPU; at the other world sizes below it (not deep) with a GPU per rank, depth=setup: both the
    # shallow selection, checked and compared across ranks, not timed
    planned = multi_rank(SPEC, host, ((("backend", b),) for b in backends), lambda p: dict(p)["backend"] != "nccl",
                         shared_gpus=1, why="NCCL refuses two ranks on one GPU", other_sizes=SETUP)
    return [dataclasses.replace(v, skip=narrowed(v, host)) if narrows(v, host) else v for v in planned]


def narrows(v: Variant, host: HostView) -> bool:
    """Whether ``v``, ranks sharing one GPU, is left to its backend's own probe (pure): a backend of
    :data:`AGREED_ELSEWHERE`, beyond :data:`SHARED_AT` ranks on a host of one GPU (where the step's own run is the
    shared one) and at every shared size on a bigger host (where the step runs with a GPU per rank). One such
    variant of eight processes time-slicing one GPU costs 7-9 s on a 1x H200, as much as a few others."""
    return (v.share_gpu and v.skip is None and str(v.param("backend")) in AGREED_ELSEWHERE
            and (host.gpu_count >= 2 or v.ranks != SHARED_AT))


def narrowed(v: Variant, host: HostView) -> Skip:
    n, backend = v.ranks, str(v.param("backend"))
    sizes = "2" if host.gpu_count == 2 else f"2 to {host.gpu_count}"
    where = (f"the step runs every backend at {SHARED_AT} ranks sharing this host's GPU" if host.gpu_count < 2
             else f"the step runs with a GPU per rank at {sizes} ranks here")
    return Skip(NARROWED, f"{n} ranks sharing one GPU: {where}, and {backend}'s set-up, rank agreement and exact "
                f"call at {n} ranks on a shared GPU are {AGREED_ELSEWHERE[backend]}'s variant at that size (the "
                "step's own answer, its times, needs a GPU per rank)", Status.NOT_RUN.value)


def preflight(variant: Variant) -> dict[str, Any] | None:
    """A backend whose library is absent is decided before any rank takes the GPUs."""
    return stepcomm.missing(variant.param("backend") or "nccl")


# --------------------------------------------------------------------------------------------------
# The verdict


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


def measure_cases(step_cases: tuple[Case, ...], run_one: Callable[[Case], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each case's result by key: ``run_one`` for the first case of each token count, that result with
    ``same_graph_as`` for a later case of the same count (``stepmodel.same_graph``); none after a hang, which
    leaves the ranks' device work unfinished."""
    cases: dict[str, dict[str, Any]] = {}
    twins = same_graph(step_cases)
    for case in step_cases:
        if (first := twins.get(case.key)) in cases:
            cases[case.key] = {**cases[first], "same_graph_as": first}
            continue
        cases[case.key] = r = run_one(case)
        if r.get("verdict") == "hang":
            break
    return cases


def agreement_cases(setup_only: bool, dtypes: tuple[str, ...]) -> tuple[_agree.Case, ...]:
    """The agreement cases at this level: ``_agree.shallow_cases`` (checked exactly) for the shallow selection
    (``setup_only``), else ``_agree.cases``."""
    return _agree.shallow_cases(dtypes) if setup_only else _agree.cases(dtypes)


def run(ctx: RankContext) -> dict[str, Any]:
    multicast_env = _dist.keep_multicast_off()
    name = ctx.param("backend", "nccl") or "nccl"
    ended, ctx = stepcomm.begin(ctx, name)
    if ended is not None:
        return ended
    shared = ctx.variant.share_gpu  # ranks on one GPU: a gloo process group, nothing timed
    setup_only = shallow(ctx.variant)  # the shallow selection: set-up and one exact case per dtype

    import torch

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
        comm = make_comm(name, ctx.rank, world, device, group, max_numel, MAX_TOKENS)
    except Exception as exc:
        ok, err = False, _errors.error_tail(exc)
    if not _dist.agree(ok, gloo):
        why = err or "a peer rank failed to set the backend up"
        return outcome("fail", f"{name}: {why[:300]}", "step-backend-failed", evidence=evidence)
    assert comm is not None
    flat = flat_buffers(max_numel, device)
    if setup_only:
        return run_shallow(ctx, comm, flat, gloo, device, evidence)
    assert barrier is not None
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
            def one(case: Case, model: Model = model, shape: Shape = shape) -> dict[str, Any]:
                r = run_case(model, case, gloo, barrier)
                ctx.log(f"{name} {shape.name} {case.key}: {r.get('verdict')} {r.get('timing', {}).get('step', '')}")
                return r

            per_model[shape.name] = measure_cases(step_cases, one)
            del model, one  # the shape's weights go before the next shape's are made
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
    on the hidden size (a fused workspace), then ``_agree.shallow_cases`` checked exactly, their graphs' kernels
    read (see the module's docstring)."""
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
    agreed = shallow_checks(comm, ctx.rank, ctx.world_size, flat, gloo, device, ctx.log, refusals)
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
# (param, value, distributions): a variant with that param value skips at once (missing-package) in a cell without
# those distributions; the host costs such a variant as a skip where the cell's build record lists what it holds
DISTRIBUTIONS = (("backend", "sgl-custom-ar", ("sgl-kernel",)),)
