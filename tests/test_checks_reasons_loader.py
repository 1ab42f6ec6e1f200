"""The reason catalogue on loader and import failures: messages the real dynamic loader gives for tiny
g++-built libraries, and one recorded from a real flashinfer import."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from checks import reasons

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


def test_every_code_the_inventory_sets_is_catalogued() -> None:
    from checks.probes import _torch_abi

    no_driver = "ImportError: libcuda.so.1: cannot open shared object file: No such file or directory"
    errors = ["x.so: undefined symbol: cuInit", "x.so: undefined symbol: _ZN2at6Tensor4sizeEv",
              "x.so: undefined symbol: ncclGroupEnd", "libcudart.so.12: cannot open shared object file", no_driver,
              "ModuleNotFoundError: No module named 'sgl_kernel'"]
    codes = {_torch_abi.failure_reason(e) for e in errors}
    fit = _torch_abi.Fit(("ops.so",), 3, {}, ("libcudart.so.13",), "13.0", needed=("libcudart.so.13",))
    judged = [_torch_abi.judge(fit, no_driver, (), None, "2.11.0"),
              _torch_abi.judge(fit, no_driver, ("libnuma.so.1",), None, "2.11.0"),
              _torch_abi.judge(_torch_abi.Fit(("ops.so",), 0, {}, (), "13.0"), no_driver, (), None, "2.11.0"),
              _torch_abi.judge(_torch_abi.Fit(("ops.so",), 3, {"ops.so": ("_ZN3c103barEv",)}, (), "13.0"),
                               None, (), None, "2.11.0"),
              _torch_abi.judge(_torch_abi.Fit(("ops.so",), 3, {}, ("libnvrtc.so.12",), "13.0"), None, (), None,
                               "2.11.0")]
    codes |= {j.reason_code for j in judged if j is not None and j.reason_code}
    assert codes == {"driver-symbol-unresolved", "abi-mismatch", "undefined-symbol", "cuda-major-mismatch",
                     "no-cuda-device", "import-error", "no-gpu"}
    assert all(CAT.get(code) is not None for code in codes), sorted(c for c in codes if CAT.get(c) is None)
