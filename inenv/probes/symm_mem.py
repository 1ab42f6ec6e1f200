"""torch symmetric memory: rendezvous, peer reads, one-shot / two-shot allreduce eager and captured,
and the multicast (multimem) ops, which must be refused where multicast is absent or disabled
(stackprobe keeps it disabled unless STACKPROBE_ALLOW_MULTICAST=1; docs/probes.md, symm-mem, says how to
read each verdict).

PyTorch core has no compute-capability allow-list here: the P2P ops need only peer access. The
framework wrappers (SGLang, vLLM) additionally demand multicast, so a pass on the P2P ops with a
multicast refusal is reported as ``partial`` with the refusal named: that is the verdict a PCIe
user needs. Ranks sharing one GPU use ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` and a gloo
group (NCCL refuses two ranks on one device).

Every size and agreement case runs at the deep world sizes (``inenv.probe.deep_sizes``); elsewhere a variant runs
the shallow selection (:func:`checked`: the rendezvous, where a world size is refused, each op at one size eagerly
and captured, and one exact agreement case per op), with a GPU per rank (``depth=setup``) at the other world sizes
up to the host's GPU count, with every rank on one GPU (``placement=shared``) beyond it.

``backend=nccl`` (a GPU per rank, at the deep world sizes): torch's NCCL symmetric-memory backend
(``set_backend("NCCL")``: ``ncclMemAlloc`` and ``ncclCommWindowRegister`` with ``NCCL_WIN_COLL_SYMMETRIC``) where
the cell's torch has it, else ``skip``. Windows registered eagerly through torch's rendezvous, the peer pointers it
got checked (a registration that returns without error may have registered nothing), then the symmetric kernels:
NCCL's allreduce on the registered window and torch's one-shot / two-shot, eager and captured; and, as an engine's
own NCCL communicator does it, windows registered with ``ncclCommWindowRegister`` eagerly and during CUDA-graph
capture, each followed by an allreduce on it. The verdict names what failed: registration, registered nothing, a
kernel, or registration during capture, with NCCL's own words (:func:`nccl_backend_verdict`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from collections.abc import Callable
from typing import Any

from inenv.kit import _agree, _data, _device, _dist, _errors, _nccl
from inenv.probe import (
    OMIT,
    QUICK,
    SETUP,
    HostView,
    ProbeSpec,
    RankContext,
    Variant,
    at_level,
    gpu_shortfall,
    multi_rank,
    outcome,
    shallow,
)
from inenv.probes.symmops import (
    MULTIMEM_FAILED,
    OP_DEADLINE_S,
    SUSTAIN_REPLAYS,
    TOKENS,
    agreement,
    agreement_outcome,
    checked,
    error_box,
    exercise_op,
    judge,
    steps,
    sustain_op,
    sustained_verdict,
    try_multimem,
    worst_multimem,
)

SPEC = ProbeSpec(
    id="symm-mem",
    title="torch symmetric memory",
    feature="Do torch symmetric-memory rendezvous and the one-shot / two-shot allreduce work (eager and in a "
    "CUDA graph), and are the multicast ops refused where multicast is unavailable? Where torch has its NCCL "
    "backend, do NCCL windows register eagerly and during capture, and do the symmetric kernels run on them?",
    ranks=(2, 4, 8),
    min_ranks=2,  # over one rank an allreduce returns its input
    # backend=nccl at one rank, on a host of one GPU: registration eagerly and in capture (ONE_RANK_OPS)
    min_ranks_by_param=(("backend", "nccl", 1),),
    # backend=nccl registers windows and checks each allreduce's result exactly: nothing timed, so it shares the
    # GPU with other such variants instead of waiting for it alone
    untimed_params=(("backend", "nccl"),),
    distinct_gpus=False,  # the placement=shared variants put every rank on one GPU
    requires=("torch",),
    timeout_s=180.0,
    # torch reads TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES at the symmetric-memory rendezvous, not at import.
    # Its symmetric-memory module pulls in sympy (through symbolic_shapes) on first use: 0.5 s, pure Python.
    preload=(*_dist.PRELOAD_DIST, "torch.distributed._symmetric_memory", "torch.fx.experimental.symbolic_shapes"),
)

OVERLAP_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"
P2P_OPS = ("one_shot", "two_shot")
BACKEND, NCCL = "backend", "nccl"  # the variant param of torch's NCCL symmetric-memory backend
# torch's refusal of a backend its build does not hold (SymmetricMemory.cpp, set_backend)
NO_BACKEND = re.compile(r"does not find allocation backend")
WINDOW_ELEMS = 4 << 10  # float32 elements of an engine-path window: 16 KiB
WINDOW_MODES = ("eager", "capture")


def variants(host: HostView) -> list[Variant]:
    # Beyond the host's GPU count the ranks share the first GPU (torch's overlapping-devices switch); at 2 ranks
    # they also do on a host with more; below it, the world sizes that are not deep run depth=setup
    out = multi_rank(SPEC, host, [()], lambda _: True, shared_gpus=1, other_sizes=SETUP)
    if host.gpu_count >= 2:
        out.append(Variant(SPEC.id, 2, share_gpu=True, gpus=1))
    # Sustained load on GPUs of their own: at 2 ranks and at the host's GPU count
    for n in sorted({2, max(host.gpu_count, 2)}):
        why = "sustained load is measured on peer links, a GPU per rank"
        out.append(Variant(SPEC.id, n, params=(("load", "sustained"),), skip=gpu_shortfall(host, n, why)))
    # torch's NCCL backend: NCCL refuses two ranks on one GPU; the registration question is asked at the deep sizes
    out += multi_rank(SPEC, host, [((BACKEND, NCCL),)], why="NCCL refuses two ranks on one GPU", other_sizes=OMIT)
    if host.gpu_count == 1 and host.level != QUICK:
        out.append(Variant(SPEC.id, 1, params=((BACKEND, NCCL),)))  # as far as one GPU goes: ONE_RANK_OPS
    return out


# backend=nccl at one rank: what a host of one GPU can ask of NCCL's windows (NCCL refuses two ranks on one GPU):
# torch's NCCL backend and an engine's own communicator register windows eagerly and during CUDA-graph capture
# (registration during capture is where NCCL releases have failed with "unhandled cuda error"), and NCCL's
# allreduce runs on the registered window; torch's one-shot and two-shot kernels, which read peers' buffers, need
# two GPUs.
ONE_RANK_OPS = ("nccl_all_reduce",)


# --------------------------------------------------------------------------------------------------
# Verdict (pure)


def multicast_reason(device_supports: bool | None, disabled_by_env: bool) -> str:
    if disabled_by_env:
        return "symm-mem-multicast-disabled"
    return "symm-mem-no-multicast" if not device_supports else ""


def verdict(facts: dict[str, Any]) -> dict[str, Any]:
    """facts: rendezvous / p2p_read / ops[op][mode] / multimem / multicast_* gathered from all ranks."""
    metrics = {
        "ops_exact": sum(1 for op in facts.get("ops", {}).values() for r in op.values() if r.get("verdict") == "ok"),
        "ops_total": sum(len(op) for op in facts.get("ops", {}).values()),
        "multicast_ptr_nonzero": int(bool(facts.get("multicast_ptr"))),
    }
    if facts.get("rendezvous", {}).get("verdict") != "ok":
        err = facts.get("rendezvous", {}).get("error", "")
        code = "symm-mem-no-p2p" if facts.get("peer_access") is False else "symm-mem-rendezvous-failed"
        return outcome("fail", f"rendezvous failed: {err[:300]}", code, metrics, facts)
    if facts.get("p2p_read", {}).get("verdict") != "ok":
        return outcome(
            "fail",
            f"peer buffer read: {facts['p2p_read'].get('error', '')[:300]}",
            "symm-mem-wrong-result",
            metrics,
            facts,
        )
    bad = []
    for op, modes in facts.get("ops", {}).items():
        for mode, res in modes.items():
            if res.get("verdict") != "ok":
                bad.append((op, mode, res))
    missing = [op for op in P2P_OPS if op not in facts.get("ops", {})]
    wrong = [b for b in bad if b[2].get("verdict") in ("wrong", "no-op", "zero")]
    if wrong:
        op, mode, res = wrong[0]
        return outcome(
            "fail",
            f"{op} {mode}: {res.get('verdict')} ({res.get('detail', '')})",
            "symm-mem-wrong-result",
            metrics,
            facts,
        )
    if bad:
        names = ", ".join(f"{op} {mode}" for op, mode, _ in bad)
        first = bad[0][2]
        code = "symm-mem-capture-failed" if all(m == "graph" for _, m, _ in bad) else "symm-mem-op-failed"
        return outcome("fail", f"{names}: {first.get('error', first.get('verdict', ''))[:300]}", code, metrics, facts)
    if missing:
        return outcome("partial", f"this torch lacks {', '.join(missing)}", "symm-mem-op-missing", metrics, facts)
    return multimem_verdict(facts, metrics)


def multimem_verdict(facts: dict[str, Any], metrics: dict[str, Any]) -> dict[str, Any]:
    """The verdict once the P2P ops are exact, from the multimem result; every result word is named here,
    so an unexpected one is a failure of the probe, never a pass."""
    mm = facts.get("multimem", {})
    got = mm.get("verdict")
    if got == "ok":
        return outcome("pass", metrics=metrics, evidence=facts)
    if got == "refused":
        reason = facts.get("multicast_reason") or "symm-mem-no-multicast"
        why = "disabled by TORCH_SYMM_MEM_DISABLE_MULTICAST" if reason.endswith("disabled") else "no multicast"
        note = f"one-shot and two-shot exact eager and captured; multimem ops refused ({why})"
        return outcome("partial", note, reason, metrics, facts)
    if got == "missing":
        note = "one-shot and two-shot exact eager and captured; this torch has no multimem_all_reduce_"
        return outcome("partial", note, "symm-mem-op-missing", metrics, facts)
    if got in MULTIMEM_FAILED:
        return outcome(
            "fail",
            f"multimem_all_reduce_: {got} {mm.get('error', mm.get('detail', ''))[:200]}",
            "symm-mem-multimem-failed",
            metrics,
            facts,
        )
    return outcome("fail", f"multimem_all_reduce_ was not judged (result {got!r})", "probe-bug", metrics, facts)


# --------------------------------------------------------------------------------------------------
# backend=nccl: torch's NCCL symmetric-memory backend and NCCL's windows as an engine registers them


def registered_nothing(ptrs: list[int], world: int) -> bool:
    """Whether a rendezvous that returned without an error left this rank without a pointer to every peer's
    buffer (pure): no pointers, fewer than the ranks, or a null one."""
    return len(ptrs) < world or any(not p for p in ptrs)


def nccl_words(logs: list[dict[str, Any]], limit: int = 4) -> list[str]:
    """NCCL's own warnings from the ranks' logs, the last ``limit`` (pure)."""
    return [w for lg in logs for w in lg.get("warnings", [])][-limit:]


def nccl_backend_verdict(facts: dict[str, Any]) -> dict[str, Any]:
    """The backend=nccl outcome (pure over the facts every rank gathered), naming what failed first: torch's
    registration, a registration that registered nothing, a symmetric kernel (wrong numbers, an error, only when
    captured), then the engine path's windows (registered eagerly, during capture); NCCL's warnings close the
    note."""
    ops = facts.get("ops", {})
    metrics = {"ops_exact": sum(1 for op in ops.values() for r in op.values() if r.get("verdict") == "ok"),
               "ops_total": sum(len(op) for op in ops.values())}
    said = "; ".join(facts.get("nccl_words") or [])
    tail = f"; NCCL said: {said}"[:300] if said else ""

    def fail(note: str, code: str) -> dict[str, Any]:
        return outcome("fail", (note + tail)[:600], code, metrics, facts)

    reg = facts.get("registration", {})
    if reg.get("verdict") != "ok":
        return fail(f"registration through torch's NCCL backend (ncclMemAlloc, ncclCommWindowRegister) failed: "
                    f"{reg.get('error', '')[:300]}", "symm-mem-nccl-register-failed")
    if facts.get("registered") is False:
        return fail("registration returned without an error but registered nothing: " + str(facts.get(
            "nothing_on", "a rank has no pointer to its peers' buffers")), "symm-mem-nccl-registered-nothing")
    if facts.get("p2p_read", {}).get("verdict") not in (None, "ok"):
        r = facts["p2p_read"]
        return fail(f"peer buffer read: {r.get('verdict')} {r.get('detail') or r.get('error', '')}"[:300],
                    "symm-mem-wrong-result")
    bad = [(op, mode, r) for op, modes in ops.items() for mode, r in modes.items() if r.get("verdict") != "ok"]
    wrong = [b for b in bad if b[2].get("verdict") in ("wrong", "no-op", "zero")]
    if wrong:
        op, mode, r = wrong[0]
        return fail(f"{op} {mode} on the registered window: {r.get('verdict')} ({r.get('detail', '')})",
                    "symm-mem-wrong-result")
    if bad:
        names = ", ".join(f"{op} {mode}" for op, mode, _ in bad)
        first = bad[0][2]
        captured = " (eager works: only when captured)" if all(m == "graph" for _, m, _ in bad) else ""
        return fail(f"symmetric kernel {names}{captured}: {first.get('error', first.get('verdict', ''))[:300]}",
                    "symm-mem-nccl-kernel-failed")
    windows = facts.get("windows", {})
    if windows.get("verdict") == "missing":
        return outcome("partial", f"torch's NCCL backend registers and its kernels are exact; the engine path was not "
                       f"checked: {windows.get('error', '')}", "symm-mem-op-missing", metrics, facts)
    for mode in WINDOW_MODES:
        w = windows.get(mode) or {"verdict": "not-run", "error": "not reached"}
        v = w.get("verdict")
        if v == "ok":
            continue
        where = "during CUDA-graph capture" if mode == "capture" else "eagerly"
        if v == "nothing":
            return fail(f"ncclCommWindowRegister {where} returned without an error but no window (it registered "
                        "nothing)", "symm-mem-nccl-registered-nothing")
        if v in ("wrong", "no-op", "zero"):
            return fail(f"allreduce on a window registered {where}: {v} ({w.get('detail', '')})",
                        "symm-mem-wrong-result")
        if mode == "capture":
            return fail("registering a window during CUDA-graph capture failed, where registering it before capture "
                        f"works: {v} {w.get('error', '')[:300]}", "symm-mem-nccl-capture-register-failed")
        return fail(f"an engine's own NCCL communicator registering a window eagerly: {v} {w.get('error', '')[:300]}",
                    "symm-mem-nccl-register-failed")
    return outcome("pass", "NCCL windows registered eagerly and during capture; NCCL's allreduce and torch's "
                   "one-/two-shot on them exact, eager and captured", metrics=metrics, evidence=facts)


def _bounded(work: Callable[[], dict[str, Any]], deadline_s: float, what: str) -> dict[str, Any]:
    """``work()`` in a thread the rank waits for: NCCL calls that never return (a collective registration whose
    peer failed) become a ``hang`` the rank still reports."""
    box: dict[str, Any] = {}

    def go() -> None:
        try:
            box.update(work())
        except _device.Hung as exc:
            box.update(verdict="hang", error=str(exc))
        except Exception as exc:
            box.update(error_box(exc))

    thread = threading.Thread(target=go, name=f"stackprobe-{what}", daemon=True)
    thread.start()
    thread.join(deadline_s)
    return dict(box) if not thread.is_alive() else {"verdict": "hang", "error": f"{what}: not finished after "
                                                                              f"{deadline_s:.0f} s"}


class _Raw:
    """Device memory NCCL allocated, seen by torch through the CUDA array interface (float32 elements)."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (ptr, False), "version": 2,
                                         "strides": None}


