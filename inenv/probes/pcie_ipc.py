"""pcie-ipc: flashinfer's PCIe IPC collectives (all-reduce, all-gather, reduce-scatter; flashinfer >= 0.7).

Built for GPUs joined only by PCIe, they are plain peer loads and stores over CUDA IPC, so they run wherever
peer access works. Every shape is checked exactly (small integers in bf16; outputs start as a sentinel, so a
kernel that did nothing is named as such), eagerly and replayed from a CUDA graph (inputs and outputs
refilled after the capture, so only a real replay gives the result), each call with an explicit launch
configuration that every rank derives alike.

The all-reduce shapes cover the kernels flashinfer's launch policy picks: at 2 ranks always the unstaged
push; at 4 ranks the staged kernel below 32 KiB and the staged ring above, with 1 to 4 blocks; at 8 ranks
the unstaged push below 32 KiB and the staged ring above. Two edge shapes that its admission rules exclude
(fewer than one 16-byte pack per rank, a size not a whole number of packs) record flashinfer's own refusal.
The all-reduce runs with flashinfer's seed configuration, then ``tune`` measures this machine's and the
tuned one is checked the same way; both configurations and their latencies (K calls per captured graph, on a
side stream, slowest rank per replay) are recorded beside NCCL's in the same processes.

``placement=shared`` variants put more ranks than GPUs on the host's GPUs (rank i on GPU i mod count; the process
group is gloo, since NCCL refuses two ranks on one device). They test correctness only: neither tuning nor
latency means anything on time-sliced GPUs. The all-reduce's also run the step probe's shallow selection on it
(``stepmodel.shallow_agreement``: rank agreement and one exact case per dtype through the step's adapter, with the
configuration flashinfer's policy resolves), so the step leaves those world sizes to them.

Every shape, the admission edges, tuning and latency run at the deep world sizes (``inenv.probe.deep_sizes``).
Elsewhere a variant runs the shallow selection (:func:`cases`: the workspace, where a world size is refused, and
the first decode shape exactly, eagerly and in a graph, with the seed configuration): with a GPU per rank
(``depth=setup``, every op) at the other world sizes up to the host's GPU count, shared beyond it (the all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inenv.kit import _agree, _api, _data, _device, _dist, _errors, _fi_pcie, _timing
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
from inenv.probes import stepmodel

SPEC = ProbeSpec(
    id="pcie-ipc",
    title="PCIe IPC all-reduce / all-gather / reduce-scatter (flashinfer)",
    feature="Do flashinfer's PCIe IPC collectives give exact results eagerly and in CUDA graphs at 2, 4 and 8 "
    "ranks, with the seed launch configuration and the one tuned on this machine, and how fast is the "
    "all-reduce against NCCL?",
    ranks=(2, 4, 8),
    min_ranks=2,
    distinct_gpus=False,  # only the placement=shared variants share; they are planned explicitly
    requires=("flashinfer",),
    timeout_s=600.0,
    preload=_dist.PRELOAD_DIST,
)

HIDDEN = _data.HIDDEN
AGREEMENT_BACKEND = "flashinfer-pcie-ipc"  # the step's name for this all-reduce (inenv.probes.stepcomm)


@dataclass(frozen=True)
class Case:
    tokens: int
    hidden: int
    edge: bool = False  # outside flashinfer's admission rules: its refusal is recorded, not judged

    @property
    def key(self) -> str:
        return f"{self.tokens}x{self.hidden}"


# 4 KiB (flashinfer's own benchmark shape), 14 KiB (below the 32 KiB staging crossover), 112 KiB (staged
# ring, 1 block at 4 and 8 ranks), 1.75 MiB (staged ring, 4 blocks).
MAIN = (Case(1, 2048), Case(1, HIDDEN), Case(8, HIDDEN), Case(128, HIDDEN))
EDGES = {
    "all-reduce": (Case(1, 8, edge=True), Case(3, 1365, edge=True)),
    "all-gather": (Case(1, 4, edge=True),),
    "reduce-scatter": (Case(1, 4, edge=True),),
}
TUNE_BATCHES = (1, 8, 128)  # the token counts of MAIN: tuning measures exactly the shapes that are checked
TUNE_HIDDENS = (2048, HIDDEN)
MAX_NUMEL = 128 * HIDDEN
SHALLOW_WHAT = "the workspace and one exact case (1x2048 bf16, eager and graph, seed config)"
K_CALLS = 20
REPLAYS = 30
DEADLINE_S = 60.0


def variants(host: HostView) -> list[Variant]:
    return multi_rank(SPEC, host, ((("op", op),) for op in _fi_pcie.OPS), lambda p: p == (("op", "all-reduce"),),
                      why="only the all-reduce is checked on shared GPUs", other_sizes=SETUP)


def preflight(variant: Variant) -> dict[str, Any] | None:
    """The verdict before any rank starts when flashinfer's files show it has no PCIe IPC API for the op
    (``_fi_pcie.unknown_without_import``): the ranks' own ``detect`` would find the same, seconds later."""
    unknown = _fi_pcie.unknown_without_import(variant.param("op") or "all-reduce")
    return unknown.outcome() if unknown else None


