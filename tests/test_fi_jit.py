"""fi-jit verdicts: the toolkit flashinfer would use (not one fi-jit picks), targets as flashinfer normalises
them, and no pass without the requested architecture in the built code; cache hits recorded as such.

Verdicts are checked on recorded build results, and end to end through the worker with a stand-in
flashinfer package (no torch here): it finds its toolkit, normalises FLASHINFER_CUDA_ARCH_LIST and writes
a build.ninja the way flashinfer 0.6.18 does, and the host's real nvcc 13.0 compiles a one-kernel module.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from inenv import carry as _fi_carry
from inenv.kit import _compile_cache
from inenv.probes import fi_jit

ROOT = Path(__file__).resolve().parents[1]
NVCC = "/usr/local/cuda/bin/nvcc"
TK13 = {"nvcc": NVCC, "cuda_home": "/usr/local/cuda", "found_by": "CUDA_HOME", "version": "13.0", "error": ""}


def _done(**kw: object) -> dict:
    return {"stage": "done", "flashinfer": "0.6.18", "toolkit": TK13, "compile_s": 14.2, "link_s": 0.4, **kw}


# --- targets as flashinfer normalises them --------------------------------------------------------------
@pytest.mark.parametrize(
    ("arch", "targets", "status"),
    [
        ("9.0a", ["sm_90a"], "pass"),
        ("10.0a", ["sm_100a"], "pass"),
        ("12.0", ["sm_120f"], "pass"),  # flashinfer >= 0.6.7 with nvcc >= 12.9 (recorded: 0.6.18, nvcc 13.0)
        ("12.0", ["sm_120"], "pass"),  # flashinfer <= 0.6.6 passes it unchanged
        ("12.0a", ["sm_120a"], "pass"),
        ("12.0f", ["sm_120f"], "pass"),
        ("12.0a", ["sm_120f"], "fail"),
        ("12.0f", ["sm_120a"], "fail"),
        ("12.0", ["sm_90a"], "fail"),
        ("10.0a", ["sm_100f"], "fail"),
    ],
)
def test_requested_arch_as_flashinfer_normalises_it(arch: str, targets: list[str], status: str) -> None:
    o = fi_jit.verdict("vllm_comm", arch, _done(), targets)
    assert o["status"] == status, o
    if status == "fail":
        assert o["reason_code"] == "fi-wrong-arch" and str(targets) in o["note"]


# --- no pass without proof; cache hits --------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["12.0a", "local"])
def test_unreadable_output_is_not_a_pass(arch: str) -> None:
    result = _done(library="/cache/vllm_comm/vllm_comm.so", local_capability="9.0")
    o = fi_jit.verdict("vllm_comm", arch, result, [])
    assert (o["status"], o["reason_code"]) == ("partial", "fi-arch-unverified"), o
    assert "/cache/vllm_comm/vllm_comm.so" in o["note"]


def test_one_step_build_without_readable_output_is_not_a_pass() -> None:
    o = fi_jit.verdict("vllm_comm", "12.0a", {"stage": "done", "one_step": True, "compile_s": 3.0}, [])
    assert o["status"] == "partial" and o["evidence"]["one_step"] is True


def test_a_cache_hit_is_recorded_with_the_build_it_came_from() -> None:
    origin = {"built_at": "2026-11-30T18:20:01Z", "toolkit": TK13, "flashinfer": "0.6.18", "module": "vllm_comm"}
    result = _done(cached=True, cached_from=origin, compile_s=0.1)
    o = fi_jit.verdict("vllm_comm", "12.0a", result, ["sm_120a"])
    assert o["status"] == "pass" and o["metrics"]["cached"] is True
    assert "compile_s" not in o["metrics"]  # 0.1 s of ninja checking timestamps is no compile time
    assert o["evidence"]["cached_from"] == origin and "cached" in o["note"] and "2026-11-30T18:20:01Z" in o["note"]
    fresh = fi_jit.verdict("vllm_comm", "12.0a", _done(cached=False), ["sm_120a"])
    assert "cached" not in fresh["metrics"] and fresh["metrics"]["compile_s"] == 14.2


# --- the toolkit in every result -------------------------------------------------------------------------
def test_every_result_names_its_toolkit_and_flags_another_cuda_major() -> None:
    tk128 = {"nvcc": "/opt/cu128/bin/nvcc", "cuda_home": "/opt/cu128", "found_by": "PATH", "version": "12.8",
             "error": ""}
    o = fi_jit.verdict("vllm_comm", "12.0a", _done(toolkit=tk128, torch_cuda="13.0"), ["sm_120a"])
    assert o["evidence"]["toolkit"] == tk128 and o["evidence"]["nvcc"] == "12.8"
    assert "CUDA 12 but torch is built with CUDA 13.0" in o["evidence"]["toolkit_warning"]
    assert "CUDA 12 but torch" in o["note"]
    gate = {"stage": "import", "toolkit": tk128, "error": "RuntimeError: SM 12.x requires CUDA >= 12.9"}
    o = fi_jit.verdict("vllm_comm", "12.0", gate, [])
    assert (o["status"], o["reason_code"]) == ("fail", "fi-nvcc-too-old")
    assert "/opt/cu128/bin/nvcc (from PATH; nvcc 12.8)" in o["note"]


# --- end to end through the worker, with a stand-in flashinfer ---------------------------------------------
STANDIN_CPP_EXT = '''
import os, re, subprocess

def get_cuda_path():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home is not None:
        return home
    found = subprocess.run(["which", "nvcc"], capture_output=True, text=True)
    if found.returncode == 0:
        return os.path.dirname(os.path.dirname(found.stdout.strip()))
    if not os.path.exists("/usr/local/cuda"):
        raise RuntimeError("Could not find nvcc and default cuda_home='/usr/local/cuda' doesn't exist")
    return "/usr/local/cuda"

def cuda_version():
    try:
        text = subprocess.check_output([os.path.join(get_cuda_path(), "bin/nvcc"), "--version"], text=True)
    except (OSError, subprocess.CalledProcessError):
        return (13, 0)  # flashinfer falls back to torch.version.cuda; the stand-in's torch would be cu130
    m = re.search(r"release (\\d+)\\.(\\d+),", text)
    return (int(m.group(1)), int(m.group(2)))
'''
STANDIN_ENV = '''
import os
from flashinfer.jit.cpp_ext import cuda_version

def _normalise(item):
    major, minor = item.split(".")
    if minor[-1].isalpha():
        return major + minor
    if major == "12":
        if cuda_version() < (12, 9):
            raise RuntimeError("SM 12.x requires CUDA >= 12.9")
        return "120f" if minor == "0" else f"12{minor}a"
    return major + minor + ("a" if int(major) >= 9 else "")

ARCHS = sorted(_normalise(a) for a in os.environ["FLASHINFER_CUDA_ARCH_LIST"].split(" "))
JIT_DIR = os.path.join(os.environ["FLASHINFER_WORKSPACE_BASE"], ".cache", "flashinfer", "_".join(ARCHS), "cached_ops")
'''
STANDIN_COMM = '''
import os
import re
import subprocess
from pathlib import Path
from flashinfer.jit import env
from flashinfer.jit.cpp_ext import get_cuda_path

DATA = Path(__file__).resolve().parent.parent / "data"  # the package's sources and headers, as flashinfer's
SOURCE = None  # the package's own kernel
# nvcc writes the headers it read to $out.d, and ninja keeps them (`ninja -t deps`), as in flashinfer's file
COMPILE = (f"$nvcc --generate-dependencies-with-compile -MF $out.d -c $in -o $out {{gencode}} -I{DATA}/include "
           "-Xcompiler -fPIC {extra}")
if os.environ.get("STANDIN_NO_DEVICE_CODE"):  # output with no fat binary to read back
    SOURCE, COMPILE = "int f() { return 1; }\\n", "c++ -MD -MF $out.d -x c++ -fPIC -c $in -o $out"

def EXTRA():  # flashinfer (0.6.16 on) adds FLASHINFER_EXTRA_CUDAFLAGS to nvcc's flags of each spec it makes
    return os.environ.get("FLASHINFER_EXTRA_CUDAFLAGS", "")

def _write_if_different(path, text):  # as flashinfer does, so an unchanged module stays up to date
    if not path.exists() or path.read_text() != text:
        path.write_text(text)

class JitSpec:
    def __init__(self, name, archs):
        self.name = name
        self.archs = archs

    @property
    def build_dir(self):
        return Path(env.JIT_DIR) / self.name

    @property
    def ninja_path(self):
        return self.build_dir / "build.ninja"

    @property
    def jit_library_path(self):
        return self.build_dir / f"{self.name}.so"

    def write_ninja(self):
        d = self.build_dir
        d.mkdir(parents=True, exist_ok=True)
        src = DATA / "csrc" / "k.cu"
        if SOURCE is not None:
            src = d / "k.cu"
            _write_if_different(src, SOURCE)
        gencode = " ".join(f"-gencode=arch=compute_{a},code=sm_{a}" for a in self.archs)
        nvcc = os.environ.get("FLASHINFER_NVCC", "$cuda_home/bin/nvcc")
        _write_if_different(d / "build.ninja",
            f"cuda_home = {get_cuda_path()}\\nnvcc = {nvcc}\\n"
            f"rule cuda_compile\\n  command = {COMPILE.format(gencode=gencode, extra=EXTRA())}\\n"
            f"  depfile = $out.d\\n  deps = gcc\\n"
            f"rule link\\n  command = c++ -shared $in -o $out {os.environ.get('STANDIN_LINK_FLAGS', '')}\\n"
            f"build {d}/k.cuda.o: cuda_compile {src}\\n"
            f"build {self.jit_library_path}: link {d}/k.cuda.o\\n"
        )

class OneStepSpec(JitSpec):  # a JitSpec without a ninja file of its own: build_and_load does it all
    def __getattribute__(self, name):
        if name in ("write_ninja", "ninja_path"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)
    def build_and_load(self):
        JitSpec.write_ninja(self)
        subprocess.run(["ninja", "-C", str(self.build_dir)], check=True, capture_output=True)

def gen_vllm_comm_module():
    # flashinfer's arch gate: a module keeps the targets of the majors it supports, and refuses when none is left
    archs = env.ARCHS
    majors = os.environ.get("STANDIN_SUPPORTED_MAJORS")
    if majors:
        archs = [a for a in archs if re.sub("[a-z]$", "", a)[:-1] in majors.split(",")]
        if not archs:
            raise RuntimeError(f"No supported CUDA architectures found for major versions {majors}")
    return (OneStepSpec if os.environ.get("STANDIN_ONE_STEP") else JitSpec)("vllm_comm", archs)
'''
STANDIN_KERNEL = '#include "k.h"\n__global__ void k(int* p) { *p = K_VALUE; }\n'
STANDIN_HEADER = "#define K_VALUE 1\n"


def write_standin(site: Path, version: str = "0.6.18", header: str = STANDIN_HEADER) -> None:
    """The stand-in flashinfer package (its JIT front end, one kernel source and the header it includes)
    and its dist-info, under ``site``."""
    pkg = site / "flashinfer"
    (pkg / "jit").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from flashinfer.jit import env  # fixes the arch list at import\n")
    (pkg / "jit" / "__init__.py").write_text("")
    (pkg / "jit" / "cpp_ext.py").write_text(STANDIN_CPP_EXT)
    (pkg / "jit" / "env.py").write_text(STANDIN_ENV)
    (pkg / "jit" / "comm.py").write_text(STANDIN_COMM)
    (pkg / "data" / "csrc").mkdir(parents=True)
    (pkg / "data" / "include").mkdir()
    (pkg / "data" / "csrc" / "k.cu").write_text(STANDIN_KERNEL)
    (pkg / "data" / "include" / "k.h").write_text(header)
    meta = site / f"flashinfer_python-{version}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flashinfer-python\nVersion: {version}\n")


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not os.access(NVCC, os.X_OK):
        pytest.skip("needs nvcc at /usr/local/cuda")
    site = tmp_path_factory.mktemp("standin")
    write_standin(site)
    return site


RUN_ENV = ("STACKPROBE_COMPILE_CACHE", "STACKPROBE_FI_JIT_ARCHS", "STACKPROBE_CELL_ID", "STACKPROBE_HOST_ID",
           "STACKPROBE_HANDOFF_TOKEN")


def _fi_jit(site: Path, arch: str, cache: Path, module: str = "vllm_comm", **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "VIRTUAL_ENV", *RUN_ENV)}
    bindir = str(Path(sys.executable).parent)  # ninja from this venv
    run_env = {**base, "PATH": f"{bindir}{os.pathsep}{base['PATH']}", "CUDA_VISIBLE_DEVICES": "",
               "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "STACKPROBE_JIT_CACHE": str(cache), **env}
    variant = {"probe_id": "fi-jit", "ranks": 1, "params": [["module", module], ["arch", arch]]}
    proc = subprocess.run([sys.executable, "-m", "inenv.worker", "--probe", "fi-jit", "--variant",
                           json.dumps(variant), "--gpus", "0"], cwd=ROOT, env=run_env, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@STACKPROBE-RESULT@@")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(lines[-1].split("@@STACKPROBE-RESULT@@", 1)[1])


def test_a_cuda_home_without_nvcc_fails_as_it_does_for_flashinfer(standin: Path, tmp_path: Path) -> None:
    wheel = tmp_path / "cuda_nvcc"  # the registry's nvidia-cuda-nvcc-cu12 layout: ptxas and nvvm, no nvcc
    (wheel / "bin").mkdir(parents=True)
    (wheel / "bin" / "ptxas").write_bytes(Path(NVCC).with_name("ptxas").read_bytes())
    r = _fi_jit(standin, "12.0a", tmp_path / "jit", CUDA_HOME=str(wheel))
    assert (r["status"], r["reason_code"]) == ("fail", "fi-no-nvcc"), r
    tk = r["evidence"]["toolkit"]
    assert (tk["nvcc"], tk["found_by"], tk["version"]) == (f"{wheel}/bin/nvcc", "CUDA_HOME", None)
    assert f"{wheel}/bin/nvcc" in r["note"]


def test_a_failure_no_target_list_changes_is_not_built_again_per_target(standin: Path, tmp_path: Path) -> None:
    wheel = tmp_path / "cuda_nvcc"  # a CUDA_HOME without nvcc, with a compile cache and two targets
    (wheel / "bin").mkdir(parents=True)
    run = {"CUDA_HOME": str(wheel), "STACKPROBE_COMPILE_CACHE": str(tmp_path / "compile"),
           "STACKPROBE_FI_JIT_ARCHS": "12.0a 12.0f"}
    r = _fi_jit(standin, "12.0a", tmp_path / "jit", **run)
    assert (r["status"], r["reason_code"]) == ("fail", "fi-no-nvcc"), r
    # one builder: the combined build's failure answers; no second build for 12.0a alone repeated it
    assert r["evidence"]["built_for"] == "12.0a 12.0f" and "combined_attempt" not in r["evidence"], r["evidence"]
    assert fi_jit.arch_independent({"stage": "compile", "reason_code": "fi-link-no-libcuda"})
    assert not fi_jit.arch_independent({"stage": "compile", "reason_code": "nvcc-unsupported-arch"})
    assert not fi_jit.arch_independent({"stage": "compile", "reason_code": "fi-nvcc-error"})


def test_a_module_no_source_names_is_absent_without_importing_flashinfer(tmp_path: Path) -> None:
    site = _site(tmp_path, "site-0.6.16", version="0.6.16")  # the stand-in has vllm_comm's generator only
    (site / "flashinfer" / "__init__.py").write_text("raise RuntimeError('flashinfer was imported')\n")
    r = _fi_jit(site, "12.0a", tmp_path / "jit", module="pcie_ipc", CUDA_HOME="/usr/local/cuda")
    assert (r["status"], r["reason_code"]) == ("skip", "fi-module-absent"), r
    assert "gen_pcie_ipc" not in r["note"] and "0.6.16 has no pcie_ipc module" in r["note"]
    assert r["evidence"]["absent_by"] == "no Python source of this flashinfer names pcie_ipc's generator"
    # a module its sources do name goes to the builder, which imports flashinfer (here: and fails)
    named = _fi_jit(site, "12.0a", tmp_path / "jit", CUDA_HOME="/usr/local/cuda")
    assert (named["status"], named["evidence"]["stage"]) == ("fail", "import"), named
    assert "flashinfer was imported" in named["note"] + str(named["evidence"].get("error_tail", ""))


def test_an_older_nvcc_first_on_path_is_the_one_used(standin: Path, tmp_path: Path) -> None:
    old = tmp_path / "cu128" / "bin"
    old.mkdir(parents=True)
    (old / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    (old / "nvcc").chmod(0o755)
    r = _fi_jit(standin, "12.0", tmp_path / "jit", PATH=f"{old}{os.pathsep}{Path(sys.executable).parent}"
                f"{os.pathsep}{os.environ['PATH']}")
    assert (r["status"], r["reason_code"]) == ("fail", "fi-nvcc-too-old"), r
    assert (r["evidence"]["toolkit"]["found_by"], r["evidence"]["toolkit"]["version"]) == ("PATH", "12.8")


def test_arch_12_0_passes_with_flashinfers_sm_120f_and_a_rerun_is_a_cache_hit(standin: Path, tmp_path: Path) -> None:
    first = _fi_jit(standin, "12.0", tmp_path / "jit", CUDA_HOME="/usr/local/cuda")
    assert first["status"] == "pass", first
    assert first["evidence"]["targets_in_output"] == ["sm_120f"]
    assert first["evidence"]["toolkit"]["version"] == "13.0" and "cached" not in first["metrics"]
    again = _fi_jit(standin, "12.0", tmp_path / "jit", CUDA_HOME="/usr/local/cuda")
    assert again["status"] == "pass" and again["metrics"]["cached"] is True, again
    assert again["evidence"]["cached_from"]["toolkit"]["nvcc"] == NVCC
    assert again["evidence"]["cached_from"]["built_at"] in again["note"]


def test_output_without_cuda_code_does_not_pass(standin: Path, tmp_path: Path) -> None:
    r = _fi_jit(standin, "12.0a", tmp_path / "jit", CUDA_HOME="/usr/local/cuda", STANDIN_NO_DEVICE_CODE="1")
    assert (r["status"], r["reason_code"]) == ("partial", "fi-arch-unverified"), r


def test_a_one_step_build_is_read_back_too(standin: Path, tmp_path: Path) -> None:
    r = _fi_jit(standin, "12.0a", tmp_path / "jit", CUDA_HOME="/usr/local/cuda", STANDIN_ONE_STEP="1")
    assert r["status"] == "pass", r
    assert r["evidence"]["targets_in_output"] == ["sm_120a"] and r["evidence"]["one_step"] is True


# --- the shared compile cache, end to end through the worker -----------------------------------------------
def _site(tmp_path: Path, name: str, version: str = "0.6.18", header: str = STANDIN_HEADER) -> Path:
    site = tmp_path / name
    write_standin(site, version, header)
    return site


def _entries(store: Path) -> list[str]:
    return sorted(p.name for p in store.iterdir() if not p.name.startswith(".")) if store.is_dir() else []


def test_another_cell_with_the_same_sources_gets_the_cached_library(standin: Path, tmp_path: Path) -> None:
    store = tmp_path / "compile"
    cuda = {"CUDA_HOME": "/usr/local/cuda", "STACKPROBE_COMPILE_CACHE": str(store)}
    first = _fi_jit(standin, "12.0a", tmp_path / "jit-a", STACKPROBE_CELL_ID="cell-a", **cuda)
    assert first["status"] == "pass" and "cached" not in first["metrics"], first
    assert first["metrics"]["compile_cpu_s"] > 0  # nvcc's CPU seconds, counted through ninja
    [key] = _entries(store)
    assert first["evidence"]["cache_key"] == key
    # another cell: its own JIT workspace, its own site-packages, another flashinfer release, same bytes
    other = _site(tmp_path, "site-0.6.19", version="0.6.19")
    again = _fi_jit(other, "12.0a", tmp_path / "jit-b", STACKPROBE_CELL_ID="cell-b", **cuda)
    assert again["status"] == "pass" and again["metrics"]["cached"] is True, again
    assert "compile_s" not in again["metrics"] and "compile_cpu_s" not in again["metrics"]
    assert again["evidence"]["flashinfer"] == "0.6.19"
    origin = again["evidence"]["cached_from"]
    assert (origin["cell"], origin["flashinfer"], origin["arch_list"]) == ("cell-a", "0.6.18", "12.0a")
    assert f"from the compile cache, built {origin['built_at']} by cell-a with flashinfer 0.6.18" in again["note"]
    assert again["evidence"]["cache_key"] == key and _entries(store) == [key]
    assert _compile_cache.compiles(store) == {key: 1}  # the store's counter: compiled once, served twice
    # the proof is read from the cached library itself, not from a build directory that was never made
    assert again["evidence"]["targets_in_output"] == ["sm_120a"]
    assert not list((tmp_path / "jit-b").rglob("*.o")) and again["evidence"]["library"].startswith(str(store))


def _builds(store: Path) -> list[str]:
    """Every stored build, as key/manifest."""
    return sorted(f"{k}/{m}" for k in _entries(store) for m in _entries(store / k))


def test_one_changed_byte_in_a_header_the_module_reads_is_a_new_build(standin: Path, tmp_path: Path) -> None:
    store = tmp_path / "compile"
    cuda = {"CUDA_HOME": "/usr/local/cuda", "STACKPROBE_COMPILE_CACHE": str(store)}
    first = _fi_jit(standin, "12.0a", tmp_path / "jit-a", **cuda)
    assert first["evidence"]["cache_headers"] >= 1, first  # k.h and the toolkit's headers, from ninja -t deps
    changed = _site(tmp_path, "site-changed", header=STANDIN_HEADER.replace("1", "2"))
    second = _fi_jit(changed, "12.0a", tmp_path / "jit-b", **cuda)
    assert first["status"] == second["status"] == "pass", second
    assert "cached" not in second["metrics"]
    # same sources and flags (one key), another header: a second build under that key, and why the first missed
    assert second["evidence"]["cache_key"] == first["evidence"]["cache_key"]
    assert second["evidence"]["cache_entry"] != first["evidence"]["cache_entry"] and len(_builds(store)) == 2
    assert any("$SITE/flashinfer/data/include/k.h differs" in m for m in second["evidence"]["cache_misses"]), second


def test_a_release_that_changed_only_headers_the_module_does_not_read_shares_its_build(
        standin: Path, tmp_path: Path) -> None:
    store = tmp_path / "compile"
    cuda = {"CUDA_HOME": "/usr/local/cuda", "STACKPROBE_COMPILE_CACHE": str(store)}
    first = _fi_jit(standin, "12.0a", tmp_path / "jit-a", **cuda)
    other = _site(tmp_path, "site-0.7.0", version="0.7.0")
    (other / "flashinfer" / "data" / "include" / "attention.cuh").write_text("#define NEW_KERNEL 1\n")
    again = _fi_jit(other, "12.0a", tmp_path / "jit-b", **cuda)
    assert again["status"] == "pass" and again["metrics"]["cached"] is True, again
    assert again["evidence"]["cached_from"]["flashinfer"] == "0.6.18" and len(_builds(store)) == 1
    # a header of the same name earlier on the search path (the source's own folder) would be read instead
    shadow = _site(tmp_path, "site-shadow", version="0.7.1")
    (shadow / "flashinfer" / "data" / "csrc" / "k.h").write_text(STANDIN_HEADER)
    third = _fi_jit(shadow, "12.0a", tmp_path / "jit-c", **cuda)
    assert third["status"] == "pass" and "cached" not in third["metrics"], third
    assert any("csrc/k.h would be read instead" in m for m in third["evidence"]["cache_misses"]), third
    assert first["evidence"]["cache_key"] == again["evidence"]["cache_key"] == third["evidence"]["cache_key"]


def test_a_failed_build_is_not_cached(standin: Path, tmp_path: Path) -> None:
    store = tmp_path / "compile"
    cuda = {"CUDA_HOME": "/usr/local/cuda", "STACKPROBE_COMPILE_CACHE": str(store)}
    broken = _site(tmp_path, "site-broken", header="#define K_VALUE )\n")
    r = _fi_jit(broken, "12.0a", tmp_path / "jit", **cuda)
    assert (r["status"], r["reason_code"]) == ("fail", "fi-nvcc-error"), r
    assert _entries(store) == [] and "cache_key" in r["evidence"]  # the cache was asked, and got nothing
    ok = _fi_jit(standin, "12.0a", tmp_path / "jit", **cuda)
    assert ok["status"] == "pass" and _entries(store) == [ok["evidence"]["cache_key"]]
    again = _fi_jit(broken, "12.0a", tmp_path / "jit", **cuda)  # proven again: compiled, failed again
    assert (again["status"], again["evidence"]["stage"]) == ("fail", "compile") and "cached" not in again["metrics"]
    assert len(_entries(store)) == 1


def test_one_build_for_both_targets_each_judged_on_its_own_sass(standin: Path, tmp_path: Path) -> None:
    store = tmp_path / "compile"
    run = {"CUDA_HOME": "/usr/local/cuda", "STACKPROBE_COMPILE_CACHE": str(store),
           "STACKPROBE_FI_JIT_ARCHS": "12.0a 12.0f"}
    a = _fi_jit(standin, "12.0a", tmp_path / "jit", **run)
    assert a["status"] == "pass" and "cached" not in a["metrics"], a
    assert a["evidence"]["built_for"] == "12.0a 12.0f" and a["evidence"]["targets_in_output"] == ["sm_120a", "sm_120f"]
    f = _fi_jit(standin, "12.0f", tmp_path / "jit", **run)
    assert f["status"] == "pass" and f["metrics"]["cached"] is True, f
    assert f["evidence"]["built_for"] == "12.0a 12.0f" and f["evidence"]["cache_key"] == a["evidence"]["cache_key"]
    assert "for 12.0a 12.0f" in f["note"] and len(_entries(store)) == 1


def test_the_combined_build_is_handed_to_the_other_target_of_its_run(standin: Path, tmp_path: Path) -> None:
    """The second target's variant of one run and cell takes the first one's combined build without an
    interpreter of flashinfer: here its flashinfer cannot even be imported, and it still gets its verdict from
    the library's own SASS. Another run (token) or a library that is gone gets no handoff."""
    store = tmp_path / "compile"
    run = {"CUDA_HOME": "/usr/local/cuda", "STACKPROBE_COMPILE_CACHE": str(store), "STACKPROBE_CELL_ID": "cell-a",
           "STACKPROBE_FI_JIT_ARCHS": "12.0a 12.0f", "STACKPROBE_HANDOFF_TOKEN": "0123456789abcdef"}
    a = _fi_jit(standin, "12.0a", tmp_path / "jit-a", **run)
    assert a["status"] == "pass" and "cached" not in a["metrics"] and "handed_over" not in a["evidence"], a
    broken = tmp_path / "broken"
    shutil.copytree(standin, broken)
    init = broken / "flashinfer" / "__init__.py"
    init.write_text(init.read_text() + "\nraise ImportError('this flashinfer does not import')\n")
    f = _fi_jit(broken, "12.0f", tmp_path / "jit-f", **run)
    assert f["status"] == "pass" and f["metrics"] == {"cached": True, "library_bytes": a["metrics"]["library_bytes"]}, f
    assert f["evidence"]["handed_over"]["by_arch"] == "12.0a" and f["evidence"]["targets_in_output"] == [
        "sm_120a", "sm_120f"]
    assert f["evidence"]["cached_from"]["variant"] == "module=vllm_comm,arch=12.0a"
    assert f["evidence"]["cached_from"]["cell"] == "cell-a" and f["evidence"]["built_for"] == "12.0a 12.0f"
    assert "in this run by the variant module=vllm_comm,arch=12.0a of this cell" in f["note"]
    assert f["evidence"]["library"].startswith(str(store))  # the stored library, not a scratch build folder
    other_run = _fi_jit(broken, "12.0f", tmp_path / "jit-g", **{**run, "STACKPROBE_HANDOFF_TOKEN": "fedcba9876543210"})
    assert (other_run["status"], other_run["evidence"]["stage"]) == ("fail", "import"), other_run
    other_cell = _fi_jit(broken, "12.0f", tmp_path / "jit-h", **{**run, "STACKPROBE_CELL_ID": "cell-b"})
    assert other_cell["evidence"]["stage"] == "import" and "handed_over" not in other_cell["evidence"]
    Path(f["evidence"]["library"]).unlink()
    gone = _fi_jit(broken, "12.0f", tmp_path / "jit-i", **run)
    assert gone["evidence"]["stage"] == "import" and "handed_over" not in gone["evidence"], gone


