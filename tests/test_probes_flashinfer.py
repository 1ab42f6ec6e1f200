"""The flashinfer-side probes on a machine without a GPU: planning, pure checks, real fatbin reads, real
classification of flashinfer's own gate error, and (slow) a real JIT cross-compile for sm_120a."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from inenv.kit import _fatbin, _fi_build
from inenv.kit import _flashinfer as fi
from inenv.probe import HostView, Variant
from inenv.probes import custom_ar, ep_a2a, fi_fusion, fi_jit

ROOT = Path(__file__).resolve().parents[1]
NVCC = "/usr/local/cuda/bin/nvcc"
FLASHINFER = "0.6.18"


def test_probe_modules_import_without_torch() -> None:
    code = (
        "import sys; import inenv.probes.inventory, inenv.probes.fi_jit, inenv.probes.fi_fusion, "
        "inenv.probes.custom_ar, inenv.probes.ep_a2a, inenv.kit._fi_build, inenv.toolkit; "
        "print(sorted(m for m in ('torch', 'flashinfer', 'sgl_kernel') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- planning ------------------------------------------------------------------------------------------
def test_fi_jit_plans_every_module_and_arch_and_skips_local_without_gpu() -> None:
    vs = fi_jit.plan(HostView(gpu_count=0))
    assert len(vs) == len(fi.COMM_MODULES) * 3
    local = [v for v in vs if v.param("arch") == "local"]
    assert local and all(v.skip for v in local)
    assert all(v.skip is None for v in vs if v.param("arch") != "local")
    keys = {v.key for v in vs}
    assert "ranks=1,module=vllm_comm,arch=12.0f" in keys


def test_fi_jit_filter_keeps_only_named_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fi_jit.ONLY_ENV, "vllm_comm@12.0a, trtllm_comm@local")
    vs = fi_jit.variants(HostView(gpu_count=1, compute_capability="9.0"))
    assert [(v.param("module"), v.param("arch"), v.skip) for v in vs] == [
        ("vllm_comm", "12.0a", None),
        ("trtllm_comm", "local", None),
    ]


@pytest.mark.parametrize("gpus", [0, 1, 2, 8])
def test_multi_rank_probes_give_every_variant_a_plan(gpus: int) -> None:
    host = HostView(gpu_count=gpus)
    for mod in (fi_fusion, custom_ar, ep_a2a):
        vs = mod.variants(host)
        assert vs, mod.__name__
        for v in vs:
            assert isinstance(v, Variant) and v.probe_id == mod.SPEC.id
            separate_gpus = not v.share_gpu and v.param("mode") != "sim"
            if gpus == 0:
                assert v.skip, v.key
            elif separate_gpus and v.ranks > gpus:
                assert v.skip and f"host has {gpus}" in v.skip.note, v.key
            else:
                assert v.skip is None, v.key
    shared = [v for v in fi_fusion.variants(HostView(gpu_count=1)) if v.share_gpu]
    # the engine case (prefill sizes, quant-fused patterns, PDL on) at the smallest world size only
    assert [v.key for v in shared] == [*(f"ranks={n},placement=shared,gpus=1" for n in (2, 3, 4, 8)),
                                       "ranks=2,placement=shared,gpus=1,case=engine"]


# --- fi-jit verdicts on recorded build results -----------------------------------------------------------
LINK_FAIL = {
    "stage": "link",
    "flashinfer": FLASHINFER,
    "compile_s": 8.1,
    "error": "FAILED: [code=1] vllm_comm.so\n/usr/bin/ld: cannot find -lcuda: No such file or directory\n"
    "collect2: error: ld returned 1 exit status\n",
}
GATE = {"stage": "spec", "error": "RuntimeError: No supported CUDA architectures found for major versions [9, 10]."}


def test_link_failure_after_compile_is_partial_with_targets() -> None:
    o = fi_jit.verdict("vllm_comm", "12.0a", LINK_FAIL, ["sm_120a"])
    assert o["status"] == "partial" and o["reason_code"] == "fi-link-no-libcuda"
    assert "sm_120a" in o["note"] and o["metrics"]["compile_s"] == 8.1


def test_gate_is_fail_with_its_code() -> None:
    o = fi_jit.verdict("trtllm_comm", "12.0a", GATE, [])
    assert (o["status"], o["reason_code"]) == ("fail", "fi-arch-gate")
    assert "No supported CUDA architectures" in o["note"]


def test_absent_module_is_skip_and_wrong_arch_output_is_fail() -> None:
    assert fi_jit.verdict("pcie_ipc", "12.0a", {"stage": "absent", "flashinfer": "0.6.18"}, [])["status"] == "skip"
    o = fi_jit.verdict("vllm_comm", "12.0a", {"stage": "done"}, ["sm_90a"])
    assert (o["status"], o["reason_code"]) == ("fail", "fi-wrong-arch")
    assert fi_jit.verdict("vllm_comm", "12.0a", {"stage": "done"}, ["sm_120a"])["status"] == "pass"


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("RuntimeError: No supported CUDA architectures found for major versions [9, 10].", "fi-arch-gate"),
        ("RuntimeError: SM 12.x requires CUDA >= 12.9", "fi-nvcc-too-old"),
        ("nvcc fatal   : Unsupported gpu architecture 'compute_120f'", "nvcc-unsupported-arch"),
        ("/usr/bin/ld: cannot find -lcuda: No such file or directory", "fi-link-no-libcuda"),
        ("/usr/bin/ld: cannot find -lcuda", "fi-link-no-libcuda"),
        # flashinfer 0.6.18 with no CUDA_HOME and nvcc found as /usr/local/bin/nvcc links -L/usr/local/lib64
        ("/usr/bin/ld: cannot find -lcudart: No such file or directory", "fi-link-missing-lib"),
        # both missing (CUDA_HOME from a wrapper nvcc outside the toolkit): the runtime decides, not the stub
        ("/usr/bin/ld: cannot find -lcudart: No such file or directory\n"
         "/usr/bin/ld: cannot find -lcuda: No such file or directory", "fi-link-missing-lib"),
        ("OSError: vllm_comm.so: undefined symbol: cuPointerGetAttribute", "fi-link-unresolved"),
        ('foo.cu(12): error: identifier "x" is undefined', "fi-nvcc-error"),
        (
            "csrc/nv_internal/include/tensorrt_llm/common/cudaUtils.h:19:10: fatal error: cublasLt.h: No such file "
            "or directory",
            "fi-missing-header",
        ),
        # a cu128 image without a host compiler (recorded here): ninja stops at flashinfer's first .cpp file
        ("FAILED: [code=127] .../mnnvl_moe_alltoall/common_envUtils.o\n/bin/sh: 1: c++: not found\n"
         "ninja: build stopped: subcommand failed.", "fi-no-host-compiler"),
        ("something else entirely", "fi-jit-error"),
    ],
)
def test_jit_error_classification(text: str, code: str) -> None:
    assert _fi_build.classify_jit_error(text) == code


def _link_like_flashinfer(home: str, work: Path, nvcc: str) -> str:
    """Compile one object with ``nvcc`` and link it the way flashinfer's JIT does (``-L<home>/lib64
    -L<home>/lib64/stubs -lcudart -lcuda``); the linker's stderr."""
    (work / "k.cu").write_text("__global__ void k(int* p) { *p = 1; }\nvoid launch(int* p) { k<<<1, 1>>>(p); }\n")
    subprocess.run([nvcc, "-c", "k.cu", "-o", "k.o", "-Xcompiler", "-fPIC", "-arch=sm_90"], cwd=work, check=True,
                   capture_output=True)
    proc = subprocess.run(["c++", "-shared", "k.o", f"-L{home}/lib64", f"-L{home}/lib64/stubs", "-lcudart", "-lcuda",
                           "-o", "k.so"], cwd=work, capture_output=True, text=True)
    assert proc.returncode != 0, "this test needs a toolkit without a libcuda stub"
    return proc.stderr


