"""The load probe's pieces, run for real on CPU: the worker's stall watchdog over progress records (inenv.progress),
and the load engine (inenv.load_engine) through the real worker with gloo ranks and stand-in backends
(tests/probes_fixtures_load)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.checks_helpers import ROOT, fixture_env, pids_with_env, run_worker

LOAD_FIXTURES = ROOT / "tests" / "probes_fixtures_load"


def _run(probe: str, ranks: int, params: list[list[str]] | None = None) -> tuple[dict[str, Any], str]:
    return run_worker(probe, ranks, params=params, env=fixture_env(STACKPROBE_PROBE_PATH=str(LOAD_FIXTURES)))


def test_a_rank_whose_progress_stands_still_is_a_hang_naming_where_each_rank_stopped() -> None:
    result, token = _run("t-stall", 2)
    assert result["status"] == "hang" and result["reason_code"] == "progress-stalled", result
    assert result["duration_s"] < 20  # the stall deadline is 1 s, the variant's timeout 60 s
    note = result["note"]
    assert "rank 0 stand-in replay: at replay 5 (verified to 4), 40 tokens, PDL on, stream 0" in note
    assert "rank 1 stand-in replay: at replay 7 (verified to 6), 64 tokens, PDL on, stream 1" in note
    assert result["evidence"]["progress"]["1"]["replay"] == 7
    assert all(r["stopped"].startswith("stalled") for r in result["evidence"]["ranks"])
    assert pids_with_env(token) == []


def test_a_phase_without_a_stall_deadline_is_left_to_finish() -> None:
    result, _ = _run("t-stall", 2, [["mode", "setup"]])
    assert result["status"] == "pass", result


QUICK = ["env.STACKPROBE_LEVEL", "quick"]


def test_an_honest_backend_passes_under_load_and_records_latency_per_size() -> None:
    result, _ = _run("t-load", 2, [["backend", "standin-honest"], QUICK])
    assert result["status"] == "pass", result
    m = result["metrics"]
    assert m["replays"] >= 300 and m["crossings"] > 20 and m["checked"] > 0
    assert set(m["latency_p50_us"]) == {"1", "8", "9", "32", "512"}  # quick sizes plus both sides of the switch
    assert result["evidence"]["sizes"] == [1, 8, 9, 32, 512]


def _logged(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()]


def test_a_backend_that_deadlocks_after_k_replays_when_the_size_changes_is_a_hang_naming_the_replay_and_size(
        tmp_path: Path) -> None:
    log = tmp_path / "standin.log"
    result, token = _run("t-load", 2, [["backend", "standin-deadlock-switch"], ["pdl", "on"], QUICK,
                                       ["env.T_LOAD_K", "40"], ["env.T_LOAD_LOG", str(log)]])
    (_, _, _, _, _, call, _, size), = _logged(log)  # "rank 0 blocked at call N size S"
    assert int(call) >= 40
    assert result["status"] == "hang" and result["reason_code"] == "progress-stalled", result
    assert result["duration_s"] < 30  # the stall deadline is 3 s, the variant's timeout 90 s
    for rank in (0, 1):  # the peer waits in the same replay's sum
        assert re.search(rf"rank {rank} standin-deadlock-switch replay: at replay {call}\b[^;]*, {size} tokens, "
                         r"PDL on, stream 0", result["note"]), result["note"]
        assert result["evidence"]["progress"][str(rank)]["replay"] == int(call)
    assert pids_with_env(token) == []


def test_a_backend_that_corrupts_after_a_size_switch_fails_naming_the_replay_and_size(tmp_path: Path) -> None:
    log = tmp_path / "standin.log"
    result, _ = _run("t-load", 2, [["backend", "standin-corrupt-switch"], ["pdl", "on"], QUICK, ["env.T_LOAD_K", "40"],
                                   ["env.T_LOAD_LOG", str(log)]])
    (_, _, _, _, call, _, size), = _logged(log)  # "rank 1 corrupted call N size S"
    assert result["status"] == "fail" and result["reason_code"] == "load-drift", result
    assert f"wrong output at replay {call} ({size} tokens, PDL on, stream 0)" in result["note"]
    assert "sum: 1 of" in result["note"]
    assert result["evidence"]["finding"]["replay"] == int(call)


def test_a_backend_that_deadlocks_only_from_two_streams_hangs_in_that_pattern_only(tmp_path: Path) -> None:
    log = tmp_path / "standin.log"
    alone, _ = _run("t-load", 2, [["backend", "standin-two-streams"], QUICK, ["env.T_LOAD_LOG", str(log)]])
    assert alone["status"] == "pass", alone
    assert not log.exists()
    both, token = _run("t-load", 2, [["backend", "standin-two-streams"], ["pattern", "two-streams"], QUICK,
                                     ["env.T_LOAD_LOG", str(log)]])
    assert both["status"] == "hang" and both["reason_code"] == "load-hang", both
    wedged = _logged(log)  # "rank R wedged at call N size S lane L", once per rank
    assert sorted(w[1] for w in wedged) == ["0", "1"]
    assert "standin-two-streams two-streams: queued replays did not finish" in both["note"]
    assert "PDL off, stream " in both["note"]
    assert both["evidence"]["pattern"] == "two-streams" and both["evidence"]["lanes"] == 2
    assert pids_with_env(token) == []


def test_a_backend_whose_set_up_never_returns_is_a_hang_in_the_set_up_long_before_the_timeout(
        tmp_path: Path) -> None:
    log = tmp_path / "standin.log"
    result, token = _run("t-load", 2, [["backend", "standin-setup-blocks"], QUICK, ["env.T_LOAD_LOG", str(log)]])
    assert _logged(log) == [["rank", "0", "blocked", "in", "set-up"]]
    assert result["status"] == "hang" and result["reason_code"] == "progress-stalled", result
    assert result["duration_s"] < 45  # the set-up's deadline is 4 x 3 s, the variant's timeout 90 s
    assert "rank 0 standin-setup-blocks replay: setting up after 0 replays" in result["note"], result["note"]
    assert pids_with_env(token) == []


def test_two_communicators_on_two_streams_pass_for_an_honest_backend() -> None:
    result, _ = _run("t-load", 2, [["backend", "standin-honest"], ["pattern", "two-comms"], QUICK])
    assert result["status"] == "pass", result
    assert result["evidence"]["lanes"] == 2 and "latency_p50_us" not in result["metrics"]  # only replay is timed


def test_the_probes_own_nccl_adapter_runs_under_the_engine_on_gloo() -> None:
    """inenv.probes.load's adapter over the step probe's NCCL backend (in place, one buffer slice per lane), on CPU:
    the same engine and checks, the collective over gloo, each lane's communicator its own."""
    result, _ = _run("t-load", 2, [["backend", "nccl"], ["pattern", "two-comms"], QUICK])
    assert result["status"] == "pass", result
    assert result["evidence"]["lanes"] == 2 and result["metrics"]["checked"] > 0


