"""The inventory probe end to end, without a GPU, on stand-in torch and sgl_kernel packages whose import
fails in the real dynamic loader: what it says about a kernel library it could not load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from elf_helpers import BAR, TORCH_SRC, build_ext, build_so, build_stub

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build small shared objects")
ROOT = Path(__file__).resolve().parents[1]

STANDIN_TORCH = """
import ctypes, os
# like torch, load the core library globally before anything imports an extension
ctypes.CDLL(os.path.join(os.path.dirname(__file__), "lib", "libc10.so"), mode=ctypes.RTLD_GLOBAL)
__version__ = "2.11.0+cu130"
class version:
    cuda = "13.0"
class cuda:
    @staticmethod
    def is_available(): return False
    @staticmethod
    def get_arch_list(): return []
"""


def _site(tmp_path: Path, calls: list[str], stubs: list[Path] = (), extra: str = "",
          requires: str | None = None) -> Path:
    site = tmp_path / "site"
    (site / "torch" / "lib").mkdir(parents=True)
    build_so(site / "torch" / "lib" / "libc10.so", TORCH_SRC, soname="libc10.so")
    (site / "torch" / "__init__.py").write_text(STANDIN_TORCH)
    pkg = site / "sgl_kernel"
    pkg.mkdir()
    build_ext(pkg / "common_ops.abi3.so", calls, stubs, extra)
    (pkg / "__init__.py").write_text("from sgl_kernel import common_ops  # noqa\n")
    info = site / "sglang_kernel-0.4.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang-kernel\nVersion: 0.4.1\n"
                                   + (f"Requires-Dist: torch{requires}\n" if requires else ""))
    return site


def _inventory(site: Path) -> dict:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"}
    proc = subprocess.run([sys.executable, "-m", "inenv.worker", "--probe", "inventory"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@STACKPROBE-RESULT@@")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(lines[-1].split("@@STACKPROBE-RESULT@@", 1)[1])


def test_inventory_fails_a_kernel_it_could_not_import_for_lack_of_a_driver_when_symbols_are_missing(
        tmp_path: Path) -> None:
    driver = build_stub(tmp_path / "drv", "libcuda.so.1")
    site = _site(tmp_path, ["c10::foo();", "c10::bar();"], [driver], requires="==2.9.1")
    driver.unlink()  # the GPU-less host: the loader stops here before resolving any symbol
    r = _inventory(site)
    assert "libcuda.so.1" in r["evidence"]["sgl_kernel_import"]
    assert (r["status"], r["reason_code"]) == ("fail", "abi-mismatch"), r
    assert BAR in r["note"] and "torch==2.9.1" in r["note"]
    assert r["evidence"]["sgl_kernel_abi"]["missing_examples"] == [BAR]


def test_inventory_passes_a_driverless_kernel_only_on_proof(tmp_path: Path) -> None:
    driver = build_stub(tmp_path / "drv", "libcuda.so.1")
    site = _site(tmp_path, ["c10::foo();"], [driver], requires="==2.11.0")
    driver.unlink()
    r = _inventory(site)
    assert (r["status"], r["reason_code"]) == ("pass", ""), r
    assert "judged from its binaries: all 1 torch symbols" in r["note"]
    assert r["evidence"]["sgl_kernel_abi"]["libraries_not_found"] == []


def test_inventory_names_a_cuda_major_mismatch(tmp_path: Path) -> None:
    nvrtc = build_stub(tmp_path / "cu12", "libnvrtc.so.12")
    site = _site(tmp_path, ["c10::foo();"], [nvrtc])
    nvrtc.unlink()  # a CUDA 13 cell has no libnvrtc.so.12
    r = _inventory(site)
    assert "libnvrtc.so.12: cannot open shared object file" in r["evidence"]["sgl_kernel_import"]
    assert (r["status"], r["reason_code"]) == ("fail", "cuda-major-mismatch"), r
    assert "libnvrtc.so.12" in r["note"] and "CUDA 13.0" in r["note"]


def test_inventory_tells_a_missing_driver_function_from_a_torch_abi_break(tmp_path: Path) -> None:
    site = _site(tmp_path, ["c10::foo();"], extra='extern "C" int cuStreamWriteValue32(void); '
                 "int d() { return cuStreamWriteValue32(); }")
    r = _inventory(site)
    assert "undefined symbol: cuStreamWriteValue32" in r["evidence"]["sgl_kernel_import"]
    assert (r["status"], r["reason_code"]) == ("fail", "driver-symbol-unresolved"), r


def test_inventory_lists_what_the_image_removed(tmp_path: Path) -> None:
    from inenv.probes import inventory
    from provision.render import KERNEL_UNUSED, SITE, removed

    listed = tmp_path / "removed"
    # the very shell words the Dockerfile runs write the list the probe reads back
    subprocess.run(["sh", "-c", removed((KERNEL_UNUSED, SITE)).replace(inventory.REMOVED_LIST, str(listed))],
                   check=True)
    assert inventory.removed_from_image(str(listed)) == [f"{SITE}/sgl_kernel/flash_ops*.so"]
    assert inventory.removed_from_image(str(tmp_path / "none")) == []  # not a stackprobe image: nothing said


def _torch_only_site(tmp_path: Path) -> Path:
    site = _site(tmp_path, [])
    shutil.rmtree(site / "sgl_kernel")
    shutil.rmtree(site / "sglang_kernel-0.4.1.dist-info")
    return site


def _dist_info(site: Path, name: str, version: str, requires: str = "") -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires.split(",") if r))


def test_a_kernel_linking_torch_without_declaring_one_is_partial_undeclared_torch(tmp_path: Path) -> None:
    driver = build_stub(tmp_path / "drv", "libcuda.so.1")
    site = _site(tmp_path, ["c10::foo();"], [driver])  # its METADATA names no torch
    driver.unlink()
    r = _inventory(site)
    assert (r["status"], r["reason_code"]) == ("partial", "undeclared-torch"), r
    assert "sgl-kernel 0.4.1 links torch (1 torch symbols)" in r["note"] and "declares no torch" in r["note"]
    assert "2.11.0+cu130" in r["note"]  # the torch it was judged against


def test_an_engine_whose_import_loads_no_extension_is_judged_by_loading_each_library(tmp_path: Path) -> None:
    """vLLM's `import vllm` binds none of its ops; a library needing a stable-ABI function this torch lacks is
    found by the loader (and by the binaries), and the verdict names the engine and the symbol."""
    site = _torch_only_site(tmp_path)
    engine = site / "vllm"
    engine.mkdir()
    (engine / "__init__.py").write_text("")  # imports nothing compiled
    build_ext(engine / "_C_stable_libtorch.abi3.so", [],
              extra='extern "C" int aoti_torch_new_in_a_later_torch(void); '
                    "int op() { return aoti_torch_new_in_a_later_torch(); }")
    _dist_info(site, "vllm", "0.99.0", "torch==2.99.0")
    _dist_info(site, "torch", "2.11.0+cu130")
    r = _inventory(site)
    assert "undefined symbol: aoti_torch_new_in_a_later_torch" in r["evidence"]["vllm_import"]
    assert (r["status"], r["reason_code"]) == ("fail", "abi-mismatch"), r
    assert "vLLM does not fit torch 2.11.0+cu130" in r["note"] and "aoti_torch_new_in_a_later_torch" in r["note"]
    assert "built for torch==2.99.0" in r["note"]
    assert r["evidence"]["vllm_abi"]["missing_examples"] == ["aoti_torch_new_in_a_later_torch"]


def test_flashinfer_kernel_packages_of_another_release_are_partial(tmp_path: Path) -> None:
    site = _torch_only_site(tmp_path)
    _dist_info(site, "flashinfer-python", "0.7.2")
    _dist_info(site, "flashinfer-cubin", "0.6.13")
    _dist_info(site, "flashinfer-jit-cache", "0.7.2+cu130")  # the same release: its CUDA label is no mismatch
    r = _inventory(site)
    assert (r["status"], r["reason_code"]) == ("partial", "flashinfer-package-mismatch"), r
    assert "flashinfer-cubin 0.6.13 is installed beside flashinfer-python 0.7.2" in r["note"]
    assert "flashinfer-jit-cache" not in r["note"]


def test_a_flashinfer_that_refuses_to_import_fails_the_inventory(tmp_path: Path) -> None:
    site = _torch_only_site(tmp_path)
    _dist_info(site, "flashinfer-python", "0.7.2")
    _dist_info(site, "flashinfer-cubin", "0.6.13")
    (site / "flashinfer").mkdir()
    (site / "flashinfer" / "__init__.py").write_text(
        'raise RuntimeError("flashinfer-cubin version (0.6.13) does not match flashinfer version (0.7.2)")\n')
    r = _inventory(site)
    assert (r["status"], r["reason_code"]) == ("fail", "flashinfer-import-error"), r
    assert "does not match flashinfer version" in r["note"]
    assert "flashinfer-cubin 0.6.13 is installed beside flashinfer-python 0.7.2" in r["note"]  # the cause, too


def test_vllm_installed_without_its_dependencies_beside_another_torch_names_the_torch_pin_first(
        tmp_path: Path) -> None:
    """vLLM 0.33.0 with --no-deps beside torch 2.15.0: its import stops at a missing dependency, its extension's
    torch symbols all resolve in this torch. The note, as the runner records it (inventory, then the host's
    requirement judge), leads with the torch pin, counts the rest, and claims no ABI break."""
    from checks.results.result import Verdict
    from checks.run import hostjudge

    site = _torch_only_site(tmp_path)
    init = site / "torch" / "__init__.py"
    init.write_text(init.read_text().replace("2.11.0+cu130", "2.15.0+cu130"))
    _dist_info(site, "torch", "2.15.0")
    engine = site / "vllm"
    engine.mkdir()
    (engine / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'packaging'\", name='packaging')\n")
    build_ext(engine / "_C.abi3.so", ["c10::foo();"])
    others = [f"dep{i:02d}" for i in range(74)]  # the test's own interpreter holds packaging: not among them
    _dist_info(site, "vllm", "0.33.0", ",".join([*others, "torch==2.14.0"]))
    r = _inventory(site)
    assert r["evidence"]["vllm_abi"]["torch_symbols_missing"] == 0, r["evidence"]["vllm_abi"]
    v = hostjudge.judge("inventory", Verdict.from_outcome(r))
    assert (v.status.value, v.reason_code) == ("fail", "import-error"), v
    assert v.note.startswith("vllm 0.33.0 requires torch==2.14.0; 2.15.0 is installed (the 1 torch symbols its "
                             "extensions import all resolve in torch 2.15.0"), v.note
    assert "ModuleNotFoundError: No module named 'packaging'" in v.note
    assert v.note.endswith("74 other declared requirement(s) not met (dep00, dep01, dep02, ...)"), v.note
    assert "does not fit" not in v.note and "abi" not in v.reason_code
