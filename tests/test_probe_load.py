"""The load probe's pieces, run for real on CPU: the worker's stall watchdog over progress records (inenv.progress),
and the load engine (inenv.load_engine) through the real worker with gloo ranks and stand-in backends
(tests/probes_fixtures_load)."""

from __future__ import annotations

from typing import Any

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
