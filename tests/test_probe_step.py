"""The step probe on CPU (its closed-form reference against a brute-force sum over ranks, the step body with a
loopback backend, verdicts, planning) and what `checks advise` makes of timed step results written here. The
GPU paths themselves run on the lent H200 (results/h200x1-*)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from checks.cli import main
from checks.report import measured
from inenv.kit import _data
from inenv.probe import HostView
from inenv.probes import step, stepmodel
from tests.checks_helpers import ROOT, committed

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
FIXTURE = ROOT / "tests" / "golden" / "advise" / "results"
H200 = "h200x2-5bce98f7"
CELL = "local-cu130-torch2.11.0-sglnone-fi0.6.18"


# --- the reference ------------------------------------------------------------------------------------


def _brute_force(shape: step.Shape, world: int, tokens: int, seed: int) -> Any:
    """The final residual by running every block on every rank in float64 and summing: no closed form."""
    import torch

    h = shape.hidden
    w_a = torch.zeros(shape.attn_in, h, dtype=torch.float64)
    w_a[(torch.arange(h) * 7 + 1) % shape.attn_in, torch.arange(h)] = 1
    w_m = torch.zeros(shape.mlp_in, h, dtype=torch.float64)
    w_m[(torch.arange(h) * 5 + 3) % shape.mlp_in, torch.arange(h)] = 1
    res = _data.pattern((tokens, h), 0, seed + 1000, dtype=torch.float64)
    for layer in range(shape.layers):
        sign = 1.0 if layer % 2 == 0 else -1.0
        for width, w, s in ((shape.attn_in, w_a, seed), (shape.mlp_in, w_m, seed + 1)):
            total = sum(sign * _data.pattern((tokens, width), r, s, dtype=torch.float64) @ w for r in range(world))
            res = res + total
    return res


@needs_torch
@pytest.mark.parametrize("layers", [3, 4, 61])
@pytest.mark.parametrize("world", [2, 8])
def test_closed_form_reference_is_the_sum_over_ranks_of_every_block(layers: int, world: int) -> None:
    import torch

    shape = step.Shape("t", 64, layers, 48, 80)
    model = step.Model(shape, 0, world, "cpu", None, _flat(shape))
    final, _, _ = model.expected(5, 2, with_comm=True)
    want = _brute_force(shape, world, 5, 2)
    assert torch.equal(final.to(torch.float64), want)
    assert float(want.abs().max()) <= 256  # every value is an integer bf16 holds exactly


def _flat(shape: step.Shape) -> dict[str, Any]:
    import torch

    return {k: torch.empty(step.MAX_TOKENS * shape.hidden, dtype=torch.bfloat16)
            for k in ("res0", "res_a", "res_b", "norm", "out")}


class _Loopback(step.Comm):
    """One rank: the allreduce of one rank is its input. ``broken`` returns nothing (leaves the output as it was)."""

    name = "loopback"

    def __init__(self, numel: int, in_place: bool, broken: bool = False, fused: bool = False) -> None:
        import torch

        self.flat_in = torch.empty(numel, dtype=torch.bfloat16)
        self.in_place, self.broken, self.fused = in_place, broken, fused

    def reduce(self, inp: Any, out: Any) -> None:
        if not self.broken and out is not inp:
            out.copy_(inp)

    def fused_op(self, inp: Any, res_in: Any, gamma: Any, res_out: Any, norm_out: Any) -> None:
        from inenv.probes.fi_fusion import reference

        res, norm = reference(inp, res_in, gamma)
        res_out.copy_(res)
        norm_out.copy_(norm)


@needs_torch
@pytest.mark.parametrize("layers", [3, 4])
@pytest.mark.parametrize("in_place", [True, False])
def test_step_body_with_a_working_backend_checks_exact(layers: int, in_place: bool) -> None:
    shape = step.Shape("t", 64, layers, 48, 80)
    comm = _Loopback(step.MAX_TOKENS * 64, in_place)
    model = step.Model(shape, 0, 1, "cpu", comm, _flat(shape))
    for with_comm in (True, False):
        model.load(9, 3)
        model.step(9, with_comm)()
        assert stepmodel._check(model, 9, 3, with_comm, fused=False)["verdict"] == "ok"


@needs_torch
def test_step_body_with_a_fused_backend_checks_the_norm_too() -> None:
    shape = step.Shape("t", 64, 3, 48, 80)
    model = step.Model(shape, 0, 1, "cpu", _Loopback(step.MAX_TOKENS * 64, False, fused=True), _flat(shape))
    model.load(4, 2)
    model.step(4, True)()
    found = stepmodel._check(model, 4, 2, True, fused=True)
    assert found["verdict"] == "ok" and found["norm"]["within_1ulp"]


@needs_torch
@pytest.mark.parametrize("layers", [3, 4])
def test_an_allreduce_that_writes_nothing_fails_the_step(layers: int) -> None:
    shape = step.Shape("t", 64, layers, 48, 80)
    model = step.Model(shape, 0, 1, "cpu", _Loopback(step.MAX_TOKENS * 64, False, broken=True), _flat(shape))
    model.load(6, 2)
    model.step(6, True)()
    assert stepmodel._check(model, 6, 2, True, fused=False)["verdict"] != "ok"


@needs_torch
def test_a_stale_result_from_the_previous_seed_fails_the_step() -> None:
    """Two seeds: a graph that replays nothing leaves the first seed's residual, which the second refuses."""
    shape = step.Shape("t", 64, 3, 48, 80)
    model = step.Model(shape, 0, 1, "cpu", _Loopback(step.MAX_TOKENS * 64, True), _flat(shape))
    model.load(6, 2)
    model.step(6, True)()
    kept = model.final(6).clone()
    model.load(6, 3)
    model.final(6).copy_(kept)
    assert stepmodel._check(model, 6, 3, True, fused=False)["verdict"] != "ok"


