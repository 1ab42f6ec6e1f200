"""The torch/NCCL probes on CPU: helper math, exact checks, verdict logic, variant planning, skip paths,
and the cross-rank helpers with real gloo ranks. The GPU paths themselves run on the lent H200.

Verdict logic, planning and log parsing are pure and run without torch; tests that need torch are marked."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from inenv.kit import _data, _dist, _errors, _nccl, _timing
from inenv.probe import QUICK, RESULT_MARKER, HostView, RankContext, Variant
from inenv.probes import ar_latency, custom_ar, ep_a2a, fi_fusion, nccl_graphs, pcie_ipc, symm_mem
from inenv.worker import skip_reason

ROOT = Path(__file__).resolve().parent.parent
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
COLLECTIVE_PROBES = (nccl_graphs, symm_mem, ar_latency, custom_ar, fi_fusion, ep_a2a, pcie_ipc)


# --- integer-valued data -----------------------------------------------------------------------------


@needs_torch
@pytest.mark.parametrize("world", [2, 4, 8])
def test_pattern_sum_is_exact_in_bf16(world: int) -> None:
    import torch

    shape = (3, 7168)
    ref = sum(_data.pattern(shape, r, 5, dtype=torch.int64) for r in range(world))
    got = _data.pattern_sum(shape, world, 5)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.to(torch.int64), ref)  # bf16 holds every such sum exactly
    one = _data.pattern(shape, 1, 5, dtype=torch.int64)
    assert int(one.min()) == -4 and int(one.max()) == 4


@needs_torch
def test_pattern_differs_per_rank_and_seed() -> None:
    import torch

    a = _data.pattern((64,), 0, 1)
    assert not torch.equal(a, _data.pattern((64,), 1, 1))
    assert not torch.equal(a, _data.pattern((64,), 0, 2))
    assert not torch.equal(_data.pattern_sum((64,), 2, 1), torch.zeros(64, dtype=torch.bfloat16))


# --- exact check and no-op detection -----------------------------------------------------------------


@needs_torch
def test_check_exact_verdicts() -> None:
    import torch

    shape = (2, 64)
    ref = _data.pattern_sum(shape, 2, 3)
    own = _data.pattern(shape, 0, 3)
    prior = _data.filled(shape)
    assert _data.check_exact(ref.clone(), ref).verdict == "exact"
    noop = _data.check_exact(prior.to(torch.bfloat16), ref, prior=prior, own_input=own)
    assert (noop.verdict, noop.detail) == ("no-op", "output equals its prior contents")
    assert _data.check_exact(own.clone(), ref, prior=prior, own_input=own).detail == "output equals its own input"
    assert _data.check_exact(torch.zeros(shape), ref).verdict == "zero"
    off = ref.clone()
    off[0, 0] += 1
    wrong = _data.check_exact(off, ref)
    assert (wrong.verdict, wrong.mismatches, wrong.max_abs_err) == ("wrong", 1, 1.0)
    assert _data.check_exact(off, ref, atol=1.0).verdict == "close"  # the tolerance is a second, named level
    assert not _data.check_exact(off, ref, atol=1.0).ok
    nan = ref.clone().float()
    nan[1, 1] = math.nan
    assert _data.check_exact(nan, ref).verdict == "wrong"
    assert _data.check_exact(ref[:1], ref).verdict == "wrong"


@needs_torch
def test_equal_to_own_input_is_not_a_noop_when_that_is_the_answer() -> None:
    ref = _data.pattern((16,), 0, 1)
    assert _data.check_exact(ref.clone(), ref, own_input=ref).verdict == "exact"


# --- timing math --------------------------------------------------------------------------------------


def test_percentile_and_median() -> None:
    vals = [float(x) for x in range(1, 101)]
    assert _timing.percentile(vals, 99) == 99.0
    assert _timing.percentile(vals, 100) == 100.0
    assert _timing.percentile([5.0], 99) == 5.0
    assert _timing.median([3.0, 1.0, 2.0]) == 2.0
    assert _timing.median([4.0, 1.0, 2.0, 3.0]) == 2.5
    with pytest.raises(ValueError):
        _timing.median([])


def test_aggregate_takes_slowest_rank_per_replay_and_scales_to_one_call() -> None:
    # ms per replay of a 10-call graph; rank 1 is the slow one in replays 0 and 2, rank 0 in 1.
    t = _timing.aggregate([[1.0, 3.0, 1.0, 1.0], [2.0, 1.0, 4.0, 1.0]], calls_per_replay=10)
    assert t.per_replay_us == [200.0, 300.0, 400.0, 100.0]
    assert t.median_us == 250.0
    assert t.p99_us == 400.0
    assert t.min_us == 100.0
    assert (t.replays, t.calls_per_replay) == (4, 10)
    assert "per_replay_us" not in t.to_json() and len(t.to_json(True)["per_replay_us"]) == 4


@pytest.mark.parametrize("bad", [[], [[1.0], [1.0, 2.0]], [[], []]])
def test_aggregate_rejects_inconsistent_input(bad: list[list[float]]) -> None:
    with pytest.raises(ValueError):
        _timing.aggregate(bad, 5)


@needs_torch
def test_time_replays_on_cpu_uses_the_host_clock() -> None:
    import time

    calls: list[str] = []
    times = _timing.time_replays(lambda: (calls.append("r"), time.sleep(0.01)), 3, barrier=lambda: calls.append("b"))
    assert calls == ["b", "r"] * 3  # the barrier precedes every replay and is not timed inside it
    assert len(times) == 3 and all(9.0 <= x < 200.0 for x in times)


# --- cross-rank helpers with real gloo ranks ----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_GLOO_RANK = r"""
import json, os, sys, time
from pathlib import Path
from inenv.probe import RankContext, Variant
from inenv.kit import _data, _dist, _timing
import torch, torch.distributed as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
ctx = RankContext(rank, world, rank, None, Variant("t", world), Path(sys.argv[1]))
_dist.init_dist(ctx, "gloo")
x = _data.pattern((4096,), rank, 7, dtype=torch.float32)
dist.all_reduce(x)
exact = _data.check_exact(x, _data.pattern_sum((4096,), world, 7, dtype=torch.float32)).verdict
agree_all = _dist.agree(True)
agree_one = _dist.agree(rank != 1)
# rank 1 is 20 ms slower per replay: the aggregate must show the slow rank, identically everywhere
timing = _timing.timed_across_ranks(lambda: time.sleep(0.005 + 0.02 * (rank == 1)), 5, 1,
                                  barrier=lambda: dist.barrier())