def window_once(comm: _nccl.DirectComm, mode: str, rank: int, world: int, device: Any) -> dict[str, Any]:
    """One engine-path window: ncclMemAlloc'd memory registered as a symmetric window eagerly, or during the
    capture of a CUDA graph that then allreduces on it; the allreduce's result checked exactly."""
    import torch

    nbytes = WINDOW_ELEMS * 4
    ptr = comm.mem_alloc(nbytes)
    t = torch.as_tensor(_Raw(ptr, WINDOW_ELEMS), device=device)
    seed = 11 if mode == "eager" else 12
    t.copy_(_data.pattern((WINDOW_ELEMS,), rank, seed, device, dtype=torch.float32))
    torch.cuda.synchronize()
    if mode == "eager":
        win = comm.window_register(ptr, nbytes)
        if not win:
            return {"verdict": "nothing"}
        comm.all_reduce_f32(ptr, WINDOW_ELEMS)
    else:
        graph = torch.cuda.CUDAGraph()
        handles: list[int] = []
        with torch.cuda.graph(graph):
            handles.append(comm.window_register(ptr, nbytes))
            comm.all_reduce_f32(ptr, WINDOW_ELEMS)
        if not handles[0]:
            return {"verdict": "nothing"}
        t.copy_(_data.pattern((WINDOW_ELEMS,), rank, seed, device, dtype=torch.float32))
        graph.replay()
    _device.wait_device(OP_DEADLINE_S)
    expected = _data.pattern_sum((WINDOW_ELEMS,), world, seed, device, dtype=torch.float32)
    return judge(t, expected, None)