@pytest.mark.skipif(not Path(NVCC).exists() or shutil.which("c++") is None, reason="needs nvcc at /usr/local/cuda")
def test_link_through_a_wrapper_nvcc_names_cuda_home_not_the_driver_stub(tmp_path: Path) -> None:
    """A wrapper script ``<dir>/bin/nvcc`` that execs the real nvcc: flashinfer takes ``<dir>`` as CUDA_HOME, so
    the real link misses libcudart as well as libcuda, and the verdict must send the user to CUDA_HOME rather
    than to a GPU host. Linked against the real toolkit root, only libcuda (no stub here) is missing."""
    from inenv import toolkit

    wrapper = tmp_path / "wrap" / "bin" / "nvcc"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f'#!/bin/sh\nexec {NVCC} "$@"\n')
    wrapper.chmod(0o755)
    tk = toolkit.with_version(toolkit.locate({"PATH": f"{wrapper.parent}:/usr/bin:/bin"}))
    assert (tk.cuda_home, tk.found_by) == (str(tmp_path / "wrap"), "PATH") and tk.version
    (tmp_path / "a").mkdir()
    err = _link_like_flashinfer(tk.cuda_home, tmp_path / "a", tk.nvcc)
    assert _fi_build.missing_libraries(err) == ["cudart", "cuda"]
    o = fi_jit.verdict("vllm_comm", "12.0a", {"stage": "link", "error": err, "toolkit": tk.as_dict()}, [])
    assert (o["status"], o["reason_code"]) == ("fail", "fi-link-missing-lib"), o
    assert "-lcudart, -lcuda" in o["note"] and f"{tmp_path / 'wrap'} (from PATH) is not a toolkit root" in o["note"]
    assert "CUDA_HOME" in fi_jit_remediation("fi-link-missing-lib")
    (tmp_path / "b").mkdir()
    root = str(Path(NVCC).resolve().parents[1])
    err = _link_like_flashinfer(root, tmp_path / "b", NVCC)
    assert _fi_build.missing_libraries(err) == ["cuda"]
    o = fi_jit.verdict("vllm_comm", "12.0a", {"stage": "link", "error": err}, [])
    assert (o["status"], o["reason_code"]) == ("partial", "fi-link-no-libcuda"), o