# lockstep: a step that fails on one rank stops every rank with the worst early outcome
from inenv.probe import outcome
from inenv.kit._lockstep import Lockstep, Stopped
lock = Lockstep(rank, None, {"base": 1})
steps = {}
with lock.step("first", "c-first"):
    pass
steps["first"] = "went on"
try:
    with lock.step("second", lambda err: "code-" + err.split(":")[0], status="partial", prefix="eager ok; ",
                   extra={"x": rank}):
        if rank == 1:
            raise ValueError("boom\nlast words")
    steps["second"] = "went on"
except Stopped as stop:
    steps["second"] = stop.outcome
try:
    with lock.step("third", "c-third", status="partial") as found:
        if rank == 0:
            raise RuntimeError("partial trouble")
        found.early = outcome("fail", "rank 1 wrong", "c-wrong")
    steps["third"] = "went on"
except Stopped as stop:
    steps["third"] = stop.outcome
steps["finish"] = lock.finish(outcome("partial", "rank 0 slow", "p") if rank == 0 else outcome("pass"))
Path(sys.argv[1], f"out{rank}.json").write_text(json.dumps(
    {"exact": exact, "agree_all": agree_all, "agree_one": agree_one, "timing": timing.to_json(True),
     "steps": steps}))
# leave as the rank launcher makes ranks leave: interpreter teardown with live gloo threads can abort
# ("terminate called without an active exception") after the work is done
os._exit(0)
"""


@needs_torch
def test_gloo_ranks_check_agree_aggregate_timing_and_stop_together(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_GLOO_RANK)
    world = 2
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=str(ROOT),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        )
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode()[-2000:]
    results = [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(world)]
    for res in results:
        assert res["exact"] == "exact"
        assert res["agree_all"] is True and res["agree_one"] is False
        assert 24.0 * 1000 <= res["timing"]["median_us"] < 200.0 * 1000  # >= 25 ms: the slow rank's time
        steps = res["steps"]
        assert steps["first"] == "went on"
        second = steps["second"]  # rank 1's exception, on both ranks
        assert (second["status"], second["reason_code"]) == ("partial", "code-ValueError")
        assert second["note"] == "eager ok; rank 1: second failed: last words"
        assert second["evidence"] == {"base": 1, "x": 1, "error": "ValueError: boom\nlast words"}
        third = steps["third"]  # rank 1's `fail` beats rank 0's `partial`
        assert (third["status"], third["reason_code"], third["note"]) == ("fail", "c-wrong", "rank 1 wrong")
        assert (steps["finish"]["status"], steps["finish"]["note"]) == ("partial", "rank 0 slow")
    assert results[0]["timing"] == results[1]["timing"]
    assert results[0]["steps"] == results[1]["steps"]


# --- NCCL logs and errors -----------------------------------------------------------------------------

NCCL_LOG = """\
h:1:1 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
h:1:9 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
h:1:9 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
h:1:9 [0] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [receive] via SHM/direct/direct
h:1:9 [0] NCCL INFO AllReduce: 57344 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..1}
h:1:9 [0] NCCL INFO AllReduce: 57344 Bytes -> Algo TREE proto LL channel{Lo..Hi}={0..1} comm 0x55
h:1:9 [0] NCCL INFO AllGather: 57344 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..1}
h:1:9 [0] NCCL WARN No algorithm/protocol available for function AllGather with datatype ncclBfloat16.
"""


def test_parse_nccl_log() -> None:
    parsed = _nccl.parse_nccl_log(NCCL_LOG)
    assert parsed["transports"] == ["P2P/CUMEM/read", "SHM/direct/direct"]
    assert parsed["nccl_version"] == "2.28.9+cuda13.0"
    assert parsed["algorithms"] == {"AllReduce": ["RING/LL", "TREE/LL"], "AllGather": ["RING/LL"]}


def test_read_nccl_logs_picks_this_process_files(tmp_path: Path) -> None:
    (tmp_path / "nccl.h.123.log").write_text(NCCL_LOG)
    (tmp_path / "nccl.h.456.log").write_text("x [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via NET/Socket/0\n")
    mine = _nccl.read_nccl_logs(tmp_path, pid=123)
    assert mine["transports"] == ["P2P/CUMEM/read", "SHM/direct/direct"]
    assert mine["warnings"] and "No algorithm/protocol available" in mine["warnings"][0]
    assert _nccl.read_nccl_logs(tmp_path / "missing", pid=1)["transports"] == []
    env = _nccl.nccl_debug_env(tmp_path)
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_FILE"].endswith("nccl.%h.%p.log")


@pytest.mark.parametrize(
    ("text", "code"),
    [
        (
            "DistBackendError: NCCL error in: ..., invalid usage (run with NCCL_DEBUG=WARN for details), NCCL "
            "version 2.28.9\nLast error:\nNo algorithm/protocol available for function AllGather with datatype "
            "ncclBfloat16. NCCL_ALGO was set to Tree.",
            "nccl-algo-unavailable",
        ),
        ("RuntimeError: CUDA error: operation not permitted when stream is capturing", "nccl-capture-failed"),
        ("RuntimeError: CUDA error: operation failed due to a previous error during capture", "nccl-capture-failed"),
        ("DistBackendError: NCCL error ... invalid usage", "nccl-invalid-usage"),
        ("RuntimeError: something else", "nccl-error"),
    ],
)
def test_classify_error(text: str, code: str) -> None:
    assert _nccl.classify_error(text) == code


def test_error_tail_drops_cpp_frames() -> None:
    exc = RuntimeError("boom\nframe #0: c10::Error\nframe #1: foo\nException raised from x\nlast line")
    assert _errors.error_tail(exc) == "RuntimeError: boom\nlast line"


# --- multicast stays off ------------------------------------------------------------------------------


def test_keep_multicast_off_sets_defaults_and_never_unsets() -> None:
    env: dict[str, str] = {"NCCL_NVLS_ENABLE": "0"}
    got = _dist.keep_multicast_off(env)
    assert got == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    opted_in: dict[str, str] = {_dist.ALLOW_MULTICAST_ENV: "1"}
    assert _dist.keep_multicast_off(opted_in) == {k: "" for k in _dist.MULTICAST_OFF}


# --- nccl-graphs ---------------------------------------------------------------------------------------


def test_nccl_graphs_variants() -> None:
    # world sizes 2, 3, 4 and 8 on a small host; at 2 ranks and at the host's GPU count the 5 NCCL_ALGO settings
    # x 2 warm-ups x 2 connections with NCCL's protocol (20) and each setting with NCCL_PROTO=Simple once (5); at
    # the other sizes each (algo, proto) once, warm-up on and NCCL's default connection (10)
    algos = ("default", "Ring", "Tree", "allreduce:tree", "ring+tree.allreduce:tree")
    two = nccl_graphs.variants(HostView(gpu_count=2))
    assert len(two) == 25 + 3 * 10 and len({v.key for v in two}) == len(two)
    assert all(v.skip is None for v in two if v.ranks == 2)
    assert all(v.skip is not None and v.skip.code == "too-few-gpus" for v in two if v.ranks > 2)
    keys = {v.key for v in two}
    assert "ranks=2,algo=allreduce:tree,warmup=no,runtime_connect=0" in keys  # the keys recorded before stay
    assert "ranks=2,algo=ring+tree.allreduce:tree,proto=Simple,warmup=yes,runtime_connect=default" in keys
    assert "ranks=2,algo=Tree,proto=Simple,warmup=no,runtime_connect=default" not in keys
    assert {v.key for v in two if v.ranks == 3} == {
        f"ranks=3,algo={a}{p},warmup=yes,runtime_connect=default" for a in algos for p in ("", ",proto=Simple")}
    one = [v for v in nccl_graphs.variants(HostView(gpu_count=1)) if v.ranks > 1]
    assert len(one) == 55 and all("NCCL refuses two ranks on one GPU" in (v.skip.note if v.skip else "") for v in one)
    eight = nccl_graphs.variants(HostView(gpu_count=8))
    assert sorted({v.ranks for v in eight}) == [2, 3, 4, 5, 6, 7, 8] and len(eight) == 2 * 25 + 5 * 10
    # 2, 4, 8 (deep) run every planned setting; 3, 5, 6 and 7 run NCCL's own choice only, the other 9 not-run
    assert all(v.skip is None for v in eight if v.ranks in (2, 4, 8))
    for n in (3, 5, 6, 7):
        runs = [v.key for v in eight if v.ranks == n and v.skip is None]
        assert runs == [f"ranks={n},algo=default,warmup=yes,runtime_connect=default,depth=setup"]
        left = [v.skip for v in eight if v.ranks == n and v.skip is not None]
        assert len(left) == 9 and {(s.status, s.code) for s in left} == {("not-run", "narrowed-world-size")}
        assert all(f"{n} ranks, outside the deep world sizes (2, 4, 8)" in s.note and "runs at 2 and 8 ranks" in s.note
                   for s in left)


def test_nccl_graphs_quick_level_asks_nccls_own_choice_with_and_without_warm_up() -> None:
    """The quick pass answers first, in seconds: NCCL's own algorithm and protocol, with and without eager warm-up,
    at 2 ranks (the other world sizes are left to the full pass by the planner)."""
    quick = nccl_graphs.variants(HostView(gpu_count=2, level=QUICK))
    assert [v.key for v in quick if v.ranks == 2] == ["ranks=2,algo=default,warmup=yes,runtime_connect=default",
                                                      "ranks=2,algo=default,warmup=no,runtime_connect=default"]


def test_nccl_env() -> None:
    assert nccl_graphs.nccl_env("default", "default") == ({}, ["NCCL_ALGO", "NCCL_PROTO", "NCCL_RUNTIME_CONNECT"])
    assert nccl_graphs.nccl_env("allreduce:tree", "0") == (
        {"NCCL_ALGO": "allreduce:tree", "NCCL_RUNTIME_CONNECT": "0"},
        ["NCCL_PROTO"],
    )
    # NCCL's "," is a "+" and its ";" a "." in the key; the variable gets NCCL's own spelling
    assert nccl_graphs.nccl_env("ring+tree.allreduce:tree", "default", "Simple") == (
        {"NCCL_ALGO": "ring,tree;allreduce:tree", "NCCL_PROTO": "Simple"}, ["NCCL_RUNTIME_CONNECT"])
    assert nccl_graphs.setting_of({"algo": "ring+tree.allreduce:tree", "proto": "Simple"}) == {
        "NCCL_ALGO": "ring,tree;allreduce:tree", "NCCL_PROTO": "Simple"}
    assert nccl_graphs.setting_of({"algo": "default", "warmup": "no"}) == {}
    assert nccl_graphs.setting_of({"algo": "ring,tree"}) is None


OK = {"verdict": "ok"}
NO_ALGO = {"verdict": "error", "code": "nccl-algo-unavailable", "error": "No algorithm/protocol available"}
CAPTURE = {
    "verdict": "error",
    "code": "nccl-capture-failed",
    "error": "operation not permitted when stream is capturing",
}


def _ops(**classes: dict[str, dict[str, str]]) -> dict[str, dict[str, dict[str, str]]]:
    base = {op: {"eager": OK, "graph": OK} for op in nccl_graphs.OPS}
    base.update(classes)
    return base


def test_nccl_graphs_global_tree_is_a_configuration_problem() -> None:
    per_op = _ops(**{op: {"eager": NO_ALGO, "graph": NO_ALGO} for op in ("all_gather", "reduce_scatter", "broadcast")})
    out = nccl_graphs.verdict(per_op, "Tree")
    assert out["status"] == "partial" and out["reason_code"] == "nccl-algo-unavailable"
    assert "fail eagerly too" in out["note"] and out["metrics"] == {"ops_ok": 1, "ops_total": 4}
    assert "use " not in out["note"]  # the next step is the catalogue's, per NCCL release, offered where it passed


def test_nccl_graphs_names_the_2_31_semantics_of_a_per_collective_string() -> None:
    """vllm-project/vllm#58179: NCCL 2.31+ enables only the collectives NCCL_ALGO names, so ``allreduce:tree``
    (with NCCL_PROTO=Simple there) leaves broadcast, all-gather and reduce-scatter with no algorithm."""
    per_op = _ops(**{op: {"eager": NO_ALGO, "graph": NO_ALGO} for op in ("all_gather", "reduce_scatter", "broadcast")})
    new = nccl_graphs.verdict(per_op, "allreduce:tree", "Simple", "2.32.6")
    assert (new["status"], new["reason_code"]) == ("partial", "nccl-algo-unavailable")
    assert new["note"] == ("all_reduce works eagerly and captured; all_gather, broadcast, reduce_scatter fail eagerly "
                           "too: NCCL_ALGO=allreduce:tree NCCL_PROTO=Simple leaves them without an algorithm "
                           "(configuration, not graph capture); NCCL 2.32.6 enables only the collectives NCCL_ALGO "
                           "names, and leaves the others without one")
    old = nccl_graphs.verdict(per_op, "Tree", "default", "2.30.7")
    assert "enables only" not in old["note"] and "NCCL_ALGO=Tree leaves them" in old["note"]
    assert nccl_graphs.verdict(_ops(), "ring+tree.allreduce:tree", "Simple", "2.32.6")["status"] == "pass"


def test_nccl_graphs_capture_only_failure_is_named() -> None:
    per_op = _ops(all_reduce={"graph": CAPTURE, "eager_after": OK})
    out = nccl_graphs.verdict(per_op, "Tree")
    assert out["status"] == "fail" and out["reason_code"] == "nccl-capture-failed"
    assert out["evidence"]["op_classes"]["all_reduce"] == "capture-only"


def test_nccl_graphs_pass_wrong_and_hang() -> None:
    assert nccl_graphs.verdict(_ops(), "Ring")["status"] == "pass"
    wrong = nccl_graphs.verdict(_ops(broadcast={"eager": OK, "graph": {"verdict": "no-op"}}), "Ring")
    assert (wrong["status"], wrong["reason_code"]) == ("fail", "nccl-wrong-result")
    hung = nccl_graphs.verdict(_ops(all_gather={"eager": {"verdict": "hang"}}), "Ring")
    assert (hung["status"], hung["reason_code"]) == ("fail", "nccl-op-hang")


def test_nccl_graphs_merge_keeps_the_worst_rank() -> None:
    r0 = {"all_reduce": {"graph": OK}}
    r1 = {"all_reduce": {"graph": CAPTURE}}
    assert nccl_graphs.merge_rank_results([r0, r1])["all_reduce"]["graph"] == CAPTURE
    assert nccl_graphs.merge_rank_results([r1, r0])["all_reduce"]["graph"] == CAPTURE


# --- symm-mem ------------------------------------------------------------------------------------------


def test_symm_mem_variants() -> None:
    keys = [(v.key, v.skip.note if v.skip else None) for v in symm_mem.variants(HostView(gpu_count=2))]
    assert keys == [
        ("ranks=2", None),
        ("ranks=3,placement=shared,gpus=1", None),
        ("ranks=4,placement=shared,gpus=1", None),
        ("ranks=8,placement=shared,gpus=1", None),
        ("ranks=2,placement=shared,gpus=1", None),
        ("ranks=2,load=sustained", None),
        ("ranks=2,backend=nccl", None),
        ("ranks=3,backend=nccl", "needs 3 GPUs (NCCL refuses two ranks on one GPU), host has 2"),
        ("ranks=4,backend=nccl", "needs 4 GPUs (NCCL refuses two ranks on one GPU), host has 2"),
        ("ranks=8,backend=nccl", "needs 8 GPUs (NCCL refuses two ranks on one GPU), host has 2"),
    ]
    assert all(v.skip for v in symm_mem.variants(HostView(gpu_count=0)))
    one = [v for v in symm_mem.variants(HostView(gpu_count=1)) if v.param("load") == "sustained"]
    assert [(v.ranks, v.skip.code if v.skip else None) for v in one] == [(2, "too-few-gpus")]
    eight = [v.ranks for v in symm_mem.variants(HostView(gpu_count=8)) if v.param("load") == "sustained"]
    assert eight == [2, 8]


def test_symm_mem_sustained_load_verdicts() -> None:
    ok = {"verdict": "ok", "calls": 5000, "seconds": 0.4}
    passed = symm_mem.sustained_verdict({"one_shot": ok, "two_shot": ok}, {})
    assert passed["status"] == "pass"
    assert passed["metrics"]["sustained_calls"] == {"one_shot": 5000, "two_shot": 5000}
    hung = {"verdict": "hang", "calls": 5000, "error": "device work not finished after 120 s"}
    wedged = symm_mem.sustained_verdict({"one_shot": ok, "two_shot": hung}, {})
    assert (wedged["status"], wedged["reason_code"]) == ("hang", "symm-mem-sustained-hang")
    assert wedged["note"].startswith("two_shot: 5000 captured calls back to back did not finish within 120 s")
    wrong = symm_mem.sustained_verdict({"one_shot": {"verdict": "wrong", "detail": "3/57344 elements differ"}}, {})
    assert (wrong["status"], wrong["reason_code"]) == ("fail", "symm-mem-wrong-result")
    assert symm_mem.sustained_verdict({}, {})["reason_code"] == "symm-mem-op-missing"


def _symm_facts(**over: object) -> dict[str, object]:
    facts: dict[str, object] = {
        "rendezvous": OK,
        "p2p_read": OK,
        "ops": {op: {"eager": OK, "graph": OK} for op in symm_mem.P2P_OPS},
        "multimem": {"verdict": "refused", "error": "multimem_all_reduce_: multicast support is required."},
        "multicast_ptr": 0,
        "multicast_reason": "symm-mem-multicast-disabled",
    }
    facts.update(over)
    return facts


def test_symm_mem_verdicts() -> None:
    out = symm_mem.verdict(_symm_facts())
    assert (out["status"], out["reason_code"]) == ("partial", "symm-mem-multicast-disabled")
    assert out["metrics"]["ops_exact"] == 4
    bad_graph = _symm_facts(
        ops={
            "one_shot": {"eager": OK, "graph": {"verdict": "error", "error": "x"}},
            "two_shot": {"eager": OK, "graph": OK},
        }
    )
    assert symm_mem.verdict(bad_graph)["reason_code"] == "symm-mem-capture-failed"
    noop = _symm_facts(ops={"one_shot": {"eager": {"verdict": "no-op"}}, "two_shot": {"eager": OK}})
    assert symm_mem.verdict(noop)["reason_code"] == "symm-mem-wrong-result"
    rdv = symm_mem.verdict(_symm_facts(rendezvous={"verdict": "error", "error": "x"}, peer_access=False))
    assert (rdv["status"], rdv["reason_code"]) == ("fail", "symm-mem-no-p2p")
    assert symm_mem.verdict(_symm_facts(multimem={"verdict": "ok"}, multicast_ptr=1))["status"] == "pass"
    assert symm_mem.multicast_reason(True, False) == ""
    assert symm_mem.multicast_reason(False, False) == "symm-mem-no-multicast"
    assert symm_mem.multicast_reason(True, True) == "symm-mem-multicast-disabled"


def test_symm_mem_multimem_missing_or_unjudged_is_never_a_pass() -> None:
    """Every multimem result word is named: a torch without the op is `partial`, a hang a failure, and a word
    the verdict does not know a probe bug (each of these read as `pass` before)."""
    missing = symm_mem.verdict(_symm_facts(multimem={"verdict": "missing"}))
    assert (missing["status"], missing["reason_code"]) == ("partial", "symm-mem-op-missing")
    assert "multimem_all_reduce_" in missing["note"]
    hung = symm_mem.verdict(_symm_facts(multimem={"verdict": "hang", "error": "device work not finished after 30 s"}))
    assert (hung["status"], hung["reason_code"]) == ("fail", "symm-mem-multimem-failed")
    for odd in ({}, {"verdict": "maybe"}):
        out = symm_mem.verdict(_symm_facts(multimem=odd))
        assert (out["status"], out["reason_code"]) == ("fail", "probe-bug")


def test_symm_mem_group_multimem_result_is_the_worst_rank() -> None:
    refused = {"verdict": "refused", "error": REFUSAL}
    assert symm_mem.worst_multimem([{"verdict": "ok"}, refused]) == refused
    assert symm_mem.worst_multimem([refused, {"verdict": "missing"}]) == {"verdict": "missing"}
    assert symm_mem.worst_multimem([refused, {"verdict": "error", "error": "x"}])["verdict"] == "error"
    assert symm_mem.worst_multimem([{"verdict": "ok"}, {"verdict": "new-word"}])["verdict"] == "new-word"


# torch's own refusal, as recorded on 2x H200 (torch 2.11, TORCH_SYMM_MEM_DISABLE_MULTICAST=1)
REFUSAL = "RuntimeError: multimem_all_reduce_: multicast support is required."


@needs_torch
@pytest.mark.parametrize(
    ("text", "multicast", "expected"),
    [
        (REFUSAL, False, "refused"),
        # the same words while the rendezvous gave a multicast address: torch and the handle disagree
        (REFUSAL, True, "error"),
        # flashinfer's words for a GPU without multicast: mentions multicast, but is not torch refusing this op
        ("RuntimeError: [SymmDeviceMemory] Device does not support multicasting.", False, "error"),
        ("RuntimeError: multimem_all_reduce_: input must be allocated with empty_strided_p2p().", False, "error"),
    ],
)
def test_only_torchs_own_refusal_without_multicast_counts_as_refused(
    monkeypatch: pytest.MonkeyPatch, text: str, multicast: bool, expected: str
) -> None:
    import torch

    def raising(*_args: object) -> None:
        raise RuntimeError(text.removeprefix("RuntimeError: "))

    monkeypatch.setattr(torch.ops.symm_mem, "multimem_all_reduce_", raising)
    buf = torch.zeros(16 * 7168, dtype=torch.bfloat16)
    got = symm_mem.try_multimem(buf, "group", 0, 2, "cpu", multicast)
    assert got == {"verdict": expected, "error": text}


# --- ar-latency ----------------------------------------------------------------------------------------


def test_ar_latency_variants_and_sizes() -> None:
    vs = ar_latency.variants(HostView(gpu_count=2))
    backends = ["nccl", "nccl-direct", "symm-mem-one-shot", "symm-mem-two-shot", "flashinfer-custom-ar",
                "flashinfer-pcie-ipc"]  # every allreduce path checks advise ranks
    runnable = [v.key for v in vs if v.skip is None]
    assert runnable == [f"ranks=2,backend={b}" for b in backends]
    skipped = sorted((v.ranks, v.skip.code) for v in vs if v.skip is not None)
    assert skipped == [(3, "too-few-gpus")] * 6 + [(4, "too-few-gpus")] * 6 + [(8, "too-few-gpus")] * 6
    sizes = ar_latency.sizes_bytes()
    assert sizes[0] == 14336 and 1835008 in sizes and sizes[-1] == 4 * 1835008  # 14 KiB .. 1.75 MiB, 4x verify


@needs_torch
def test_expected_after_in_place_calls_is_exact_in_bf16() -> None:
    import torch

    assert ar_latency.expected_after(20, 2, in_place=False) == 1
    for world in (2, 4, 8):
        factor = ar_latency.expected_after(20, world, in_place=True)
        s = _data.pattern_sum((4096,), world, 2, dtype=torch.float64) * factor
        assert torch.equal(s.to(torch.bfloat16).double(), s)  # power-of-two worlds stay exact


def _timed(us: float) -> dict[str, object]:
    return {"verdict": "ok", "timing": {"median_us": us, "p99_us": us * 1.5}}


def test_ar_latency_summarize() -> None:
    res = ar_latency.summarize(
        "symm-mem-one-shot", {14336: _timed(5.0), 28672: _timed(6.0)}, {14336: _timed(10.0), 28672: _timed(12.0)}
    )
    assert res["status"] == "pass"
    assert res["metrics"]["latency_us"] == {"14336": 5.0, "28672": 6.0}
    assert res["metrics"]["ratio_vs_nccl"] == {"14336": 0.5, "28672": 0.5}
    assert res["metrics"]["p99_us"]["14336"] == 7.5
    wrong = ar_latency.summarize("x", {14336: {"verdict": "no-op", "detail": "d"}}, None)
    assert (wrong["status"], wrong["reason_code"], wrong["metrics"]["latency_us"]) == ("fail", "ar-wrong-result", {})
    part = ar_latency.summarize("x", {14336: _timed(5.0), 28672: {"verdict": "error", "error": "too big"}}, None)
    assert (part["status"], part["reason_code"]) == ("partial", "ar-size-unsupported")
    assert "ratio_vs_nccl" not in part["metrics"]


# --- skip paths ----------------------------------------------------------------------------------------


@needs_torch
@pytest.mark.parametrize("module", [nccl_graphs, symm_mem, ar_latency])
def test_run_without_a_gpu_skips_before_touching_torch_distributed(module: object, tmp_path: Path) -> None:
    import torch

    ctx = RankContext(0, 2, 0, None, Variant(module.SPEC.id, 2), tmp_path)  # type: ignore[attr-defined]
    out = module.run(ctx)  # type: ignore[attr-defined]
    assert out["status"] == "skip" and out["reason_code"] == "no-gpu"
    assert not torch.distributed.is_initialized()


@needs_torch
@pytest.mark.parametrize(
    ("probe", "params"),
    [
        ("nccl-graphs", [["algo", "Tree"], ["warmup", "no"], ["runtime_connect", "default"]]),
        ("symm-mem", []),
        ("ar-latency", [["backend", "nccl"]]),
    ],
)
def test_worker_reports_skip_for_gpu_probes_on_a_host_without_gpus(probe: str, params: list[list[str]]) -> None:
    variant = json.dumps({"probe_id": probe, "ranks": 2, "params": params})
    proc = subprocess.run(
        [sys.executable, "-m", "inenv.worker", "--probe", probe, "--variant", variant, "--gpus", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER))
    result = json.loads(line[len(RESULT_MARKER) :])
    assert result["status"] == "skip" and result["reason_code"] == "no-gpu"


def test_worst_verdict() -> None:
    assert _dist.worst_verdict(["ok", "ok"]) == "ok"
    assert _dist.worst_verdict(["ok", "no-op", "error"]) == "no-op"
    assert _dist.worst_verdict(["wrong", "hang"]) == "hang"
    assert _dist.worst_verdict(["ok", "something-new"]) == "something-new"
    assert _dist.worst_verdict([]) == "ok"


_DIRECT_RANK = r"""
import json, os, sys
import torch, torch.distributed as dist
from inenv.kit import _nccl
dist.init_process_group("gloo", rank=0, world_size=1)
out = {"library": _nccl.loaded_library(), "gpu": torch.cuda.is_available()}
try:
    comm = _nccl.DirectComm(0, 1, dist.group.WORLD)
    out["version"] = comm.version
