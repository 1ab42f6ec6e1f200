"""What a host of one GPU can tell of NCCL settings and NCCL windows (NCCL refuses two ranks on one GPU):
nccl-graphs ``check=table`` reads how NCCL parsed each NCCL_ALGO / NCCL_PROTO setting (the enable matrix its rank 0
logs at communicator init), and symm-mem ``backend=nccl`` registers windows at one rank. The logs below are written
by hand in the layout NCCL's tuning.cc prints the matrix in (``Function | <protocols> | <algorithms>`` and a row
per collective, on lines of their own after the INFO line)."""

from __future__ import annotations

from typing import Any

from checks.results import remedies
from checks.results.result import ProbeResult
from common import reasons
from inenv.kit import _nccl
from inenv.probe import QUICK, HostView
from inenv.probes import nccl_graphs, symm_mem

PREFIX = "gpu0:4242:4242 [0] NCCL INFO "
ALGOS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")


def _log(rows: dict[str, tuple[int, ...]], setting: str = "allreduce:tree") -> str:
    lines = [PREFIX + f"NCCL_ALGO set by environment to {setting}", PREFIX + "Enabled NCCL Func/Proto/Algo Matrix:",
             "     Function | " + "".join(f"{p:>8}  " for p in ("LL", "LL128", "Simple")) + " | "
             + "".join(f"{a:>13}  " for a in ALGOS)]
    for func, algos in rows.items():
        lines.append(f"{func:>13} | " + "".join(f"{v:>8}  " for v in (1, 2, 1)) + " | "
                     + "".join(f"{v:>13}  " for v in algos))
    lines += ["", PREFIX + "  Algorithm   |                 Tree   |", PREFIX + "Channel 00/02 : 0[0] -> 0[0] via P2P"]
    return "\n".join(lines) + "\n"


NONE = (0,) * 7
TREE_ONLY = (1, 0, 0, 0, 0, 0, 0)
DEFAULTS = (1,) * 7


def _named_only() -> str:
    """NCCL >= 2.31 under allreduce:tree: AllReduce has Tree, the other collectives nothing."""
    return _log({"Broadcast": NONE, "Reduce": NONE, "AllGather": NONE, "ReduceScatter": NONE,
                 "AllReduce": TREE_ONLY})


def _kept_defaults() -> str:
    """An earlier release under allreduce:tree: the other collectives keep their defaults."""
    return _log({"Broadcast": DEFAULTS, "Reduce": DEFAULTS, "AllGather": DEFAULTS, "ReduceScatter": DEFAULTS,
                 "AllReduce": TREE_ONLY})


def test_the_enable_matrix_is_read_row_by_row() -> None:
    matrix = _nccl.enable_matrix(_named_only())
    assert set(matrix) == {"Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce"}
    assert matrix["AllReduce"] == {"Tree": 1, "Ring": 0, "CollNetDirect": 0, "CollNetChain": 0, "NVLS": 0,
                                   "NVLSTree": 0, "PAT": 0}
    assert _nccl.without_algorithm(matrix, ("AllReduce", "Broadcast", "AllGather")) == ["Broadcast", "AllGather"]
    assert _nccl.without_algorithm(_nccl.enable_matrix(_kept_defaults()), ("Broadcast",)) == []
    assert _nccl.enable_matrix(PREFIX + "Channel 00/02 : 0[0] -> 1[1] via P2P/CUMEM\n") == {}
    # read through the log reader too
    assert _nccl.parse_nccl_log(_named_only())["enabled"]["Broadcast"]["Ring"] == 0


def _ops_ok() -> dict[str, dict[str, dict[str, str]]]:
    return {op: {"eager": {"verdict": "ok"}, "graph": {"verdict": "ok"}} for op in nccl_graphs.OPS}


def test_a_setting_that_leaves_collectives_without_an_algorithm_is_named_from_nccls_own_parse() -> None:
    matrix = _nccl.enable_matrix(_named_only())
    got = nccl_graphs.table_verdict(_ops_ok(), matrix, "allreduce:tree", "default", "2.32.6")
    assert got["status"] == "partial"
    assert got["reason_code"] == "nccl-algo-unavailable"
    assert "no algorithm for all_gather, reduce_scatter, broadcast" in got["note"]
    assert "enables only the collectives NCCL_ALGO names" in got["note"]
    assert got["evidence"]["no_algorithm"] == ["AllGather", "ReduceScatter", "Broadcast"]
    # the same parse on a release before 2.31: named, without the 2.31 sentence
    older = nccl_graphs.table_verdict(_ops_ok(), matrix, "allreduce:tree", "default", "2.28.9")
    assert older["reason_code"] == "nccl-algo-unavailable"
    assert "enables only" not in older["note"]