# --- the probe's pure parts: facts read from the backends' sources, the schedule, the plan ----------------------

def test_switch_points_from_the_backends_own_thresholds() -> None:
    from inenv import load_engine as engine

    # flashinfer's fusion heuristic: one-shot while tokens x 7168 x 2 x world x 2 bytes <= 512 / 64 / 42 MiB
    assert [engine.fusion_switch(w, 7168) for w in (2, 4, 8, 3)] == [9362, 585, 192, None]
    # the custom allreduce: one stage at 2 ranks; below 512 KiB up to 4 ranks, below 256 KiB up to 8 (14 KiB a token)
    assert [engine.custom_ar_switch(w, 7168) for w in (2, 4, 6, 8)] == [None, 36, 18, 18]


def test_the_sizes_hold_decode_verify_and_prefill_and_both_sides_of_each_switch() -> None:
    from inenv import load_engine as engine

    assert engine.sizes((36,), 585) == (1, 2, 4, 8, 16, 32, 36, 37, 64, 128, 256, 512)
    assert engine.sizes((128,), 2048) == (1, 2, 4, 8, 16, 32, 64, 128, 129, 256, 512, 2048)
    assert engine.sizes((), 2048, quick=True) == (1, 8, 32, 512)


def test_the_walk_alternates_across_the_switch_and_holds_each_count_for_a_while() -> None:
    import itertools

    from inenv import load_engine as engine

    counts = (1, 8, 9, 32, 512)
    steps = list(itertools.islice(engine.walk(counts, 8, 1), 200))
    runs = [(k, len(list(g))) for k, g in itertools.groupby(steps)]
    # a run may join two visits that drew the same count, but visits alternate sides, so sides alternate by run
    sides = [k <= 8 for k, _ in runs]
    assert all(a != b for a, b in itertools.pairwise(sides))
    assert {n for n, _ in runs} == set(counts) and max(n for _, n in runs) == 8
    assert steps == list(itertools.islice(engine.walk(counts, 8, 1), 200))  # deterministic
    assert steps != list(itertools.islice(engine.walk(counts, 8, 2), 200))  # another lane walks its own way