def fi_jit_remediation(code: str) -> str:
    from common import reasons

    return reasons.default().get(code).remediation


# --- fatbin headers, from real nvcc output --------------------------------------------------------------
@pytest.fixture(scope="module")
def objects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    if not os.access(NVCC, os.X_OK):
        pytest.skip("no nvcc at /usr/local/cuda")
    d = tmp_path_factory.mktemp("fatbin")
    src = d / "k.cu"
    src.write_text("__global__ void k(int* p) { *p = 1; }\n")
    flags = {
        "sm_90a": "-gencode=arch=compute_90a,code=sm_90a",
        "sm_120f": "-gencode=arch=compute_120f,code=sm_120f",
        "compute_90": "-gencode=arch=compute_90,code=compute_90",
        "sm_120": "-gencode=arch=compute_120,code=sm_120",
    }
    out = {}
    for name, flag in flags.items():
        obj = d / f"{name}.o"
        subprocess.run([NVCC, "-c", str(src), flag, "-o", str(obj)], check=True, capture_output=True)
        out[name] = str(obj)
    return out


def test_fatbin_reads_targets_nvcc_wrote(objects: dict[str, str]) -> None:
    for name, path in objects.items():
        assert list(_fatbin.entries(path)) == [name], name
    assert _fatbin.archs(objects.values()) == ["sm_90a", "compute_90", "sm_120", "sm_120f"]


def test_fatbin_on_a_file_without_cuda_code(tmp_path: Path) -> None:
    f = tmp_path / "plain.bin"
    f.write_bytes(b"\x7fELF" + b"\0" * 100)
    assert not _fatbin.entries(str(f))
    empty = tmp_path / "empty.so"
    empty.write_bytes(b"")
    assert _fatbin.archs([str(empty), str(tmp_path / "missing.so")]) == []


@pytest.mark.parametrize(
    ("targets", "cap", "ok"),
    [
        (["sm_90"], "9.0", True),
        (["sm_80"], "9.0", False),
        (["sm_90a"], "9.0", True),
        (["sm_90a"], "12.0", False),
        (["compute_90"], "12.0", True),
        (["compute_90a"], "12.0", False),
        (["sm_120f"], "12.1", True),
        (["sm_120a", "sm_121a"], "12.0", True),
        (["sm_100", "sm_100a"], "12.0", False),
        ([], "9.0", False),
    ],
)
def test_runs_on(targets: list[str], cap: str, ok: bool) -> None:
    assert _fatbin.runs_on(targets, cap) is ok


# --- numeric checks, on CPU tensors -----------------------------------------------------------------------
def test_ep_routing_two_distinct_experts_and_exact_checks() -> None:
    torch = pytest.importorskip("torch")
    ep, tpr, hidden = 4, 5, 16
    route = ep_a2a.routing(ep, tpr)
    assert all(len(set(c)) == 2 and all(0 <= e < ep * ep_a2a.EXPERTS_PER_RANK for e in c) for c in route)
    # What a correct dispatch delivers to each rank passes; a corrupted copy does not.
    from inenv.probes.epmoe import Received
    from tests.test_probes_fi_api import _delivered

    for rank in range(ep):
        good = _delivered(rank, ep, tpr, hidden, route)
        ids, hid, experts = good.raw_ids, good.hidden, good.experts
        assert ep_a2a.check_received(good, rank, ep, tpr, route) == ""
        if int(ids[0, 0]):
            bad = hid.clone()
            bad[0, 0, 0] += 1
            assert "hidden rows differ" in ep_a2a.check_received(Received(ids, bad, experts), rank, ep, tpr, route)
    ref = ep_a2a.combine_reference(1, tpr, hidden, route, "cpu")
    g = tpr  # first token of rank 1
    scale = sum(t + 1 for t in ep_a2a.targets(route[g]))
    assert torch.equal(ref[0], (ep_a2a.hidden_rows(torch.tensor([g]), hidden, "cpu")[0].float() * scale).bfloat16())


def test_fusion_reference_and_untouched_output() -> None:
    torch = pytest.importorskip("torch")
    from inenv.kit import _data

    shape = (4, fi_fusion.HIDDEN)
    total = _data.pattern_sum(shape, 2, 0)
    residual = _data.pattern(shape, 0, 1000)
    gamma = (1 + torch.arange(fi_fusion.HIDDEN) % 3).bfloat16()
    res_out, norm = fi_fusion.reference(total, residual, gamma)
    assert torch.equal(res_out.float(), total.float() + residual.float())  # integers: exact in bf16
    good = fi_fusion.norm_check(norm, norm)
    assert good["within_1ulp"] and good["exact_fraction"] == 1.0
    untouched = fi_fusion.norm_check(torch.full(shape, _data.SENTINEL).bfloat16(), norm)
    assert untouched["untouched"] and not untouched["within_1ulp"]


