"""Engine gates read at a host: the engine probe's recorded runs against vLLM 0.33.0 and SGLang 0.5.23 as
installed from the registry (tests/golden/gates/results, copied from results/cpu-7eb23414), looked up at
compute capabilities and tp sizes under stackprobe's reading of each release's code (checks/report/engine_rules.py,
itself checked against the releases' source by tests/test_engine_rules.py).

The expected numbers are the releases' own source, read by hand: vLLM 0.33.0's all_reduce_utils.py keys its
tables by "9.0", "10.0", "10.3", "10.7" (none for 12.0) with symmetric memory at 9.0 / tp 2 64 MiB and the
custom allreduce at 9.0 / tp 8 256 KiB; its CustomAllreduce lists world sizes 2, 4, 6, 8, 16. SGLang 0.5.23
holds one custom-allreduce limit, 8192 * 1024 bytes, and keys its symmetric-memory table by majors 9 and 10.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from checks.cli import main
from checks.report import gates
from checks.results import hostresults
from tests.checks_helpers import ROOT

FIXTURE = ROOT / "tests" / "golden" / "gates" / "results"
HOST = "cpu-7eb23414"
ADVISE = ROOT / "tests" / "golden" / "advise" / "results"
H200 = "h200x2-5bce98f7"
CELL = "local-cu130-torch2.11.0-sglnone-fi0.6.18"


@pytest.fixture(scope="module")
def latest() -> list:
    return hostresults.load(FIXTURE)[HOST].latest()


def _by(found: list[gates.EngineGates], engine: str) -> dict[str, gates.GateLine]:
    (g,) = [g for g in found if g.engine == engine]
    return {line.gate: line for line in g.lines}


def test_no_entry_for_sm120_in_either_engines_symmetric_memory_table(latest: list) -> None:
    found = gates.engine_gates(latest, ("12.0",), (2, 4))
    assert sorted(g.engine for g in found) == ["SGLang", "vLLM"]
    v, s = _by(found, "vLLM"), _by(found, "SGLang")
    assert "no entry for compute capability 12.0 (entries: 9.0, 10.0, 10.3, 10.7)" in v["symm-mem-max-bytes"].text
    assert v["symm-mem-max-bytes"].off == (2, 4)
    assert "no entry for compute capability 12.0 (entries: 9, 10)" in s["symm-mem-max-bytes"].text
    assert s["custom-ar-max-bytes"].text.startswith("custom-ar-max-bytes: 8 MiB at every architecture")
    assert s["custom-ar-max-bytes"].off == ()
    # a missing multimem entry picks the engine's other kernel: it admits or refuses nothing
    assert v["symm-mem-multimem-world-sizes"].off == ()


def test_values_at_hopper_per_tp(latest: list) -> None:
    v = _by(gates.engine_gates(latest, ("9.0",), (2, 8)), "vLLM")
    assert "symm-mem-max-bytes[9.0]: tp 2 64 MiB; tp 8 64 MiB" in v["symm-mem-max-bytes"].text
    assert "custom-ar-max-bytes[9.0]: tp 2 64 MiB; tp 8 256 KiB" in v["custom-ar-max-bytes"].text
    assert v["custom-ar-world-sizes"].text.startswith("custom-ar-world-sizes [2, 4, 6, 8, 16]: tp 2 listed")
    assert all(line.off == () for line in v.values())
    s = _by(gates.engine_gates(latest, ("9.0",), (2,)), "SGLang")
    assert s["symm-mem-max-bytes"].text.startswith("symm-mem-max-bytes[9]: tp 2 64 MiB")


def test_a_world_size_the_engine_does_not_list(latest: list) -> None:
    v = _by(gates.engine_gates(latest, ("9.0",), (3,)), "vLLM")
    assert v["custom-ar-world-sizes"].off == (3,) and "tp 3 not listed" in v["custom-ar-world-sizes"].text


def test_a_gpu_less_host_reads_at_its_cross_compile_targets(latest: list) -> None:
    assert gates.capabilities({}, latest) == ("12.0",)
    assert gates.capabilities({"compute_capability": "9.0"}, latest) == ("9.0",)
    assert gates.tp_sizes(None, None) == (2, 4, 8) and gates.tp_sizes(2, None) == (2,)
    assert gates.tp_sizes(8, 4) == (4,)
    assert gates.tp_sizes(8, None) == (2, 3, 4, 5, 6, 7, 8) and gates.tp_sizes(8, 3) == (3,)


def test_advise_prints_the_gates_of_a_gpu_less_host(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["advise", "--results", str(FIXTURE), "--host", HOST]) == 0
    out = capsys.readouterr().out
    assert "Engine gates — cell `local-cu130-torch2.14.0-sglnone-fi0.7.2.post1-nvcc13.0`: vLLM 0.33.0" in out
    assert "SGLang 0.5.23 (compute capability 12.0, tp 2/4/8)" in out


def test_an_advised_backend_the_engine_in_the_cell_does_not_admit_is_flagged(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The 2x H200 fixture advises flashinfer-custom-ar at tp 2. An engine in that cell whose custom
    allreduce lists only 4 and 8 is shown beside the advice; the same engine listing 2 is not."""
    line = json.loads((FIXTURE / HOST / "20261204T020803Z-d866.jsonl").read_text().splitlines()[0])
    assert line["variant"] == "ranks=1,engine=vllm"

    def with_sizes(sizes: list[int]) -> str:
        shutil.rmtree(tmp_path / "r", ignore_errors=True)
        shutil.copytree(ADVISE / H200, tmp_path / "r" / H200)
        runs = sorted(p for p in (tmp_path / "r" / H200).glob("*.jsonl"))
        rec = json.loads(json.dumps(line))
        rec.update(cell_id=CELL, host_id=H200, run_id=runs[-1].name.removesuffix(".jsonl"))  # a line of that run
        rec["evidence"]["gates"]["custom-ar-world-sizes"]["value"] = sizes
        with runs[-1].open("a") as f:
            f.write(json.dumps(rec) + "\n")
        assert main(["advise", "--results", str(tmp_path / "r"), "--host", H200, "--cell", CELL, "--tp", "2"]) == 0
        return capsys.readouterr().out

    out = with_sizes([4, 8])
    assert "Engine gate: vLLM 0.33.0 in this cell: its own gate data admits no flashinfer-custom-ar at tp 2" in out
    assert "custom-ar-world-sizes [4, 8]: tp 2 not listed" in out
    assert "Engine gate:" not in with_sizes([2, 4, 8])