def engine_windows(rank: int, world: int, device: Any, gloo: Any, log: Callable[[str], None]) -> dict[str, Any]:
    """NCCL's symmetric windows through an NCCL communicator of the probe's own, as an engine's (vLLM's pynccl)
    uses them: registered eagerly, then during capture; every rank settles each mode together."""
    try:
        comm = _nccl.DirectComm(rank, world, gloo)
    except Exception as exc:
        return {"verdict": "error", "error": _errors.error_tail(exc)}
    lacking = [n for n in _nccl.WINDOW_CALLS if not comm.has(n)]
    if lacking:
        return {"verdict": "missing", "error": f"NCCL {comm.version} has no {', '.join(lacking)}"}
    out: dict[str, Any] = {"nccl": comm.version}
    for mode in WINDOW_MODES:
        mine = _bounded(lambda mode=mode: window_once(comm, mode, rank, world, device), OP_DEADLINE_S + 30.0,
                        f"window {mode}")
        everyone = _dist.gather_objects(mine, gloo)
        out[mode] = next((r for r in everyone if r.get("verdict") != "ok"), mine)
        log(f"window {mode}: {out[mode].get('verdict')}")
        if out[mode].get("verdict") != "ok":
            break  # a stream may be stuck behind it
    return out


def backend_choice(symm_mem: Any) -> dict[str, Any] | None:
    """Switch torch's symmetric memory to its NCCL backend before anything is allocated; None when it is, else
    the outcome: ``skip`` where this torch has no such backend (no ``set_backend``, or its build holds none
    named NCCL), ``fail`` where it refused otherwise."""
    chooser = getattr(symm_mem, "set_backend", None)
    if chooser is None:
        return outcome("skip", "this torch has no choice of symmetric-memory backend (no set_backend): its symmetric "
                       "memory is CUDA's only", "symm-mem-nccl-absent")
    try:
        chooser("NCCL")
    except Exception as exc:
        said = _errors.error_tail(exc, 300)
        if NO_BACKEND.search(said):
            return outcome("skip", f"this torch's build has no NCCL symmetric-memory backend: {said}",
                           "symm-mem-nccl-absent")
        return outcome("fail", f"set_backend('NCCL') refused: {said}", "symm-mem-nccl-register-failed")
    return None