# --- real runs through the worker, without a GPU ----------------------------------------------------------
def _worker(python: str, probe: str, variant: dict, env: dict[str, str], timeout: float = 900) -> dict:
    proc = subprocess.run(
        [python, "-m", "inenv.worker", "--probe", probe, "--variant", json.dumps(variant), "--gpus", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@STACKPROBE-RESULT@@")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(lines[-1].split("@@STACKPROBE-RESULT@@", 1)[1])


def test_inventory_reports_torch_archs_from_the_binary_without_gpu() -> None:
    pytest.importorskip("torch")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = _worker(sys.executable, "inventory", {"probe_id": "inventory", "ranks": 1}, env, timeout=300)
    assert r["status"] == "pass", r
    archs = r["evidence"]["torch_binary_archs"]["lib/libtorch_cuda.so"]
    assert "sm_90" in archs and any(a.startswith("sm_120") for a in archs)
    assert "gpus" not in r["evidence"]


# sgl_kernel's own loader wraps the dynamic loader's error in a report of this shape (sgl_kernel/load_utils.py)
SGL_REPORT = """
[sgl_kernel] CRITICAL: Could not load any common_ops library!

Attempted locations:
1. Architecture-specific pattern: /opt/venv/lib/python3.12/site-packages/sgl_kernel/sm100/common_ops.* - found files: []

Error details from previous import attempts:
- ImportError: /opt/venv/sgl_kernel/sm100/common_ops.abi3.so: undefined symbol: _ZN3c104cuda9SetDeviceEa
- ModuleNotFoundError: No module named 'common_ops'
"""


def test_inventory_names_the_loader_line_of_an_sgl_kernel_import_failure() -> None:
    from inenv.probes import inventory

    line = inventory.import_error_line(SGL_REPORT)
    assert line.endswith("common_ops.abi3.so: undefined symbol: _ZN3c104cuda9SetDeviceEa")
    assert inventory.sgl_kernel_import_reason(SGL_REPORT) == "abi-mismatch"
    assert inventory.sgl_kernel_import_reason("ModuleNotFoundError: No module named 'sgl_kernel'") == "import-error"


def _standin_sgl_kernel(root: Path, c_source: str, link: list[str]) -> Path:
    """A package named sgl_kernel whose import dlopens a real shared object, as sgl-kernel's does; the
    loader's error is real, only the package is ours (the real wheels are several hundred MB)."""
    pkg = root / "site" / "sgl_kernel"
    pkg.mkdir(parents=True)
    (root / "ops.c").write_text(c_source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(pkg / "common_ops.abi3.so"), str(root / "ops.c"), *link],
                   check=True, cwd=root)
    (pkg / "__init__.py").write_text("from sgl_kernel import common_ops  # noqa\n")
    return root / "site"


@pytest.mark.parametrize("case", ["undefined-symbol", "no-driver"])
def test_inventory_imports_sgl_kernel_and_fails_on_a_loader_error(tmp_path: Path, case: str) -> None:
    pytest.importorskip("torch")
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    if case == "undefined-symbol":  # what a kernel built against another torch's C++ ABI hits
        site = _standin_sgl_kernel(tmp_path, "void _ZN3c1014gone_in_nightlyEv(void);\n"
                                   "void f(void) { _ZN3c1014gone_in_nightlyEv(); }\n", [])
    else:  # a kernel that links the driver, on a host without one
        drv = tmp_path / "drv"
        drv.mkdir()
        subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(drv / "libcuda.so.1"),
                        "-x", "c", "-"], input="void cuInit(void) {}\n", text=True, check=True)
        site = _standin_sgl_kernel(tmp_path, "void cuInit(void);\nvoid f(void) { cuInit(); }\n",
                                   [f"-L{drv}", "-l:libcuda.so.1"])
        (drv / "libcuda.so.1").unlink()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"}
    r = _worker(sys.executable, "inventory", {"probe_id": "inventory", "ranks": 1}, env, timeout=300)
    if case == "undefined-symbol":
        assert r["status"] == "fail" and r["reason_code"] == "abi-mismatch", r
        assert "undefined symbol: _ZN3c1014gone_in_nightlyEv" in r["note"]
        assert "undefined symbol" in r["evidence"]["sgl_kernel_import"]
    else:  # no driver: the loader stops before any symbol, and this kernel imports no torch symbol to judge
        assert (r["status"], r["reason_code"]) == ("skip", "no-gpu"), r
        assert "not proven" in r["note"] and "libcuda.so.1" in r["evidence"]["sgl_kernel_import"]


