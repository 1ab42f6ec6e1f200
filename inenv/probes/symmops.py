"""symm-mem's ops on the ranks: each op eagerly and captured at every size, checked exactly; multimem's attempt
and the group's word on it; the sustained load (calls captured in one graph, replayed back to back); the agreement
cases and their outcome.

Not a probe (no SPEC): symm-mem imports it and carries it in its hash.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from inenv.kit import _agree, _data, _device, _dist, _errors
from inenv.probe import at_level, outcome

TOKENS = (1, 16, 128)  # 14 KiB, 224 KiB, 1.75 MiB of bf16 at hidden 7168
OP_DEADLINE_S = 30.0
# The sustained-load variant (load=sustained): calls captured in one graph, the graph replayed back to back with
# no host wait between replays, the whole run bounded in time. A signal protocol that wedges under load (peer
# access without native P2P atomics) stops there, where the short checks above pass.
SUSTAIN_TOKENS = 8  # a decode step of 8 sequences
SUSTAIN_CALLS = 100  # per graph
SUSTAIN_REPLAYS = (50, 10)  # full, quick: 5000 and 1000 calls of each op
SUSTAIN_DEADLINE_S = 120.0
# What multimem_all_reduce_ can give, best first: `refused` and `missing` are the expected negatives
# (no multicast; an older torch), the rest are failures. The worst rank's word is the group's.
MULTIMEM_RESULTS = ("ok", "refused", "missing", "error", "zero", "no-op", "wrong", "hang")
MULTIMEM_FAILED = MULTIMEM_RESULTS[3:]
# torch's own refusal (a TORCH_CHECK before any launch) when the rendezvous gave no multicast mapping;
# any other error, even one that mentions multicast, is a failure.
MULTIMEM_REFUSAL = re.compile(r"multimem_all_reduce_: multicast support is required")


# --------------------------------------------------------------------------------------------------
# In-rank execution


def error_box(exc: BaseException) -> dict[str, str]:
    return {"verdict": "error", "error": _errors.error_tail(exc)}


def judge(out: Any, expected: Any, own: Callable[[], Any] | None) -> dict[str, str]:
    """``expected`` on the device of ``out``: compared there; the host-side comparison (with this rank's own
    input, made only then) runs only to name a mismatch."""
    if _data.equal_exactly(out, expected):
        return {"verdict": "ok"}
    chk = _data.check_exact(out, expected, prior=_data.filled(out.shape), own_input=own() if own else None)
    return {"verdict": "ok"} if chk.ok else {"verdict": chk.verdict, "detail": chk.detail}


StepBuilder = Callable[[Any, Any, Any], Callable[[], None]]


def exercise_op(
    builder: StepBuilder, buf: Any, rank: int, world: int, device: Any, gloo: Any, sizes: tuple[int, ...]
) -> dict[str, dict[str, Any]]:
    """Eager then captured, per token count of ``sizes``; the first size that fails on any rank decides the
    mode's verdict.

    Every exchange below is reached by every rank in the same order, whatever fails locally."""
    import torch

    results: dict[str, dict[str, Any]] = {}
    for mode in ("eager", "graph"):
        res: dict[str, Any] = {"verdict": "ok"}
        everyone = ["ok"]
        for tokens in sizes:
            shape = (tokens, _data.HIDDEN)
            inp = buf[: tokens * _data.HIDDEN].view(shape)  # a view of the symmetric buffer, as the ops need
            out = torch.empty(shape, device=device, dtype=torch.bfloat16)
            staged = torch.empty(shape, device=device, dtype=torch.bfloat16)
            step = builder(inp, out, staged)

            def load(seed: int, staged: Any = staged, out: Any = out, shape: tuple[int, int] = shape) -> None:
                staged.copy_(_data.pattern(shape, rank, seed, device))
                out.fill_(_data.SENTINEL)

            seeds = (1,) if mode == "eager" else (2, 3)
            graph = None
            if mode == "graph":
                try:
                    load(seeds[0])
                    graph = _device.capture(step, 2, warmup=1)
                except Exception as exc:
                    res = error_box(exc)
                # Replaying while a peer failed to capture would spin forever: agree first.
                if not _dist.agree(graph is not None, gloo):
                    if res["verdict"] == "ok":
                        res = {"verdict": "error", "error": "a peer rank failed to capture"}
                    res["tokens"] = tokens
                    everyone = ["error"]
                    break
            try:
                for seed in seeds:
                    load(seed)
                    if graph is not None:
                        graph.replay()
                    else:
                        step()
                    _device.wait_device(OP_DEADLINE_S)
                    res = judge(out, _data.pattern_sum(shape, world, seed, device),
                                 lambda shape=shape, seed=seed: _data.pattern(shape, rank, seed))
                    if res["verdict"] != "ok":
                        break
            except _device.Hung as exc:
                res = {"verdict": "hang", "error": str(exc)}
            except Exception as exc:
                res = error_box(exc)
            everyone = _dist.gather_objects(res["verdict"], gloo)
            if _dist.worst_verdict(everyone) != "ok":
                res = dict(res, tokens=tokens)
                if res["verdict"] == "ok":
                    res = {"verdict": _dist.worst_verdict(everyone), "error": "failed on a peer rank", "tokens": tokens}
                break
        results[mode] = res
        if "hang" in everyone:
            break  # a stream is stuck; nothing later can run
    return results


def steps(group_name: str) -> dict[str, StepBuilder]:
    """Per op: a builder of one captured step that reads ``staged`` and leaves the sum in ``out``."""
    one_out = _dist.symm_op("one_shot_all_reduce_out")
    one = _dist.symm_op("one_shot_all_reduce")
    two_out = _dist.symm_op("two_shot_all_reduce_out")
    two = _dist.symm_op("two_shot_all_reduce_")
    found: dict[str, StepBuilder] = {}
    if one_out is not None or one is not None:

        def one_shot(inp: Any, out: Any, staged: Any) -> Callable[[], None]:
            def step() -> None:
                inp.copy_(staged)
                if one_out is not None:
                    one_out(inp, "sum", group_name, out)
                else:
                    out.copy_(one(inp, "sum", group_name))

            return step

        found["one_shot"] = one_shot
    if two_out is not None or two is not None:

        def two_shot(inp: Any, out: Any, staged: Any) -> Callable[[], None]:
            def step() -> None:
                inp.copy_(staged)
                if two_out is not None:
                    two_out(inp, "sum", group_name, out)
                else:
                    two(inp, "sum", group_name)
                    out.copy_(inp)

            return step

        found["two_shot"] = two_shot
    return found


def multimem_error(text: str, multicast: bool) -> dict[str, str]:
    """The result for an error from multimem_all_reduce_: ``refused`` only for torch's own refusal, and only
    when the rendezvous gave no multicast address (with one, the same words would be a failure)."""
    refused = not multicast and MULTIMEM_REFUSAL.search(text) is not None
    return {"verdict": "refused" if refused else "error", "error": text}


def worst_multimem(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The group's multimem result: the worst rank's (an unknown word counts as the worst)."""
    order = {v: i for i, v in enumerate(MULTIMEM_RESULTS)}
    return max(results, key=lambda r: order.get(r.get("verdict"), len(order)), default={})