except RuntimeError as exc:
    out["error"] = str(exc)
print(json.dumps(out), flush=True)
os._exit(0)
"""


@needs_torch
def test_direct_nccl_uses_torchs_library_and_fails_clearly_without_a_gpu(tmp_path: Path) -> None:
    """The ctypes communicator binds the libnccl torch mapped; where NCCL cannot start, the error names the
    call and NCCL's own text instead of crashing the rank."""
    script = tmp_path / "direct.py"
    script.write_text(_DIRECT_RANK)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert os.path.basename(out["library"]).startswith("libnccl.so") and os.path.isabs(out["library"])
    if out["gpu"]:
        assert out["version"] >= 21800, out
    else:
        assert out["error"].startswith("ncclCommInitRank returned "), out


# --- custom-ar: the timed graph's output and timing failures -----------------------------------------------

EXACT = {"verdict": "exact", "mismatches": 0, "numel": 7168, "max_abs_err": 0.0, "detail": ""}
NOOP = {"verdict": "no-op", "mismatches": 7168, "numel": 7168, "max_abs_err": 107.0,
        "detail": "output equals its prior contents"}


def _sized(check: dict[str, object], us: float) -> dict[str, object]:
    return {"check": check, "latency_us": us, "latency_p99_us": us + 1, "nccl_latency_us": 2 * us,
            "nccl_latency_p99_us": 2 * us + 1}