def test_an_accepted_setting_is_set_up_only_never_a_pass() -> None:
    matrix = _nccl.enable_matrix(_kept_defaults())
    got = nccl_graphs.table_verdict(_ops_ok(), matrix, "allreduce:tree", "default", "2.28.9")
    assert (got["status"], got["reason_code"]) == ("partial", "nccl-setup-only")
    assert got["evidence"]["world"] == 1
    assert got["evidence"]["enabled"]["Broadcast"]["Ring"] == 1
    # no matrix logged: set-up only, saying so; NCCL's own choice has no matrix to read
    none = nccl_graphs.table_verdict(_ops_ok(), {}, "Ring", "default", "2.28.9")
    assert (none["status"], none["reason_code"]) == ("partial", "nccl-setup-only")
    assert "logged no enable matrix" in none["note"]
    own = nccl_graphs.table_verdict(_ops_ok(), {}, "default", "default", "2.28.9")
    assert (own["status"], own["reason_code"]) == ("partial", "nccl-setup-only")
    assert "matrix" not in own["note"]


def test_an_op_that_fails_at_one_rank_is_the_verdict() -> None:
    ops = _ops_ok()
    ops["broadcast"]["graph"] = {"verdict": "error", "code": "nccl-capture-failed", "error": "capture invalidated"}
    got = nccl_graphs.table_verdict(ops, _nccl.enable_matrix(_kept_defaults()), "Ring", "default", "2.28.9")
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


def _window_facts(eager: str, capture: str, torch_ok: bool) -> dict[str, Any]:
    facts: dict[str, Any] = {"windows": {"nccl": "2.32.6", "eager": {"verdict": eager}}}
    if eager == "ok":
        facts["windows"]["capture"] = {"verdict": capture, "error": "operation not permitted when stream is capturing"}
    if torch_ok:
        facts.update(registration={"verdict": "ok"}, registered=True, p2p_read={"verdict": "ok"},
                     ops={"nccl_all_reduce": {"eager": {"verdict": "ok"}, "graph": {"verdict": "ok"}}})
    else:
        facts["registration"] = {"verdict": "error", "error": "ncclDevCommCreate failed: invalid usage"}
    return facts


def test_a_window_check_at_one_rank_is_judged_as_at_any_rank_count_and_never_passes() -> None:
    works = symm_mem.one_rank_verdict(_window_facts("ok", "ok", torch_ok=True))
    assert (works["status"], works["reason_code"]) == ("partial", "symm-mem-nccl-one-rank")
    # torch's backend refusing the registration (NCCL 2.32.6 under torch 2.11: ncclDevCommCreate) is a failure
    refused = symm_mem.one_rank_verdict(_window_facts("ok", "ok", torch_ok=False))
    assert (refused["status"], refused["reason_code"]) == ("fail", "symm-mem-nccl-register-failed")
    assert "ncclDevCommCreate failed" in refused["note"]
    # registering during capture fails: a failure of the feature
    failed = symm_mem.one_rank_verdict(_window_facts("ok", "error", torch_ok=True))
    assert (failed["status"], failed["reason_code"]) == ("fail", "symm-mem-nccl-capture-register-failed")
    # a wrong allreduce on a window torch registered fails too
    wrong = _window_facts("ok", "ok", torch_ok=True)
    wrong["ops"]["nccl_all_reduce"]["eager"] = {"verdict": "wrong", "detail": "12 elements differ"}
    assert symm_mem.one_rank_verdict(wrong)["reason_code"] == "symm-mem-wrong-result"


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


def test_nccl_2_32_6s_own_matrix_under_allreduce_tree_leaves_the_other_collectives_without_an_algorithm() -> None:
    """The lines NCCL 2.32.6 logged on a 1x H100 (rank 0, NCCL_ALGO=allreduce:tree, NCCL_DEBUG_SUBSYS=ENV): four
    sections (its symmetric kernels after the algorithms) and the AllReduce row cut at 300 characters."""
    from pathlib import Path

    text = (Path(__file__).parent / "data" / "nccl-2.32.6-enable-matrix-allreduce-tree.log").read_text()
    assert len(text.splitlines()[-1]) == 300 and text.splitlines()[2].count("|") == 3
    matrix = _nccl.enable_matrix(text)
    assert set(matrix) == {"Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce"}
    assert matrix["AllReduce"] == {"Tree": 1, "Ring": 0, "CollNetDirect": 0, "CollNetChain": 0, "NVLS": 0,
                                   "NVLSTree": 0, "PAT": 0}
    assert _nccl.without_algorithm(matrix, ("AllReduce", "AllGather", "ReduceScatter", "Broadcast")) == [
        "AllGather", "ReduceScatter", "Broadcast"]
    ops = {op: {"eager": {"verdict": "ok"}, "graph": {"verdict": "ok"}}
           for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")}
    got = nccl_graphs.table_verdict(ops, matrix, "allreduce:tree", "default", "2.32.6")
    assert got["status"] == "partial" and got["reason_code"] == "nccl-algo-unavailable"
