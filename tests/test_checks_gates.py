"""Engine gates read at a host: the engine probe's recorded runs against vLLM 0.33.0 and SGLang 0.5.23 as
installed from the registry (tests/golden/gates/results, copied from results/cpu-7eb23414), looked up at
compute capabilities and tp sizes.

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