# --- kernels, verdicts, planning ------------------------------------------------------------------------


def test_comm_kernels_name_what_the_backends_graph_launched() -> None:
    from collections import Counter

    nccl = Counter({"ncclDevKernel_AllReduce_Sum_bf16_RING_LL": 122})
    assert stepmodel.comm_kernels(nccl) == {"kernels": {"ncclDevKernel_AllReduce_Sum_bf16_RING_LL": 122}, "nccl": True}
    two = Counter({"vllm::cross_device_reduce_1stage": 4, "flashinfer::comm::pcie_ipc::ipc_tp2_remote_push_kernel": 1})
    assert stepmodel.comm_kernels(two) == {"kernels": {"flashinfer::comm::pcie_ipc::ipc_tp2_remote_push_kernel": 1,
                                                       "vllm::cross_device_reduce_1stage": 4}, "nccl": False}
    assert stepmodel.comm_kernels("profiler unavailable") == {"error": "profiler unavailable"}


def _case(verdict: str = "ok", nccl: bool = False, step_us: float = 3000.0, base_us: float = 2500.0) -> dict[str, Any]:
    t = {"median_us": step_us, "p99_us": step_us, "min_us": step_us}
    b = {"median_us": base_us, "p99_us": base_us, "min_us": base_us}
    c = {"median_us": 4.0, "p99_us": 4.0, "min_us": 4.0}
    out: dict[str, Any] = {"verdict": verdict, "launched": {"kernels": {"k": 122}, "nccl": nccl}}
    if verdict == "ok":
        out["timing"] = {"step": t, "baseline": b, "comm": c}
    return out