def run_nccl_backend(ctx: RankContext) -> dict[str, Any]:
    multicast_env = _dist.keep_multicast_off()
    os.environ.update(_nccl.nccl_debug_env(ctx.workdir, "INIT,ENV,TUNING,REG"))
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    import torch

    if (skipped := _dist.gpu_precheck(ctx)) is not None:
        return skipped
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as exc:
        return outcome("skip", f"this torch has no symmetric memory: {exc}", "symm-mem-absent")
    refused = backend_choice(symm_mem)
    device = _dist.init_dist(ctx, "nccl")
    import torch.distributed as dist

    gloo = _dist.cpu_group()
    choices = _dist.gather_objects(refused, gloo)
    if any(c is not None for c in choices):  # every rank decides alike
        return next(c for c in choices if c is not None)
    group = dist.group.WORLD
    facts: dict[str, Any] = {"torch": torch.__version__, "backend": symm_mem.get_backend(device),
                             "nccl_version": _nccl.runtime_version(torch),
                             "multicast_env": multicast_env}
    numel = max(TOKENS) * _data.HIDDEN
    reg: dict[str, Any] = {"verdict": "ok"}
    handle = buf = None
    try:
        buf = symm_mem.empty(numel, dtype=torch.bfloat16, device=device)
        handle, _ = _dist.symm_rendezvous(buf, group)
    except Exception as exc:
        reg = error_box(exc)
    everyone = _dist.gather_objects(reg, gloo)
    facts["registration"] = next((r for r in everyone if r["verdict"] != "ok"), reg)
    if facts["registration"]["verdict"] == "ok" and handle is not None:
        try:
            ptrs = [int(p) for p in handle.buffer_ptrs]
        except Exception as exc:
            ptrs = []
            facts["buffer_ptrs_error"] = _errors.error_tail(exc, 200)
        nothing = _dist.gather_objects([ctx.rank, ptrs] if registered_nothing(ptrs, ctx.world_size) else None, gloo)
        empty = [n for n in nothing if n is not None]
        facts["registered"] = not empty
        if empty:
            facts["nothing_on"] = "; ".join(
                f"rank {r}: {sum(1 for x in p if not x)} of {len(p)} peer pointers null" if p else
                f"rank {r}: no peer pointers (torch's NCCL backend gives them only when built with NCCL's device API)"
                for r, p in empty)
        else:
            facts["p2p_read"] = peer_read(handle, buf, ctx.rank, ctx.world_size, device, gloo)
            builders = {**steps(group.group_name), "nccl_all_reduce": nccl_allreduce}
            if ctx.world_size == 1:
                builders = {k: v for k, v in builders.items() if k in ONE_RANK_OPS}
            facts["ops"] = {name: exercise_op(b, buf, ctx.rank, ctx.world_size, device, gloo, TOKENS[:1])
                            for name, b in builders.items()}
            ctx.log("ops: " + ", ".join(f"{n}={m}" for n, m in facts["ops"].items()))
    # at one rank the engine path is asked whatever torch's backend said (evidence: it needs no torch backend)
    if (facts.get("registered") or ctx.world_size == 1) and not any(
            r.get("verdict") == "hang" for m in facts.get("ops", {}).values() for r in m.values()):
        facts["windows"] = engine_windows(ctx.rank, ctx.world_size, device, gloo, ctx.log)
    logs = [_nccl.read_nccl_logs(ctx.workdir, pid) for pid in _dist.gather_objects(os.getpid(), gloo)]
    facts["nccl_words"] = nccl_words(logs)
    facts["algorithms_chosen"] = logs[0]["algorithms"] if logs else {}
    return one_rank_verdict(facts) if ctx.world_size == 1 else nccl_backend_verdict(facts)


