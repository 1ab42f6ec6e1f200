"""What the engine would load counts: a comm module the environment already has (flashinfer's own JIT cache, an
installed flashinfer-jit-cache) is read back and taken instead of compiled again, and one that is stale, built
for another GPU or not the module is not taken, with why.

A stand-in flashinfer (tests/test_fi_jit.py's, its cache laid out as flashinfer's ``.cache/flashinfer/<version>/
<arch>/cached_ops``) builds a real sm_90a library with the host's nvcc 13.0 into a user's JIT cache first; the
lookup then runs in the interpreter flashinfer would (no GPU here, so nothing is loaded and the arch list is
given as flashinfer would resolve it for an H100/H200)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from inenv.kit import _fi_build, _fi_existing
from inenv.probes import fi_jit
from tests.test_fi_jit import NVCC, STANDIN_ENV, write_standin

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.7.4"
# the stand-in's kernel with the entry points flashinfer's vllm_comm library exports (tvm-ffi's names)
ENTRY_KERNEL = ('#include "k.h"\n__global__ void k(int* p) { *p = K_VALUE; }\n'
                'extern "C" int __tvm_ffi_init_custom_ar(void*, void*, int, void*) { return 0; }\n'
                'extern "C" int __tvm_ffi_all_reduce(void*, void*, int, void*) { return 0; }\n')
# a flashinfer-jit-cache whose one provider holds modules for sm_90a; the stand-in's spec asks it as 0.7.4 does
JIT_CACHE_PKG = '''
from pathlib import Path
from types import SimpleNamespace
__version__ = "0.7.4+cu130"
def get_jit_cache_providers():
    d = Path(__file__).resolve().parent / "jit_cache"
    return [SimpleNamespace(provider_id="cu130-sm90", distribution="flashinfer-jit-cache-cu130-sm90",
                            version=__version__, jit_cache_dir=d, cuda_architectures=["sm90a"],
                            modules=[p.name for p in d.iterdir()] if d.is_dir() else [])]
'''
AOT_ARTIFACTS = '''
    @property
    def aot_artifacts(self):
        try:
            import flashinfer_jit_cache
        except ImportError:
            return ()
        from types import SimpleNamespace
        out = []
        for p in flashinfer_jit_cache.get_jit_cache_providers():
            lib = Path(p.jit_cache_dir) / self.name / f"{self.name}.so"
            if lib.exists():
                out.append(SimpleNamespace(provider_id=p.provider_id, path=lib,
                                           cuda_architectures=frozenset(p.cuda_architectures)))
        return tuple(out)
'''


def make_site(root: Path, entry_points: bool = True) -> Path:
    """A stand-in flashinfer 0.7.4 whose JIT cache has flashinfer's layout (the release in the path) and whose
    spec names its AOT artifacts as 0.7.4's does."""
    site = root / "site"
    write_standin(site, VERSION)
    env_py = STANDIN_ENV.replace('".cache", "flashinfer", "_".join(ARCHS)',
                                 f'".cache", "flashinfer", "{VERSION}", "_".join(ARCHS)')
    env_py = env_py.replace('os.environ["FLASHINFER_WORKSPACE_BASE"]',
                            'os.environ.get("FLASHINFER_WORKSPACE_BASE") or os.path.expanduser("~")')
    (site / "flashinfer" / "jit" / "env.py").write_text(env_py)
    comm = (site / "flashinfer" / "jit" / "comm.py").read_text()
    comm = comm.replace("    def write_ninja(self):", AOT_ARTIFACTS.lstrip("\n") + "\n    def write_ninja(self):", 1)
    (site / "flashinfer" / "jit" / "comm.py").write_text(comm)
    if entry_points:
        (site / "flashinfer" / "data" / "csrc" / "k.cu").write_text(ENTRY_KERNEL)
    return site


def lookup_env(site: Path, base: Path, archs: str = "9.0a", **extra: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("STACKPROBE_", "FLASHINFER_", "CUDA_"))
            and k != "VIRTUAL_ENV"}
    return {**keep, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "CUDA_HOME": "/usr/local/cuda", "CUDA_VISIBLE_DEVICES": "",
            "FLASHINFER_WORKSPACE_BASE": str(base), "FLASHINFER_CUDA_ARCH_LIST": archs, **extra}


def user_build(site: Path, base: Path, archs: str = "9.0a") -> Path:
    """flashinfer compiling vllm_comm into the user's JIT cache at ``base``, as a first use of the engine does."""
    built = _fi_build.run_build_subprocess("vllm_comm", lookup_env(site, base, archs), timeout_s=300)
    assert built.get("ok"), built
    lib = Path(built["library"])
    assert lib.is_file() and str(lib).startswith(str(base / ".cache" / "flashinfer" / VERSION)), lib
    return lib


