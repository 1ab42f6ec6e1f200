"""What a host of one GPU can tell of NCCL settings and NCCL windows (NCCL refuses two ranks on one GPU):
nccl-graphs ``check=table`` reads the tuning table NCCL logs at communicator init under each NCCL_ALGO / NCCL_PROTO
setting, and symm-mem ``backend=nccl`` registers windows at one rank. The log below is written by hand in the layout
NCCL's tuning.cc prints (three algorithms a block, LL / LL128 / Simple each, ``latency/bandwidth`` per cell)."""

from __future__ import annotations

from typing import Any

from checks.results import remedies
from checks.results.result import ProbeResult
from common import reasons
from inenv.kit import _nccl
from inenv.probe import QUICK, HostView
from inenv.probes import nccl_graphs, symm_mem

PREFIX = "gpu0:4242:4242 [0] NCCL INFO "


def _log(rows: dict[str, list[str]]) -> str:
    """A two-block table: Tree, Ring, CollNetDirect then CollNetChain, NVLS, NVLSTree; ``rows`` gives each
    collective's 18 cells."""
    lines = ["gpu0:4242:4242 [0] NCCL INFO NCCL_ALGO set by environment to allreduce:tree"]
    for block, algos in enumerate((("Tree", "Ring", "CollNetDirect"), ("CollNetChain", "NVLS", "NVLSTree"))):
        lines.append(PREFIX + "  Algorithm   |" + "".join(f" {'':>14}   {a:>14}   {'':>14} |" for a in algos))
        lines.append(PREFIX + "  Protocol    |" + "".join(f" {p:>14} |" for _ in algos for p in ("LL", "LL128",
                                                                                                   "Simple")))
        lines.append(PREFIX + " Max NThreads |" + "".join(f" {512:>14} |" for _ in range(9)))
        for func, cells in rows.items():
            lines.append(PREFIX + f"{func:>13} |" + "".join(f"{c} |" for c in cells[block * 9:(block + 1) * 9]))
    lines.append("    Broadcast |        0         0         0")  # a continuation line of another message
    return "\n".join(lines) + "\n"


ZERO = "     0.0/   0.0"
ON = "     4.4/  22.5"
INF = "     0.0/   inf"


def _only_allreduce() -> str:
    """AllReduce has Tree/Simple; the other three collectives have nothing (NCCL >= 2.31 under allreduce:tree)."""
    allreduce = [ZERO, ZERO, ON] + [ZERO] * 15
    return _log({"Broadcast": [ZERO] * 18, "AllGather": [ZERO] * 18, "ReduceScatter": [ZERO] * 18,
                 "AllReduce": allreduce})


def _every_collective() -> str:
    ring = [ZERO] * 3 + [ON, ON, INF] + [ZERO] * 12  # Ring cells; AllGather's at one rank: bandwidth x inf
    return _log({"Broadcast": ring, "AllGather": ring, "ReduceScatter": ring, "AllReduce": [ON] * 3 + ring[3:]})


def test_the_tuning_table_is_read_cell_by_cell() -> None:
    table = _nccl.tuning_table(_only_allreduce())
    assert set(table) == {"Broadcast", "AllGather", "ReduceScatter", "AllReduce"}
    assert table["AllReduce"]["Tree/Simple"] == 22.5
    assert table["AllReduce"]["Ring/LL"] == 0.0
    assert table["Broadcast"]["NVLSTree/Simple"] == 0.0
    assert len(table["AllReduce"]) == 18
    assert _nccl.without_algorithm(table, ("AllReduce", "Broadcast", "AllGather")) == ["Broadcast", "AllGather"]
    # bandwidth x inf (one rank, n-1 steps) is an algorithm; nothing logged is no table
    assert _nccl.without_algorithm(_nccl.tuning_table(_every_collective()), ("AllGather",)) == []
    assert _nccl.tuning_table("NCCL INFO Channel 00/02 : 0[0] -> 1[1] via P2P/CUMEM\n") == {}


def _ops_ok() -> dict[str, dict[str, dict[str, str]]]:
    return {op: {"eager": {"verdict": "ok"}, "graph": {"verdict": "ok"}} for op in nccl_graphs.OPS}


def test_a_setting_that_leaves_collectives_without_an_algorithm_is_named_from_nccls_own_table() -> None:
    table = _nccl.tuning_table(_only_allreduce())
    got = nccl_graphs.table_verdict(_ops_ok(), table, "allreduce:tree", "default", "2.32.6")
    assert got["status"] == "partial"
    assert got["reason_code"] == "nccl-algo-unavailable"
    assert "all_gather, reduce_scatter, broadcast no algorithm" in got["note"]
    assert "enables only the collectives NCCL_ALGO names" in got["note"]
    assert got["evidence"]["no_algorithm"] == ["AllGather", "ReduceScatter", "Broadcast"]
    # the same table on a release before 2.31: named, without the 2.31 sentence
    older = nccl_graphs.table_verdict(_ops_ok(), table, "allreduce:tree", "default", "2.28.9")
    assert older["reason_code"] == "nccl-algo-unavailable"
    assert "enables only" not in older["note"]