# What the real-JIT venv holds: torch with the few packages flashinfer's import needs, then flashinfer itself
# without its dependencies. The venv is named by a digest of these and the interpreter, so every test run
# reuses it (nothing downloaded) until one of them changes; uv links its files from its shared cache.
FI_STACK = ("torch==2.11.0", "numpy", "nvidia-ml-py", "tqdm", "requests", "packaging", "ninja")
FI_NO_DEPS = (f"flashinfer-python=={FLASHINFER}", "apache-tvm-ffi==0.1.15.post2")


def fi_venv_key() -> str:
    spec = [*FI_STACK, "--no-deps", *FI_NO_DEPS, sys.version.split()[0]]
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:12]


@pytest.fixture(scope="module")
def fi_python() -> str:
    """A venv with torch (from the uv cache) and flashinfer with the few packages its import needs, made once
    per install spec and kept under .cache/ for later runs."""
    if not os.access(NVCC, os.X_OK) or shutil.which("uv") is None:
        pytest.skip("needs nvcc at /usr/local/cuda and uv")
    venv = ROOT / ".cache" / f"fi-venv-{FLASHINFER}-{fi_venv_key()}"
    python = venv / "bin" / "python"
    marker = venv / ".ready"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # xdist workers share this venv; one builds it
        _build_venv(venv, marker)
    return str(python)


def _build_venv(venv: Path, marker: Path) -> None:
    if marker.exists():
        return
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run(["uv", "venv", "-q", str(venv), "--python", sys.executable], check=True)
    env = {**os.environ, "VIRTUAL_ENV": str(venv)}
    pip = ["uv", "pip", "install", "-q"]
    subprocess.run([*pip, *FI_STACK], check=True, env=env)
    subprocess.run([*pip, "--no-deps", *FI_NO_DEPS], check=True, env=env)
    marker.write_text("ok\n")
    for old in venv.parent.glob("fi-venv-*"):  # venvs of other specs: no test of this checkout uses them
        if old != venv and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def _fi_env(tmp_path: Path, python: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env.update(
        {
            "CUDA_VISIBLE_DEVICES": "",
            "STACKPROBE_JIT_CACHE": str(tmp_path / "jit"),
            "PATH": f"{Path(python).parent}{os.pathsep}{env['PATH']}",
            "PYTHONPATH": str(ROOT),
            # As the images set it. Without it flashinfer takes the home of the first nvcc on PATH: here a
            # wrapper in /usr/local/bin, so it links -L/usr/local/lib64 and finds no libcudart.
            "CUDA_HOME": str(Path(NVCC).parents[1]),
        }
    )
    return env


@pytest.mark.slow
def test_fi_jit_real_gate_refusal(fi_python: str, tmp_path: Path) -> None:
    """flashinfer's own trtllm gate, raised by the real generator for an architecture it excludes."""
    variant = {"probe_id": "fi-jit", "ranks": 1, "params": [["module", "trtllm_comm"], ["arch", "8.0"]]}
    r = _worker(fi_python, "fi-jit", variant, _fi_env(tmp_path, fi_python), timeout=300)
    assert (r["status"], r["reason_code"]) == ("fail", "fi-arch-gate"), r
    assert r["evidence"]["flashinfer"] == FLASHINFER


@pytest.mark.slow
def test_fi_jit_real_cuda_home_without_nvcc(fi_python: str, tmp_path: Path) -> None:
    """CUDA_HOME at a directory laid out like the nvidia-cuda-nvcc-cu12 wheel (ptxas, no nvcc): flashinfer
    itself fails to compile there, and so does fi-jit (it does not fall back to /usr/local/cuda)."""
    wheel = tmp_path / "cuda_nvcc"
    (wheel / "bin").mkdir(parents=True)
    shutil.copy(Path(NVCC).with_name("ptxas"), wheel / "bin" / "ptxas")
    variant = {"probe_id": "fi-jit", "ranks": 1, "params": [["module", "vllm_comm"], ["arch", "12.0a"]]}
    r = _worker(fi_python, "fi-jit", variant, {**_fi_env(tmp_path, fi_python), "CUDA_HOME": str(wheel)}, timeout=300)
    assert (r["status"], r["reason_code"]) == ("fail", "fi-no-nvcc"), r
    assert f"{wheel}/bin/nvcc: not found" in r["note"]
    assert r["evidence"]["flashinfer_cuda_home"] == str(wheel) == r["evidence"]["toolkit"]["cuda_home"]


def _stub(directory: Path, symbols: list[str]) -> Path:
    """A link-time libcuda.so with the driver's soname exporting ``symbols``."""
    directory.mkdir(parents=True, exist_ok=True)
    src = directory / "stub.c"
    src.write_text("".join(f"void {name}(void){{}}\n" for name in symbols))
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(directory / "libcuda.so"), str(src)],
        check=True,
    )
    return directory


def _driver_api() -> list[str]:
    import re

    text = (Path(NVCC).parents[1] / "include" / "cuda.h").read_text(errors="replace")
    return sorted(set(re.findall(r"\bcu[A-Z][A-Za-z0-9_]*\b", text)))