def one_rank_verdict(facts: dict[str, Any]) -> dict[str, Any]:
    """A one-rank backend=nccl outcome (pure over the rank's facts): a failure is judged as at any rank count
    (:func:`nccl_backend_verdict`; a device communicator and a window of one rank are valid NCCL objects: NCCL
    2.28.9 registered through torch at one rank, 2.32.6 refused torch 2.11's request as a struct its headers
    predate); what works is never ``pass``, since no kernel read a peer's buffer. The engine path's windows are
    asked even when torch's registration failed, as evidence."""
    judged = nccl_backend_verdict(facts)
    if judged["status"] != "pass":
        return judged
    return outcome("partial", "at one rank: torch's NCCL backend and an engine's own NCCL communicator registered "
                   "windows, eagerly and during CUDA-graph capture, and NCCL's allreduce on them was exact; torch's "
                   "one-shot and two-shot kernels across ranks need a host of two or more GPUs",
                   "symm-mem-nccl-one-rank", judged.get("metrics"), evidence=facts)


def nccl_allreduce(inp: Any, out: Any, staged: Any) -> Callable[[], None]:
    """NCCL's allreduce on a view of the registered window (NCCL picks its symmetric kernels for such a buffer)."""
    import torch.distributed as dist

    def step() -> None:
        inp.copy_(staged)
        dist.all_reduce(inp)
        out.copy_(inp)

    return step