def test_an_accepted_setting_is_set_up_only_never_a_pass() -> None:
    table = _nccl.tuning_table(_every_collective())
    got = nccl_graphs.table_verdict(_ops_ok(), table, "ring+tree.allreduce:tree", "default", "2.32.6")
    assert (got["status"], got["reason_code"]) == ("partial", "nccl-setup-only")
    assert got["evidence"]["world"] == 1
    assert got["evidence"]["tuning"]["AllReduce"]["Tree/LL"] == 22.5
    # no table in the log, or one that gives nothing anything: set-up only, saying so
    none = nccl_graphs.table_verdict(_ops_ok(), {}, "Ring", "default", "2.28.9")
    assert (none["status"], none["reason_code"]) == ("partial", "nccl-setup-only")
    assert "was not in its log" in none["note"]
    blank = _nccl.tuning_table(_log({f: [ZERO] * 18 for f in ("Broadcast", "AllGather", "ReduceScatter",
                                                              "AllReduce")}))
    assert "tells nothing" in nccl_graphs.table_verdict(_ops_ok(), blank, "Ring", "default", "2.28.9")["note"]


def test_an_op_that_fails_at_one_rank_is_the_verdict() -> None:
    ops = _ops_ok()
    ops["broadcast"]["graph"] = {"verdict": "error", "code": "nccl-capture-failed", "error": "capture invalidated"}
    got = nccl_graphs.table_verdict(ops, _nccl.tuning_table(_every_collective()), "Ring", "default", "2.28.9")
    assert (got["status"], got["reason_code"]) == ("fail", "nccl-capture-failed")


def _keys(variants: list[Any]) -> list[str]:
    return [v.key for v in variants]


def test_one_rank_checks_are_planned_on_a_host_of_one_gpu_at_the_full_level_only() -> None:
    one = [v for v in nccl_graphs.variants(HostView(gpu_count=1)) if v.ranks == 1]
    # five NCCL_ALGO settings, each with NCCL's protocol and with NCCL_PROTO=Simple
    assert len(one) == 10
    assert "ranks=1,algo=ring+tree.allreduce:tree,proto=Simple,warmup=yes,runtime_connect=default,check=table" in \
        _keys(one)
    assert all(v.skip is None for v in one)
    assert [v for v in nccl_graphs.variants(HostView(gpu_count=2)) if v.ranks == 1] == []
    assert [v for v in nccl_graphs.variants(HostView(gpu_count=1, level=QUICK)) if v.ranks == 1] == []
    assert nccl_graphs.SPEC.min_ranks_for(one[0]) == 1
    windows = [v.key for v in symm_mem.variants(HostView(gpu_count=1)) if v.ranks == 1]
    assert windows == ["ranks=1,backend=nccl"]
    assert [v for v in symm_mem.variants(HostView(gpu_count=2)) if v.ranks == 1] == []


def test_a_window_check_at_one_rank_passes_as_partial_and_fails_as_fail() -> None:
    passed = {"status": "pass", "note": "", "reason_code": "", "metrics": {"ops_exact": 2}, "evidence": {"x": 1}}
    got = symm_mem.one_rank_outcome(passed)
    assert (got["status"], got["reason_code"]) == ("partial", "symm-mem-nccl-one-rank")
    assert got["evidence"] == {"x": 1}
    failed = {"status": "fail", "reason_code": "symm-mem-nccl-capture-register-failed", "note": "unhandled cuda error"}
    assert symm_mem.one_rank_outcome(failed) is failed


def _row(variant: str, status: str, code: str) -> dict[str, Any]:
    return {"schema": "stackprobe.result/1", "run_id": "20261206T000000Z-abcd", "host_id": "h100x1-0000aaaa",
            "cell_id": "cu130-torch2.11.0-sglnone-fi0.7.4-nccl2.32.6", "probe_id": "nccl-graphs",
            "variant": variant, "status": status, "reason_code": code, "note": "", "remediation": "",
            "metrics": {}, "evidence": {"env": {"nccl": "2.32.6"}}, "started_at": "2026-12-06T00:00:00+00:00",
            "duration_s": 3.0}


def test_a_one_rank_set_up_result_neither_proves_nor_blocks_a_remedy() -> None:
    two = "ranks=2,algo=ring+tree.allreduce:tree,warmup=yes,runtime_connect=default"
    one = "ranks=1,algo=ring+tree.allreduce:tree,warmup=yes,runtime_connect=default,check=table"
    tree = "ranks=2,algo=Tree,warmup=yes,runtime_connect=default"
    rows = [_row(two, "pass", ""), _row(one, "partial", "nccl-setup-only"),
            _row(tree, "partial", "nccl-algo-unavailable")]
    results = [ProbeResult.from_json(r) for r in rows]
    seen = remedies.shown(results)
    offered = remedies.offered(results[2], reasons.default(), seen) or ""
    assert offered.startswith('use NCCL_ALGO="ring,tree;allreduce:tree"')
    # the one-rank result alone proves nothing
    alone = remedies.shown(results[1:])
    assert not (remedies.offered(results[2], reasons.default(), alone) or "").startswith("use NCCL_ALGO")
    # a one-rank result whose table left collectives without an algorithm counts against its setting
    against = [ProbeResult.from_json(_row(one, "partial", "nccl-algo-unavailable"))]
    blocked = remedies.shown(results[:1] + against)
    assert not (remedies.offered(results[2], reasons.default(), blocked) or "").startswith("use NCCL_ALGO")