def test_custom_ar_timed_output_is_checked_and_timing_failure_is_partial() -> None:
    evidence = {"impl": "flashinfer"}
    ok = custom_ar.latency_outcome({"sizes": {"14336": _sized(EXACT, 4.3), "229376": _sized(EXACT, 6.0)}}, evidence)
    assert ok["status"] == "pass"
    assert ok["metrics"]["latency_us"] == {"14336": 4.3, "229376": 6.0}
    assert ok["metrics"]["nccl_latency_us"] == {"14336": 8.6, "229376": 12.0}
    assert ok["evidence"]["timed_output"]["14336"]["verdict"] == "exact"

    noop = custom_ar.latency_outcome({"sizes": {"14336": _sized(EXACT, 4.3), "229376": _sized(NOOP, 1.0)}}, evidence)
    assert (noop["status"], noop["reason_code"]) == ("partial", "custom-ar-graph-wrong")
    assert "no-op output at 229376 bytes" in noop["note"]
    assert noop["metrics"]["latency_us"] == {"14336": 4.3}  # never the speed of a kernel that did nothing

    err = "RuntimeError: CUDA error: an illegal memory access was encountered"
    failed = custom_ar.latency_outcome({"error": err}, evidence)
    assert (failed["status"], failed["reason_code"]) == ("partial", "custom-ar-timing-failed")
    assert failed["note"].endswith("timing failed: " + err) and failed["metrics"] == {}
    assert failed["evidence"]["timing_error"] == err

    nothing = custom_ar.latency_outcome({"sizes": {}}, evidence)
    assert nothing["status"] == "partial"


