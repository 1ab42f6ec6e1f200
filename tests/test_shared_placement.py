"""What a variant whose ranks share one GPU (``placement=shared``) checks, per probe and level, against what a
variant with a GPU per rank checks: the set-up and one exact case per dtype there, the full grid here. The
expected selections are written out; nothing here reads them back from the code under test."""

from __future__ import annotations

import pytest

from inenv.kit import _agree
from inenv.probe import QUICK
from inenv.probes import custom_ar, fi_fusion, pcie_ipc, step, symm_mem

SHARED_BF16 = "bf16:graph:256x8192"  # a verify step of 32 x (1 + 7) tokens at the largest hidden size, in a graph
SHARED_FP16 = "fp16:graph:256x8192"
MODELS = ["deepseek-v3", "kimi-k2", "llama-3.1-70b", "qwen3-coder-480b-a35b", "qwen3-235b-a22b", "qwen3-32b"]
STEP_CASES = ["decode:1", "decode:8", "decode:32", "verify:8x3", "verify:8x7", "verify:32x3", "verify:32x7"]


def _keys(cases: tuple[_agree.Case, ...]) -> list[str]:
    return [c.key for c in cases]


def test_shared_agreement_cases_are_one_per_dtype_and_the_first_dtype_in_a_quick_run(level: str) -> None:
    want = [SHARED_BF16] if level == QUICK else [SHARED_BF16, SHARED_FP16]
    assert _keys(_agree.shallow_cases(("bf16", "fp16"))) == want
    assert _keys(_agree.shallow_cases(("bf16",))) == [SHARED_BF16]
    assert _agree.shallow_checked(shared=True) == (
        "set-up and one exact agreement case; shapes are checked at a GPU per rank" if level == QUICK
        else "set-up and one exact agreement case per dtype; shapes are checked at a GPU per rank")


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_step_shared_runs_no_model_step_and_one_agreement_case_per_dtype(level: str, world: int) -> None:
    assert step.checks(True, world) == ((), ())
    # custom AR takes bf16 and fp16, symmetric memory and the fused backend bf16 only
    want = [SHARED_BF16] if level == QUICK else [SHARED_BF16, SHARED_FP16]
    assert _keys(step.agreement_cases(True, ("bf16", "fp16"))) == want
    assert _keys(step.agreement_cases(True, ("bf16",))) == [SHARED_BF16]


def test_step_with_a_gpu_per_rank_keeps_the_full_grid(level: str) -> None:
    shapes, cases = step.checks(False, 2)
    agreement = _keys(step.agreement_cases(False, ("bf16", "fp16")))
    if level == QUICK:
        assert ([s.name for s in shapes], [c.key for c in cases]) == (["deepseek-v3"], ["decode:1"])
        assert agreement == ["bf16:eager:256x8192", "bf16:graph:256x8192", "fp16:eager:256x8192",
                             "fp16:graph:256x8192"]
        return
    assert [s.name for s in shapes] == MODELS and [c.key for c in cases] == STEP_CASES
    # every dtype x hidden size x decode 1 / decode 32 / verify 256 tokens x eager and graph
    assert len(agreement) == len(set(agreement)) == 2 * 5 * 3 * 2
    assert {k.split(":")[2] for k in agreement} == {f"{t}x{h}" for t in (1, 32, 256)
                                                     for h in (4096, 5120, 6144, 7168, 8192)}


def test_custom_ar_shared_checks_one_size_each_way_and_one_agreement_case_per_dtype(level: str) -> None:
    sizes, graph_shapes, agreement = custom_ar.checked(True)
    assert (sizes, graph_shapes) == ((1,), ((8, 7168),))
    assert _keys(agreement) == ([SHARED_BF16] if level == QUICK else [SHARED_BF16, SHARED_FP16])
    sizes, graph_shapes, agreement = custom_ar.checked(False)
    assert sizes == ((1,) if level == QUICK else (1, 8, 32, 128))
    assert graph_shapes == ((8, 7168), (128, 7168))
    assert len(agreement) == (4 if level == QUICK else 60)


