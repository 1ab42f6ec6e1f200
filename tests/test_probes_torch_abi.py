"""sgl-kernel's fit with torch judged from the binaries, without a GPU: the stdlib ELF reader and the
verdicts, on tiny real shared objects that g++ builds (a "torch" library defining c10 symbols, extensions
importing them), and the reasons of real loader failures."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest
from elf_helpers import BAR, FOO, NO_DRIVER, SIZE, TORCH_SRC, build_ext, build_so, build_stub

from inenv.kit import _elf, _torch_abi

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build small shared objects")


@pytest.fixture
def torch_lib(tmp_path: Path) -> Path:
    """A stand-in torch/lib/libc10.so exporting c10::foo() and c10::Tensor::size() const."""
    (tmp_path / "torch" / "lib").mkdir(parents=True)
    return build_so(tmp_path / "torch" / "lib" / "libc10.so", TORCH_SRC, soname="libc10.so")


# --- the ELF reader on real files ----------------------------------------------------------------------
def test_elf_reader_sees_needed_defined_and_undefined_cxx_symbols(tmp_path: Path, torch_lib: Path) -> None:
    nvrtc = build_stub(tmp_path / "cu12", "libnvrtc.so.12")
    ext = build_ext(tmp_path / "ext.so", ["c10::foo();", "c10::bar();", "c10::Tensor t; t.size();"], [nvrtc],
               extra="extern \"C\" int cuFoo(void); extern \"C\" __attribute__((weak)) int cuWeak(void);"
                     "int drv() { return cuFoo() + (cuWeak ? 1 : 0); }")
    lib = _elf.linkage(str(torch_lib))
    assert lib is not None and lib.soname == "libc10.so"
    assert {FOO, SIZE} <= lib.defined and "_ZN5other6helperEv" in lib.defined
    e = _elf.linkage(str(ext))
    assert e is not None and "libnvrtc.so.12" in e.needed
    assert e.torch_imports() == tuple(sorted((FOO, BAR, SIZE)))  # mangled names, _ZNK const member included
    assert "cuFoo" in e.undefined and "cuWeak" not in e.undefined  # weak references may stay unresolved
    assert e.unresolved_driver_calls() == ("cuFoo",)
    assert {s.name for s in _elf.sections_of(ext.read_bytes()) or ()} >= {".dynsym", ".dynstr", ".dynamic"}
    empty = tmp_path / "empty.so"
    empty.write_bytes(b"")
    assert _elf.linkage(str(empty)) is None and _elf.linkage(str(ext.with_suffix(".cc"))) is None


# --- verdicts from what was read --------------------------------------------------------------------------
def _fit(tmp_path: Path, calls: list[str], stubs: list[Path] = (), torch_cuda: str = "13.0") -> _torch_abi.Fit:
    ext = build_ext(tmp_path / "common_ops.abi3.so", calls, stubs)
    return _torch_abi.read_fit({"common_ops.abi3.so": str(ext)}, [str(tmp_path / "torch" / "lib" / "libc10.so")],
                               torch_cuda)


def test_a_symbol_this_torch_lacks_is_abi_mismatch_naming_it_and_the_torch_built_for(
        tmp_path: Path, torch_lib: Path) -> None:
    fit = _fit(tmp_path, ["c10::foo();", "c10::bar();"])
    assert fit.torch_symbols == 2 and fit.missing == {"common_ops.abi3.so": (BAR,)}
    j = _torch_abi.judge(fit, NO_DRIVER, (), "==2.9.1", "2.11.0+cu130")
    assert j is not None and (j.status, j.reason_code) == ("fail", "abi-mismatch")
    assert BAR in j.note and "1 of 2 torch symbols" in j.note and "built for torch==2.9.1" in j.note
    unknown = _torch_abi.judge(fit, None, (), None, "2.11.0+cu130")  # even when the import itself went through
    assert unknown is not None and unknown.reason_code == "abi-mismatch" and "unknown" in unknown.note


def test_every_symbol_resolved_without_a_driver_passes_saying_what_was_proven(
        tmp_path: Path, torch_lib: Path) -> None:
    cudart = build_stub(tmp_path / "cu13", "libcudart.so.13")
    fit = _fit(tmp_path, ["c10::foo();", "c10::Tensor t; t.size();"], [cudart])
    j = _torch_abi.judge(fit, NO_DRIVER, (), None, "2.11.0+cu130")
    assert j is not None and (j.status, j.reason_code) == ("pass", "")
    assert "all 2 torch symbols" in j.note and "(libcudart.so.13) are CUDA 13" in j.note
    assert "libcuda.so.1" in j.note
    nothing = _torch_abi.judge(_fit(tmp_path, []), NO_DRIVER, (), None, "2.11.0")  # nothing to prove it with
    assert nothing is not None and (nothing.status, nothing.reason_code) == ("skip", "no-gpu")
    assert "not proven" in nothing.note
    lost = _torch_abi.judge(fit, NO_DRIVER, ("libnuma.so.1",), None, "2.11.0")
    assert lost is not None and (lost.status, lost.reason_code) == ("fail", "import-error")


def test_a_cuda_12_build_beside_a_cuda_13_torch_is_cuda_major_mismatch(tmp_path: Path, torch_lib: Path) -> None:
    nvrtc = build_stub(tmp_path / "cu12", "libnvrtc.so.12")
    fit = _fit(tmp_path, ["c10::foo();"], [nvrtc])
    assert fit.cuda_mismatch() == ("libnvrtc.so.12",)
    j = _torch_abi.judge(fit, NO_DRIVER, (), None, "2.11.0+cu130")
    assert j is not None and (j.status, j.reason_code) == ("fail", "cuda-major-mismatch")
    assert "libnvrtc.so.12" in j.note and "CUDA 13.0" in j.note
    assert _fit(tmp_path, ["c10::foo();"], [nvrtc], torch_cuda="12.8").cuda_mismatch() == ()


def _loader_error(path: Path) -> str:
    """What the real dynamic loader says when the library cannot load."""
    with pytest.raises(OSError) as exc:
        ctypes.CDLL(str(path))
    return f"ImportError: {exc.value}"


def test_loader_errors_get_their_own_reasons(tmp_path: Path, torch_lib: Path) -> None:
    drv = build_ext(tmp_path / "drv.so", [], extra='extern "C" int cuStreamWriteValue32(void); int d() { return '
               'cuStreamWriteValue32(); }')
    nccl = build_ext(tmp_path / "nccl.so", [], extra='extern "C" int ncclCommWindowRegister(void); int n() { return '
                'ncclCommWindowRegister(); }')
    cxx = build_ext(tmp_path / "cxx.so", ["c10::bar();"])
    gone = build_stub(tmp_path / "cu12", "libnvrtc.so.12")
    cu12 = build_ext(tmp_path / "cu12.so", [], [gone])
    gone.unlink()
    reasons = {name: _torch_abi.failure_reason(_loader_error(p))
               for name, p in {"drv": drv, "nccl": nccl, "cxx": cxx, "cu12": cu12}.items()}
    assert reasons == {"drv": "driver-symbol-unresolved", "nccl": "undefined-symbol", "cxx": "abi-mismatch",
                       "cu12": "cuda-major-mismatch"}
    assert _torch_abi.failure_reason(NO_DRIVER) == "no-cuda-device"
    assert _torch_abi.failure_reason("ModuleNotFoundError: No module named 'sgl_kernel'") == "import-error"