def test_custom_ar_eager_outcome() -> None:
    assert custom_ar.eager_outcome({"14336": EXACT}, 2, True, {}) is None
    silent = custom_ar.eager_outcome({"14336": EXACT, "229376": NOOP}, 4, False, {})
    assert silent is not None and (silent["status"], silent["reason_code"]) == ("fail", "custom-ar-silent-noop")
    assert "full_nvlink=False" in silent["note"]
    wrong = custom_ar.eager_outcome({"14336": dict(EXACT, verdict="wrong")}, 2, True, {})
    assert wrong is not None and wrong["reason_code"] == "custom-ar-wrong"


# --- how many ranks, and on which GPUs: declared in ProbeSpec, enforced by the worker -------------------


@pytest.mark.parametrize("module", COLLECTIVE_PROBES, ids=lambda m: m.SPEC.id)
def test_a_one_rank_collective_variant_is_refused_before_launch(module: ModuleType) -> None:
    """By hand a worker can be given one rank; over one rank an allreduce returns its input, so it would pass."""
    params = (("mode", "gpus"),) if module is ep_a2a else ()
    variant = Variant(module.SPEC.id, 1, params=params)
    got = skip_reason(module, variant, gpus=8)
    assert got is not None and got[0] == "too-few-ranks", got
    assert "needs at least 2 ranks" in got[1] and "this variant has 1" in got[1]