def test_summarize_pass_records_the_step_and_its_communication_share() -> None:
    r = step.summarize("nccl", {"deepseek-v3": {"decode:8": _case(nccl=True)}}, {"deepseek-v3": 122}, shared=False)
    assert r["status"] == "pass"
    m = r["metrics"]
    assert m["step_us"] == {"deepseek-v3": {"decode:8": 3000.0}}
    assert m["comm_share"]["deepseek-v3"]["decode:8"] == round(500 / 3000, 4)
    assert m["per_allreduce_us"]["deepseek-v3"]["decode:8"] == round(500 / 122, 3)
    assert m["headline"] == "deepseek-v3 decode:8: 3.00 ms, 17% comm"


def test_summarize_shared_gpu_records_no_time() -> None:
    case = _case()
    del case["timing"]
    r = step.summarize("flashinfer-custom-ar", {"deepseek-v3": {"decode:1": case}}, {"deepseek-v3": 122}, shared=True)
    assert r["status"] == "pass" and not r["metrics"] and r["evidence"]["timed"] is False


def test_summarize_verdicts() -> None:
    blocks = {"m": 10}
    wrong = step.summarize("x", {"m": {"decode:1": {"verdict": "wrong", "detail": "off"}}}, blocks, False)
    assert (wrong["status"], wrong["reason_code"]) == ("fail", "step-wrong-result")
    refused = {"verdict": "refused", "detail": "no configuration"}
    some = step.summarize("x", {"m": {"decode:1": _case(), "decode:8": refused}}, blocks, False)
    assert (some["status"], some["reason_code"]) == ("partial", "step-backend-fallback")
    assert "refused at m decode:8" in some["note"]
    every = step.summarize("x", {"m": {"decode:1": refused}}, blocks, False)
    assert (every["status"], every["reason_code"]) == ("fail", "step-backend-refused")
    fell = step.summarize("flashinfer-pcie-ipc", {"m": {"decode:1": _case(nccl=True)}}, blocks, False)
    assert (fell["status"], fell["reason_code"]) == ("partial", "step-backend-fallback")
    assert "launched NCCL kernels at m decode:1" in fell["note"]


def _host(gpus: int) -> HostView:
    return HostView(gpu_count=gpus, compute_capability="9.0", gpu_name="NVIDIA H200")


def test_variants_one_gpu_checks_every_backend_but_nccl_on_shared_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(step.ONLY_ENV, raising=False)
    shareable = sorted(b for b in step.BACKENDS if b != "nccl")
    shared = [v for v in step.variants(_host(1)) if v.share_gpu]
    # every backend but NCCL at 2, 3, 4 and 8 ranks, all on the one GPU; run at 2 ranks only, the other sizes
    # planned not-run (the feature probes' shared variants check each backend's set-up there)
    assert sorted((v.param("backend"), v.ranks) for v in shared) == sorted((b, n) for b in shareable
                                                                           for n in (2, 3, 4, 8))
    assert all(v.gpus == 1 for v in shared)
    # the backends whose own probes run the same set-up, agreement and exact case on shared ranks
    own = ("flashinfer-custom-ar", "symm-mem-one-shot", "flashinfer-pcie-ipc", "flashinfer-fusion")
    assert sorted((v.param("backend"), v.ranks) for v in shared if v.skip is not None) == sorted(
        (b, n) for b in own for n in (3, 4, 8))
    assert {(v.skip.code, v.skip.status) for v in shared if v.skip} == {("narrowed-world-size", "not-run")}
    two = step.variants(_host(2))
    assert sorted((v.param("backend"), v.ranks) for v in two if v.share_gpu) == sorted(
        (b, n) for b in shareable for n in (3, 4, 8))
    assert {v.param("backend") for v in two if v.share_gpu and v.skip is None} == {"sgl-custom-ar"}
    assert {v.param("backend") for v in two if v.ranks == 2 and v.skip is None} == set(step.BACKENDS)
    monkeypatch.setenv(step.ONLY_ENV, "nccl,flashinfer-fusion")
    assert {v.param("backend") for v in step.variants(_host(2))} == {"nccl", "flashinfer-fusion"}


