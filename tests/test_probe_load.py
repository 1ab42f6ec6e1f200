"""The load probe's pieces, run for real on CPU: the worker's stall watchdog over progress records (inenv.progress),
and the load engine (inenv.load_engine) through the real worker with gloo ranks and stand-in backends
(tests/probes_fixtures_load)."""

from __future__ import annotations

import re
from pathlib import Path
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
    result, token = _run("t-load", 2, [["backend", "standin-deadlock-switch"], QUICK, ["env.T_LOAD_K", "40"],
                                       ["env.T_LOAD_LOG", str(log)]])
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
    result, _ = _run("t-load", 2, [["backend", "standin-corrupt-switch"], QUICK, ["env.T_LOAD_K", "40"],
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
    assert both["evidence"]["pattern"] == "two-streams" and both["evidence"]["lanes"] == 2
    assert pids_with_env(token) == []


def test_two_communicators_on_two_streams_pass_for_an_honest_backend() -> None:
    result, _ = _run("t-load", 2, [["backend", "standin-honest"], ["pattern", "two-comms"], QUICK])
    assert result["status"] == "pass", result
    assert result["evidence"]["lanes"] == 2 and "latency_p50_us" not in result["metrics"]  # only replay is timed
