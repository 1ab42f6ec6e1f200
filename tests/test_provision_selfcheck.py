"""Self-check pieces: the fatbin reader against binaries nvcc builds for known architectures, and the
comparison that turns what an image holds into a verdict."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from provision.selfcheck import fatbin_archs
from provision.verify import mismatches

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
SRC = "__global__ void k(int* p) { p[threadIdx.x] += 1; }\n"


@pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine")
def test_fatbin_archs_match_what_nvcc_built(tmp_path: Path) -> None:
    (tmp_path / "k.cu").write_text(SRC)
    gencode = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90a,code=sm_90a",
               "-gencode", "arch=compute_120,code=[sm_120,compute_120]"]
    out = tmp_path / "libk.so"
    proc = subprocess.run([str(NVCC), "-shared", "-Xcompiler", "-fPIC", *gencode, "k.cu", "-o", str(out)],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert fatbin_archs(out) == {"sass": ["sm_80", "sm_90", "sm_120"], "ptx": ["compute_120"]}


def test_fatbin_archs_of_a_plain_file_is_empty(tmp_path: Path) -> None:
    f = tmp_path / "x.so"
    f.write_bytes(b"\x7fELF" + bytes(200))
    assert fatbin_archs(f) == {"sass": [], "ptx": []}


def test_torch_of_the_dev_env_has_sm120() -> None:
    torch_lib = Path(__import__("importlib.util").util.find_spec("torch").origin).parent / "lib" / "libtorch_cuda.so"
    if not torch_lib.exists():
        pytest.skip("the dev torch is a CPU build here")
    archs = fatbin_archs(torch_lib)["sass"]
    assert {"sm_90", "sm_120"} <= set(archs)


EXPECTED = {"cuda": "13.0", "torch": "2.11.0", "sgl_kernel": "0.4.2", "flashinfer": "0.6.8.post1"}
GOOD = {
    "torch": {"version": "2.11.0+cu130", "cuda": "13.0"},
    "sgl_kernel": {"version": "0.4.2", "cudart_major": ["13"]},
    "flashinfer": {"version": "0.6.8.post1"},
    "toolkit": {"nvcc": "13.0", "compile_sm_120a": "ok"},
}


def test_verify_accepts_a_matching_image() -> None:
    assert mismatches(EXPECTED, GOOD, compiled_toolkit=True) == []


def test_verify_rejects_a_mislabelled_torch() -> None:
    probs = mismatches(dict(EXPECTED, cuda="12.8"), GOOD, compiled_toolkit=False)
    assert any("torch.version.cuda is 13.0, the cell is CUDA 12.8" in p for p in probs)
    assert any("libcudart.so.13" in p for p in probs)


@pytest.mark.parametrize(
    ("facts", "needle"),
    [
        ({**GOOD, "torch": {"error": "import torch: ImportError: libcudnn.so.9"}}, "torch does not import"),
        ({**GOOD, "torch": {"version": "2.9.1+cu128", "cuda": "13.0"}}, "torch is 2.9.1+cu128"),
        ({**GOOD, "sgl_kernel": {}}, "sgl-kernel is absent"),
        ({**GOOD, "flashinfer": {"version": "0.6.7"}}, "flashinfer-python is 0.6.7"),
        ({**GOOD, "toolkit": {"nvcc": "12.8", "compile_sm_120a": "ok"}}, "nvcc is CUDA 12.8"),
        ({**GOOD, "toolkit": {"nvcc": "13.0", "compile_sm_120a": "error: fatal"}}, "cannot compile for sm_120a"),
        ({**GOOD, "toolkit": {}}, "no working nvcc"),
    ],
)
def test_verify_names_each_mismatch(facts: dict, needle: str) -> None:
    probs = mismatches(EXPECTED, facts, compiled_toolkit=True)
    assert any(needle in p for p in probs), probs