def test_a_handoff_needs_a_token_and_a_finished_build(tmp_path: Path) -> None:
    from inenv.kit import _compile_cache as cc

    lib = tmp_path / "m.so"
    lib.write_bytes(b"\x7fELF")
    env = {cc.ENV: str(tmp_path / "store"), cc.CELL_ENV: "c", cc.RUN_ENV: "00112233aabbccdd"}
    done = {"ok": True, "library": str(lib), "module": "m"}
    for token in ("", "../../etc", "not-hex-at-all!"):
        assert not cc.hand_over("m", "12.0a 12.0f", done, {**env, cc.RUN_ENV: token})
    assert not cc.hand_over("m", "12.0a 12.0f", done, {**env, cc.ENV: ""})
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").rglob("*.json"))
    assert cc.hand_over("m", "12.0a 12.0f", done, env)
    assert cc.handed("m", "12.0a 12.0f", env)["library"] == str(lib)
    assert cc.handed("m", "12.0a", env) is None and cc.handed("other", "12.0a 12.0f", env) is None
    assert cc.hand_over("m", "9.0a 12.0a", {**done, "ok": False}, env)
    assert cc.handed("m", "9.0a 12.0a", env) is None  # a failure is proven again by each target
    old = tmp_path / "store" / cc.HANDOFF / "99999999aaaaaaaa"
    old.mkdir(parents=True)
    os.utime(old, (1.0, 1.0))
    assert cc.hand_over("m", "12.0a 12.0f", done, env) and not old.exists()  # an old run's folder is removed