def test_ep_a2a_simulated_ranks_run_in_one_process() -> None:
    sim = Variant("ep-a2a", 1, params=(("mode", "sim"), ("ep", "4")))
    assert ep_a2a.SPEC.min_ranks_for(sim) == 1
    assert ep_a2a.SPEC.min_ranks_for(Variant("ep-a2a", 1, params=(("mode", "gpus"),))) == 2
    assert (skip_reason(ep_a2a, sim, gpus=1) or ("",))[0] != "too-few-ranks"


@pytest.mark.parametrize("module", [nccl_graphs, ar_latency], ids=lambda m: m.SPEC.id)
def test_ranks_sharing_a_gpu_are_refused_where_the_probe_needs_one_each(module: ModuleType) -> None:
    assert module.SPEC.distinct_gpus
    got = skip_reason(module, Variant(module.SPEC.id, 2, share_gpu=True), gpus=2)
    assert got is not None and got[0] == "not-applicable" and "needs a GPU per rank" in got[1]


@pytest.mark.parametrize("module", COLLECTIVE_PROBES, ids=lambda m: m.SPEC.id)
@pytest.mark.parametrize("gpus", [0, 1, 2, 8])
def test_planned_variants_respect_the_declared_ranks_and_gpus(module: ModuleType, gpus: int) -> None:
    for v in module.variants(HostView(gpu_count=gpus)):
        assert v.ranks >= module.SPEC.min_ranks_for(v), v.key
        assert not (v.share_gpu and module.SPEC.distinct_gpus), v.key
        if v.skip is None:  # what the planner runs, the worker runs (flashinfer is absent here)
            refused = skip_reason(module, v, gpus)
            assert refused is None or refused[0] == "missing-package", (v.key, refused)