def test_symm_mem_shared_checks_one_size_and_one_agreement_case_per_op(level: str) -> None:
    sizes, agreement = symm_mem.checked(True)
    assert sizes == (1,) and _keys(agreement) == [SHARED_BF16]
    sizes, agreement = symm_mem.checked(False)
    assert sizes == ((1,) if level == QUICK else (1, 16, 128))
    assert len(agreement) == (2 if level == QUICK else 30)


def test_fi_fusion_shared_checks_one_size_eagerly_and_in_a_graph(level: str) -> None:
    assert fi_fusion.checked(True) == ((1,), (1,))
    want = ((1,), (1,)) if level == QUICK else ((1, 2, 4, 8, 16, 32, 64, 128), (1, 16, 128))
    assert fi_fusion.checked(False) == want


def test_pcie_ipc_shared_checks_the_first_decode_shape_without_the_admission_edges(level: str) -> None:
    assert [(c.tokens, c.hidden, c.edge) for c in pcie_ipc.cases("all-reduce", setup_only=True)] == [(1, 2048, False)]
    real = [(c.tokens, c.hidden, c.edge) for c in pcie_ipc.cases("all-reduce")]
    main = [(1, 2048, False)] if level == QUICK else [(1, 2048, False), (1, 7168, False), (8, 7168, False),
                                                       (128, 7168, False)]
    assert real == [*main, (1, 8, True), (3, 1365, True)]


def test_pcie_ipc_refusing_the_one_shape_checked_is_refusing_every_shape_checked() -> None:
    refused = {"1x2048": {"refused": "world size 3 unsupported; expected one of (2, 4, 8)"}}
    got = pcie_ipc.judge("all-reduce", refused, "seed", "eager")
    assert got is not None and (got["status"], got["reason_code"]) == ("fail", "pcie-ipc-refused")
    exact = {"1x2048": {"eager": {"verdict": "exact"}}, "1x8": {"refused": "fewer than one pack per rank"}}
    assert pcie_ipc.judge("all-reduce", exact, "seed", "eager") is None


# --- verdicts of a shared placement (pure) ------------------------------------------------------------------

def _agreed(exact: dict[str, object] | None = None, **extra: object) -> dict[str, object]:
    rec: dict[str, object] = {"verdict": "ok", "numel": 2097152, "identical": True, "differing": 0,
                              "max_ulp_between_ranks": 0, "divergent_ranks": [], "deterministic": True,
                              "changed_on_repeat": 0, "max_ulp_vs_reference": 0.5, "outputs": ["out"]}
    rec["exact"] = exact if exact is not None else {"verdict": "exact", "mismatches": 0, "numel": 2097152,
                                                     "max_abs_err": 0.0, "detail": ""}
    return {**rec, **extra}


KERNELS = {"kernels": {"void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(vllm::RankData*)": 1},
           "nccl": False}


def test_step_shared_pass_says_what_it_checked_and_records_no_time() -> None:
    agreed = {SHARED_BF16: _agreed(launched=KERNELS), SHARED_FP16: _agreed(launched=KERNELS)}
    r = step.summarize_shallow("flashinfer-custom-ar", agreed, {})
    assert (r["status"], r["reason_code"]) == ("pass", "")
    assert r["metrics"] == {} and r["evidence"]["timed"] is False and "per_case" not in r["evidence"]
    assert sorted(r["evidence"]["shared_checks"]) == [SHARED_BF16, SHARED_FP16]
    assert r["evidence"]["shared_checks"][SHARED_BF16]["launched"] == KERNELS