def test_a_target_nvcc_refuses_falls_back_to_its_own_build(standin: Path, tmp_path: Path) -> None:
    # nvcc 13.0 dropped sm_70: the combined build fails, and each target gets its own answer
    run = {"CUDA_HOME": "/usr/local/cuda", "STACKPROBE_COMPILE_CACHE": str(tmp_path / "compile"),
           "STACKPROBE_FI_JIT_ARCHS": "7.0 12.0a"}
    ok = _fi_jit(standin, "12.0a", tmp_path / "jit", **run)
    assert ok["status"] == "pass" and ok["evidence"]["built_for"] == "12.0a", ok
    attempt = ok["evidence"]["combined_attempt"]
    assert (attempt["arch_list"], attempt["reason_code"]) == ("7.0 12.0a", "nvcc-unsupported-arch"), attempt
    bad = _fi_jit(standin, "7.0", tmp_path / "jit", **run)
    assert (bad["status"], bad["reason_code"]) == ("fail", "nvcc-unsupported-arch"), bad
    assert bad["evidence"]["built_for"] == "7.0"


def test_a_target_the_arch_gate_drops_is_answered_by_its_own_build(standin: Path, tmp_path: Path) -> None:
    # flashinfer keeps the targets of the majors a module supports: the combined build then succeeds without
    # 9.0a, and 9.0a's answer must be the gate's refusal, not "built without sm_90a"
    run = {"CUDA_HOME": "/usr/local/cuda", "STACKPROBE_COMPILE_CACHE": str(tmp_path / "compile"),
           "STACKPROBE_FI_JIT_ARCHS": "9.0a 12.0a", "STANDIN_SUPPORTED_MAJORS": "12"}
    ok = _fi_jit(standin, "12.0a", tmp_path / "jit", **run)
    assert ok["status"] == "pass" and ok["evidence"]["built_for"] == "9.0a 12.0a", ok
    gated = _fi_jit(standin, "9.0a", tmp_path / "jit", **run)
    assert (gated["status"], gated["reason_code"]) == ("fail", "fi-arch-gate"), gated
    assert gated["evidence"]["combined_attempt"]["reason_code"] == "fi-wrong-arch"
    assert gated["evidence"]["built_for"] == "9.0a"