def try_multimem(buf: Any, group_name: str, rank: int, world: int, device: Any, multicast: bool) -> dict[str, Any]:
    """Call multimem_all_reduce_. Without a multicast mapping torch refuses before launching anything
    (a TORCH_CHECK on the handle), which is the expected negative; it is only run for real when the
    rendezvous produced a multicast address, i.e. when the user allowed multicast."""
    op = _dist.symm_op("multimem_all_reduce_")
    if op is None:
        return {"verdict": "missing"}
    shape = (16, _data.HIDDEN)
    inp = buf[: 16 * _data.HIDDEN].view(shape)
    inp.copy_(_data.pattern(shape, rank, 5, device))
    try:
        op(inp, "sum", group_name)
        _device.wait_device(OP_DEADLINE_S)
    except _device.Hung as exc:
        return {"verdict": "hang", "error": str(exc)}
    except Exception as exc:
        return multimem_error(_errors.error_tail(exc), multicast)
    if not multicast:
        return {"verdict": "error", "error": "ran without a multicast address (unexpected)"}
    return judge(inp, _data.pattern_sum(shape, world, 5, device), lambda: _data.pattern(shape, rank, 5))


def sustain_op(builder: StepBuilder, buf: Any, rank: int, world: int, device: Any, gloo: Any,
               replays: int) -> dict[str, Any]:
    """``replays`` replays of a graph of ``SUSTAIN_CALLS`` calls, queued back to back, then one wait bounded by
    ``SUSTAIN_DEADLINE_S`` and an exact check of the last call; every rank settles each step together."""
    import time

    import torch

    shape = (SUSTAIN_TOKENS, _data.HIDDEN)
    inp = buf[: SUSTAIN_TOKENS * _data.HIDDEN].view(shape)
    out = torch.empty(shape, device=device, dtype=torch.bfloat16)
    staged = _data.pattern(shape, rank, 7, device)
    local: dict[str, Any] = {"verdict": "ok"}
    graph = None
    try:
        out.fill_(_data.SENTINEL)
        graph = _device.capture(builder(inp, out, staged), SUSTAIN_CALLS, warmup=1)
    except Exception as exc:
        local = error_box(exc)
    if (stopped := _dist.settle(local, gloo)) is not None:
        return {**stopped, "calls": 0}
    assert graph is not None
    start = time.monotonic()
    try:
        for _ in range(replays):
            graph.replay()
        _device.wait_device(SUSTAIN_DEADLINE_S)
        local = judge(out, _data.pattern_sum(shape, world, 7, device), lambda: _data.pattern(shape, rank, 7))
    except _device.Hung as exc:
        local = {"verdict": "hang", "error": str(exc)}
    except Exception as exc:
        local = error_box(exc)
    local.update(calls=replays * SUSTAIN_CALLS, seconds=round(time.monotonic() - start, 3))
    return _dist.settle(local, gloo) or local