def test_the_offsets_keep_every_sum_exact_in_bf16() -> None:
    from inenv import load_engine as engine

    assert {engine.offset(r, k) for r in range(50) for k in range(8)} == {-2, -1, 0, 1, 2}
    assert engine.offset_sum(3, 2) == engine.offset(3, 0) + engine.offset(3, 1) == (21 % 5 - 2) + (24 % 5 - 2)


def test_the_plan_runs_replay_everywhere_and_the_other_patterns_at_two_ranks() -> None:
    from inenv.probe import QUICK, HostView
    from inenv.probes import load

    one = {v.key: v for v in load.variants(HostView(gpu_count=1))}
    assert "ranks=2,placement=shared,gpus=1,backend=flashinfer-fusion,pattern=two-streams,pdl=on,mode=crossing" in one
    assert "ranks=4,placement=shared,gpus=1,backend=flashinfer-fusion,pattern=replay,pdl=on,mode=auto" in one
    assert not [k for k in one if "ranks=4" in k and "pattern=replay" not in k]
    assert not [k for k in one if "ranks=3" in k or "ranks=8" in k]  # shared at 2 and 4 ranks only
    assert one["ranks=2,backend=nccl,pattern=replay"].skip.code == "too-few-gpus"
    assert "ranks=2,backend=nccl,pattern=two-streams" not in one and "ranks=2,placement=shared,gpus=1,backend=nccl," \
        "pattern=replay" not in one
    planned = load.variants(HostView(gpu_count=8))
    eight = {v.key for v in planned}
    assert {k.split(",")[0] for k in eight} == {"ranks=2", "ranks=4", "ranks=8"}  # the deep sizes, a GPU per rank
    assert not [k for k in eight if "placement=shared" in k]
    assert "ranks=8,backend=flashinfer-fusion,pattern=replay,pdl=on,mode=crossing" in eight
    # more than 4 GPUs: 2 ranks (24: 9 backends' replay, 12 more patterns, fusion's second mode and PDL off) and 8
    # ranks (10: replay of 9 backends, fusion in both modes) run; the 10 at 4 ranks are planned not-run
    runs = [v for v in planned if v.skip is None]
    assert (sum(v.ranks == 2 for v in runs), sum(v.ranks == 8 for v in runs), len(runs)) == (24, 10, 34)
    left = [v for v in planned if v.skip is not None]
    assert len(left) == 10 and {(v.ranks, v.skip.status, v.skip.code) for v in left} == {
        (4, "not-run", "narrowed-world-size")}
    assert left[0].skip.note.startswith("4 ranks on a host of 8 GPUs: load runs a GPU per rank at 2 and 8 ranks only")
    # 4 GPUs and fewer: every deep size runs
    four = load.variants(HostView(gpu_count=4))
    assert {v.ranks for v in four if v.skip is None} == {2, 4} and all(v.skip is None for v in four)
    six = load.variants(HostView(gpu_count=6))
    assert {v.ranks for v in six if v.skip is None} == {2, 6} and {v.ranks for v in six if v.skip} == {4}
    assert load.variants(HostView(gpu_count=8, level=QUICK)) == []


def test_the_planning_filter_keeps_only_the_backends_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from inenv.probe import HostView
    from inenv.probes import load

    monkeypatch.setenv("STACKPROBE_LOAD_ONLY", "symm-mem-two-shot, nccl")
    keys = [v.key for v in load.variants(HostView(gpu_count=1))]
    assert keys == ["ranks=2,backend=nccl,pattern=replay", "ranks=2,backend=nccl,pattern=two-comms",
                    "ranks=2,placement=shared,gpus=1,backend=symm-mem-two-shot,pattern=replay",
                    "ranks=4,backend=nccl,pattern=replay",
                    "ranks=4,placement=shared,gpus=1,backend=symm-mem-two-shot,pattern=replay"]


def test_a_backend_whose_library_is_absent_is_a_skip_before_any_rank_starts() -> None:
    from inenv.probe import Variant
    from inenv.probes import load

    got = load.preflight(Variant("load", 2, (("backend", "vllm-custom-ar"), ("pattern", "replay"))))
    assert got is not None and got["status"] == "skip" and got["reason_code"] == "missing-package"
    assert "vllm is not installed" in got["note"]
    assert load.preflight(Variant("load", 2, (("backend", "nccl"), ("pattern", "replay")))) is None


