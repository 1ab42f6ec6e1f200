"""NCCL algorithms under CUDA graphs (docs/probes.md, nccl-graphs).

Each variant is one fresh set of rank processes with one NCCL configuration (NCCL reads its
environment when the communicator is created): each ``NCCL_ALGO`` setting engines use (:data:`ALGOS`), with
and without ``NCCL_PROTO=Simple``. The four collectives an engine issues at warm-up (all-reduce, all-gather,
reduce-scatter, broadcast) are run eagerly and captured in a CUDA graph, each checked exactly. Per-op results
tell the known failure mechanisms apart:

- a setting that leaves a collective without an algorithm fails it *eagerly too*, so it is a configuration
  problem, not a graph problem (``nccl-algo-unavailable``): a global ``NCCL_ALGO=Tree`` (Tree exists for
  all-reduce only), and from NCCL 2.31 on a per-collective string that names all-reduce alone
  (``allreduce:tree``): 2.31 fills the per-collective table with nothing and enables only what the string
  names, where earlier releases kept their defaults for the collectives it leaves out;
- a collective whose channels are connected lazily on first use inside a global-mode capture
  fails *only when captured* (``nccl-capture-failed``); eager warm-up or ``NCCL_RUNTIME_CONNECT=0``
  avoid it.

Each algorithm's variant with eager warm-up and NCCL's default connection also runs the rank agreement check
(``_agree``): every case at the deep world sizes (``inenv.probe.deep_sizes``), and at the other world sizes up to
the host's GPU count (``depth=setup``, NCCL's own choice only: :func:`variants`) one exact case per dtype
(``_agree.shallow_cases``) beside the four ops.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from inenv.kit import _agree, _data, _device, _dist, _errors, _nccl
from inenv.probe import (
    DEPTH,
    NARROWED,
    QUICK,
    SETUP,
    HostView,
    Params,
    ProbeSpec,
    RankContext,
    Skip,
    Variant,
    deep_sizes,
    gpu_shortfall,
    outcome,
    shallow,
    world_sizes,
)
from inenv.status import Status

SPEC = ProbeSpec(
    id="nccl-graphs",
    title="NCCL algorithms under CUDA graphs",
    feature="Do all_reduce, all_gather, reduce_scatter and broadcast work eagerly and captured in a CUDA graph "
    "with NCCL_ALGO unset / Ring / Tree / allreduce:tree / ring,tree;allreduce:tree, with and without "
    "NCCL_PROTO=Simple, eager warm-up and lazy connection?",
    ranks=(2,),
    min_ranks=2,  # over one rank every collective returns its input: all four ops would pass untested
    # check=table: one rank reads how NCCL parsed a setting (its enable matrix) (a host of one GPU; see TABLE)
    min_ranks_by_param=(("check", "table", 1),),
    distinct_gpus=True,  # NCCL refuses two ranks on one GPU
    requires=("torch",),
    timeout_s=300.0,  # with the rank agreement check of the algorithm variants
    preload=_dist.PRELOAD_DIST,
    timed=False,  # every verdict is an exact check or a hang against a 30 s deadline: it may share the GPUs
)

# The ``algo`` value of a variant -> the NCCL_ALGO it sets (None: unset, NCCL decides). A variant key separates
# its params with commas and holds no shell character (checks.results.ids), so NCCL's "," is a "+" and its ";" a
# "." in the value: "ring,tree;allreduce:tree" is ring+tree.allreduce:tree.
ALGOS: dict[str, str | None] = {
    "default": None,
    "Ring": "Ring",
    "Tree": "Tree",
    "allreduce:tree": "allreduce:tree",
    "ring+tree.allreduce:tree": "ring,tree;allreduce:tree",
}
# The ``proto`` value -> NCCL_PROTO (None: unset). A variant without the param is NCCL's default.
PROTOS: dict[str, str | None] = {"default": None, "Simple": "Simple"}
WARMUPS = ("yes", "no")
RUNTIME_CONNECT = ("default", "0")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")

ELEMS = _data.HIDDEN * 4  # per-rank elements: a 4-token decode step, 56 KiB in bf16
CAPTURED_CALLS = 3
OP_DEADLINE_S = 30.0  # a collective that does not finish by then is recorded as a hang for that op


def settings(level: str) -> list[tuple[str, str, str, str]]:
    """The (algo, proto, warmup, runtime_connect) settings planned at ``level``. The full level: every algorithm
    with NCCL's protocol at each warm-up and connection, and with ``NCCL_PROTO=Simple`` once (eager warm-up,
    NCCL's connection: the protocol changes how data moves, not when channels connect). The quick level: NCCL's
    own choice of algorithm, with and without eager warm-up (what an engine meets first), in seconds."""
    if level == QUICK:
        return [("default", "default", warm, "default") for warm in WARMUPS]
    out = []
    for algo in ALGOS:
        for proto in PROTOS:
            for warm in WARMUPS:
                for rc in RUNTIME_CONNECT:
                    if proto == "default" or checks_agreement(algo, warm == "yes", rc):
                        out.append((algo, proto, warm, rc))
    return out


def params_of(algo: str, proto: str, warm: str, rc: str) -> Params:
    """A setting's variant params; NCCL's default protocol leaves ``proto`` out of the key."""
    return (("algo", algo), *((("proto", proto),) if proto != "default" else ()), ("warmup", warm),
            ("runtime_connect", rc))


# ``check=table`` at one rank: what a host of one GPU can tell of a setting, where NCCL refuses two ranks on one
# GPU. NCCL parses NCCL_ALGO and NCCL_PROTO when a communicator is created and logs the enable matrix it read from
# them (_nccl.enable_matrix), also at one rank, where the collectives themselves are local copies; a collective the
# matrix enables no algorithm for fails at warm-up on two or more ranks. (NCCL's one-rank tuning table is no guide:
# on 2.32.6 it was the same under NCCL_ALGO unset, Tree and allreduce:tree.) The four ops run eagerly and captured.
TABLE = ("check", "table")
# The NCCL collective (as NCCL's table names it) behind each op this probe runs
NCCL_FUNCS = {"all_reduce": "AllReduce", "all_gather": "AllGather", "reduce_scatter": "ReduceScatter",
              "broadcast": "Broadcast"}


def table_variants(host: HostView) -> list[Variant]:
    """One ``check=table`` variant per algorithm and protocol setting (eager warm-up, NCCL's connection) at one
    rank, on a host of one GPU at the full level: a host of more GPUs runs the settings across ranks instead."""
    if host.gpu_count != 1 or host.level == QUICK:
        return []
    return [Variant(SPEC.id, 1, params=(*params_of(algo, proto, warm, rc), TABLE))
            for algo, proto, warm, rc in settings(host.level) if checks_agreement(algo, warm == "yes", rc)]


def variants(host: HostView) -> list[Variant]:
    """Every setting of :func:`settings` at every world size (``world_sizes``: a size beyond the host's GPUs is a
    planned skip, NCCL refusing two ranks on one GPU); the warm-up and lazy-connection variants, which test when
    channels connect rather than how the sum is made, at 2 ranks and at the host's GPU count only. At a world
    size the host has GPUs for outside ``deep_sizes`` (8 GPUs: 3, 5, 6, 7) only NCCL's own choice runs, its
    algorithm variant with ``depth=setup`` (:func:`agreement_cases`): what an NCCL_ALGO or NCCL_PROTO setting
    does does not depend on an odd world size (an engine's gate does, which other probes ask), and every
    setting runs at 2 ranks and at the GPU count; the other settings there are planned ``not-run`` +
    :data:`NARROWED`, saying so. On a host of one GPU, also :func:`table_variants`."""
    full = {2, host.gpu_count}
    deep = deep_sizes(host)
    out: list[Variant] = table_variants(host)
    for n in world_sizes(host):
        skip = gpu_shortfall(host, n, "NCCL refuses two ranks on one GPU")
        shallow_size = skip is None and n not in deep
        depth = ((DEPTH, SETUP),) if shallow_size else ()
        for algo, proto, warm, rc in settings(host.level):
            if n in full or checks_agreement(algo, warm == "yes", rc):
                left = narrowed(n, host) if shallow_size and (algo, proto) != ("default", "default") else None
                out.append(Variant(SPEC.id, n, params=(*params_of(algo, proto, warm, rc), *depth),
                                   skip=skip or left))
    return out


def narrowed(n: int, host: HostView) -> Skip:
    """Why a setting other than NCCL's own choice is not run at ``n`` ranks, a world size outside the deep ones."""
    sizes = " and ".join(str(s) for s in sorted({2, host.gpu_count}))
    return Skip(NARROWED, f"{n} ranks, outside the deep world sizes ({', '.join(map(str, deep_sizes(host)))}): "
                f"nccl-graphs runs NCCL's own choice there; this setting runs at {sizes} ranks (what an NCCL_ALGO or "
                "NCCL_PROTO setting does does not depend on the world size; an engine's gate at it is asked by "
                "the engine and step probes)", Status.NOT_RUN.value)


def setting_of(params: Mapping[str, str]) -> dict[str, str] | None:
    """The NCCL_ALGO and NCCL_PROTO a variant with these params runs under (a variable left to NCCL is absent);
    None for an ``algo`` or ``proto`` value this probe does not plan. The host side reads recorded variants with
    it (which remedy a result shows passing)."""
    algo, proto = params.get("algo", "default"), params.get("proto", "default")
    if algo not in ALGOS or proto not in PROTOS:
        return None
    wanted = {"NCCL_ALGO": ALGOS[algo], "NCCL_PROTO": PROTOS[proto]}
    return {k: v for k, v in wanted.items() if v is not None}


def nccl_env(algo: str, runtime_connect: str, proto: str = "default") -> tuple[dict[str, str], list[str]]:
    """Variables to set and to remove for one variant; ``default`` means NCCL decides."""
    set_: dict[str, str] = {}
    unset: list[str] = []
    for var, value in (("NCCL_ALGO", ALGOS[algo]), ("NCCL_PROTO", PROTOS[proto]),
                       ("NCCL_RUNTIME_CONNECT", None if runtime_connect == "default" else runtime_connect)):
        if value is None:
            unset.append(var)
        else:
            set_[var] = value
    return set_, unset


# --------------------------------------------------------------------------------------------------
# Verdict logic (pure: unit-tested without a GPU)


def merge_rank_results(per_rank: list[dict[str, dict[str, dict[str, str]]]]) -> dict[str, dict[str, dict[str, str]]]:
    """Per op and mode, the worst rank's result (anything not ``ok`` beats ``ok``)."""
    merged: dict[str, dict[str, dict[str, str]]] = {}
    for rank_result in per_rank:
        for op, modes in rank_result.items():
            for mode, res in modes.items():
                cur = merged.setdefault(op, {}).get(mode)
                if cur is None or (cur.get("verdict") == "ok" and res.get("verdict") != "ok"):
                    merged[op][mode] = res
    return merged


def op_class(modes: dict[str, dict[str, str]]) -> str:
    """ok | algo-unavailable | capture-only | wrong | hang | error | not-run for one collective."""
    verdicts = {m: r.get("verdict", "not-run") for m, r in modes.items()}
    if verdicts and all(v == "ok" for v in verdicts.values()):
        return "ok"
    if "hang" in verdicts.values():
        return "hang"
    if any(v in ("wrong", "no-op", "zero") for v in verdicts.values()):
        return "wrong"
    eager = [verdicts[m] for m in ("eager", "eager_after") if m in verdicts]
    codes = {r.get("code", "") for r in modes.values()}
    if "nccl-algo-unavailable" in codes and any(v != "ok" for v in eager):
        return "algo-unavailable"
    if eager and all(v == "ok" for v in eager) and verdicts.get("graph") not in (None, "ok"):
        return "capture-only"
    if set(verdicts.values()) == {"not-run"}:
        return "not-run"
    return "error"


# The first NCCL release that reads NCCL_ALGO as a per-collective table filled only from the string: a collective
# the string does not name has no algorithm (earlier releases kept their defaults for it)
NAMED_ONLY = (2, 31)


def described(algo: str, proto: str = "default") -> str:
    """A variant's setting as a note says it: ``NCCL_ALGO=allreduce:tree NCCL_PROTO=Simple``, ``NCCL_ALGO unset``."""
    value = ALGOS.get(algo, algo)
    out = f"NCCL_ALGO={value}" if value is not None else "NCCL_ALGO unset"
    return out + (f" NCCL_PROTO={PROTOS.get(proto, proto)}" if proto != "default" else "")


def release(text: str) -> tuple[int, ...] | None:
    """``2.32.6`` as (2, 32, 6); None when it is not a dotted release."""
    parts = text.strip().split(".") if text else []
    return tuple(int(p) for p in parts) if parts and all(p.isdigit() for p in parts) else None


def named_only(algo: str, nccl_version: str) -> str:
    """The clause a note gets when a per-collective NCCL_ALGO string runs on a release from :data:`NAMED_ONLY` on
    (pure); "" otherwise."""
    seen = release(nccl_version)
    if seen is None or seen[:2] < NAMED_ONLY or ":" not in (ALGOS.get(algo) or ""):
        return ""
    return f"; NCCL {nccl_version} enables only the collectives NCCL_ALGO names, and leaves the others without one"


def verdict(per_op: dict[str, dict[str, dict[str, str]]], algo: str, proto: str = "default",
            nccl_version: str = "") -> dict[str, Any]:
    """The variant's outcome from the worst rank's per-op results (pure). It names what failed and how; which
    setting to use instead is the reason catalogue's, per NCCL release, offered where a result shows it passing."""
    setting = described(algo, proto)
    classes = {op: op_class(per_op.get(op, {})) for op in OPS}
    bad = {op: c for op, c in classes.items() if c != "ok"}
    metrics = {"ops_ok": sum(c == "ok" for c in classes.values()), "ops_total": len(OPS)}
    evidence = {"op_classes": classes, "ops": per_op}
    if not bad:
        return outcome("pass", metrics=metrics, evidence=evidence)
    names = ", ".join(sorted(bad))
    kinds = set(bad.values())
    if "hang" in kinds:
        return outcome(
            "fail",
            f"{names}: a collective did not finish within {OP_DEADLINE_S:.0f} s",
            "nccl-op-hang",
            metrics,
            evidence,
        )
    if "wrong" in kinds:
        return outcome("fail", f"{names}: wrong numbers or no-op output", "nccl-wrong-result", metrics, evidence)
    if kinds == {"algo-unavailable"} and classes["all_reduce"] == "ok":
        note = (f"all_reduce works eagerly and captured; {names} fail eagerly too: {setting} leaves them without an "
                "algorithm (configuration, not graph capture)")
        return outcome("partial", note + named_only(algo, nccl_version), "nccl-algo-unavailable", metrics, evidence)
    if "capture-only" in kinds:
        only = ", ".join(sorted(op for op, c in bad.items() if c == "capture-only"))
        note = f"{only}: eager works, CUDA-graph capture fails"
        others = sorted(op for op, c in bad.items() if c != "capture-only")
        if others:
            note += f"; also failing: {', '.join(others)}"
        return outcome("fail", note, "nccl-capture-failed", metrics, evidence)
    if "algo-unavailable" in kinds:
        return outcome(
            "fail",
            f"{names}: no algorithm available under {setting}",
            "nccl-algo-unavailable",
            metrics,
            evidence,
        )
    first = next(iter(per_op.get(sorted(bad)[0], {}).values()), {})
    return outcome(
        "fail", f"{names}: {first.get('error', 'failed')[:300]}", first.get("code") or "nccl-error", metrics, evidence
    )


def table_verdict(per_op: dict[str, dict[str, dict[str, str]]], matrix: dict[str, dict[str, int]], algo: str,
                  proto: str = "default", nccl_version: str = "") -> dict[str, Any]:
    """A ``check=table`` variant's outcome (pure): the one rank's four ops, then what NCCL's enable matrix under
    the setting (``_nccl.enable_matrix``: how NCCL parsed it) says of two or more ranks. Never ``pass``: one rank
    moves no data between GPUs, and whether an enabled algorithm implements a collective is decided across ranks
    (a global ``NCCL_ALGO=Tree`` enables Tree for broadcast, which has none)."""
    ran = verdict(per_op, algo, proto, nccl_version)
    if ran["status"] != "pass":
        return ran  # an op failed, hung or was wrong even at one rank: that is the verdict
    setting = described(algo, proto)
    release_ = nccl_version or "?"
    funcs = tuple(NCCL_FUNCS[op] for op in OPS)
    evidence = {**ran["evidence"], "enabled": {f: matrix[f] for f in funcs if f in matrix}, "world": 1}
    metrics = ran["metrics"]
    ran_note = "the four ops ran exact at one rank, eagerly and captured"
    if algo == "default" and proto == "default":
        return outcome("partial", f"{setting}: {ran_note}; the collectives across ranks need a host of two or more "
                       "GPUs", "nccl-setup-only", metrics, evidence)
    lacking = [f for f in funcs if f not in matrix]
    if lacking:
        return outcome("partial", f"{setting}: accepted at init; {ran_note}; NCCL {release_} logged no enable "
                       f"matrix for {', '.join(lacking)}", "nccl-setup-only", metrics, evidence)
    none = _nccl.without_algorithm(matrix, funcs)
    if none:
        ops = ", ".join(op for op in OPS if NCCL_FUNCS[op] in none)
        note = (f"{setting}: NCCL {release_} parsed it into an enable matrix with no algorithm for {ops}, so on two "
                "or more ranks they fail at warm-up; at one rank NCCL copies locally, so the ops ran")
        return outcome("partial", note + named_only(algo, nccl_version), "nccl-algo-unavailable", metrics,
                       {**evidence, "no_algorithm": none})
    return outcome("partial", f"{setting}: accepted at init; NCCL {release_}'s enable matrix keeps an algorithm on "
                   f"for each of the four collectives (whether it implements the collective is decided across "
                   f"ranks); {ran_note}", "nccl-setup-only", metrics, evidence)


# --------------------------------------------------------------------------------------------------
# In-rank execution


@dataclass
class OpCase:
    name: str
    load: Callable[[int], None]  # write this seed's inputs, fill outputs with the sentinel
    step: Callable[[], None]  # one collective (what gets captured)
    out: Any
    expected: Callable[[int], Any]
    own: Callable[[int], Any] | None  # this rank's contribution when it has the output's shape


def build_cases(rank: int, world: int, device: Any) -> list[OpCase]:
    import torch
    import torch.distributed as dist

    n = ELEMS
    bf16 = torch.bfloat16

    ar_in = torch.empty(n, device=device, dtype=bf16)
    ar_buf = torch.empty(n, device=device, dtype=bf16)

    def ar_load(seed: int) -> None:
        ar_in.copy_(_data.pattern((n,), rank, seed, device))
        ar_buf.fill_(_data.SENTINEL)

    def ar_step() -> None:
        ar_buf.copy_(ar_in)  # copy first so K captured calls give the same result, not world**K times it
        dist.all_reduce(ar_buf)

    ag_in = torch.empty(n, device=device, dtype=bf16)
    ag_out = torch.empty(world * n, device=device, dtype=bf16)

    def ag_load(seed: int) -> None:
        ag_in.copy_(_data.pattern((n,), rank, seed, device))
        ag_out.fill_(_data.SENTINEL)

    def ag_expected(seed: int) -> Any:
        return torch.cat([_data.pattern((n,), r, seed, device) for r in range(world)])

    rs_in = torch.empty(world * n, device=device, dtype=bf16)
    rs_out = torch.empty(n, device=device, dtype=bf16)

    def rs_load(seed: int) -> None:
        rs_in.copy_(_data.pattern((world * n,), rank, seed, device))
        rs_out.fill_(_data.SENTINEL)

    def rs_expected(seed: int) -> Any:
        return _data.pattern_sum((world * n,), world, seed, device)[rank * n : (rank + 1) * n]

    bc_src = torch.empty(n, device=device, dtype=bf16)
    bc_buf = torch.empty(n, device=device, dtype=bf16)

    def bc_load(seed: int) -> None:
        if rank == 0:
            bc_src.copy_(_data.pattern((n,), 0, seed, device))
        else:
            bc_src.fill_(_data.SENTINEL)
        bc_buf.fill_(_data.SENTINEL)

    def bc_step() -> None:
        bc_buf.copy_(bc_src)
        dist.broadcast(bc_buf, src=0)

    return [
        OpCase(
            "all_reduce",
            ar_load,
            ar_step,
            ar_buf,
            lambda s: _data.pattern_sum((n,), world, s, device),
            lambda s: _data.pattern((n,), rank, s, device),
        ),
        OpCase("all_gather", ag_load, lambda: dist.all_gather_into_tensor(ag_out, ag_in), ag_out, ag_expected, None),
        OpCase("reduce_scatter", rs_load, lambda: dist.reduce_scatter_tensor(rs_out, rs_in), rs_out, rs_expected, None),
        OpCase("broadcast", bc_load, bc_step, bc_buf, lambda s: _data.pattern((n,), 0, s, device), None),
    ]


def _failure(exc: BaseException) -> dict[str, str]:
    text = _errors.error_tail(exc)
    return {"verdict": "error", "code": _nccl.classify_error(text), "error": text}


def _judge(case: OpCase, seed: int) -> dict[str, str]:
    """References are made on the GPU and compared there; the host-side comparison runs only to name a mismatch
    (references on the host cost a second per variant on 2x H200)."""
    expected = case.expected(seed)
    if _data.equal_exactly(case.out, expected):
        return {"verdict": "ok"}
    own = case.own(seed) if case.own else None
    chk = _data.check_exact(case.out, expected, own_input=own, prior=_data.filled(case.out.shape))
    if chk.ok:
        return {"verdict": "ok"}
    return {"verdict": chk.verdict, "code": "nccl-wrong-result", "error": chk.detail}


def run_eager(case: OpCase, seed: int) -> dict[str, str]:
    try:
        case.load(seed)
        case.step()
        _device.wait_device(OP_DEADLINE_S)
    except _device.Hung as exc:
        return {"verdict": "hang", "code": "nccl-op-hang", "error": str(exc)}
    except Exception as exc:
        return _failure(exc)
    return _judge(case, seed)


def run_graph(case: OpCase, warmup: int, seeds: tuple[int, ...], gloo: Any) -> dict[str, str]:
    graph = None
    captured: dict[str, str] = {}
    try:
        case.load(seeds[0])
        graph = _device.capture(case.step, CAPTURED_CALLS, warmup=warmup)
    except Exception as exc:
        captured = _failure(exc)
    # Replaying while a peer failed to capture would leave this rank spinning: agree first.
    if not _dist.agree(graph is not None, gloo):
        return captured or {"verdict": "error", "code": "nccl-capture-failed", "error": "a peer rank failed to capture"}
    assert graph is not None
    for seed in seeds:
        try:
            case.load(seed)  # fresh inputs per replay: a stale result from the previous replay is caught
            graph.replay()
            _device.wait_device(OP_DEADLINE_S)
        except _device.Hung as exc:
            return {"verdict": "hang", "code": "nccl-op-hang", "error": str(exc)}
        except Exception as exc:
            return _failure(exc)
        res = _judge(case, seed)
        if res["verdict"] != "ok":
            return res
    return {"verdict": "ok"}


def exercise(cases: list[OpCase], warm: bool, gloo: Any, log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for case in cases:
        modes: dict[str, Any] = {}
        results[case.name] = modes
        if warm:
            modes["eager"] = run_eager(case, 1)
        modes["graph"] = run_graph(case, 1 if warm else 0, (2, 3), gloo)
        if not warm:
            modes["eager_after"] = run_eager(case, 4)
        log(f"{case.name}: " + ", ".join(f"{m}={r['verdict']}" for m, r in modes.items()))
        # Decided together: a rank that stopped alone would leave its peers waiting in the next exchange.
        if not _dist.agree(all(r["verdict"] != "hang" for r in modes.values()), gloo):
            break  # a stream is stuck behind the hung collective; nothing later can run
    return results


def checks_agreement(algo: str, warm: bool, runtime_connect: str) -> bool:
    """The agreement check runs once per algorithm: in its variant with eager warm-up and NCCL's default
    connection (the warm-up and connection variants change when channels connect, not how the sum is made)."""
    return warm and runtime_connect == "default"


def agreement_cases(setup_only: bool) -> tuple[_agree.Case, ...]:
    """The agreement cases at this level: one per dtype, checked exactly (``_agree.shallow_cases``), for a
    ``depth=setup`` variant (``setup_only``); every case of ``_agree.cases`` at a deep world size."""
    return _agree.shallow_cases(_agree.DTYPES) if setup_only else _agree.cases(_agree.DTYPES)


def agreement_outcome(result: dict[str, Any], agreed: dict[str, dict[str, Any]], setting: str) -> dict[str, Any]:
    """``result`` with the agreement summary applied (``_agree.apply``), or ``fail`` + ``nccl-wrong-result`` when
    an agreement case's integer-valued call was not the exact sum (pure). A worse verdict stays."""
    found = _agree.inexact(agreed)
    if found is not None and result.get("status") in ("pass", "partial"):
        key, chk = found
        if chk.get("verdict") in ("no-op", "zero", "wrong"):
            note = f"agreement case {key}: integer inputs gave {chk['verdict']} ({chk.get('detail', '')})"
            result = outcome("fail", note[:400], "nccl-wrong-result", result.get("metrics"), result.get("evidence"))
    return _agree.apply(result, _agree.summarize(agreed), f"NCCL allreduce ({setting})")


def agreement_bind(rank: int, world: int, device: Any) -> Callable[[_agree.Case], _agree.Bound]:
    """NCCL's allreduce under this variant's algorithm, in place on a buffer of the case's dtype."""
    import torch.distributed as dist

    buffers: dict[str, Any] = {}

    def bind(case: _agree.Case) -> _agree.Bound:
        import torch

        dtype = _agree.torch_dtype(case.dtype)
        if case.dtype not in buffers:
            buffers[case.dtype] = torch.empty(_agree.max_numel(), device=device, dtype=dtype)
        buf = buffers[case.dtype][: case.numel]
        return _agree.allreduce_bound(case, buf, buf, lambda: dist.all_reduce(buf), rank, world)

    return bind


def run(ctx: RankContext) -> dict[str, Any]:
    algo = ctx.param("algo", "default") or "default"
    proto = ctx.param("proto", "default") or "default"
    warm = (ctx.param("warmup", "yes") or "yes") == "yes"
    rc = ctx.param("runtime_connect", "default") or "default"
    if algo not in ALGOS or proto not in PROTOS:
        return outcome("fail", f"unknown setting algo={algo!r} proto={proto!r}; known: algo {', '.join(ALGOS)}; "
                       f"proto {', '.join(PROTOS)}", "probe-bug")
    set_, unset = nccl_env(algo, rc, proto)
    removed = {k: os.environ.pop(k) for k in unset if k in os.environ}
    os.environ.update(set_)
    os.environ.update(_nccl.nccl_debug_env(ctx.workdir))
    # Keep the rank alive after an NCCL error so that it can report which op failed and how.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    multicast = _dist.keep_multicast_off()

    import torch

    if (skipped := _dist.gpu_precheck(ctx)) is not None:
        return skipped

    device = _dist.init_dist(ctx, "nccl")
    gloo = _dist.cpu_group()
    cases = build_cases(ctx.rank, ctx.world_size, device)
    mine = exercise(cases, warm, gloo, ctx.log)
    everyone = _dist.gather_objects(mine, gloo)
    per_op = merge_rank_results(everyone)
    version = _nccl.runtime_version(torch)
    one_rank = ctx.param(TABLE[0]) == TABLE[1]
    if one_rank:
        result = table_verdict(per_op, _nccl.read_nccl_logs(ctx.workdir)["enabled"], algo, proto, version)
    else:
        result = verdict(per_op, algo, proto, version)
    agreed: dict[str, Any] = {}
    setup_only = shallow(ctx.variant)  # depth=setup: one exact agreement case per dtype
    if not one_rank and checks_agreement(algo, warm, rc) and op_class(per_op.get("all_reduce", {})) == "ok":
        agreed = _agree.run_cases(agreement_bind(ctx.rank, ctx.world_size, device), agreement_cases(setup_only),
                                  gloo, ctx.log, exact=setup_only)
        result = agreement_outcome(result, agreed, described(algo, proto))
    if setup_only:
        result["evidence"]["checked"] = f"the four ops and one exact agreement case per dtype; {_agree.FULL_GRID_SETUP}"
    logs = [_nccl.read_nccl_logs(ctx.workdir, pid) for pid in _dist.gather_objects(os.getpid(), gloo)]
    result["evidence"].update(
        {
            "nccl_env": {**set_, **{k: "(unset)" for k in unset}},
            "removed_from_env": removed,
            "multicast_env": multicast,
            "torch": torch.__version__,
            "nccl_version": version,
            "transports": sorted({t for lg in logs for t in lg["transports"]}),
            "algorithms_chosen": logs[0]["algorithms"] if logs else {},
            "nccl_warnings": [w for lg in logs for w in lg["warnings"]][-6:],
            "captured_calls": CAPTURED_CALLS,
            "elements_per_rank": ELEMS,
            "agreement": agreed,
        }
    )
    return result


# --- declared fields: what this probe records, and the roles checks report and checks advise read them by
# (inenv.probe.Field: name, unit, meaning, role). Left out of the probe hash: it changes no verdict.
METRICS = (
    ("ops_ok", "count", "collectives exact eagerly and in a CUDA graph", None),
    ("ops_total", "count", "collectives checked", None),
    ("agreement", "record", "rank agreement on random bf16/fp16 data (inenv/kit/_agree.py): ranks identical, "
     "differing elements, max ulp between ranks, deterministic, max ulp vs the float64 sum, divergent cases",
     "agreement"),
)
EVIDENCE = (
    ("ops", "record", "per collective, the eager and graph results against the exact answer", "op-checks"),
)
ALLREDUCE_PATH = True