def test_cases_cover_decode_and_verify_with_eagle_and_mtp_drafts() -> None:
    keys = [c.key for c in step.CASES]
    assert keys[:3] == ["decode:1", "decode:8", "decode:32"]
    assert {"verify:8x3", "verify:8x7", "verify:32x3", "verify:32x7"} <= set(keys)
    assert step.MAX_TOKENS == 32 * 8


def test_cases_of_one_token_count_are_measured_once_under_the_first_key() -> None:
    from inenv.probes import stepmodel

    # decode at batch 32 and verify at batch 8 with 3 drafts are both 32 tokens; every other count is its own
    assert stepmodel.same_graph(step.CASES) == {"verify:8x3": "decode:32"}
    cases = (stepmodel.Case("verify", 4, 1), stepmodel.Case("decode", 8), stepmodel.Case("verify", 2, 3),
             stepmodel.Case("decode", 1))
    assert stepmodel.same_graph(cases) == {"decode:8": "verify:4x1", "verify:2x3": "verify:4x1"}


def test_measure_cases_runs_one_graph_per_token_count_and_stops_after_a_hang() -> None:
    ran: list[str] = []

    def one(case: Any) -> dict[str, Any]:
        ran.append(case.key)
        return {"verdict": "ok", "timing": {"step": {"median_us": float(case.tokens)}}}

    got = step.measure_cases(step.CASES, one)
    assert ran == ["decode:1", "decode:8", "decode:32", "verify:8x7", "verify:32x3", "verify:32x7"]
    assert list(got) == [c.key for c in step.CASES]
    assert got["verify:8x3"] == {"verdict": "ok", "timing": {"step": {"median_us": 32.0}}, "same_graph_as": "decode:32"}
    assert "same_graph_as" not in got["decode:32"]

    def hangs_at_8(case: Any) -> dict[str, Any]:
        return {"verdict": "hang" if case.tokens == 8 else "ok"}

    # the ranks' device work is unfinished after a hang: nothing more runs on them
    assert list(step.measure_cases(step.CASES, hangs_at_8)) == ["decode:1", "decode:8"]


def test_model_shapes_give_every_row_parallel_width_divisible_by_the_world_sizes() -> None:
    from inenv import models

    hiddens = {int(str(d["hidden"])) for d in models.SHAPES.values()}
    assert {4096, 5120, 6144, 7168, 8192} <= hiddens
    for name, d in models.SHAPES.items():
        for key in ("attn_out", "mlp_out"):
            assert all(int(str(d[key])) % n == 0 for n in step.SPEC.ranks), (name, key)
    assert set(models.SOURCES) == set(models.SHAPES)


# --- advise on timed step results -----------------------------------------------------------------------


def _step_line(run_id: str, backend: str, step_us: dict[str, float], base_us: dict[str, float],
               comm_us: float, nccl_kernels: bool = False) -> dict[str, Any]:
    model = "deepseek-v3"
    share = {k: round((step_us[k] - base_us[k]) / step_us[k], 4) for k in step_us}
    per_ar = {k: round((step_us[k] - base_us[k]) / 122, 3) for k in step_us}
    launched = {"kernels": {("ncclDevKernel_AllReduce_Sum_bf16_RING_LL()" if nccl_kernels
                             else f"void ns::{backend.replace('-', '_')}_kernel<bf16, 2>(int)"): 122},
                "nccl": nccl_kernels}
    return {
        "schema": "stackprobe.result/2", "run_id": run_id, "host_id": H200, "cell_id": CELL, "probe_id": "step",
        "variant": f"ranks=2,backend={backend}", "status": "pass", "reason_code": "", "note": "", "remediation": "",
        "metrics": {"step_us": {model: step_us}, "baseline_us": {model: base_us}, "comm_share": {model: share},
                    "per_allreduce_us": {model: per_ar}, "comm_only_us": {model: {"decode:8": comm_us}}},
        "evidence": {"models": {model: {"hidden": 7168}}, "timed": True,
                     "per_case": {model: {k: {"launched": launched} for k in step_us}}},
        "started_at": "2026-11-29T18:00:00Z", "duration_s": 20.0,
        "code": {"version": "0.1.0", "commit": "0" * 40, "dirty": False, "probe_hash": "0123456789abcdef"},
    }


