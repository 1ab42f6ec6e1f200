"""Target architectures: spelled one way, refused with the closest valid value before anything runs, and
the SASS flashinfer may turn each into."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from inenv import gpuarch
from inenv.probe import HostView
from inenv.probes import fi_jit

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("text", "want"),
    [("12.0a", "12.0a"), (" 12.0A ", "12.0a"), ("sm_120f", "12.0f"), ("compute_90a", "9.0a"), ("12.0", "12.0"),
     ("10.0a", "10.0a"), ("8.9", "8.9")],
)
def test_targets_are_normalised(text: str, want: str) -> None:
    assert str(gpuarch.parse_target(text)) == want


@pytest.mark.parametrize(("text", "closest"), [("12.0x", "12.0"), ("9.0f", "9.0"), ("13.0a", "12.0a"), ("12", "12.0")])
def test_unknown_targets_name_the_closest_valid_one(text: str, closest: str) -> None:
    with pytest.raises(gpuarch.TargetError) as err:
        gpuarch.parse_target(text)
    assert f"closest valid value: {closest} " in str(err.value)


def test_a_list_keeps_order_and_drops_repeats() -> None:
    assert gpuarch.parse_targets("12.0A, sm_120a,9.0a,,12.0f") == ("12.0a", "9.0a", "12.0f")
    assert gpuarch.parse_targets("") == ()


def test_variant_keys_show_the_normalised_target() -> None:
    host = HostView(gpu_count=0, target_archs=gpuarch.parse_targets("12.0A,sm_120f"))
    keys = {v.key for v in fi_jit.plan(host, modules=("vllm_comm",))}
    assert keys == {"ranks=1,module=vllm_comm,arch=local", "ranks=1,module=vllm_comm,arch=12.0a",
                    "ranks=1,module=vllm_comm,arch=12.0f"}


@pytest.mark.parametrize(
    ("target", "sass"),
    [
        ("9.0a", {"sm_90a"}),
        ("10.0a", {"sm_100a"}),
        ("12.0a", {"sm_120a"}),
        ("12.0f", {"sm_120f"}),
        # unsuffixed: as is (<= 0.6.6), sm_120f (0.6.7+, nvcc >= 12.9), sm_120a (0.7 with nvcc 12.8)
        ("12.0", {"sm_120", "sm_120a", "sm_120f"}),
        ("12.1", {"sm_121", "sm_121a", "sm_120f"}),
        ("9.0", {"sm_90", "sm_90a"}),
        ("8.0", {"sm_80"}),
    ],
)
def test_what_flashinfer_may_compile_a_target_into(target: str, sass: set[str]) -> None:
    assert gpuarch.flashinfer_sass(gpuarch.parse_target(target)) == sass


def test_checks_run_refuses_a_bad_target_before_anything_runs(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "checks.cli", "run", "--backend", "local", "--probe", "inventory", "--target-arch",
         "12.0a,12.0x", "--results", str(tmp_path / "results")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--target-arch" in lines[0] and "closest valid value: 12.0 " in lines[0], lines
    assert "Traceback" not in proc.stderr and not (tmp_path / "results").exists()