def peer_read(handle: Any, buf: Any, rank: int, world: int, device: Any, gloo: Any) -> dict[str, Any]:
    """Every rank writes its pattern, then reads its neighbour's buffer through the handle (the ranks wait for each
    other over gloo: the NCCL backend has no barrier of its own)."""
    import torch
    import torch.distributed as dist

    try:
        n = 4096
        buf[:n].copy_(_data.pattern((n,), rank, 9, device))
        torch.cuda.synchronize()
        dist.barrier(group=gloo)
        peer = (rank + 1) % world
        seen = handle.get_buffer(peer, (n,), torch.bfloat16).clone()
        _device.wait_device(OP_DEADLINE_S)
        dist.barrier(group=gloo)
        return judge(seen, _data.pattern((n,), peer, 9, device), None)
    except Exception as exc:
        return error_box(exc)


def run(ctx: RankContext) -> dict[str, Any]:
    if ctx.param(BACKEND) == NCCL:
        return run_nccl_backend(ctx)
    multicast_env = _dist.keep_multicast_off()
    shared = ctx.variant.share_gpu  # every rank on one GPU: overlapping devices, a gloo process group
    setup_only = shallow(ctx.variant)  # the shallow selection
    if shared:
        os.environ[OVERLAP_ENV] = "1"

    import torch

    if (skipped := _dist.gpu_precheck(ctx, shared)) is not None:
        return skipped
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as exc:
        return outcome("skip", f"this torch has no symmetric memory: {exc}", "symm-mem-absent")

    if shared:
        ctx = dataclasses.replace(ctx, device_index=0)  # every rank on the first visible GPU
    device = _dist.init_dist(ctx, "gloo" if shared else "nccl")
    import torch.distributed as dist

    gloo = _dist.cpu_group() if not shared else dist.group.WORLD
    group = dist.group.WORLD
    sizes, agreement_cases = checked(setup_only)
    facts: dict[str, Any] = {
        **({"checked": _agree.shallow_checked(shared)} if setup_only else {}),
        "torch": torch.__version__,
        "shared_gpu": shared,
        "multicast_env": multicast_env,
        "devices": _dist.gather_objects(ctx.device_index, gloo),
    }
    try:
        from torch._C._autograd import DeviceType
        from torch._C._distributed_c10d import _SymmetricMemory

        facts["device_multicast_support"] = bool(_SymmetricMemory.has_multicast_support(DeviceType.CUDA, device.index))
    except Exception as exc:
        facts["device_multicast_support"] = None
        facts["device_multicast_support_error"] = _errors.error_tail(exc, 200)
    if not shared:
        n = torch.cuda.device_count()
        facts["peer_access"] = all(
            torch.cuda.can_device_access_peer(a, b)
            for a in range(min(n, ctx.world_size))
            for b in range(min(n, ctx.world_size))
            if a != b
        )
    get_backend = getattr(symm_mem, "get_backend", None)
    if get_backend is not None:
        try:
            facts["backend"] = get_backend(device)
        except Exception as exc:
            facts["backend"] = f"? {_errors.error_tail(exc, 120)}"

    numel = max(max(TOKENS) * _data.HIDDEN, _agree.max_numel())
    rendezvous: dict[str, Any] = {"verdict": "ok"}
    try:
        buf = symm_mem.empty(numel, dtype=torch.bfloat16, device=device)
        handle, enabled_here = _dist.symm_rendezvous(buf, group)
        facts["enable_symm_mem_for_group_called"] = enabled_here
        facts["multicast_ptr"] = int(getattr(handle, "multicast_ptr", 0) or 0)
        facts["signal_pad_size"] = int(getattr(handle, "signal_pad_size", 0) or 0)
    except Exception as exc:
        rendezvous = error_box(exc)
    # Every rank takes part in this one exchange whatever happened, so nobody waits on a missing peer.
    everyone = _dist.gather_objects(rendezvous, gloo)
    facts["rendezvous"] = next((r for r in everyone if r["verdict"] != "ok"), rendezvous)
    if facts["rendezvous"]["verdict"] != "ok":
        return verdict(facts)
    disabled = multicast_env.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", "") not in ("", "0")
    facts["multicast_reason"] = multicast_reason(facts.get("device_multicast_support"), disabled)

    # Direct peer read: every rank writes its pattern, then reads its neighbour's buffer.
    try:
        n = 4096
        buf[:n].copy_(_data.pattern((n,), ctx.rank, 9, device))
        torch.cuda.synchronize()
        handle.barrier()
        peer = (ctx.rank + 1) % ctx.world_size
        seen = handle.get_buffer(peer, (n,), torch.bfloat16).clone()
        handle.barrier()  # nobody overwrites its buffer before its neighbour has read it
        _device.wait_device(OP_DEADLINE_S)
        facts["p2p_read"] = judge(seen, _data.pattern((n,), peer, 9, device), None)
    except Exception as exc:
        facts["p2p_read"] = error_box(exc)

    if ctx.param("load") == "sustained":
        replays = SUSTAIN_REPLAYS[1] if at_level((0, 1)) == (0,) else SUSTAIN_REPLAYS[0]
        sustained: dict[str, dict[str, Any]] = {}
        for name, builder in steps(group.group_name).items():
            sustained[name] = sustain_op(builder, buf, ctx.rank, ctx.world_size, device, gloo, replays)
            ctx.log(f"{name} sustained: {sustained[name]}")
            if sustained[name].get("verdict") == "hang":
                break  # the stream is stuck behind it
        return sustained_verdict(sustained, facts)

    ops: dict[str, Any] = {}
    for name, builder in steps(group.group_name).items():
        ops[name] = exercise_op(builder, buf, ctx.rank, ctx.world_size, device, gloo, sizes)
        ctx.log(f"{name}: " + ", ".join(f"{m}={r['verdict']}" for m, r in ops[name].items()))
    facts["ops"] = ops
    if not any(r.get("verdict") == "hang" for modes in ops.values() for r in modes.values()):
        facts["multimem"] = try_multimem(
            buf, group.group_name, ctx.rank, ctx.world_size, device, bool(facts["multicast_ptr"])
        )
        ctx.log(f"multimem_all_reduce_: {facts['multimem']['verdict']}")

    # Every rank decides on the same merged facts: the worst rank's op results.
    everyone = _dist.gather_objects(
        {"ops": facts["ops"], "p2p_read": facts["p2p_read"], "multimem": facts.get("multimem", {})}, gloo
    )
    for other in everyone:
        for op, modes in other["ops"].items():
            for mode, res in modes.items():
                if res.get("verdict") != "ok" and facts["ops"].get(op, {}).get(mode, {}).get("verdict") == "ok":
                    facts["ops"][op][mode] = res
        if other["p2p_read"].get("verdict") != "ok":
            facts["p2p_read"] = other["p2p_read"]
    if "multimem" in facts:
        facts["multimem"] = worst_multimem([other["multimem"] for other in everyone])
    hung = any(r.get("verdict") == "hang" for modes in facts["ops"].values() for r in modes.values())
    agreed = {} if hung else agreement(buf, group.group_name, ctx.rank, ctx.world_size, gloo, ctx.log,
                                       agreement_cases, exact=setup_only)
    result = verdict(facts)
    result["evidence"]["agreement"] = agreed
    return agreement_outcome(result, agreed)