@pytest.mark.slow
def test_fi_jit_real_cross_compile_for_sm120a(fi_python: str, tmp_path: Path) -> None:
    """The smallest comm module, really compiled for sm_120a with the host's nvcc 13.0 (about 15 s), then
    linked three ways: without a libcuda stub (partial), against a stub that lacks the driver function
    vllm_comm calls (the linker drops libcuda.so.1: fail), and against a driver-API stub (pass)."""
    if Path("/usr/local/cuda/lib64/stubs/libcuda.so").exists() or shutil.which("gcc") is None:
        pytest.skip("needs a toolkit without its own libcuda stub (it is searched before LIBRARY_PATH) and gcc")
    variant = {"probe_id": "fi-jit", "ranks": 1, "params": [["module", "vllm_comm"], ["arch", "12.0a"]]}
    env = _fi_env(tmp_path, fi_python)
    r = _worker(fi_python, "fi-jit", variant, env)
    assert (r["status"], r["reason_code"]) == ("partial", "fi-link-no-libcuda"), r
    assert r["evidence"]["targets_in_output"] == ["sm_120a"]
    assert any("compute_120a" in g for g in r["evidence"]["gencode"])
    assert r["metrics"]["compile_s"] > 0

    env["LIBRARY_PATH"] = str(_stub(tmp_path / "one", ["cuGetErrorString"]))
    r = _worker(fi_python, "fi-jit", variant, env)
    assert (r["status"], r["reason_code"]) == ("fail", "fi-link-unresolved"), r
    assert "cuPointerGetAttribute" in r["note"] and "libcuda.so.1" not in r["evidence"]["needed"]

    for so in (tmp_path / "jit").rglob("vllm_comm.so"):
        so.unlink()  # ninja does not see a new stub; relink from the same objects
    env["LIBRARY_PATH"] = str(_stub(tmp_path / "full", _driver_api()))
    r = _worker(fi_python, "fi-jit", variant, env)
    assert r["status"] == "pass", r
    assert "libcuda.so.1" in r["evidence"]["needed"] and "cuPointerGetAttribute" in r["evidence"]["driver_calls"]
    assert r["evidence"]["targets_in_output"] == ["sm_120a"]