def _nccl_latency_at_8_tokens() -> float:
    for line in (FIXTURE / H200 / "20261129T164359Z-5173.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["probe_id"] == "ar-latency" and row["cell_id"] == CELL and row["variant"] == "ranks=2,backend=nccl":
            return float(row["metrics"]["latency_us"][str(8 * 7168 * 2)])
    raise AssertionError("the fixture has no NCCL latency at 8 tokens")


def test_advise_ranks_backends_by_the_measured_step_and_says_when_the_estimate_disagrees(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results"
    shutil.copytree(FIXTURE, results)
    run = "20261129T180000Z-5e0f"
    nccl_us = _nccl_latency_at_8_tokens()
    # custom AR is the fastest allreduce in the fixture's latency curves; in this step NCCL's step is faster
    rows = [
        _step_line(run, "nccl", {"decode:8": 3100.0, "verify:8x3": 3600.0}, {"decode:8": 2500.0, "verify:8x3": 2900.0},
                   nccl_us),
        _step_line(run, "flashinfer-custom-ar", {"decode:8": 3400.0, "verify:8x3": 3500.0},
                   {"decode:8": 2500.0, "verify:8x3": 2900.0}, nccl_us * 3),
        _step_line(run, "flashinfer-pcie-ipc", {"decode:8": 2000.0, "verify:8x3": 2100.0},
                   {"decode:8": 1900.0, "verify:8x3": 2000.0}, 5.0, nccl_kernels=True),
    ]
    (results / H200 / f"{run}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = json.loads((results / H200 / "20261129T164359Z-5173.manifest.json").read_text())
    manifest["run_id"] = run
    (results / H200 / f"{run}.manifest.json").write_text(json.dumps(manifest))
    assert main(["advise", "--results", str(results), "--host", H200, "--cell", CELL, "--model", "deepseek-v3",
                 "--tp", "2"]) == 0
    out = capsys.readouterr().out
    block = out.split(f"Measured step — deepseek-v3, tp 2, cell `{CELL}` (ranked on this)")[1].split("\n\n")[0]
    lines = [ln for ln in block.splitlines() if ln.startswith("- ")]
    # fastest decode first; the backend that launched NCCL's kernels last, named as such
    assert [ln.split(":")[0] for ln in lines] == ["- nccl", "- flashinfer-custom-ar", "- flashinfer-pcie-ipc"]
    assert "decode 3.100 ms (19% communication, 4.9 µs per allreduce over the 2.500 ms without it" in lines[0]
    assert "launched NCCL's kernels: not its own speed" in lines[2]
    assert "kernel flashinfer_custom_ar_kernel" in lines[1]
    assert "The estimate below disagrees with the measurement: measured fastest decode nccl" in block
    assert f"its allreduces alone: {nccl_us:.2f} µs per call" in block and "(agree within the noise)" in block
    assert "(differ by more than 5%)" in block  # the custom AR's comm-only time is 3x its ar-latency
    assert out.index("Measured step — ") < out.index("Estimate, not a measurement — ")
    code = main(["advise", "--results", str(results), "--host", H200, "--cell", CELL, "--model", "deepseek-v3",
                 "--tp", "2", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    got = data[0]["cells"][0]["measured"]
    assert got["verdict"] == "disagree" and got["rows"][0]["backend"] == "nccl"
    assert got["rows"][0]["decode"]["step_us"] == 3100.0


def test_advise_names_the_shared_gpu_step_checks_without_ranking_them(capsys: pytest.CaptureFixture[str]) -> None:
    host = "h200x1-a18818d1"  # the committed 1x H200 step run: ranks sharing the GPU
    assert main(["advise", "--results", str(committed()), "--host", host, "--model", "deepseek-v3", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    block = out.split("cell `cu130-torch2.11.0-sglnone-fi0.7.4`: checked, not timed")[1].split("\n\n")[0]
    assert "- flashinfer-fusion (allreduce_fusion_kernel_oneshot_lamport)" in block
    assert "- symm-mem-one-shot (one_shot_all_reduce_kernel)" in block
    assert "- flashinfer-custom-ar (cross_device_reduce_1stage)" in block
    assert "- flashinfer-pcie-ipc (ipc_tp2_remote_push_kernel)" in block
    assert "Measured step —" not in out


def test_advise_names_a_shared_placement_step_checked_with_one_case_per_dtype(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A shared-placement step result runs no model shapes: its one agreement case per dtype stands for every
    model, with the kernels its replay launched, and is never ranked."""
    results = tmp_path / "results"
    shutil.copytree(FIXTURE, results)
    run = "20261129T180000Z-5e0f"
    kernel = "void vllm::cross_device_reduce_1stage<__nv_bfloat16, 3>(vllm::RankData*)"
    row = {
        "schema": "stackprobe.result/2", "run_id": run, "host_id": H200, "cell_id": CELL, "probe_id": "step",
        "variant": "ranks=3,placement=shared,gpus=1,backend=flashinfer-custom-ar", "status": "pass",
        "reason_code": "", "note": "", "remediation": "", "metrics": {},
        "evidence": {"timed": False, "models": {}, "cases": [],
                     "checked": "set-up and one exact agreement case per dtype; shapes are checked at a GPU per rank",
                     "shared_checks": {"bf16:graph:256x8192": {"verdict": "ok", "launched": {
                         "kernels": {kernel: 1}, "nccl": False}}}},
        "started_at": "2026-11-29T18:00:00Z", "duration_s": 5.0,
        "code": {"version": "0.1.0", "commit": "0" * 40, "dirty": False, "probe_hash": "0123456789abcdef"},
    }
    (results / H200 / f"{run}.jsonl").write_text(json.dumps(row) + "\n")
    manifest = json.loads((results / H200 / "20261129T164359Z-5173.manifest.json").read_text())
    manifest["run_id"] = run
    (results / H200 / f"{run}.manifest.json").write_text(json.dumps(manifest))
    assert main(["advise", "--results", str(results), "--host", H200, "--cell", CELL, "--model", "qwen3-32b",
                 "--tp", "3"]) == 0
    out = capsys.readouterr().out
    block = out.split(f"Step — tp 3, cell `{CELL}`: checked, not timed")[1].split("\n\n")[0]
    assert "- flashinfer-custom-ar (cross_device_reduce_1stage)" in block
    assert "checked these backends without timing them, with the ranks sharing one GPU" in block
    assert "Measured step —" not in out
    # a GPU per rank at a world size outside the deep ones: its set-up checks are shown the same way
    row["variant"] = "ranks=3,backend=flashinfer-custom-ar,depth=setup"
    row["evidence"]["setup_checks"] = row["evidence"].pop("shared_checks")
    (results / H200 / f"{run}.jsonl").write_text(json.dumps(row) + "\n")
    assert main(["advise", "--results", str(results), "--host", H200, "--cell", CELL, "--model", "qwen3-32b",
                 "--tp", "3"]) == 0
    block = capsys.readouterr().out.split(f"Step — tp 3, cell `{CELL}`: checked, not timed")[1].split("\n\n")[0]
    assert "- flashinfer-custom-ar (cross_device_reduce_1stage)" in block


def test_case_keys_follow_advise_draft_counting() -> None:
    assert measured.case_keys(8, 4) == ("decode:8", "verify:8x3")
    assert measured.short_kernel("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(vllm::RankData*)") \
        == "cross_device_reduce_1stage"
    assert measured.short_kernel("void (anonymous namespace)::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>"
                                 "(c10::BFloat16**, unsigned long)") == "one_shot_all_reduce_kernel"