def _edited(tmp_path: Path, engine: str, edit) -> list:
    """The fixture's results with the ``engine`` record changed by ``edit`` (a function of its JSON)."""
    shutil.copytree(FIXTURE, tmp_path / "r")
    for run in (tmp_path / "r" / HOST).glob("*.jsonl"):
        lines = [json.loads(x) for x in run.read_text().splitlines() if x.strip()]
        for rec in lines:
            if rec.get("probe_id") == "engine" and rec["evidence"].get("engine") == engine:
                edit(rec)
        run.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return hostresults.load(tmp_path / "r")[HOST].latest()


def test_vllm_custom_allreduce_keeps_its_default_limit_where_its_size_table_has_no_entry(latest: list) -> None:
    """vLLM 0.33.0 looks CUSTOM_ALL_REDUCE_MAX_SIZES up only to lower its 8 MiB default (custom_all_reduce.py
    lines 237-251): no entry for 12.0 leaves its custom allreduce on, unlike symmetric memory's table."""
    (g,) = [g for g in gates.engine_gates(latest, ("12.0",), (2, 4)) if g.engine == "vLLM"]
    v = {line.gate: line for line in g.lines}
    assert v["custom-ar-max-bytes"].off == ()
    assert "the engine keeps its default limit" in v["custom-ar-max-bytes"].text
    said = v["custom-ar-max-bytes"].text
    assert "stackprobe's reading of vLLM 0.33.0" in said
    assert "vllm/distributed/device_communicators/custom_all_reduce.py:138, 237-251" in said
    assert v["symm-mem-max-bytes"].off == (2, 4) and "symm_mem.py:65-79, 117-125" in v["symm-mem-max-bytes"].text
    assert g.off_for("flashinfer-custom-ar", 2) == [] and g.off_for("symm-mem-one-shot", 2)
    assert g.rules.startswith("Rules: stackprobe's reading of vLLM 0.33.0's code")
    assert "vLLM's CustomAllreduce, the kernel flashinfer ships as vllm_comm" in g.rules


def test_vllm_custom_allreduce_is_off_above_eight_gpus_though_16_is_listed(latest: list) -> None:
    v = _by(gates.engine_gates(latest, ("9.0",), (8, 16)), "vLLM")
    assert v["custom-ar-world-sizes"].off == (16,) and "tp 16 above 8: off" in v["custom-ar-world-sizes"].text
    assert "custom_all_reduce.py:211-219, 496-498" in v["custom-ar-world-sizes"].text