def cases(op: str, setup_only: bool = False) -> tuple[Case, ...]:
    """The shapes a variant checks at this level: the shallow selection (``setup_only``: ranks sharing a GPU or
    ``depth=setup``) the first decode shape only (the workspace, where a world size is refused, and one exact call
    eagerly and in a graph; every shape and admission edge is checked at the deep world sizes)."""
    return MAIN[:1] if setup_only else at_level(MAIN) + EDGES[op]


# --- data ------------------------------------------------------------------------------------------------
def shapes(op: str, case: Case, world: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(input shape, output shape) of one call."""
    t, h = case.tokens, case.hidden
    if op == "all-gather":
        return (t, h), (world * t, h)
    if op == "reduce-scatter":
        return (world * t, h), (t, h)
    return (t, h), (t, h)


def reference(op: str, case: Case, rank: int, world: int, seed: int, device: Any = "cpu") -> Any:
    """The exact output of rank ``rank`` when every rank r contributes ``pattern(input shape, r, seed)``."""
    import torch

    inp, _ = shapes(op, case, world)
    if op == "all-gather":
        return torch.cat([_data.pattern(inp, r, seed, device) for r in range(world)])
    total = _data.pattern_sum(inp, world, seed, device)
    if op == "reduce-scatter":
        return total[rank * case.tokens : (rank + 1) * case.tokens]
    return total


class _Buffers:
    """Static input/output buffers of one case; ``fill`` rewrites the input and resets the output."""

    def __init__(self, op: str, case: Case, rank: int, world: int, device: Any) -> None:
        import torch

        self.op, self.case, self.rank, self.world, self.device = op, case, rank, world, device
        in_shape, out_shape = shapes(op, case, world)
        self.inp = torch.empty(in_shape, dtype=torch.bfloat16, device=device)
        self.out = torch.empty(out_shape, dtype=torch.bfloat16, device=device)
        self.seed = 0

    def fill(self, seed: int) -> None:
        self.seed = seed
        self.inp.copy_(_data.pattern(tuple(self.inp.shape), self.rank, seed, self.device))
        self.out.fill_(_data.SENTINEL)

    def check(self) -> dict[str, Any]:
        ref = reference(self.op, self.case, self.rank, self.world, self.seed, self.device)
        own = self.inp if self.inp.shape == self.out.shape else None
        return _data.check_exact(self.out, ref, prior=_data.filled(tuple(self.out.shape)), own_input=own).to_json()


# --- verdicts (pure) ---------------------------------------------------------------------------------------
def judge(op: str, results: dict[str, dict[str, Any]], phase: str, mode: str) -> dict[str, Any] | None:
    """The early outcome of one phase's per-case results on this rank (None: all admitted cases exact).

    ``results[case]`` holds ``refused`` (flashinfer's words) or ``eager``/``graph`` check records."""
    main = [c.key for c in MAIN if c.key in results]  # the decode shapes this level checked
    for key, r in results.items():
        check = r.get(mode)
        if check is None or check["verdict"] == "exact":
            continue
        code = "pcie-ipc-noop" if check["verdict"] in ("no-op", "zero") else "pcie-ipc-wrong"
        status = "fail" if mode == "eager" else "partial"
        prefix = "" if mode == "eager" else "eager exact; "
        return outcome(
            status, f"{prefix}{op} {phase} config, {mode}, {key}: {check['verdict']} ({check['detail']})", code
        )
    refused = [k for k in main if "refused" in results.get(k, {})]
    if mode == "eager" and main and len(refused) == len(main):
        words = results[main[0]]["refused"]
        return outcome("fail", f"flashinfer refused every decode shape of {op}: {words}", "pcie-ipc-refused")
    return None


def headline(metrics: dict[str, Any]) -> str:
    lat, base = metrics.get("latency_us", {}), metrics.get("nccl_latency_us", {})
    size = min((int(k) for k in lat if k in base), default=None)
    if size is None:
        return ""
    return f"{lat[str(size)]} us vs NCCL {base[str(size)]} us at {size // 1024} KiB (tuned)"


# --- the probe ---------------------------------------------------------------------------------------------
def _exercise(coll: Any, op: str, bufs: dict[str, _Buffers], config_of: Any, seed: int) -> dict[str, dict[str, Any]]:
    """Each case eagerly with ``config_of(input)``: its check, or flashinfer's refusal."""
    out: dict[str, dict[str, Any]] = {}
    for i, (key, b) in enumerate(bufs.items()):
        b.fill(seed + i)
        config = config_of(b.inp)
        if config is None:
            refusal = coll.refusal(b.inp, b.out)
            out[key] = {"refused": refusal.message} if refusal else {"refused": "", "ran_without_config": True}
            continue
        coll.run(b.inp, b.out, config)
        _device.wait_device(DEADLINE_S)
        out[key] = {"config": _fi_pcie.describe(config), "eager": b.check()}
    return out


def _graphs(
    coll: Any, bufs: dict[str, _Buffers], configs: dict[str, Any], results: dict[str, dict[str, Any]], seed: int
) -> None:
    """Capture one call per admitted case, refill, replay, check: adds ``graph`` to ``results``."""
    for i, (key, b) in enumerate(bufs.items()):
        config = configs.get(key)
        if config is None:
            continue
        graph = _device.capture(lambda b=b, c=config: coll.run(b.inp, b.out, c), calls=1, warmup=0)
        b.fill(seed + i)
        _device.wait_device(DEADLINE_S)
        graph.replay()
        _device.wait_device(DEADLINE_S)
        results[key]["graph"] = b.check()


def _graph_step(
    lock: Lockstep,
    coll: Any,
    op: str,
    bufs: dict[str, _Buffers],
    configs: dict[str, Any],
    results: dict[str, dict[str, Any]],
    phase: str,
    seed: int,
    prefix: str,
) -> None:
    """One configuration's captured calls as a step of every rank: a failure or a wrong result is ``partial``,
    since the eager calls before it were exact; ``prefix`` says what was established."""
    with lock.step(
        f"{phase}-config graph capture/replay", "pcie-ipc-graph-failed", status="partial", prefix=prefix
    ) as st:
        _graphs(coll, bufs, configs, results, seed)
        st.early = judge(op, results, phase, "graph")


def _latency(
    coll: Any, bufs: dict[str, _Buffers], configs: dict[str, dict[str, Any]], device: Any, group: Any
) -> dict[str, Any]:
    """Per admitted main case: K captured calls with the seed config, with the tuned one, and NCCL's
    all-reduce of the same buffer, each timed on a side stream, slowest rank per replay."""
    import torch
    import torch.distributed as dist

    out: dict[str, dict[str, float]] = {"latency_us": {}, "seed_latency_us": {}, "nccl_latency_us": {}}
    with _timing.side_stream(device):
        barrier = _timing.stream_barrier(device, group)
        for c in at_level(MAIN):
            b = bufs[c.key]
            seed_cfg, tuned_cfg = configs["seed"].get(c.key), configs["tuned"].get(c.key)
            if seed_cfg is None or tuned_cfg is None:
                continue
            size = str(b.inp.numel() * 2)
            b.inp.zero_()
            for name, cfg in (("seed_latency_us", seed_cfg), ("latency_us", tuned_cfg)):
                g = _device.capture(lambda cfg=cfg, b=b: coll.run(b.inp, b.out, cfg), calls=K_CALLS, warmup=2)
                t = _timing.timed_across_ranks(g.replay, REPLAYS, K_CALLS, barrier, group)
                out[name][size] = round(t.median_us, 2)
            z = torch.zeros_like(b.inp)
            g = _device.capture(lambda z=z: dist.all_reduce(z, group=group), calls=K_CALLS, warmup=2)
            t = _timing.timed_across_ranks(g.replay, REPLAYS, K_CALLS, barrier, group)
            out["nccl_latency_us"][size] = round(t.median_us, 2)
    return out


def _workspace_error(text: str) -> str:
    """flashinfer refuses a topology or an argument with ValueError (jointly, on every rank)."""
    return "pcie-ipc-refused" if text.startswith("ValueError") else "pcie-ipc-error"


def run(ctx: RankContext) -> dict[str, Any]:
    op = ctx.param("op") or "all-reduce"
    found = _fi_pcie.detect(op)
    if isinstance(found, _api.ApiUnknown):
        return found.outcome()
    shared = ctx.variant.share_gpu  # ranks on shared GPUs: a gloo process group
    setup_only = shallow(ctx.variant)  # the shallow selection: no tuning, nothing timed
    fi.prepare_env()
    device = _dist.init_dist(ctx, backend="gloo" if shared else "nccl")
    import torch.distributed as dist

    group = dist.group.WORLD
    world = ctx.world_size
    devices = _dist.gather_objects(ctx.device_index, group)
    evidence: dict[str, Any] = {
        "op": op,
        "flashinfer": _api.package_version(*_fi_pcie.DISTRIBUTIONS),
        "devices": devices,
        "placement": f"shared: {world} ranks on {len(set(devices))} GPUs" if shared else "one GPU per rank",
        **({"checked": f"{SHALLOW_WHAT}; {_agree.full_grid_at(shared)}"} if setup_only else {}),
        "process_group": dist.get_backend(group),
    }
    lock = Lockstep(ctx.rank, group, evidence)
    coll: Any = None
    try:
        with lock.step("workspace creation", _workspace_error):
            coll = _fi_pcie.Collective(op, group, MAX_NUMEL, str(ctx.workdir / "pcie_ipc_tune.json"), TUNE_BATCHES)
        evidence["workspace"] = coll.evidence()
        bufs = {c.key: _Buffers(op, c, ctx.rank, world, device) for c in cases(op, setup_only)}
        configs: dict[str, dict[str, Any]] = {"seed": {}, "tuned": {}}
        with lock.step("seed-config eager calls", "pcie-ipc-error") as st:
            seed = evidence["seed"] = _exercise(coll, op, bufs, coll.seed, 0)
            configs["seed"] = {k: coll.seed(bufs[k].inp) for k in bufs}
            st.early = judge(op, seed, "seed", "eager")
        _graph_step(lock, coll, op, bufs, configs["seed"], seed, "seed", 100, "eager exact; ")
        metrics: dict[str, Any] = {"configs": {"seed": {k: _fi_pcie.describe(v) for k, v in configs["seed"].items()}}}
        lock.metrics = metrics
        if op != "all-reduce" or setup_only:
            placed = evidence["placement"] + (", set-up check" if setup_only and not shared else "")
            metrics["headline"] = f"exact eagerly and in a graph, seed config ({placed})"
            if not (shared and op == "all-reduce"):
                return lock.finish(outcome("pass", metrics=metrics, evidence=evidence))
            # ranks sharing a GPU: the step's shallow selection on this all-reduce (its policy's configuration,
            # rank agreement, one exact case per dtype, its kernels read), which the step leaves to this variant
            with lock.step("rank agreement set-up", _workspace_error, status="partial", prefix="seed config exact; "):
                agreed, more = stepmodel.shallow_agreement(AGREEMENT_BACKEND, ctx.rank, world, device, group, ctx.log)
            evidence["agreement"] = agreed
            evidence["agreement_comm"] = more
            return _agree.shallow_outcome(lock.finish(outcome("pass", metrics=metrics, evidence=evidence)), agreed,
                                          "flashinfer PCIe IPC all-reduce", "pcie-ipc-wrong", "pcie-ipc-noop",
                                          "pcie-ipc-error")
        with lock.step("tune", "pcie-ipc-tune-failed", status="partial", prefix="seed config exact; "):
            metrics["tuned_by_flashinfer"] = coll.tune(TUNE_HIDDENS)
        with lock.step("tuned-config calls", "pcie-ipc-error") as st:
            configs["tuned"] = {k: coll.resolved(bufs[k].inp) for k in bufs}  # collective: every rank, eagerly
            metrics["configs"]["tuned"] = {k: _fi_pcie.describe(v) for k, v in configs["tuned"].items()}
            tuned = evidence["tuned"] = _exercise(coll, op, bufs, lambda x: configs["tuned"][_key(x)], 200)
            st.early = judge(op, tuned, "tuned", "eager")
        _graph_step(lock, coll, op, bufs, configs["tuned"], tuned, "tuned", 300, "seed config exact; ")
        try:
            metrics.update(_latency(coll, bufs, configs, device, group))
            metrics["headline"] = headline(metrics)
        except Exception as exc:  # exactness is established; a timing failure is evidence, not a verdict
            evidence["latency_error"] = _errors.error_tail(exc)
        return lock.finish(outcome("pass", metrics=metrics, evidence=evidence))
    except Stopped as stop:
        return stop.outcome


def _key(inp: Any) -> str:
    return f"{inp.shape[0]}x{inp.shape[1]}"


# --- declared fields: what this probe records, and the roles checks report and checks advise read them by
# (inenv.probe.Field: name, unit, meaning, role). Left out of the probe hash: it changes no verdict.
METRICS = (
    ("headline", "text", "what the table shows for a pass: exactness, config, and the time against NCCL",
     "headline"),
    ("latency_us", "µs by message bytes", "median time of one call with flashinfer's tuned config", "latency"),
    ("seed_latency_us", "µs by message bytes", "the same with the seed config", None),
    ("nccl_latency_us", "µs by message bytes", "NCCL timed the same way in the same processes", "nccl-latency"),
    ("configs", "record", "seed and tuned configs per shape", None),
    ("tuned_by_flashinfer", "record", "what flashinfer's own tuning returned", None),
    ("agreement", "record", "ranks sharing a GPU: rank agreement on random bf16/fp16 data through the step's "
     "adapter (inenv/kit/_agree.py): ranks identical, differing elements, max ulp between ranks, deterministic, "
     "max ulp vs the float64 sum, divergent cases", "agreement"),
)
ALLREDUCE_PATH = True
