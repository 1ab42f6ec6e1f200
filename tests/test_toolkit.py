"""Which nvcc an environment compiles with, found in flashinfer's order: the pure lookup on stand-in
filesystems, and the environment versions (which name a --local cell) on real directories and a real nvcc."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from inenv import toolkit
from inenv.toolkit import Toolkit

ROOT = Path(__file__).resolve().parents[1]
NVCC = "/usr/local/cuda/bin/nvcc"
# `nvcc --version` of the toolkit on this machine, as printed
NVCC_13_BANNER = """nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Wed_Aug_20_01:58:59_PM_PDT_2025
Cuda compilation tools, release 13.0, V13.0.88
Build cuda_13.0.r13.0/compiler.36424714_0
"""


def _which(found: dict[str, str]):
    def which(name: str, path: str) -> str | None:
        for d in path.split(os.pathsep):
            if f"{d}/{name}" in found.values():
                return f"{d}/{name}"
        return None

    return which


@pytest.mark.parametrize(
    ("env", "on_path", "default_exists", "want"),
    [
        # CUDA_HOME wins even without a bin/nvcc (the cu12 nvcc wheel has only ptxas): flashinfer uses it
        ({"CUDA_HOME": "/wheel/cuda_nvcc", "PATH": "/opt/cu128/bin"}, {"p": "/opt/cu128/bin/nvcc"}, True,
         ("/wheel/cuda_nvcc/bin/nvcc", "/wheel/cuda_nvcc", "CUDA_HOME")),
        ({"CUDA_HOME": "", "CUDA_PATH": "/opt/cp", "PATH": ""}, {}, True, ("/opt/cp/bin/nvcc", "/opt/cp", "CUDA_PATH")),
        # an nvcc first on PATH comes before /usr/local/cuda; its home is two levels up, links not followed
        ({"PATH": "/usr/bin:/opt/cu128/bin"}, {"p": "/opt/cu128/bin/nvcc"}, True,
         ("/opt/cu128/bin/nvcc", "/opt/cu128", "PATH")),
        ({"PATH": "/usr/bin"}, {}, True, ("/usr/local/cuda/bin/nvcc", "/usr/local/cuda", "default")),
        ({"PATH": "/usr/bin"}, {}, False, ("", "", "none")),
        ({"CUDA_HOME": "/c", "FLASHINFER_NVCC": "/ccache/nvcc"}, {}, True,
         ("/ccache/nvcc", "/c", "CUDA_HOME+FLASHINFER_NVCC")),
    ],
)
def test_locate_follows_flashinfers_order(env: dict, on_path: dict, default_exists: bool, want: tuple) -> None:
    tk = toolkit.locate(env, which=_which(on_path), exists=lambda p: default_exists and p == "/usr/local/cuda")
    assert (tk.nvcc, tk.cuda_home, tk.found_by) == want
    assert tk.version is None  # locating runs nothing


def test_flashinfer_nvcc_means_nothing_without_flashinfer() -> None:
    tk = toolkit.locate({"CUDA_HOME": "/c", "FLASHINFER_NVCC": "/x/nvcc"}, which=_which({}), flashinfer=False)
    assert (tk.nvcc, tk.found_by) == ("/c/bin/nvcc", "CUDA_HOME")


def test_release_parsing_and_labels() -> None:
    assert toolkit.parse_release(NVCC_13_BANNER) == "13.0"
    assert toolkit.parse_release("bash: nvcc: command not found") is None
    tk = Toolkit("/usr/local/cuda/bin/nvcc", "/usr/local/cuda", "default", "13.0")
    assert (tk.label(), tk.major) == ("nvcc13.0", 13)
    missing = Toolkit("/w/bin/nvcc", "/w", "CUDA_HOME", None, "/w/bin/nvcc: not found")
    assert missing.label() == "nonvcc" and "not runnable: /w/bin/nvcc: not found" in missing.describe()


def test_major_mismatch_is_flagged_only_across_majors() -> None:
    tk128 = Toolkit("/opt/cu128/bin/nvcc", "/opt/cu128", "PATH", "12.8")
    assert "CUDA 12 but torch is built with CUDA 13.0" in toolkit.major_mismatch(tk128, "13.0")
    assert toolkit.major_mismatch(tk128, "12.9") == ""
    assert toolkit.major_mismatch(Toolkit("", "", "none"), "13.0") == ""
    assert toolkit.major_mismatch(tk128, None) == ""


def test_an_nvcc_that_is_not_there_has_no_version(tmp_path: Path) -> None:
    version, error = toolkit.nvcc_release(str(tmp_path / "bin" / "nvcc"))
    assert version is None and error.endswith("bin/nvcc: not found")


# --- the environment's nvcc version (part of a --local cell id), through inenv.envinfo -----------------
def _fake_nvcc(bindir: Path, release: str) -> None:
    """A stand-in nvcc that answers --version like a CUDA ``release`` nvcc."""
    bindir.mkdir(parents=True)
    nvcc = bindir / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.93'\n")
    nvcc.chmod(0o755)


def _env_nvcc(env: dict[str, str]) -> str:
    code = "from inenv import envinfo; print(envinfo.nvcc_version())"
    base = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "FLASHINFER_NVCC")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**base, "PYTHONPATH": str(ROOT), **env},
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not os.access(NVCC, os.X_OK), reason="needs the toolkit at /usr/local/cuda")
def test_environment_nvcc_is_the_one_flashinfer_would_run(tmp_path: Path) -> None:
    wheel = tmp_path / "cuda_nvcc"  # what nvidia-cuda-nvcc-cu12 installs: ptxas, no nvcc
    (wheel / "bin").mkdir(parents=True)
    (wheel / "bin" / "ptxas").write_bytes(Path(NVCC).with_name("ptxas").read_bytes())
    assert _env_nvcc({"CUDA_HOME": str(wheel)}) == "None"  # not /usr/local/cuda's 13.0
    _fake_nvcc(tmp_path / "cu128" / "bin", "12.8")
    path = f"{tmp_path / 'cu128' / 'bin'}{os.pathsep}{os.environ['PATH']}"
    assert _env_nvcc({"PATH": path}) == "12.8"  # first on PATH, before /usr/local/cuda
    assert _env_nvcc({"PATH": path, "CUDA_HOME": "/usr/local/cuda"}) == "13.0"
