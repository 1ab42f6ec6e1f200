"""Depth by world size: with a GPU per rank, the full grid and timings run at the deep world sizes (powers of two
up to the host's GPU count, and the GPU count), and a multi-rank probe with a shallow path runs its set-up and one
exact agreement case per dtype (``depth=setup``) at the other sizes; ar-latency, timings only, is planned at the
deep sizes only. The planned variants per probe and world size are written out for hosts of 1, 2, 4, 6 and 8 GPUs;
nothing here reads them back from the code under test."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from checks.results import hostfacts, ids
from checks.run.cost import budget
from checks.run.plan import CellState, CellTarget, WorkItem, deferred_shallow, deferred_sizes, plan_work
from inenv import registry
from inenv.kit import _agree
from inenv.probe import QUICK, HostView, ProbeSpec, Variant, deep_sizes, multi_rank, question, shallow
from inenv.probes import custom_ar, fi_fusion, nccl_graphs, pcie_ipc, step, symm_mem

ROOT = Path(__file__).resolve().parent.parent
FACTS = ROOT / "results" / "h200x2-5bce98f7" / "20261201T021126Z-b42a.manifest.json"
CELL = CellTarget("local-x", CellState.LOCAL)
MULTI_RANK = ("ar-latency", "custom-ar", "ep-a2a", "fi-fusion", "nccl-graphs", "pcie-ipc", "step", "symm-mem")


def _items(gpus: int) -> list[WorkItem]:
    facts = dict(json.loads(FACTS.read_text())["facts"], gpu_count=gpus)
    probes = {pid: mod for pid, (_, mod) in registry.discover().items()}
    return plan_work([CELL], probes, hostfacts.host_view(facts))


def _kind(v: Variant) -> str:
    if v.skip is not None:
        return "not-run" if v.skip.status == "not-run" else "skip"
    if v.param("load") is not None:
        return "load"
    if v.share_gpu:
        return "shared"
    return "setup" if v.param("depth") == "setup" else "deep"


def _table(gpus: int) -> dict[str, dict[int, str]]:
    """probe -> world size -> "6 deep", "5 shared + 1 skip", ... (kinds in a fixed order)."""
    counts: dict[str, dict[int, Counter[str]]] = {}
    for it in _items(gpus):
        v = it.variant
        if v.probe_id in MULTI_RANK and v.ranks > 1:
            counts.setdefault(v.probe_id, {}).setdefault(v.ranks, Counter())[_kind(v)] += 1
    order = ("deep", "setup", "shared", "load", "skip", "not-run")
    return {pid: {n: " + ".join(f"{c[k]} {k}" for k in order if c[k]) for n, c in sorted(by.items())}
            for pid, by in counts.items()}


def test_deep_sizes_are_the_powers_of_two_and_the_gpu_count() -> None:
    want = {0: (), 1: (), 2: (2,), 3: (2, 3), 4: (2, 4), 5: (2, 4, 5), 6: (2, 4, 6), 7: (2, 4, 7), 8: (2, 4, 8),
            12: (2, 4, 8, 12), 16: (2, 4, 8, 16)}
    assert {n: deep_sizes(HostView(gpu_count=n)) for n in want} == want


# Written out from the rules: step 6 backends (NCCL never shares a GPU; flashinfer's custom allreduce, symm-mem
# one-shot, PCIe IPC and the fusion are planned not-run where they would share, but at 2 ranks on one GPU), custom-ar 2
# implementations x 2 modes (only flashinfer forced shares), fi-fusion and symm-mem one set (also 2 ranks on one GPU,
# and symm-mem's sustained load at 2 ranks and the GPU count and its NCCL backend at the deep sizes, a GPU per rank or a
# planned skip; fi-fusion's engine case at the deep sizes, or at 2 ranks on the one GPU), pcie-ipc 3 ops (the all-reduce
# shares), ar-latency 6 backends (never shares), nccl-graphs 25 at 2 ranks and the GPU count (5 NCCL_ALGO settings x 2
# warm-ups x 2 connections, and each with NCCL_PROTO=Simple once) and the 10 (algorithm, protocol) variants at the other
# deep sizes and beyond the GPU count (never shares); at a size outside the deep ones NCCL's own choice runs (1 setup)
# and the other 9 (algorithm, protocol) pairs are planned not-run; ep-a2a one variant across GPUs (never shares; its
# simulated ranks are one process).
EIGHT = {
    "step": {2: "6 deep", 3: "6 setup", 4: "6 deep", 5: "6 setup", 6: "6 setup", 7: "6 setup", 8: "6 deep"},
    "custom-ar": {2: "4 deep", 3: "4 setup", 4: "4 deep", 5: "4 setup", 6: "4 setup", 7: "4 setup", 8: "4 deep"},
    "fi-fusion": {2: "2 deep + 1 shared", 3: "1 setup", 4: "2 deep", 5: "1 setup", 6: "1 setup", 7: "1 setup",
                  8: "2 deep"},
    "pcie-ipc": {2: "3 deep", 3: "3 setup", 4: "3 deep", 5: "3 setup", 6: "3 setup", 7: "3 setup", 8: "3 deep"},
    "symm-mem": {2: "2 deep + 1 shared + 1 load", 3: "1 setup", 4: "2 deep", 5: "1 setup", 6: "1 setup",
                 7: "1 setup", 8: "2 deep + 1 load"},
    "ar-latency": {2: "6 deep", 4: "6 deep", 8: "6 deep"},
    "nccl-graphs": {2: "25 deep", 3: "1 setup + 9 not-run", 4: "10 deep", 5: "1 setup + 9 not-run",
                    6: "1 setup + 9 not-run", 7: "1 setup + 9 not-run", 8: "25 deep"},
    "ep-a2a": {n: "1 deep" for n in range(2, 9)},
}
SIX = {
    "step": {2: "6 deep", 3: "6 setup", 4: "6 deep", 5: "6 setup", 6: "6 deep", 8: "1 shared + 1 skip + 4 not-run"},
    "custom-ar": {2: "4 deep", 3: "4 setup", 4: "4 deep", 5: "4 setup", 6: "4 deep", 8: "1 shared + 3 skip"},
    "fi-fusion": {2: "2 deep + 1 shared", 3: "1 setup", 4: "2 deep", 5: "1 setup", 6: "2 deep", 8: "1 shared"},
    "pcie-ipc": {2: "3 deep", 3: "3 setup", 4: "3 deep", 5: "3 setup", 6: "3 deep", 8: "1 shared + 2 skip"},
    "symm-mem": {2: "2 deep + 1 shared + 1 load", 3: "1 setup", 4: "2 deep", 5: "1 setup", 6: "2 deep + 1 load",
                 8: "1 shared + 1 skip"},
    "ar-latency": {2: "6 deep", 4: "6 deep", 6: "6 deep", 8: "6 skip"},
    "nccl-graphs": {2: "25 deep", 3: "1 setup + 9 not-run", 4: "10 deep", 5: "1 setup + 9 not-run", 6: "25 deep",
                    8: "10 skip"},
    "ep-a2a": {2: "1 deep", 3: "1 deep", 4: "1 deep", 5: "1 deep", 6: "1 deep", 8: "1 skip"},
}
FOUR = {
    "step": {2: "6 deep", 3: "6 setup", 4: "6 deep", 8: "1 shared + 1 skip + 4 not-run"},
    "custom-ar": {2: "4 deep", 3: "4 setup", 4: "4 deep", 8: "1 shared + 3 skip"},
    "fi-fusion": {2: "2 deep + 1 shared", 3: "1 setup", 4: "2 deep", 8: "1 shared"},
    "pcie-ipc": {2: "3 deep", 3: "3 setup", 4: "3 deep", 8: "1 shared + 2 skip"},
    "symm-mem": {2: "2 deep + 1 shared + 1 load", 3: "1 setup", 4: "2 deep + 1 load", 8: "1 shared + 1 skip"},
    "ar-latency": {2: "6 deep", 4: "6 deep", 8: "6 skip"},
    "nccl-graphs": {2: "25 deep", 3: "1 setup + 9 not-run", 4: "25 deep", 8: "10 skip"},
    "ep-a2a": {2: "1 deep", 3: "1 deep", 4: "1 deep", 8: "1 skip"},
}
TWO = {  # every size but 2 is beyond the GPU count: shared or a planned skip, never depth=setup
    "step": {2: "6 deep", 3: "1 shared + 1 skip + 4 not-run", 4: "1 shared + 1 skip + 4 not-run",
             8: "1 shared + 1 skip + 4 not-run"},
    "custom-ar": {2: "4 deep", 3: "1 shared + 3 skip", 4: "1 shared + 3 skip", 8: "1 shared + 3 skip"},
    "fi-fusion": {2: "2 deep + 1 shared", 3: "1 shared", 4: "1 shared", 8: "1 shared"},
    "pcie-ipc": {2: "3 deep", 3: "1 shared + 2 skip", 4: "1 shared + 2 skip", 8: "1 shared + 2 skip"},
    "symm-mem": {2: "2 deep + 1 shared + 1 load", 3: "1 shared + 1 skip", 4: "1 shared + 1 skip",
                 8: "1 shared + 1 skip"},
    "ar-latency": {2: "6 deep", 3: "6 skip", 4: "6 skip", 8: "6 skip"},
    "nccl-graphs": {2: "25 deep", 3: "10 skip", 4: "10 skip", 8: "10 skip"},
    "ep-a2a": {2: "1 deep", 3: "1 skip", 4: "1 skip", 8: "1 skip"},
}
ONE = {  # no deep size: every multi-rank variant shares the GPU or is a planned skip
    "step": {2: "5 shared + 1 skip", 3: "1 shared + 1 skip + 4 not-run", 4: "1 shared + 1 skip + 4 not-run",
             8: "1 shared + 1 skip + 4 not-run"},
    "custom-ar": {n: "1 shared + 3 skip" for n in (2, 3, 4, 8)},
    "fi-fusion": {2: "2 shared", 3: "1 shared", 4: "1 shared", 8: "1 shared"},
    "pcie-ipc": {n: "1 shared + 2 skip" for n in (2, 3, 4, 8)},
    "symm-mem": {2: "1 shared + 2 skip", 3: "1 shared + 1 skip", 4: "1 shared + 1 skip", 8: "1 shared + 1 skip"},
    "ar-latency": {n: "6 skip" for n in (2, 3, 4, 8)},
    "nccl-graphs": {2: "25 skip", 3: "10 skip", 4: "10 skip", 8: "10 skip"},
    "ep-a2a": {n: "1 skip" for n in (2, 3, 4, 8)},
}


@pytest.mark.parametrize(("gpus", "want"), [(8, EIGHT), (6, SIX), (4, FOUR), (2, TWO), (1, ONE)])
def test_planned_variants_per_probe_and_world_size(gpus: int, want: dict[str, dict[int, str]]) -> None:
    assert _table(gpus) == want


def test_a_shallow_variant_says_so_in_its_key() -> None:
    keys = {it.variant.key for it in _items(8)}
    assert {"ranks=3,backend=nccl,depth=setup", "ranks=7,backend=flashinfer-fusion,depth=setup",
            "ranks=5,impl=sgl_kernel,full_nvlink=topology,depth=setup", "ranks=6,depth=setup",
            "ranks=3,op=reduce-scatter,depth=setup",
            "ranks=5,algo=Tree,warmup=yes,runtime_connect=default,depth=setup"} <= keys
    # the deep sizes keep their keys
    assert {"ranks=4,backend=nccl", "ranks=8,impl=flashinfer,full_nvlink=forced", "ranks=8",
            "ranks=4,algo=Tree,warmup=yes,runtime_connect=default", "ranks=8,backend=flashinfer-pcie-ipc"} <= keys
    assert not [k for k in keys if "depth=setup" in k and ("ranks=2," in k or "ranks=4," in k or "ranks=8," in k)]


@pytest.mark.parametrize("gpus", [8, 1])
def test_every_planned_key_is_one_the_results_reader_accepts(gpus: int) -> None:
    """A key the reader refuses would be a result left out of every table: the planner makes none (NCCL's
    "ring,tree;allreduce:tree" included, spelled without a shell character)."""
    keys = {it.variant.key for it in _items(gpus)}
    assert "ranks=2,algo=ring+tree.allreduce:tree,proto=Simple,warmup=yes,runtime_connect=default" in keys
    assert [k for k in keys if not ids.valid("variant", k)] == []


def test_shallow_is_ranks_sharing_a_gpu_or_depth_setup() -> None:
    by_kind: dict[str, set[bool]] = {}
    for it in _items(6):
        if it.variant.probe_id in ("step", "custom-ar", "fi-fusion", "pcie-ipc", "symm-mem", "nccl-graphs"):
            by_kind.setdefault(_kind(it.variant), set()).add(shallow(it.variant))
    assert by_kind == {"deep": {False}, "setup": {True}, "shared": {True}, "load": {False}, "skip": {False},
                       "not-run": {True}}


def test_question_leaves_the_depth_out() -> None:
    assert question(Variant("step", 3, (("backend", "nccl"), ("depth", "setup")))) == (("backend", "nccl"),)
    assert question(Variant("step", 4, (("backend", "nccl"),))) == (("backend", "nccl"),)


def test_other_sizes_must_be_one_of_three() -> None:
    with pytest.raises(ValueError, match="other_sizes 'shallow' is not one of full, setup, omit"):
        multi_rank(ProbeSpec("x", "t", "f", ranks=(2,)), HostView(gpu_count=8), [()], other_sizes="shallow")


SHALLOW_BF16 = "bf16:graph:256x8192"
SHALLOW_FP16 = "fp16:graph:256x8192"


def _variant(gpus: int, probe: str, ranks: int, **params: str | None) -> Variant:
    found = [it.variant for it in _items(gpus) if it.variant.probe_id == probe and it.variant.ranks == ranks
             and all(it.variant.param(k) == v for k, v in params.items())]
    assert len(found) == 1, (probe, ranks, params, [v.key for v in found])
    return found[0]


def test_step_selects_the_shallow_cases_at_a_setup_size_and_the_full_grid_at_a_deep_one(level: str) -> None:
    setup = _variant(8, "step", 6, backend="nccl")
    deep = _variant(8, "step", 4, backend="nccl")
    assert (setup.share_gpu, setup.key) == (False, "ranks=6,backend=nccl,depth=setup")  # NCCL, a GPU per rank
    assert step.checks(shallow(setup), 6) == ((), ())
    dtypes = [SHALLOW_BF16] if level == QUICK else [SHALLOW_BF16, SHALLOW_FP16]
    assert [c.key for c in step.agreement_cases(shallow(setup), ("bf16", "fp16"))] == dtypes
    shapes, cases = step.checks(shallow(deep), 4)
    if level == QUICK:
        assert ([s.name for s in shapes], [c.key for c in cases]) == (["deepseek-v3"], ["decode:1"])
    else:
        assert len(shapes) == 6 and len(cases) == 7
        assert len(step.agreement_cases(shallow(deep), ("bf16", "fp16"))) == 2 * 5 * 3 * 2


def test_the_other_probes_select_their_shallow_path_at_a_setup_size(level: str) -> None:
    dtypes = [SHALLOW_BF16] if level == QUICK else [SHALLOW_BF16, SHALLOW_FP16]
    ar_setup = _variant(8, "custom-ar", 3, impl="flashinfer", full_nvlink="topology")
    ar_deep = _variant(8, "custom-ar", 8, impl="flashinfer", full_nvlink="topology")
    sizes, graphs, agreement = custom_ar.checked(shallow(ar_setup))
    assert (sizes, graphs, [c.key for c in agreement]) == ((1,), ((8, 7168),), dtypes)
    assert custom_ar.checked(shallow(ar_deep))[1] == ((8, 7168), (128, 7168))
    assert fi_fusion.checked(shallow(_variant(8, "fi-fusion", 5))) == ((1,), (1,))
    assert fi_fusion.checked(shallow(_variant(8, "fi-fusion", 4, depth=None, case=None)))[0] == (
        (1,) if level == QUICK else (1, 2, 4, 8, 16, 32, 64, 128))
    pcie = _variant(8, "pcie-ipc", 7, op="all-gather")
    assert [(c.tokens, c.hidden, c.edge) for c in pcie_ipc.cases("all-gather", shallow(pcie))] == [(1, 2048, False)]
    pcie_deep = _variant(8, "pcie-ipc", 8, op="all-gather")
    assert (1, 4, True) in [(c.tokens, c.hidden, c.edge) for c in pcie_ipc.cases("all-gather", shallow(pcie_deep))]
    sizes, agreement = symm_mem.checked(shallow(_variant(8, "symm-mem", 6)))
    assert (sizes, [c.key for c in agreement]) == ((1,), [SHALLOW_BF16])
    assert symm_mem.checked(shallow(_variant(8, "symm-mem", 8, load=None, backend=None)))[0] == (
        (1,) if level == QUICK else (1, 16, 128))
    graphs_setup = _variant(8, "nccl-graphs", 5, algo="Ring", proto=None, warmup="yes", runtime_connect="default")
    assert [c.key for c in nccl_graphs.agreement_cases(shallow(graphs_setup))] == dtypes
    graphs_deep = _variant(8, "nccl-graphs", 4, algo="Ring", proto=None, warmup="yes", runtime_connect="default")
    assert len(nccl_graphs.agreement_cases(shallow(graphs_deep))) == (4 if level == QUICK else 60)


def test_a_setup_variants_evidence_says_the_full_grid_runs_at_the_deep_sizes(level: str) -> None:
    what = "set-up and one exact agreement case" + ("" if level == QUICK else " per dtype")
    assert _agree.shallow_checked(shared=False) == (
        f"{what}; every shape, case and timing runs at the deep world sizes (powers of two and the host's GPU count)")
    assert _agree.shallow_checked(shared=True) == f"{what}; shapes are checked at a GPU per rank"


def test_a_setup_step_result_keeps_its_checks_apart_from_a_shared_one() -> None:
    ok = {"verdict": "ok", "identical": True, "deterministic": True, "max_ulp_vs_reference": 0.5,
          "exact": {"verdict": "exact", "mismatches": 0}}
    r = step.summarize_shallow("nccl", {SHALLOW_BF16: ok}, {}, shared=False)
    assert (r["status"], r["evidence"]["timed"]) == ("pass", False)
    assert list(r["evidence"]["setup_checks"]) == [SHALLOW_BF16] and "shared_checks" not in r["evidence"]
    noop = {**ok, "exact": {"verdict": "no-op", "detail": "output left as it was"}}
    bad = step.summarize_shallow("nccl", {SHALLOW_BF16: noop}, {}, shared=False)
    assert (bad["status"], bad["reason_code"]) == ("fail", "step-wrong-result")
    assert f"in the set-up check {SHALLOW_BF16} step" in bad["note"]


def test_nccl_graphs_fails_a_setup_variant_whose_exact_case_did_nothing() -> None:
    passed = {"status": "pass", "note": "", "reason_code": "", "metrics": {}, "evidence": {}}
    agreed = {SHALLOW_BF16: {"verdict": "ok", "identical": True, "deterministic": True,
                             "exact": {"verdict": "no-op", "detail": "every element is this rank's input"}}}
    got = nccl_graphs.agreement_outcome(dict(passed), agreed, "Ring")
    assert (got["status"], got["reason_code"]) == ("fail", "nccl-wrong-result")
    exact = {SHALLOW_BF16: {**agreed[SHALLOW_BF16], "exact": {"verdict": "exact"}}}
    assert nccl_graphs.agreement_outcome(dict(passed), exact, "Ring")["status"] == "pass"


def test_the_quick_pass_runs_each_question_at_its_smallest_world_size_at_any_depth() -> None:
    gpu = [it for it in _items(8) if it.runs and it.spec.needs_gpu]
    ran = [it.variant for it in deferred_sizes(gpu) if it.runs and it.variant.ranks > 1]
    assert ran and {v.ranks for v in ran} == {2} and not [v for v in ran if v.param("depth")]
    # every depth=setup variant is left to the full pass
    deferred = [it for it in deferred_sizes(gpu) if it.variant.param("depth") == "setup"]
    assert deferred and {it.decided.reason_code for it in deferred if it.decided} == {"deferred-world-size"}
    assert all(it.decided is not None for it in deferred)


def test_the_quick_pass_on_one_gpu_leaves_the_steps_shared_variants_and_keeps_the_feature_probes() -> None:
    gpu = [it for it in _items(1) if it.runs and it.spec.needs_gpu]
    quick = deferred_shallow(deferred_sizes(gpu))
    ran = {(it.spec.id, it.variant.ranks) for it in quick if it.runs and it.variant.share_gpu}
    assert ran == {("custom-ar", 2), ("fi-fusion", 2), ("pcie-ipc", 2), ("symm-mem", 2)}
    left = [it for it in quick if it.spec.id == "step" and it.variant.ranks == 2]
    assert len(left) == 6 - 1  # every backend but NCCL, which refuses two ranks on one GPU
    assert {it.decided.reason_code for it in left if it.decided} == {"deferred-shallow"}
    # on two GPUs the step's deep variant at 2 ranks is the quick answer; nothing shallow of it runs
    two = deferred_shallow(deferred_sizes([it for it in _items(2) if it.runs and it.spec.needs_gpu]))
    step2 = [it.variant for it in two if it.runs and it.spec.id == "step"]
    assert step2 and {(v.ranks, v.share_gpu, v.param("depth")) for v in step2} == {(2, False, None)}


def test_the_budget_tiers_a_setup_variant_as_a_gpu_per_rank_at_another_world_size() -> None:
    items = [it for it in _items(8) if it.runs and it.variant.probe_id == "step"
             and it.variant.param("backend") == "nccl"]
    smallest = budget.smallest_sizes(items)
    tiers = {it.variant.key: budget.tier(it, smallest, 8) for it in items}
    assert tiers == {"ranks=2,backend=nccl": 0, "ranks=3,backend=nccl,depth=setup": 2, "ranks=4,backend=nccl": 2,
                     "ranks=5,backend=nccl,depth=setup": 2, "ranks=6,backend=nccl,depth=setup": 2,
                     "ranks=7,backend=nccl,depth=setup": 2, "ranks=8,backend=nccl": 1}


def test_the_step_leaves_shared_sizes_to_the_probes_that_check_the_same_there_and_says_which() -> None:
    one = [it.variant for it in _items(1) if it.variant.probe_id == "step" and it.variant.share_gpu]
    ran = {(v.ranks, v.param("backend")) for v in one if v.skip is None}
    kept = {"sgl-custom-ar"}  # custom-ar checks sgl-kernel's implementation with a GPU per rank only
    own = {"symm-mem-one-shot", "flashinfer-custom-ar", "flashinfer-pcie-ipc", "flashinfer-fusion"}
    assert ran == {(2, b) for b in kept | own} | {(n, b) for n in (3, 4, 8) for b in kept}
    left = [v for v in one if v.skip is not None]
    assert {(v.ranks, v.param("backend")) for v in left} == {(n, b) for n in (3, 4, 8) for b in own}
    assert {(v.skip.code, v.skip.status) for v in left if v.skip} == {("narrowed-world-size", "not-run")}
    note = next(v.skip.note for v in left if v.ranks == 8 and v.param("backend") == "symm-mem-one-shot" and v.skip)
    assert "8 ranks sharing one GPU" in note and "symm-mem's variant at that size" in note
    note = next(v.skip.note for v in left if v.ranks == 4 and v.param("backend") == "flashinfer-pcie-ipc" and v.skip)
    assert "pcie-ipc's variant at that size" in note
    # on two GPUs the step's own run has a GPU per rank; the two backends are left to their probes at every
    # shared size
    two = [it.variant for it in _items(2) if it.variant.probe_id == "step" and it.variant.share_gpu
           and it.variant.param("backend") == "flashinfer-custom-ar"]
    assert {v.ranks for v in two} == {3, 4, 8} and all(v.skip is not None for v in two)
    assert "GPU per rank at 2 ranks here" in next(v.skip.note for v in two if v.skip)