@pytest.fixture()
def cached(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(site, user's workspace base, the sm_90a library flashinfer put in its JIT cache)."""
    if not os.access(NVCC, os.X_OK):
        pytest.skip("needs nvcc at /usr/local/cuda")
    site, base = make_site(tmp_path), tmp_path / "user"
    return site, base, user_build(site, base)


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.rglob("*") if p.is_file()}


def _log() -> Any:
    lines: list[str] = []
    return SimpleNamespace(log=lines.append, lines=lines)


def test_a_current_module_in_the_jit_cache_is_judged_and_taken_without_compiling(
        cached: tuple[Path, Path, Path]) -> None:
    site, base, lib = cached
    env = lookup_env(site, base)
    before = _snapshot(base)
    assert _fi_existing.might_have(VERSION, env) and not _fi_existing.might_have("0.7.3", env)
    found = _fi_existing.existing_subprocess("vllm_comm", env, timeout_s=120, capability="9.0")
    assert (found["stage"], found["cached_by"], found["library"]) == ("done", "env-jit-cache", str(lib)), found
    assert found["found"] == [{"source": "env-jit-cache", "library": str(lib), "current": True}]
    assert found["cached_from"]["path"] == str(lib)
    assert _snapshot(base) == before  # nothing written into the user's cache: no build.ninja, no object, no .so
    ctx = _log()
    out, lacks = fi_jit.from_environment(ctx, "vllm_comm", "9.0", env=env, load=False)
    assert out is not None and lacks == []
    assert out["status"] == "pass", out
    ev = out["evidence"]
    assert ev["module_from"] == "the environment's flashinfer JIT cache"
    assert ev["targets_in_output"] == ["sm_90a"] and ev["library"] == str(lib)
    assert out["metrics"]["cached"] is True and "compile_s" not in out["metrics"]
    assert out["note"].startswith(f"from the environment's flashinfer JIT cache: {lib}")
    assert _snapshot(base) == before


def test_a_module_newer_sources_would_rebuild_is_not_taken(cached: tuple[Path, Path, Path]) -> None:
    site, base, lib = cached
    header = site / "flashinfer" / "data" / "include" / "k.h"
    header.write_text("#define K_VALUE 2\n")
    later = time.time() + 5
    os.utime(header, (later, later))  # newer than the objects: ninja would compile again
    found = _fi_existing.existing_subprocess("vllm_comm", lookup_env(site, base), timeout_s=120, capability="9.0")
    assert found["stage"] == "none", found
    [entry] = found["found"]
    assert entry["current"] is False and entry["stale"].startswith("ninja would run 2 step(s) again"), entry
    out, lacks = fi_jit.from_environment(_log(), "vllm_comm", "9.0", env=lookup_env(site, base), load=False)
    assert out is None
    assert lacks == [{"source": "env-jit-cache", "library": str(lib), "why": entry["stale"]}]


def test_a_module_built_with_another_toolkit_is_not_taken(cached: tuple[Path, Path, Path], tmp_path: Path) -> None:
    site, base, _ = cached
    other = tmp_path / "cuda-13.0"  # the same nvcc through another CUDA_HOME: flashinfer's build.ninja differs
    other.symlink_to("/usr/local/cuda")
    found = _fi_existing.existing_subprocess("vllm_comm", lookup_env(site, base, CUDA_HOME=str(other)), timeout_s=120,
                                   capability="9.0")
    assert found["stage"] == "none", found
    assert found["found"][0]["stale"].startswith("its build.ninja is not the one this flashinfer writes")
    assert (base / ".cache").is_dir() and "cuda-13.0" not in (Path(found["found"][0]["library"]).parent /
                                                              "build.ninja").read_text()  # left as it was


def test_a_module_for_another_gpu_is_not_taken(cached: tuple[Path, Path, Path]) -> None:
    site, base, lib = cached
    found = _fi_existing.existing_subprocess("vllm_comm", lookup_env(site, base), timeout_s=120, capability="12.0")
    assert found["stage"] == "none", found
    assert found["found"][0]["refused"] == "it holds sm_90a: nothing that runs on compute capability 12.0"
    assert _fi_existing.environment_refusal("vllm_comm", lib, "9.0") == ""
    assert _fi_existing.environment_refusal("vllm_comm", lib, "10.0").startswith("it holds sm_90a")


def test_a_library_without_the_modules_entry_points_is_not_taken(tmp_path: Path) -> None:
    if not os.access(NVCC, os.X_OK):
        pytest.skip("needs nvcc at /usr/local/cuda")
    site, base = make_site(tmp_path, entry_points=False), tmp_path / "user"
    user_build(site, base)
    found = _fi_existing.existing_subprocess("vllm_comm", lookup_env(site, base), timeout_s=120, capability="9.0")
    assert found["stage"] == "none", found
    assert found["found"][0]["refused"] == ("exports none of vllm_comm's entry point(s) __tvm_ffi_init_custom_ar, "
                                            "__tvm_ffi_all_reduce")


def test_the_jit_cache_package_comes_first_as_flashinfer_loads_it(cached: tuple[Path, Path, Path],
                                                                   tmp_path: Path) -> None:
    site, base, lib = cached
    pkg = site / "flashinfer_jit_cache"
    (pkg / "jit_cache" / "vllm_comm").mkdir(parents=True)
    (pkg / "__init__.py").write_text(JIT_CACHE_PKG)
    shutil.copy(lib, pkg / "jit_cache" / "vllm_comm" / "vllm_comm.so")
    found = _fi_existing.existing_subprocess("vllm_comm", lookup_env(site, base), timeout_s=120, capability="9.0")
    assert (found["stage"], found["cached_by"]) == ("done", "jit-cache-package"), found
    assert found["library"] == str(pkg / "jit_cache" / "vllm_comm" / "vllm_comm.so")
    assert found["cached_from"]["provider"] == "cu130-sm90" and found["cached_from"]["package_archs"] == ["sm90a"]
    assert [f["source"] for f in found["found"]] == ["jit-cache-package", "env-jit-cache"]


def test_nothing_to_look_for_without_a_cache_of_this_release(tmp_path: Path) -> None:
    env = {"FLASHINFER_WORKSPACE_BASE": str(tmp_path)}
    assert not _fi_existing.might_have(VERSION, env)
    ops = tmp_path / ".cache" / "flashinfer" / VERSION / "90a" / "cached_ops" / "vllm_comm"
    ops.mkdir(parents=True)
    assert not _fi_existing.might_have(VERSION, env)  # a folder without a library
    (ops / "vllm_comm.so").write_bytes(b"")
    assert _fi_existing.might_have(VERSION, env)
    assert _fi_existing.jit_cache_root({"HOME": "/home/u"}) == Path("/home/u/.cache/flashinfer")


@pytest.mark.parametrize(("result", "says"), [
    ({"cached": True, "cached_by": "env-jit-cache"}, "the environment's flashinfer JIT cache"),
    ({"cached": True, "cached_by": "jit-cache-package"}, "the installed flashinfer-jit-cache package"),
    ({"cached": True, "cached_by": "carried"}, "the cell's carried kernel set"),
    ({"cached": True, "cached_by": "store"}, "stackprobe's compile cache"),
    ({"cached": False}, "compiled now"),
    ({}, "compiled now"),
])
def test_every_result_says_where_its_module_came_from(result: dict[str, Any], says: str) -> None:
    assert fi_jit.module_from(result) == says
    out = fi_jit.verdict("vllm_comm", "12.0a", {"stage": "done", "flashinfer": VERSION, **result}, ["sm_120a"])
    assert out["evidence"]["module_from"] == says


def test_a_build_file_written_in_scratch_reads_as_in_the_users_cache(tmp_path: Path) -> None:
    (tmp_path / "scratch-real").mkdir()
    (tmp_path / "scratch").symlink_to(tmp_path / "scratch-real")  # a temporary folder reached through a link
    (tmp_path / "home-real").mkdir()
    (tmp_path / "home").symlink_to(tmp_path / "home-real")
    written = (f"build {tmp_path}/scratch-real/vllm_comm/a.cuda.o: cuda_compile /site/a.cu\n"
               f"build {tmp_path}/scratch/vllm_comm/vllm_comm.so: link {tmp_path}/scratch-real/vllm_comm/a.cuda.o\n")
    assert _fi_existing.as_placed(written, tmp_path / "scratch", tmp_path / "home" / "ops") == (
        f"build {tmp_path}/home-real/ops/vllm_comm/a.cuda.o: cuda_compile /site/a.cu\n"
        f"build {tmp_path}/home/ops/vllm_comm/vllm_comm.so: link {tmp_path}/home-real/ops/vllm_comm/a.cuda.o\n")


def test_one_look_says_which_modules_the_environment_has(cached: tuple[Path, Path, Path]) -> None:
    site, base, lib = cached
    env = lookup_env(site, base)
    # trtllm_comm: the stand-in has no generator for it, so the environment has none
    assert _fi_existing.have_subprocess(["vllm_comm", "trtllm_comm"], env, 120, capability="9.0") == {
        "vllm_comm": {"source": "env-jit-cache", "library": str(lib), "name": "vllm_comm", "arch_dir": None,
                      "flashinfer": VERSION}}
    assert _fi_existing.have_subprocess(["vllm_comm"], env, 120, capability="12.0") == {}