def sustained_verdict(results: dict[str, dict[str, Any]], facts: dict[str, Any]) -> dict[str, Any]:
    """The sustained-load variant's outcome (pure): a wedge is ``hang``, a wrong sum ``fail``, else ``pass``."""
    metrics = {"sustained_calls": {op: r.get("calls", 0) for op, r in results.items()},
               "sustained_s": {op: r.get("seconds") for op, r in results.items()}}
    evidence = {**facts, "sustained": results}
    for op, r in results.items():
        v = r.get("verdict")
        if v == "hang":
            note = (f"{op}: {r.get('calls', 0)} captured calls back to back did not finish within "
                    f"{SUSTAIN_DEADLINE_S:.0f} s ({r.get('error') or r.get('detail', '')})")
            return outcome("hang", note[:400], "symm-mem-sustained-hang", metrics, evidence)
        if v in ("wrong", "no-op", "zero"):
            return outcome("fail", f"{op} under sustained load: {v} ({r.get('detail', '')})"[:400],
                           "symm-mem-wrong-result", metrics, evidence)
        if v != "ok":
            return outcome("fail", f"{op} under sustained load: {r.get('error') or r.get('detail') or v}"[:400],
                           "symm-mem-op-failed", metrics, evidence)
    if not results:
        return outcome("fail", "no one-shot or two-shot op in this torch to load", "symm-mem-op-missing", metrics,
                       evidence)
    return outcome("pass", metrics=metrics, evidence=evidence)


def checked(setup_only: bool) -> tuple[tuple[int, ...], tuple[_agree.Case, ...]]:
    """(token counts each op is checked at, eagerly and captured; agreement cases per op) at this level: the
    shallow selection (``setup_only``: ranks sharing a GPU or ``depth=setup``) one size and
    ``_agree.shallow_cases`` (rendezvous and the ops' refusal of a world size show at any size; every size is
    checked at the deep world sizes)."""
    if setup_only:
        return TOKENS[:1], _agree.shallow_cases(("bf16",))
    return at_level(TOKENS), _agree.cases(("bf16",))


def agreement_outcome(result: dict[str, Any], agreed: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``result`` with the agreement summary applied (``_agree.apply``), or ``fail`` + ``symm-mem-wrong-result``
    when an agreement case's integer-valued call was not the exact sum (pure). A worse verdict stays."""
    found = _agree.inexact(agreed)
    if found is not None and result.get("status") in ("pass", "partial"):
        key, chk = found
        if chk.get("verdict") in ("no-op", "zero", "wrong"):
            note = f"agreement case {key}: integer inputs gave {chk['verdict']} ({chk.get('detail', '')})"
            result = outcome("fail", note[:400], "symm-mem-wrong-result", result.get("metrics"),
                             result.get("evidence"))
    return _agree.apply(result, _agree.summarize(agreed), "torch symmetric memory (one-/two-shot)")


def agreement(buf: Any, group_name: str, rank: int, world: int, gloo: Any,
              log: Callable[[str], None], wanted: tuple[_agree.Case, ...] | None = None,
              exact: bool = False) -> dict[str, dict[str, Any]]:
    """The rank agreement check (``_agree``) of each op on the symmetric buffer, keyed ``<op>:<case>``: the cases
    ``wanted`` (by default every bf16 case of this level), ``exact`` passed to ``_agree.run_cases``."""
    import torch

    out_buf = torch.empty_like(buf)
    found: dict[str, dict[str, Any]] = {}
    for name, builder in steps(group_name).items():

        def bind(case: _agree.Case, builder: StepBuilder = builder) -> _agree.Bound:
            inp, out = buf[: case.numel], out_buf[: case.numel]
            shape = (case.tokens, case.hidden)
            # the op reads the symmetric buffer itself: its staging copy is a copy onto itself here
            step = builder(inp.view(shape), out.view(shape), inp.view(shape))
            return _agree.allreduce_bound(case, inp, out, step, rank, world)

        cases = _agree.cases(("bf16",)) if wanted is None else wanted
        for key, res in _agree.run_cases(bind, cases, gloo, log, exact=exact).items():
            found[f"{name}:{key}"] = res
        if any(r.get("verdict") == "hang" for r in found.values()):
            break
    return found
