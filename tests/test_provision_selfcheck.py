"""Self-check pieces: the fatbin reader (shared with the probes) against binaries nvcc builds for known
architectures, the self-check run from the files `provision build` mounts into an image, and the
comparison that turns what an image holds into a verdict."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from inenv.selfcheck import fatbin_archs
from provision.verify import mismatches

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
SRC = "__global__ void k(int* p) { p[threadIdx.x] += 1; }\n"
ROOT = Path(__file__).resolve().parents[1]
GENCODE = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90a,code=sm_90a",
           "-gencode", "arch=compute_120,code=[sm_120,compute_120]"]
# A fatbin header claiming sm_75 SASS, as plain data outside any fatbin section: must not be read as code.
_HEADER = struct.pack("<IHHQ", 0xBA55ED50, 1, 16, 64)  # magic, version, header size, payload size
_ENTRY = struct.pack("<HHIQ12xI", 2, 0, 64, 0, 75)  # SASS, entry header size, payload size, arch at 28
_BLOB = (_HEADER + _ENTRY).ljust(80, b"\0")
STRAY = f"__attribute__((used)) static const unsigned char stray[] = {{{', '.join(map(str, _BLOB))}}};\n"


def _nvcc_so(folder: Path, name: str, source: str, *extra: str) -> Path:
    (folder / "k.cu").write_text(source)
    out = folder / name
    proc = subprocess.run([str(NVCC), "-shared", "-Xcompiler", "-fPIC", *GENCODE, *extra, "k.cu", "-o", str(out)],
                          cwd=folder, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine")
def test_fatbin_archs_match_what_nvcc_built_a_suffix_included(tmp_path: Path) -> None:
    out = _nvcc_so(tmp_path, "libk.so", SRC + STRAY)
    # sm_90a runs only on 9.0, so it is not sm_90; the stray header in .rodata is data, not code
    assert fatbin_archs(out) == {"sass": ["sm_80", "sm_90a", "sm_120"], "ptx": ["compute_120"]}


@pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine")
def test_selfcheck_reports_a_kernels_suffixed_archs_and_its_cudart(tmp_path: Path) -> None:
    """An installed sgl-kernel whose common_ops carries sm_90a: the archs sort with their suffix and the
    CUDA runtime major comes from DT_NEEDED."""
    site = tmp_path / "site"
    (site / "sgl_kernel").mkdir(parents=True)
    _nvcc_so(site / "sgl_kernel", "common_ops.abi3.so", SRC, "-cudart", "shared")
    info = site / "sglang_kernel-0.4.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang-kernel\nVersion: 0.4.2\n")
    (info / "RECORD").write_text("sgl_kernel/common_ops.abi3.so,,\n")
    code = "import json; from inenv.selfcheck import kernel_facts; print(json.dumps(kernel_facts()))"
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    cuda_major = subprocess.run([str(NVCC), "--version"], capture_output=True, text=True).stdout
    assert json.loads(proc.stdout) == {"version": "0.4.2", "archs": {"sass": ["sm_80", "sm_90a", "sm_120"]},
                                       "cudart_major": [cuda_major.split("release ")[1].split(".")[0]]}


@pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine")
def test_selfcheck_runs_from_the_files_build_mounts_into_the_image(tmp_path: Path) -> None:
    """The image has no checkout: only the self-check and the modules it shares, at the paths
    `provision build` mounts them to. Laid out the same way here, outside the repository, it runs."""
    from provision.cellrecord import selfcheck_files

    image = tmp_path / "image"
    for host, inside in selfcheck_files():
        target = image / inside.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(host, target)
    lib = _nvcc_so(tmp_path, "libk.so", SRC)
    script = image / selfcheck_files()[0][1].lstrip("/")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-s", str(script), "--archs", str(lib)], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"sass": ["sm_80", "sm_90a", "sm_120"], "ptx": ["compute_120"]}


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


def test_verify_checks_the_engine_an_engine_cell_carries() -> None:
    want = dict(EXPECTED, engine="vllm==0.33.0")
    assert mismatches(want, {**GOOD, "engines": {"vllm": "0.33.0"}}, compiled_toolkit=True) == []
    assert "vllm is absent, the cell asks 0.33.0" in mismatches(want, GOOD, compiled_toolkit=True)
    assert "vllm is 0.32.0, the cell asks 0.33.0" in mismatches(
        want, {**GOOD, "engines": {"vllm": "0.32.0"}}, compiled_toolkit=True)