def test_a_release_stackprobe_has_not_read_is_shown_and_judged_by_nothing(tmp_path: Path) -> None:
    def newer(rec: dict) -> None:
        rec["evidence"]["version"] = "0.99.0"
        rec["evidence"]["gates"]["custom-ar-world-sizes"]["value"] = [4, 8]

    found = gates.engine_gates(_edited(tmp_path, "vllm", newer), ("12.0",), (2, 4))
    (g,) = [g for g in found if g.engine == "vLLM"]
    assert g.version == "0.99.0" and all(line.off == () for line in g.lines)
    assert all("not judged: stackprobe holds no reading of vLLM 0.99.0's code" in line.text for line in g.lines)
    assert "no reading of vLLM 0.99.0's code" in g.rules
    assert "custom-ar-world-sizes: [4, 8]" in {line.gate: line for line in g.lines}["custom-ar-world-sizes"].text


def test_a_table_whose_keys_are_not_spelled_as_the_reading_expects_is_not_judged(tmp_path: Path) -> None:
    def int_keys(rec: dict) -> None:
        rec["evidence"]["gates"]["symm-mem-max-bytes"].update(keys="int", value={"9": {"2": 1}, "12": {"2": 1}})

    v = _by(gates.engine_gates(_edited(tmp_path, "vllm", int_keys), ("12.0",), (2,)), "vLLM")
    assert v["symm-mem-max-bytes"].off == ()
    assert "not judged: its keys are spelled as int" in v["symm-mem-max-bytes"].text


def test_sglang_custom_allreduce_follows_the_engines_own_function_where_it_answered(tmp_path: Path) -> None:
    """SGLang 0.5.23 runs CustomAllReduceV2 at a tp its own table function admits, else its older allreduce
    at a tp its list [2, 4, 6, 8] holds. tp 3: admitted, refused, or (no answer recorded) undecided."""
    def answered(admits3: bool):
        def edit(rec: dict) -> None:
            at = {"12.0": {"world_sizes": [2, 3, 4] if admits3 else [2, 4],
                           "admits": {str(n): n in ([2, 3, 4] if admits3 else [2, 4]) for n in range(2, 9)}}}
            rec["evidence"]["answers"] = {"custom-ar-v2-world-sizes": {
                "found": True, "backend": "custom-ar", "at": at,
                "where": "sglang.srt.distributed.device_communicators.configs.custom_all_reduce_v2:"
                         "get_supported_world_sizes"}}
        return edit

    yes = _by(gates.engine_gates(_edited(tmp_path / "a", "sglang", answered(True)), ("12.0",), (2, 3, 16)),
              "SGLang")
    assert yes["custom-ar-world-sizes"].off == (16,)  # the answer's world sizes stop at 4
    assert "tp 3 not listed, admitted by the engine's own" in yes["custom-ar-world-sizes"].text
    no = _by(gates.engine_gates(_edited(tmp_path / "b", "sglang", answered(False)), ("12.0",), (2, 3)), "SGLang")
    assert no["custom-ar-world-sizes"].off == (3,)
    assert "get_supported_world_sizes" in no["custom-ar-world-sizes"].text
    unasked = _by(gates.engine_gates(hostresults.load(FIXTURE)[HOST].latest(), ("12.0",), (2, 3)), "SGLang")
    assert unasked["custom-ar-world-sizes"].off == ()  # the committed result predates the question
    assert "tp 3 not listed; undecided" in unasked["custom-ar-world-sizes"].text


def test_advise_names_whose_rules_decided_the_engine_gates(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["advise", "--results", str(FIXTURE), "--host", HOST]) == 0
    out = capsys.readouterr().out
    assert "Rules: stackprobe's reading of vLLM 0.33.0's code" in out
    assert "Rules: stackprobe's reading of SGLang 0.5.23's code" in out


ANSWERED = ROOT / "tests" / "golden" / "gates" / "answered"


def test_sglang_0_5_23s_own_function_decides_its_custom_allreduce_in_a_real_run() -> None:
    """The engine probe's run on SGLang 0.5.23 installed from the registry (copied from results/cpu-7eb23414,
    run 20261204T234259Z-b76d). Its configs/custom_all_reduce_v2.py, read by hand: Hopper (major 9) has tables
    for world sizes 2 to 8, an architecture with no table of its own (12.0) the default for 2 to 16. So tp 3,
    which the older list [2, 4, 6, 8] lacks, is admitted at 12.0 and 9.0, and tp 16 only at 12.0."""
    latest = hostresults.load(ANSWERED)[HOST].latest()
    at120 = _by(gates.engine_gates(latest, ("12.0",), (3, 16)), "SGLang")["custom-ar-world-sizes"]
    assert at120.off == () and "tp 3 not listed, admitted by the engine's own" in at120.text
    at90 = _by(gates.engine_gates(latest, ("9.0",), (3, 16)), "SGLang")["custom-ar-world-sizes"]
    assert at90.off == (16,) and "tp 16 not listed, nor admitted by the engine's own" in at90.text