@pytest.mark.slow
def test_fi_jit_real_arch_12_0_is_sm_120f_and_a_rerun_is_cached(fi_python: str, tmp_path: Path) -> None:
    """flashinfer 0.6.18 turns FLASHINFER_CUDA_ARCH_LIST=12.0 into sm_120f with nvcc 13.0: a pass (it was
    failed as fi-wrong-arch); the second run compiles nothing and says so."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc for the libcuda stub")
    variant = {"probe_id": "fi-jit", "ranks": 1, "params": [["module", "vllm_comm"], ["arch", "12.0"]]}
    env = {**_fi_env(tmp_path, fi_python), "LIBRARY_PATH": str(_stub(tmp_path / "full", _driver_api()))}
    r = _worker(fi_python, "fi-jit", variant, env)
    assert r["status"] == "pass", r
    assert r["evidence"]["targets_in_output"] == ["sm_120f"] and "cached" not in r["metrics"]
    again = _worker(fi_python, "fi-jit", variant, env)
    assert again["status"] == "pass" and again["metrics"]["cached"] is True, again
    assert again["evidence"]["cached_from"]["toolkit"]["version"] == "13.0"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build small shared objects")
def test_elf_linkage_tells_a_kept_libcuda_dependency_from_a_dropped_one(tmp_path: Path) -> None:
    from inenv.kit import _elf

    src = tmp_path / "mod.c"
    src.write_text(
        "extern int cuPointerGetAttribute(void*, int, unsigned long long);\n"
        "extern int cudaGetDevice(int*);\n"
        "__attribute__((weak)) extern int cuWeakOne(void);\n"
        "int f(void) { int d; cudaGetDevice(&d); return cuPointerGetAttribute(0, 0, 0) + (cuWeakOne ? 1 : 0); }\n"
    )
    one = _stub(tmp_path / "one", ["cuGetErrorString"])
    full = _stub(tmp_path / "full", ["cuGetErrorString", "cuPointerGetAttribute"])

    def build(stub: Path, name: str) -> Path:
        out = tmp_path / name
        cmd = ["gcc", "-shared", "-fPIC", "-Wl,--as-needed", "-o", str(out), str(src), f"-L{stub}", "-lcuda"]
        subprocess.run(cmd, check=True)
        return out

    dropped = _elf.linkage(str(build(one, "dropped.so")))
    kept = _elf.linkage(str(build(full, "kept.so")))
    assert dropped is not None and kept is not None
    assert "libcuda.so.1" not in dropped.needed and "libcuda.so.1" in kept.needed
    assert dropped.driver_calls() == ("cuPointerGetAttribute",)  # the runtime's cudaGetDevice and weak refs aside
    assert dropped.unresolved_driver_calls() == ("cuPointerGetAttribute",)
    assert kept.unresolved_driver_calls() == ()
    assert "cudaGetDevice" in dropped.undefined and "cuWeakOne" not in dropped.undefined
    assert _elf.linkage(str(src)) is None  # not ELF


def test_unresolved_driver_calls_and_load_failure_are_fail() -> None:
    done = {"stage": "done", "unresolved_driver_calls": ["cuPointerGetAttribute"], "needed": ["libc.so.6"]}
    o = fi_jit.verdict("vllm_comm", "12.0a", done, ["sm_120a"])
    assert (o["status"], o["reason_code"]) == ("fail", "fi-link-unresolved") and "cuPointerGetAttribute" in o["note"]
    load = {"stage": "load", "error": "RuntimeError: vllm_comm.so: undefined symbol: cuPointerGetAttribute"}
    o = fi_jit.verdict("vllm_comm", "local", load, ["sm_90a"])
    assert (o["status"], o["reason_code"]) == ("fail", "fi-link-unresolved")
    assert o["note"].startswith("vllm_comm for local: built but failed to load")


def _stop_worker(rank: int, world: int, init_file: str, queue: object) -> None:
    import torch.distributed as dist

    from inenv.kit._lockstep import stop_together
    from inenv.probe import outcome

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    first = stop_together(None)
    local = outcome("partial", note="graph failed on rank 1", reason_code="x") if rank == 1 else None
    if rank == 2:
        local = outcome("fail", note="rank 2 broke", reason_code="y")
    second = stop_together(local)
    queue.put((rank, first, second))  # type: ignore[attr-defined]
    dist.destroy_process_group()


def test_stop_together_gives_every_rank_the_worst_early_verdict(tmp_path: Path) -> None:
    """Real gloo ranks: nobody stops when all go on; when two stop, all three stop with the worst."""
    pytest.importorskip("torch")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_stop_worker, args=(r, 3, str(tmp_path / "init"), queue)) for r in range(3)]
    for p in procs:
        p.start()
    got = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for _rank, first, second in got:
        assert first is None
        assert (second["status"], second["reason_code"], second["note"]) == ("fail", "y", "rank 2 broke")


def test_a_failed_edge_is_found_under_the_commands_ninja_prints_after_it() -> None:
    """flashinfer 0.7.4's moe_a2a with a toolkit that lacks cuRAND's headers, as ninja printed it with four
    jobs in flight: the other edges' nvcc command lines (1.5 kB each) fill the tail after the failure."""
    command = "/usr/local/cuda/bin/nvcc --generate-dependencies-with-compile " + "-I/opt/x/include " * 120
    failed = ("FAILED: [code=1] /tmp/ws/nvlink_one_sided_alltoall/communication_moeAlltoAllKernels.cuda.o\n"
              f"{command}-c moeAlltoAllKernels.cu\n"
              "In file included from .../tensorrt_llm/kernels/quantization.cuh:27,\n"
              ".../tensorrt_llm/common/reduceKernelUtils.cuh:27:10: fatal error: curand_kernel.h: "
              "No such file or directory\n   27 | #include <curand_kernel.h>\ncompilation terminated.\n")
    log = (f"[1/7] {command}-c a.cu\n" + failed + f"[3/7] {command}-c b.cu\n[4/7] {command}-c c.cu\n"
           "ninja: build stopped: subcommand failed.\n")
    assert "curand" not in log[-3000:]  # the log's last 3000 characters miss the cause
    excerpt = _fi_build.failure_excerpt(log)
    assert _fi_build.classify_jit_error(excerpt) == "fi-missing-header"
    assert excerpt.startswith("FAILED: [code=1]") and excerpt.endswith("ninja: build stopped: subcommand failed.")
    assert "fatal error: curand_kernel.h" in excerpt and len(excerpt) < 1000
    assert _fi_build.failure_excerpt("no ninja here") == "no ninja here"


