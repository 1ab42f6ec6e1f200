"""The time left is learnt per probe, module, backend and outcome (checks.run.runprogress)."""

from __future__ import annotations

import json
from pathlib import Path

from checks.results.provenance import Provenance
from checks.results.result import ProbeResult, Verdict
from checks.run import runprogress
from checks.run.plan import CellTarget, WorkItem
from inenv.probe import Variant
from inenv.probes import fi_jit
from inenv.status import Status

CELL = "cu128-torch2.11.0-sgl0.4.2-fi0.6.17"


def _variant(module: str, arch: str) -> Variant:
    return Variant("fi-jit", 1, (("module", module), ("arch", arch)))


def _item(module: str, arch: str) -> WorkItem:
    return WorkItem(CellTarget(CELL, "resolved"), fi_jit.SPEC, _variant(module, arch), 3000.0)


def _run(folder: Path, run_id: str, executor: str, rows: list[tuple[str, str, Status, str, float]]) -> None:
    """One recorded run: its results and the manifest naming its executor."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for module, arch, status, reason, seconds in rows:
        r = ProbeResult(run_id, folder.name, CELL, "fi-jit", _variant(module, arch).key,
                        Verdict(status, reason, duration_s=seconds), "2026-12-01T00:00:00Z",
                        Provenance("0.1", "abc", False, "h"))
        lines.append(json.dumps(r.to_json()))
    (folder / f"{run_id}.jsonl").write_text("\n".join(lines) + "\n")
    (folder / f"{run_id}.manifest.json").write_text(json.dumps({"schema": "stackprobe.manifest/2", "run_id": run_id,
                                                                "host_id": folder.name, "executor": executor}))


def test_a_docker_fail_fast_time_is_not_borrowed_for_a_venv_compile(tmp_path: Path) -> None:
    # The Docker image has no nvcc: trtllm_comm for 12.0a failed in 9 s there. The venv cell compiles it.
    _run(tmp_path, "20261201T000000Z-aaaa", "docker",
         [("trtllm_comm", "12.0a", Status.SKIP, "fi-no-nvcc", 9.0)])
    history = runprogress.learned(tmp_path)
    exp = runprogress.expected_durations([_item("trtllm_comm", "12.0a")], history, "venv")
    key = _item("trtllm_comm", "12.0a").key
    assert exp[key].seconds is None
    assert exp[key].text() == "no earlier run"
    # on the backend that recorded it, the same record is this variant's own, and says what it learnt from
    again = runprogress.expected_durations([_item("trtllm_comm", "12.0a")], history, "docker")
    assert again[key].seconds == 9.0
    assert again[key].text() == "last time 9.0 s (skip fi-no-nvcc on docker)"


def test_a_sibling_estimate_comes_from_the_same_module_and_the_longest_outcome(tmp_path: Path) -> None:
    _run(tmp_path, "20261201T000000Z-aaaa", "venv", [
        ("trtllm_comm", "12.0f", Status.PARTIAL, "fi-link-no-libcuda", 1050.0),
        ("trtllm_comm", "10.0a", Status.FAIL, "fi-arch-gate", 12.0),
        ("vllm_comm", "12.0a", Status.PASS, "", 20.0),
    ])
    history = runprogress.learned(tmp_path)
    item = _item("trtllm_comm", "12.0a")
    exp = runprogress.expected_durations([item], history, "venv")[item.key]
    assert not exp.own
    assert exp.seconds == 1050.0  # not (1050 + 12 + 20) / 3: another module and a fail-fast outcome left out
    assert exp.text() == "about 17m30s by its probe's trtllm_comm record (partial fi-link-no-libcuda on venv)"
    other = _item("moe_a2a", "12.0a")
    assert runprogress.expected_durations([other], history, "venv")[other.key].text() == "no earlier run"


def test_the_newest_run_of_each_backend_is_kept_apart(tmp_path: Path) -> None:
    _run(tmp_path, "20261201T000000Z-aaaa", "venv", [("vllm_comm", "12.0a", Status.PASS, "", 30.0)])
    _run(tmp_path, "20261201T010000Z-bbbb", "docker", [("vllm_comm", "12.0a", Status.SKIP, "fi-no-nvcc", 4.0)])
    _run(tmp_path, "20261201T020000Z-cccc", "venv", [("vllm_comm", "12.0a", Status.PASS, "", 25.0)])
    history = runprogress.learned(tmp_path)
    key = _item("vllm_comm", "12.0a").key
    assert history[key]["venv"].seconds == 25.0
    assert history[key]["docker"].seconds == 4.0
    assert history[key]["docker"].outcome == "skip fi-no-nvcc"
