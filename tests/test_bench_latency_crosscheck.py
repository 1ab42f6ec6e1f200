"""bench_latency_crosscheck without GPUs: its arguments, the flashinfer PCIe IPC skip line, and the ratio
table on recorded numbers (the GPU comparisons themselves run only on a host with two GPUs)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checks_helpers import benchmark

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_latency_crosscheck.py"
RECORDED = ROOT / "benchmarks" / "results" / "h200x2-20261129" / "crosscheck.json"


def _bench():
    return benchmark("bench_latency_crosscheck")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_fewer_than_two_gpus_is_one_line_and_exit_2() -> None:
    proc = _run("--gpus", "1", "--compare", "pcie-ipc")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "bench_latency_crosscheck: needs at least 2 GPUs (allreduce between GPUs)"
    ]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args", [("--compare", "nvls"), ("--gpus", "-1")])
def test_bad_arguments_exit_2_without_traceback(args: tuple[str, ...]) -> None:
    proc = _run(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert args[0] in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="this Python has flashinfer")
def test_pcie_ipc_without_flashinfer_is_one_skip_line() -> None:
    # --gpus 2 passes the GPU gate; with only the PCIe IPC comparison asked for and no flashinfer here,
    # nothing is launched: one line names why, and no comparison is counted.
    proc = _run("--gpus", "2", "--compare", "pcie-ipc")
    assert proc.returncode == 0, proc.stderr
    skips = [ln for ln in proc.stdout.splitlines() if "not cross-checked" in ln]
    assert skips == ["bench: flashinfer-pcie-ipc not cross-checked: flashinfer is not installed in this Python"]
    assert "0/0 comparisons within 10%" in proc.stdout


def test_ratio_rows_reproduce_the_recorded_nccl_tests_comparison() -> None:
    bench = _bench()
    recorded = json.loads(RECORDED.read_text())["comparisons"]["probe NCCL direct vs nccl-tests -n20 -G20"]
    probe = {r["bytes"]: r["probe_us"] for r in recorded}
    other = {r["bytes"]: r["other_us"] for r in recorded}
    rows = bench.ratio_rows(probe, other)
    assert [r["bytes"] for r in rows] == sorted(probe)
    for row, rec in zip(rows, sorted(recorded, key=lambda r: r["bytes"]), strict=True):
        assert row["ratio"] == pytest.approx(rec["ratio"], rel=1e-12)
        assert row["ok"] is rec["ok"]
    assert rows[0]["ratio"] == pytest.approx(7.729 / 7.76)


def test_pcie_table_from_recorded_numbers() -> None:
    bench = _bench()
    # The probe's committed 2x H200 flashinfer 0.7.4 numbers at 14 KiB and 28 KiB (median us), against the
    # flashinfer method at hidden 7168; the 1x2048 row is flashinfer's default shape and is left out here.
    fi = {
        "1x7168": [2.9, 2.8, "16x128 UNSTAGED"],
        "2x7168": [2.9, 2.85, "16x128 UNSTAGED"],
        "1x2048": [2.62, 2.6, "16x128 UNSTAGED"],
    }
    ref = bench.fi_by_bytes(fi, 0)
    assert ref == {14336: 2.9, 28672: 2.9}
    assert bench.fi_by_bytes(fi, 1) == {14336: 2.8, 28672: 2.85}
    rows = bench.ratio_rows({14336: 3.26, 28672: 2.932, 57344: 3.383}, ref)
    assert [(r["bytes"], round(r["ratio"], 4), r["ok"]) for r in rows] == [(14336, 1.1241, False), (28672, 1.011, True)]
    lines = bench.format_rows("probe pcie-ipc median", "flashinfer method median", rows)
    assert lines[1].split() == ["14336", "3.26", "2.90", "1.124", "NO"]
    assert lines[2].split() == ["28672", "2.93", "2.90", "1.011", "yes"]


def test_flashinfer_shapes_add_its_default_shape_where_it_has_one() -> None:
    bench = _bench()
    two = bench.fi_shapes(2)
    assert two[:2] == [(1, 7168), (2, 7168)]
    assert two[-3:] == [(1, 2048), (64, 2048), (128, 2048)]
    assert all(h == 7168 for _, h in bench.fi_shapes(3))