def test_probe_spec_rejects_default_world_sizes_below_its_minimum() -> None:
    from inenv.probe import ProbeSpec

    with pytest.raises(ValueError, match="below min_ranks"):
        ProbeSpec(id="x", title="x", feature="x", ranks=(1, 2), min_ranks=2)
    with pytest.raises(ValueError, match="at least 1"):
        ProbeSpec(id="x", title="x", feature="x", min_ranks=0)


@needs_torch
def test_worker_by_hand_with_one_rank_does_not_pass_nccl_graphs() -> None:
    """`python -m inenv.worker --probe nccl-graphs --variant '{... "ranks": 1}'` on a host with a GPU: no
    rank starts, the result is `skip` with the reason, never a `pass` of four ops over one rank."""
    variant = json.dumps({"probe_id": "nccl-graphs", "ranks": 1, "params": [["algo", "Ring"]]})
    proc = subprocess.run(
        [sys.executable, "-m", "inenv.worker", "--probe", "nccl-graphs", "--variant", variant, "--gpus", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER))
    result = json.loads(line[len(RESULT_MARKER) :])
    assert (result["status"], result["reason_code"]) == ("skip", "too-few-ranks")
    assert "ranks" not in result["evidence"]  # refused before any rank was launched


# --- fi-fusion and ep-a2a steps, run for real on CPU gloo ranks with stand-ins for flashinfer's ops ------