# --- declared fields: what this probe records, and the roles checks report and checks advise read them by
# (inenv.probe.Field: name, unit, meaning, role). Left out of the probe hash: it changes no verdict.
METRICS = (
    ("ops_exact", "count", "(op, mode) checks exact against the exact result", None),
    ("ops_total", "count", "(op, mode) checks made", None),
    ("multicast_ptr_nonzero", "bool", "the symmetric memory handle has a multicast address", None),
    ("agreement", "record", "rank agreement of one-shot and two-shot on random bf16 data (inenv/kit/_agree.py): "
     "ranks identical, differing elements, max ulp between ranks, deterministic, max ulp vs the float64 sum",
     "agreement"),
    ("sustained_calls", "count by op", "load=sustained: captured calls run back to back per op", None),
    ("sustained_s", "s by op", "load=sustained: how long those calls took, queued to finished", None),
)
EVIDENCE = (
    ("ops", "record", "per symmetric-memory op, the eager and graph results against the exact answer",
     "op-checks"),
    ("registration", "record", "backend=nccl: torch's rendezvous through its NCCL backend, the worst rank's result",
     None),
    ("windows", "record", "backend=nccl: windows an NCCL communicator of the probe's own registered eagerly and "
     "during capture, each allreduce's result", None),
    ("device_multicast_support", "bool", "the CUDA device attribute for multicast objects", "multicast"),
)
ALLREDUCE_PATH = True
