"""The reason catalogue on loader and import failures: messages the real dynamic loader gives for tiny
g++-built libraries, and one recorded from a real flashinfer import."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from common import reasons

CAT = reasons.default()
# `uv pip install torch==2.11.0 flashinfer-python==0.6.18` (Python 3.11) resolves cuda-python 12.6.2.post1
# beside cuda-bindings 13.5.0; then `import flashinfer` ends with this line.
SHADOWED = ("AttributeError: module 'cuda.bindings.runtime' has no attribute 'cudaLibrary_t'. "
            "Did you mean: 'cudaArray_t'?")


def _loader_error(tmp_path: Path, name: str, source: str, needs: str | None = None) -> str:
    """Build a library that cannot load (an undefined symbol, or a dependency deleted after linking) and
    return what dlopen says, as Python's import reports it."""
    link = []
    if needs:
        dep = tmp_path / needs
        subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{needs}", "-o", str(dep), "-x", "c", "-"],
                       input="void dep(void) {}\n", text=True, check=True)
        link = ["-Wl,--no-as-needed", f"-L{tmp_path}", f"-l:{needs}"]
    src = tmp_path / f"{name}.cc"
    src.write_text(source)
    out = tmp_path / f"{name}.so"
    subprocess.run(["g++", "-shared", "-fPIC", "-o", str(out), str(src), *link], check=True)
    if needs:
        (tmp_path / needs).unlink()
    with pytest.raises(OSError) as exc:
        ctypes.CDLL(str(out))
    return f"ImportError: {exc.value}"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_loader_failures_are_told_apart(tmp_path: Path) -> None:
    cases = {
        "cuda-major-mismatch": _loader_error(tmp_path, "cu12", "int f() { return 0; }\n", needs="libnvrtc.so.12"),
        "no-cuda-device": _loader_error(tmp_path, "drv", "int f() { return 0; }\n", needs="libcuda.so.1"),
        "abi-mismatch": _loader_error(tmp_path, "abi", "namespace c10 { namespace cuda { void SetDevice(signed "
                                      "char); } }\nvoid f() { c10::cuda::SetDevice(0); }\n"),
        "undefined-symbol": _loader_error(tmp_path, "nccl", 'extern "C" int ncclCommWindowRegister(void);\n'
                                          "int f() { return ncclCommWindowRegister(); }\n"),
        "fi-link-unresolved": _loader_error(tmp_path, "cu", 'extern "C" int cuPointerGetAttribute(void);\n'
                                            "int f() { return cuPointerGetAttribute(); }\n"),
    }
    assert "libnvrtc.so.12: cannot open shared object file" in cases["cuda-major-mismatch"]
    assert "undefined symbol: _ZN3c104cuda9SetDeviceEa" in cases["abi-mismatch"]
    got = {code: (hit.code if (hit := CAT.match([text])) else None) for code, text in cases.items()}
    assert got == {code: code for code in cases}


def test_cuda_python_over_cuda_bindings_is_catalogued_with_the_fix() -> None:
    hit = CAT.match([SHADOWED])
    assert hit is not None and hit.code == "cuda-python-shadowed"
    assert "cuda-python>=13" in hit.remediation and "--reinstall-package cuda-bindings" in hit.remediation