_STANDIN_RANKS = r"""
import json, os, sys
from pathlib import Path
import torch, torch.distributed as dist
from inenv.probe import RankContext, Variant
from inenv.kit import _device, _dist
from inenv.probes import epmoe
from inenv.probes import ep_a2a, fi_fusion
from inenv.kit import _flashinfer as fi

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
# CPU stand-ins for what needs a GPU: the probe's own steps and checks run unchanged
_dist.init_dist = lambda ctx, backend="nccl", timeout_s=120.0: torch.device("cpu")
_device.wait_device = lambda deadline_s: None

REPLAYING = []

class Replay:
    def __init__(self, step, calls):
        self.step, self.calls = step, calls
    def replay(self):
        REPLAYING.append(True)
        for _ in range(self.calls):
            self.step()
        REPLAYING.clear()

def capture(step, calls, warmup=3, pool=None, keep=False):
    for _ in range(warmup):
        step()
    return Replay(step, calls)

_device.capture = capture
FAIL = os.environ.get("STANDIN_FAIL", "")

class Fusion:
    # allreduce over gloo, then residual add and RMSNorm as the reference computes them
    api = "stand-in"
    def create_workspace(self, rank, world, max_tokens, hidden, dtype, group):
        if FAIL == f"workspace{rank}":
            raise RuntimeError("IPC handle exchange failed\nworkspace: out of IPC handles")
    def workspace_bytes(self):
        return 4096
    def ar_residual_rmsnorm(self, inp, residual, gamma, eps, res_out, norm_out, rank, world):
        total = inp.float().clone()
        dist.all_reduce(total)
        r, n = fi_fusion.reference(total.bfloat16(), residual, gamma)
        res_out.copy_(r)
        norm_out.copy_(n + 1 if FAIL == "graph" and REPLAYING else n)

class A2A:
    # MoE all-to-all over gloo: every rank sees every rank's tokens and keeps those routed to it
    workspace_bytes = 1 << 20
    def _gather(self, t):
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t.contiguous())
        return out
    def dispatch(self, experts, hid, ids):
        tpr = hid.shape[0]
        ex, hs, js = self._gather(experts), self._gather(hid), self._gather(ids)
        recv_h = torch.zeros(world, tpr, hid.shape[-1], dtype=hid.dtype)
        recv_i = torch.zeros(world, tpr, 1, dtype=ids.dtype)
        recv_e = torch.full((world, tpr, experts.shape[1]), epmoe.INVALID_EXPERT, dtype=experts.dtype)
        for src in range(world):
            n = 0
            for t in range(tpr):
                if rank in {int(e) // ep_a2a.EXPERTS_PER_RANK for e in ex[src][t]}:
                    recv_h[src, n], recv_i[src, n], recv_e[src, n] = hs[src][t], js[src][t], ex[src][t]
                    n += 1
        self.recv_ids = self._gather(recv_i)
        if FAIL == f"dispatch{rank}":  # after the exchange, as a kernel's error is seen after its launch
            raise RuntimeError("moe_a2a_dispatch: workspace too small")
        return epmoe.Received(recv_i[..., 0], recv_h, recv_e)
    def combine(self, payload):
        tpr = payload.shape[1]
        loads = self._gather(payload)
        out = torch.zeros(tpr, payload.shape[-1])
        for t in range(world):
            for n, token in enumerate(self.recv_ids[t][rank].reshape(-1).tolist()):
                if token:
                    out[token - 1 - rank * tpr] += loads[t][rank, n].float()
        return out.bfloat16()

fi.Fusion = Fusion
epmoe.detect = lambda: epmoe.TRTLLM
epmoe.open_ranks = lambda *a, **k: A2A()
fi_fusion.TOKENS = fi_fusion.GRAPH_TOKENS  # fewer sizes: gloo on two shared cores
probe = sys.argv[2]
module = fi_fusion if probe == "fi-fusion" else ep_a2a
params = (("placement", "1gpu"),) if probe == "fi-fusion" else (("mode", "gpus"),)
ctx = RankContext(rank, world, rank, 0, Variant(probe, world, params=params), Path(sys.argv[1]))
result = module.run(ctx)
Path(sys.argv[1], f"{probe}-{FAIL or 'none'}-{rank}.json").write_text(json.dumps(result))
os._exit(0)
"""


def _standin_run(tmp_path: Path, probe: str, fail: str) -> list[dict[str, object]]:
    script = tmp_path / "standin.py"
    script.write_text(_STANDIN_RANKS)
    port = _free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=str(ROOT), STANDIN_FAIL=fail)
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path), probe], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out.decode()[-3000:]
    return [json.loads((tmp_path / f"{probe}-{fail or 'none'}-{r}.json").read_text()) for r in range(2)]


@needs_torch
@pytest.mark.parametrize(
    ("probe", "fail", "status", "code"),
    [
        ("fi-fusion", "", "pass", ""),
        ("fi-fusion", "workspace1", "fail", "fi-workspace-failed"),
        ("fi-fusion", "graph", "partial", "fi-fusion-wrong"),
        ("ep-a2a", "", "pass", ""),
        ("ep-a2a", "dispatch0", "fail", "ep-a2a-error"),
    ],
)
def test_probe_steps_run_and_stop_together_with_stand_in_ops(
    tmp_path: Path, probe: str, fail: str, status: str, code: str
) -> None:
    """fi-fusion and ep-a2a end to end on two CPU ranks, flashinfer's ops replaced by exact gloo stand-ins: the
    probes' own checks pass them, and a step failing on one rank ends both ranks with that rank's verdict."""
    results = _standin_run(tmp_path, probe, fail)
    assert [(r["status"], r["reason_code"]) for r in results] == [(status, code)] * 2, results[0]["note"]
    if fail:
        assert results[0]["note"] == results[1]["note"]
    if fail == "workspace1":
        assert results[0]["note"] == "rank 1: workspace creation failed: workspace: out of IPC handles"
    if fail == "dispatch0":
        assert results[1]["note"] == "rank 0: dispatch failed: RuntimeError: moe_a2a_dispatch: workspace too small"
    if probe == "fi-fusion" and not fail:
        assert results[0]["metrics"]["workspace_bytes"] == 4096
        assert set(results[0]["evidence"]["graph"]) == {"1", "16", "128"}