def test_the_fusion_modes_choose_one_shot_or_two_shot_by_size() -> None:
    from types import SimpleNamespace

    from inenv.probes import load

    def pick(mode: str, world: int) -> list[bool | None]:
        f = load.Fusion(SimpleNamespace(mode=mode, world=world))  # type: ignore[arg-type]
        return [f.oneshot(n) for n in (1, 8, 128, 129, 2048)]

    assert pick("crossing", 8) == [True, True, True, False, False]  # two-shot needs more tokens than ranks
    assert pick("auto", 8) == [None, None, None, None, None]  # flashinfer chooses
    assert pick("twoshot", 4) == [True, False, False, False, False]
    assert pick("oneshot", 2) == [True] * 5


def test_the_warm_launcher_applies_the_stall_deadline_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """inenv.warm watches its kept ranks with the worker's own watch: the deadline travels in the records."""
    from checks.run.executor import LocalExecutor
    from common import reasons
    from inenv.probe import Variant

    env = fixture_env(STACKPROBE_PROBE_PATH=str(LOAD_FIXTURES))
    for k, v in env.items():
        if k.startswith("STACKPROBE_") or k == "PYTHONPATH":
            monkeypatch.setenv(k, v)
    ex = LocalExecutor().with_run_env((), warm=True)
    try:
        v = ex.run(Variant("t-stall", 2), 0, 60.0, reasons.default())
    finally:
        ex.close()
    assert (v.status, v.reason_code) == ("hang", "progress-stalled"), v.note
    assert "rank 1 stand-in replay: at replay 7 (verified to 6), 64 tokens, PDL on, stream 1" in v.note
    assert v.evidence["warm"]["ended"]


def test_a_digest_reads_a_zero_of_either_sign_as_one_value_and_every_other_bit() -> None:
    import torch

    from inenv import load_engine as engine

    checks = engine.Checks("cpu", hidden=4, limit=2)
    plus = torch.tensor([[0.0, 1.0, -3.0, 0.0], [2.0, 0.0, 0.5, 1.0]], dtype=torch.bfloat16)
    minus = plus.clone()
    minus[0, 0], minus[1, 1] = -0.0, -0.0
    assert not torch.equal(plus.view(torch.int16), minus.view(torch.int16))
    assert int(checks.digest(plus)) == int(checks.digest(minus))
    one_ulp = plus.clone()
    one_ulp[0, 1] = 1.0 + 2**-7  # the next bf16 above 1.0
    moved = plus.clone()
    moved[0, 1], moved[0, 2] = -3.0, 1.0  # the same values in other places
    assert int(checks.digest(one_ulp)) != int(checks.digest(plus)) != int(checks.digest(moved))
    ints = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)  # an integer output's bits as they are
    assert int(checks.digest(ints)) != int(checks.digest(ints.flip(1)))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "float16", "float32"])
def test_a_digest_of_any_float_width_folds_the_zeros_sign(dtype: str) -> None:
    """The fused allreduce's quantized output is FP8, a dtype without arithmetic: its digest still reads a zero of
    either sign as one value (bit 0x80 alone is -0 there), and tells a changed value apart."""
    import torch

    from inenv import load_engine as engine

    checks = engine.Checks("cpu", hidden=4, limit=2)
    plus = torch.tensor([[0.0, 1.0, -2.0, 0.0], [0.5, 0.0, 4.0, 1.0]]).to(getattr(torch, dtype))
    minus = plus.clone()
    minus.view(torch.uint8 if plus.element_size() == 1 else {2: torch.int16, 4: torch.int32}[plus.element_size()])[
        0, 0] = {1: 0x80, 2: -0x8000, 4: -0x80000000}[plus.element_size()]  # -0 by its bits
    assert float(minus[0, 0].float()) == 0.0 and str(minus[0, 0].float().item()) == "-0.0"
    assert int(checks.digest(plus)) == int(checks.digest(minus))
    other = plus.clone()
    other[1, 2] = 2.0
    assert int(checks.digest(other)) != int(checks.digest(plus))


def test_a_digest_leaves_the_fnuz_pattern_that_is_nan_alone() -> None:
    """In the ``fnuz`` FP8 types 0x80 is NaN, not -0: a NaN is not folded into a zero."""
    import torch

    from inenv import load_engine as engine

    if not hasattr(torch, "float8_e4m3fnuz"):
        pytest.skip("this torch has no float8_e4m3fnuz")
    checks = engine.Checks("cpu", hidden=2, limit=1)
    zero = torch.zeros((1, 2), dtype=torch.float8_e4m3fnuz)
    nan = zero.clone()
    nan.view(torch.uint8)[0, 0] = 0x80
    assert torch.isnan(nan.float()[0, 0])
    assert int(checks.digest(nan)) != int(checks.digest(zero))