def _flashinfer_with_own_aot(python: str, site: Path) -> Path:
    """A flashinfer package in ``site`` made of links to the venv's, with an ``data/aot`` folder of its own (as
    a cell's is): the carried modules of one test never reach the shared venv. Returns that AOT folder."""
    real = Path(subprocess.run([python, "-c", "import importlib.util as u; "
                                "print(list(u.find_spec('flashinfer').submodule_search_locations)[0])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    pkg = site / "flashinfer"
    pkg.mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name != "data":
            (pkg / entry.name).symlink_to(entry)
    (pkg / "data").mkdir()
    for entry in (real / "data").iterdir():
        if entry.name != "aot":
            (pkg / "data" / entry.name).symlink_to(entry)
    (pkg / "data" / "aot").mkdir()
    return pkg / "data" / "aot"


@pytest.mark.slow
def test_carried_module_is_built_by_the_kernel_builder_and_answers_fi_jit(fi_python: str, tmp_path: Path) -> None:
    """The kernel builder compiles vllm_comm for 12.0a into a kernel set (record and library); installed in the
    cell's AOT folder, fi-jit's 12.0a variant answers from it without compiling, and its 12.0f variant, which
    the carried library holds no SASS for, compiles as usual."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc for the libcuda stub")
    env = {**_fi_env(tmp_path, fi_python), "LIBRARY_PATH": str(_stub(tmp_path / "full", _driver_api())),
           "STACKPROBE_COMPILE_CACHE": str(tmp_path / "store")}
    kset = tmp_path / "kernels"
    proc = subprocess.run([fi_python, "-m", "inenv.carry", "vllm_comm", "--archs", "12.0a", "--out", str(kset)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("@@FI-CARRY@@ "))
    got = json.loads(line.split(" ", 1)[1])
    assert got["ok"] is True and got["sass"] == ["sm_120a"], got
    record = json.loads((kset / "vllm_comm" / "stackprobe-kernel.json").read_text())
    assert (record["module"], record["arch_list"], record["flashinfer"]) == ("vllm_comm", "12.0a", FLASHINFER)
    assert record["toolkit"]["version"] == "13.0" and "libcuda.so.1" in record["needed"]

    aot = _flashinfer_with_own_aot(fi_python, tmp_path / "site")
    shutil.copytree(kset / "vllm_comm", aot / "vllm_comm")
    env["PYTHONPATH"] = f"{tmp_path / 'site'}{os.pathsep}{ROOT}"
    env.pop("STACKPROBE_COMPILE_CACHE")  # nothing to find there: what answers is the carried module
    variant = {"probe_id": "fi-jit", "ranks": 1, "params": [["module", "vllm_comm"], ["arch", "12.0a"]]}
    r = _worker(fi_python, "fi-jit", variant, env)
    assert r["status"] == "pass", r
    assert r["evidence"]["carried"] == str(aot / "vllm_comm" / "vllm_comm.so")
    assert r["evidence"]["targets_in_output"] == ["sm_120a"] and r["metrics"]["cached"] is True
    assert r["note"].startswith("carried:") and "nothing compiled here" in r["note"]
    assert not list((tmp_path / "jit").rglob("*.o")), "a carried answer compiles nothing"

    other = {"probe_id": "fi-jit", "ranks": 1, "params": [["module", "vllm_comm"], ["arch", "12.0f"]]}
    r = _worker(fi_python, "fi-jit", other, env)
    assert r["status"] == "pass" and "carried" not in r["evidence"], r
    assert r["evidence"]["targets_in_output"] == ["sm_120f"] and r["metrics"]["compile_s"] > 0


HEADER_FAIL = {
    "stage": "compile", "flashinfer": FLASHINFER,
    "error": "csrc/trtllm_allreduce.cu:3:10: fatal error: cuda_runtime.h: No such file or directory\n",
    "toolkit": {"nvcc": "/opt/cuda-13.0/bin/nvcc", "cuda_home": "/usr", "found_by": "PATH"},
}


def test_a_missing_header_from_another_toolkit_root_names_the_root_and_the_fix() -> None:
    """flashinfer took CUDA_HOME=/usr (a wrapper nvcc on PATH), the nvcc that ran lives in /opt/cuda-13.0: the
    cause is the root, not a toolkit without headers."""
    wrong = fi_jit.verdict("trtllm_comm", "12.0a", {**HEADER_FAIL, "flashinfer_cuda_home": "/usr",
                                                    "nvcc_root": "/opt/cuda-13.0"}, [])
    assert (wrong["status"], wrong["reason_code"]) == ("fail", "fi-toolkit-root")
    assert "under /usr (its CUDA_HOME)" in wrong["note"] and "set CUDA_HOME=/opt/cuda-13.0" in wrong["note"]
    assert wrong["evidence"]["nvcc_root"] == "/opt/cuda-13.0"
    same = fi_jit.verdict("trtllm_comm", "12.0a", {**HEADER_FAIL, "flashinfer_cuda_home": "/opt/cuda-13.0/",
                                                   "nvcc_root": "/opt/cuda-13.0"}, [])
    assert same["reason_code"] == "fi-missing-header"  # one toolkit, and it lacks the header
    unknown = fi_jit.verdict("trtllm_comm", "12.0a", HEADER_FAIL, [])
    assert unknown["reason_code"] == "fi-missing-header"  # nothing recorded says where either lives


def test_a_link_without_the_libcuda_stub_names_where_cuda_home_came_from() -> None:
    o = fi_jit.verdict("vllm_comm", "12.0a", {**LINK_FAIL, "toolkit": {"nvcc": "/usr/local/cuda/bin/nvcc",
                                                                      "cuda_home": "/usr/local/cuda",
                                                                      "found_by": "default"}}, ["sm_120a"])
    assert o["reason_code"] == "fi-link-no-libcuda"
    assert "(/usr/local/cuda, CUDA_HOME from default) has no libcuda.so stub" in o["note"]