def test_step_shared_verdicts_keep_the_step_vocabulary() -> None:
    noop = {"verdict": "no-op", "mismatches": 2097152, "numel": 2097152, "max_abs_err": 107.0,
            "detail": "output equals its prior contents", "rank": 1}
    r = step.summarize_shallow("flashinfer-fusion", {SHARED_BF16: _agreed(noop)}, {})
    assert (r["status"], r["reason_code"]) == ("fail", "step-wrong-result")
    assert r["note"] == ("flashinfer-fusion: wrong result in the shared placement bf16:graph:256x8192 step "
                         "(output equals its prior contents)")
    why = "flashinfer's PCIe IPC policy has no configuration for (256, 8192): too large"
    refused = {SHARED_BF16: {"verdict": "unsupported", "error": f"ValueError: {why}"}}
    r = step.summarize_shallow("flashinfer-pcie-ipc", refused, {SHARED_BF16: why})
    assert (r["status"], r["reason_code"]) == ("fail", "step-backend-refused")
    # one dtype refused, the other exact: partial, as a shape refused beside a working one is at a GPU per rank
    r = step.summarize_shallow("x", {SHARED_BF16: _agreed(), SHARED_FP16: refused[SHARED_BF16]}, {SHARED_FP16: why})
    assert (r["status"], r["reason_code"]) == ("partial", "step-backend-fallback")
    # a world size the backend refuses in its call: the error text stays in the note for the worker to read
    failed = {SHARED_BF16: {"verdict": "error", "error": "capture: Traceback ...\nKeyError: 3"}}
    r = step.summarize_shallow("flashinfer-fusion", failed, {})
    assert (r["status"], r["reason_code"]) == ("fail", "step-backend-failed")
    assert r["note"].endswith("KeyError: 3")
    from inenv.worker import refuses_world_size

    assert refuses_world_size(r["note"], 3) and not refuses_world_size(r["note"], 4)
    # an exact call that raised is a failure, never a pass
    raised = _agreed({"verdict": "error", "error": "RuntimeError: CUDA error: an illegal memory access"})
    r = step.summarize_shallow("x", {SHARED_BF16: raised}, {})
    assert (r["status"], r["reason_code"]) == ("fail", "step-backend-failed")
    fell = step.summarize_shallow("x", {SHARED_BF16: _agreed(launched={"kernels": {"ncclDevKernel_AllReduce": 1},
                                                                            "nccl": True})}, {})
    assert (fell["status"], fell["reason_code"]) == ("partial", "step-backend-fallback")
    assert step.summarize_shallow("x", {}, {})["status"] == "fail"  # nothing checked is no pass


def test_an_inexact_agreement_case_fails_custom_ar_and_symm_mem_in_their_own_words() -> None:
    passed = {"status": "pass", "note": "", "reason_code": "", "metrics": {"headline": "h"}, "evidence": {}}
    noop = {"verdict": "no-op", "detail": "output equals its prior contents", "rank": 0}
    wrong = {"verdict": "wrong", "detail": "3/2097152 elements differ", "rank": 1}
    got = custom_ar.agreement_outcome(dict(passed), {SHARED_BF16: _agreed(noop)}, "flashinfer")
    assert (got["status"], got["reason_code"]) == ("fail", "custom-ar-silent-noop")
    got = custom_ar.agreement_outcome(dict(passed), {SHARED_BF16: _agreed(), SHARED_FP16: _agreed(wrong)},
                                      "flashinfer")
    assert (got["status"], got["reason_code"]) == ("fail", "custom-ar-wrong")
    assert got["note"] == "agreement case fp16:graph:256x8192: integer inputs gave wrong (3/2097152 elements differ)"
    assert got["metrics"]["agreement"]["inexact_cases"] == [SHARED_FP16]
    got = symm_mem.agreement_outcome(dict(passed), {f"one_shot:{SHARED_BF16}": _agreed(wrong)})
    assert (got["status"], got["reason_code"]) == ("fail", "symm-mem-wrong-result")
    clean = custom_ar.agreement_outcome(dict(passed), {SHARED_BF16: _agreed()}, "flashinfer")
    assert (clean["status"], clean["metrics"]["agreement"]["inexact_cases"]) == ("pass", [])
    # a verdict already worse stays as it was
    failed = {**passed, "status": "fail", "reason_code": "custom-ar-init-failed"}
    assert custom_ar.agreement_outcome(failed, {SHARED_BF16: _agreed(noop)}, "flashinfer")["reason_code"] == \
        "custom-ar-init-failed"