def test_without_a_lasting_cache_each_target_builds_alone(standin: Path, tmp_path: Path) -> None:
    r = _fi_jit(standin, "12.0a", tmp_path / "jit", CUDA_HOME="/usr/local/cuda",
                STACKPROBE_FI_JIT_ARCHS="12.0a 12.0f", STACKPROBE_JIT_CACHE="")
    assert r["status"] == "pass" and r["evidence"]["built_for"] == "12.0a", r


@pytest.mark.parametrize(("arch", "listed", "combined"), [
    ("12.0a", "12.0a 12.0f", "12.0a 12.0f"),
    ("12.0f", "12.0a,12.0f", "12.0a 12.0f"),
    ("12.0a", "12.0a", ""),  # one target: nothing to share
    ("9.0a", "12.0a 12.0f", ""),  # not one of them
    ("12.0a", "sm_120a 12.0A 12.0f", "12.0a 12.0f"),  # spelt as gpuarch spells them, once each
    ("12.0a", "", ""),
])
def test_combined_arch_list(arch: str, listed: str, combined: str) -> None:
    assert fi_jit.combined_archs(arch, listed) == combined


def _checks_run(site: Path, tmp_path: Path, name: str, *flags: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "VIRTUAL_ENV", *RUN_ENV)}
    env.update(CUDA_HOME="/usr/local/cuda", CUDA_VISIBLE_DEVICES="", PYTHONPATH=f"{site}{os.pathsep}{ROOT}",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               STACKPROBE_FI_JIT_ONLY="vllm_comm@12.0a,vllm_comm@12.0f")
    proc = subprocess.run([sys.executable, "-m", "checks.cli", "run", "--backend", "local", "--python", sys.executable,
                           "--probe", "fi-jit", "--target-arch", "12.0a,12.0f", "--json", "--no-report",
                           "--results", str(tmp_path / name), *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sorted(json.loads(proc.stdout), key=lambda r: r["variant"])


def test_checks_run_shares_one_build_between_targets_through_its_cache(standin: Path, tmp_path: Path) -> None:
    store = tmp_path / "compile"
    a, f = _checks_run(standin, tmp_path, "cached", "--compile-cache", str(store))
    assert (a["variant"], f["variant"]) == ("ranks=1,module=vllm_comm,arch=12.0a",
                                            "ranks=1,module=vllm_comm,arch=12.0f")
    assert a["status"] == f["status"] == "pass", (a, f)
    assert "cached" not in a["metrics"] and f["metrics"]["cached"] is True
    assert a["evidence"]["built_for"] == f["evidence"]["built_for"] == "12.0a 12.0f"
    assert f["evidence"]["cached_from"]["cell"] == a["cell_id"] and len(_entries(store)) == 1
    a, f = _checks_run(standin, tmp_path, "fresh", "--no-compile-cache")
    assert a["status"] == f["status"] == "pass" and "cached" not in a["metrics"] | f["metrics"]
    assert (a["evidence"]["built_for"], f["evidence"]["built_for"]) == ("12.0a", "12.0f")


def test_the_next_target_of_a_combined_build_links_the_kept_objects(standin: Path, tmp_path: Path) -> None:
    # A toolkit without a libcuda stub: every object compiles, the link fails. The first target's variant
    # compiles for both targets once; the second one's combined build copies those objects in and only links.
    run = {"CUDA_HOME": "/usr/local/cuda", "STACKPROBE_COMPILE_CACHE": str(tmp_path / "compile"),
           "STACKPROBE_FI_JIT_ARCHS": "12.0a 12.0f", "STANDIN_LINK_FLAGS": "-lcuda", "STACKPROBE_JIT_CACHE": ""}
    first = _fi_jit(standin, "12.0a", tmp_path / "jit-a", **run)
    assert (first["status"], first["reason_code"]) == ("partial", "fi-link-no-libcuda"), first
    assert first["evidence"].get("objects_stored") is True, first
    assert first["metrics"]["compile_cpu_s"] > 0
    assert first["evidence"]["built_for"] == "12.0a 12.0f"
    second = _fi_jit(standin, "12.0f", tmp_path / "jit-b", **run)
    assert (second["status"], second["reason_code"]) == ("partial", "fi-link-no-libcuda"), second
    assert second["evidence"]["objects_cached"] is True and second["metrics"]["compile_cpu_s"] == 0.0
    assert "objects from the compile cache" in second["note"]
    assert not second["metrics"].get("cached")  # a failed link is never a cached pass


@pytest.mark.parametrize(("nvcc", "cxx", "code"), [
    ("$cuda_home/bin/nvcc", "no-such-c++", "fi-no-nvcc"),   # both missing: nvcc is named, always
    ("$cuda_home/bin/nvcc", "sh", "fi-no-nvcc"),
    ("/bin/sh", "no-such-c++", "fi-no-host-compiler"),
])
def test_missing_compilers_are_found_before_ninja_in_a_fixed_order(nvcc: str, cxx: str, code: str) -> None:
    """What a cell lacks is named by the ninja file's own tools, not by whichever compile job failed first."""
    from inenv.kit import _fi_build

    text = f"ninja_required_version = 1.3\ncuda_home = /nonexistent/cuda\ncxx = {cxx}\nnvcc = {nvcc}\n"
    missing = _fi_build.missing_tools(text)
    assert missing and all(m.endswith(": not found") for m in missing)
    assert _fi_build.classify_jit_error("\n".join(missing)) == code
    assert _fi_build.missing_tools("cuda_home = /bin\ncxx = sh\nnvcc = $cuda_home/sh\n") == []
    assert _fi_build.missing_tools("cxx = sh\nnvcc = $somewhere/bin/nvcc\n") == []  # only ninja knows that one


def test_one_compile_serves_the_carried_kernel_and_the_fi_jit_verdict(standin: Path, tmp_path: Path) -> None:
    """The kernel stage's build of a module for a cell's target list and fi-jit's build for the same list are
    one compile: whichever runs first, the other finds it in the compile cache (its counter says 1)."""
    store = tmp_path / "compile"
    base = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "VIRTUAL_ENV", *RUN_ENV)}
    env = {**base, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{base['PATH']}", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": f"{standin}{os.pathsep}{ROOT}", "CUDA_HOME": "/usr/local/cuda",
           "STACKPROBE_COMPILE_CACHE": str(store), "STACKPROBE_CELL_ID": "cell-a"}
    proc = subprocess.run([sys.executable, "-m", "inenv.carry", "vllm_comm", "--archs", "12.0a", "--out",
                           str(tmp_path / "kset")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith(_fi_carry.RESULT_PREFIX)]
    carried = json.loads(line[len(_fi_carry.RESULT_PREFIX):])
    assert carried["ok"] and carried["source_hash"], carried
    record = json.loads((tmp_path / "kset" / "vllm_comm" / "stackprobe-kernel.json").read_text())
    assert record["sources"] and all(n.startswith("$SITE/") for n in record["sources"])
    verdict = _fi_jit(standin, "12.0a", tmp_path / "jit", STACKPROBE_CELL_ID="cell-a", CUDA_HOME="/usr/local/cuda",
                      STACKPROBE_COMPILE_CACHE=str(store))
    assert verdict["status"] == "pass" and verdict["metrics"]["cached"] is True, verdict
    assert list(_compile_cache.compiles(store).values()) == [1]


# --- nvcc's split compile for builds for the local GPU ---------------------------------------------------
@pytest.mark.parametrize(("cpus", "threads"), [(1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (31, 7), (64, 8), (224, 8)])
def test_split_threads_take_a_quarter_of_the_cores_at_most_eight(cpus: int, threads: int) -> None:
    assert fi_jit.split_threads(cpus) == threads


def test_only_a_build_for_the_local_gpu_is_split_by_default_and_the_callers_value_stays(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STACKPROBE_NVCC_SPLIT", raising=False)
    monkeypatch.setattr(fi_jit, "usable_cpus", lambda: 16)
    assert fi_jit.build_env("local", "/c")["STACKPROBE_NVCC_SPLIT"] == "4"
    assert "STACKPROBE_NVCC_SPLIT" not in fi_jit.build_env("12.0a", "/c")
    monkeypatch.setenv("STACKPROBE_NVCC_SPLIT", "1")
    assert fi_jit.build_env("local", "/c")["STACKPROBE_NVCC_SPLIT"] == "1"


@pytest.mark.parametrize(("asked", "version", "flags", "nvcc_flags", "applied"), [
    ("4", "13.0", "", "", "-split-compile=4"),
    ("2", "12.8", "-lineinfo", "", "-lineinfo -split-compile=2"),
    ("1", "13.0", "", "", None),                 # one thread: nothing to split
    ("", "13.0", "", "", None),                  # not asked
    ("4", "11.7", "", "", None),                 # an nvcc without the flag
    ("4", None, "", "", None),                   # an nvcc that did not run
    ("4", "13.0", "-split-compile=0", "", None),  # the environment's own choice stays
    ("4", "13.0", "", "--split-compile 2", None),
])
def test_the_split_is_asked_of_flashinfer_only_where_nvcc_has_the_flag(
        monkeypatch: pytest.MonkeyPatch, asked: str, version: str | None, flags: str, nvcc_flags: str,
        applied: str | None) -> None:
    from inenv import toolkit
    from inenv.kit import _fi_build
    monkeypatch.setenv("STACKPROBE_NVCC_SPLIT", asked)
    monkeypatch.setenv("FLASHINFER_EXTRA_CUDAFLAGS", flags)
    monkeypatch.setenv("NVCC_APPEND_FLAGS", nvcc_flags)
    assert _fi_build.nvcc_split(toolkit.from_dict({**TK13, "version": version})) is (applied is not None)
    assert os.environ["FLASHINFER_EXTRA_CUDAFLAGS"] == (applied or flags)


@pytest.mark.parametrize(("text", "threads"), [
    ("cuda_cflags = -O3 -split-compile=4 -DX", 4), ("cuda_cflags = --split-compile 0", 0),
    ("cuda_cflags = -O3", None), ("cuda_cflags = -O3 -DSPLIT_COMPILE=3", None),
])
def test_the_split_a_build_used_is_read_from_its_ninja_file(text: str, threads: int | None) -> None:
    from inenv.kit import _fi_build
    assert _fi_build.split_of(text) == threads


def test_a_split_build_says_so_and_is_kept_apart_from_one_without(standin: Path, tmp_path: Path) -> None:
    store = tmp_path / "compile"
    cuda = {"CUDA_HOME": "/usr/local/cuda", "STACKPROBE_COMPILE_CACHE": str(store)}
    split = _fi_jit(standin, "12.0a", tmp_path / "jit", STACKPROBE_NVCC_SPLIT="2", **cuda)
    assert split["status"] == "pass" and split["evidence"]["split_compile"] == 2, split
    whole = _fi_jit(standin, "12.0a", tmp_path / "jit", STACKPROBE_NVCC_SPLIT="1", **cuda)
    assert whole["status"] == "pass" and "split_compile" not in whole["evidence"], whole
    assert "cached" not in whole["metrics"]  # the split build's objects and library are not this build's
    assert whole["evidence"]["cache_key"] != split["evidence"]["cache_key"]
    assert _entries(store) == sorted([split["evidence"]["cache_key"], whole["evidence"]["cache_key"]])


def test_a_compile_that_fails_only_when_split_is_answered_by_the_build_without_it(standin: Path,
                                                                                 tmp_path: Path) -> None:
    wrapper = tmp_path / "bin" / "nvcc"  # an nvcc whose split mode breaks; otherwise the real one
    wrapper.parent.mkdir()
    wrapper.write_text('#!/bin/sh\ncase "$*" in *split-compile*) '
                       'echo "k.cu(1): error: split mode broke" >&2; exit 1;; esac\n'
                       f'exec {NVCC} "$@"\n')
    wrapper.chmod(0o755)
    r = _fi_jit(standin, "12.0a", tmp_path / "jit", CUDA_HOME="/usr/local/cuda", FLASHINFER_NVCC=str(wrapper),
                STACKPROBE_NVCC_SPLIT="2")
    assert r["status"] == "pass", r
    assert "split_compile" not in r["evidence"]
    assert any("split mode broke" in line for line in r["evidence"]["split_compile_failed"]), r["evidence"]
