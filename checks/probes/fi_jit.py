"""fi-jit: does each flashinfer comm module compile for this GPU, and cross-compile for a target arch?

Each variant builds one JIT module (vllm_comm, trtllm_comm, moe_a2a, pcie_ipc) for one architecture with
the environment's own nvcc, in a fresh interpreter (flashinfer fixes its arch list at import). ``arch=local``
lets flashinfer pick the architecture of the visible GPU itself, the path a user takes; any other value is
passed as ``FLASHINFER_CUDA_ARCH_LIST`` (no GPU needed). Compile and link are reported apart: a toolkit
without a ``libcuda.so`` stub compiles every object but cannot link, which is ``partial``. The objects
are then read back to prove they hold code for the requested architecture, and the library's dynamic
dependencies to prove it can load: driver calls (``cu*``) need a ``libcuda.so.1`` dependency, which the
linker drops when the link stub does not export them. For ``arch=local`` the module is also loaded.

Planning filter: ``STACKPROBE_FI_JIT_ONLY="vllm_comm@12.0a,trtllm_comm@local"`` keeps only those pairs
(CI compiles the smallest module for one arch). JIT cache: ``STACKPROBE_JIT_CACHE`` (reused between runs),
else the variant's scratch directory.
"""

from __future__ import annotations

import glob
import os
import re
import sys
from pathlib import Path
from typing import Any

from checks.probe import HostView, ProbeSpec, RankContext, Skip, Variant, outcome
from checks.probes import _fatbin
from checks.probes import _flashinfer as fi

SPEC = ProbeSpec(
    id="fi-jit",
    title="flashinfer comm JIT (local GPU and cross-compile)",
    feature="Do flashinfer's allreduce-fusion, custom-AR, MoE-A2A and PCIe-IPC modules compile for my GPU "
    "and for a target architecture such as sm_120, with this environment's nvcc?",
    ranks=(1,),
    requires=("flashinfer",),
    needs_gpu=False,
    timeout_s=1500.0,
)

ONLY_ENV = "STACKPROBE_FI_JIT_ONLY"
CACHE_ENV = "STACKPROBE_JIT_CACHE"
LOCAL = "local"


def plan(host: HostView, modules: tuple[str, ...] = fi.COMM_MODULES, only: str = "") -> list[Variant]:
    wanted = {tuple(p.strip().split("@", 1)) for p in only.split(",") if "@" in p}
    out: list[Variant] = []
    for module in modules:
        for arch in (LOCAL, *host.target_archs):
            if wanted and (module, arch) not in wanted:
                continue
            params = (("module", module), ("arch", arch))
            no_gpu = arch == LOCAL and not host.gpu_count
            skip = Skip("no-gpu", "no GPU on this host: only cross-compile targets run") if no_gpu else None
            out.append(Variant(SPEC.id, 1, params=params, skip=skip))
    return out


def variants(host: HostView) -> list[Variant]:
    return plan(host, only=os.environ.get(ONLY_ENV, ""))


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def _cuda_home() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return home
    import shutil

    nvcc = shutil.which("nvcc")
    return str(Path(nvcc).resolve().parents[1]) if nvcc else None


def build_env(arch: str, cuda_home: str, cache: str) -> dict[str, str]:
    env = dict(os.environ)
    env["CUDA_HOME"] = cuda_home
    env["FLASHINFER_WORKSPACE_BASE"] = cache
    env["PATH"] = os.pathsep.join([os.path.join(cuda_home, "bin"), os.path.dirname(sys.executable), env["PATH"]])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_repo_root(), env.get("PYTHONPATH", "")) if p)
    if arch == LOCAL:
        env.pop("FLASHINFER_CUDA_ARCH_LIST", None)  # flashinfer's own detection is what is under test
    else:
        env["FLASHINFER_CUDA_ARCH_LIST"] = arch
    return env


def _objects_targets(result: dict[str, Any]) -> list[str]:
    lib = result.get("library") or ""
    if lib and os.path.exists(lib):
        return _fatbin.archs([lib])
    build_dir = result.get("build_dir") or ""
    return _fatbin.archs(glob.glob(os.path.join(build_dir, "*.o"))) if build_dir else []


def _expected_sass(arch: str) -> str:
    """``12.0a`` -> ``sm_120a``; ``9.0`` -> ``sm_90``."""
    base, suffix = (arch[:-1], arch[-1]) if arch[-1] in "af" else (arch, "")
    major, minor = base.split(".")
    return f"sm_{int(major) * 10 + int(minor)}{suffix}"


def _headline(lines: list[str]) -> str:
    """The first error line from its error keyword on (compiler lines start with long paths)."""
    line = lines[0]
    m = re.search(r"(?:fatal )?error\b.*|\w*Error\b.*", line)
    return (m.group(0) if m else line)[:300]


def verdict(module: str, arch: str, result: dict[str, Any], targets: list[str]) -> dict[str, Any]:
    """Map one build result to an outcome; pure, so it is tested on recorded results."""
    stage = result.get("stage", "")
    err = str(result.get("error", ""))
    metrics = {k: result[k] for k in ("compile_s", "link_s", "library_bytes", "objects") if k in result}
    evidence: dict[str, Any] = {
        "module": module,
        "arch": arch,
        "flashinfer": result.get("flashinfer"),
        "nvcc": result.get("nvcc"),
        "local_capability": result.get("local_capability"),
        "gencode": result.get("gencode", []),
        "stage": stage,
        "targets_in_output": targets,
    }
    if err:
        evidence["error_lines"] = fi.error_lines(err)
        evidence["error_tail"] = err[-1500:]
    if stage == "absent":
        return outcome(
            "skip",
            note=f"flashinfer {result.get('flashinfer')} has no {module} module",
            reason_code="fi-module-absent",
            evidence=evidence,
        )
    for key in ("needed", "driver_calls", "loaded"):
        if key in result:
            evidence[key] = result[key]
    if stage == "done":
        unresolved = result.get("unresolved_driver_calls") or []
        if unresolved:
            return outcome(
                "fail",
                note=f"built, but it calls {len(unresolved)} CUDA driver function(s) ({', '.join(unresolved[:3])}) "
                "with no libcuda.so.1 dependency: it will not load where libcuda is loaded privately, as the "
                "CUDA runtime does (the link-time libcuda stub lacks those symbols)",
                reason_code="fi-link-unresolved",
                metrics=metrics,
                evidence=evidence,
            )
        if arch != LOCAL and targets and _expected_sass(arch) not in targets:
            return outcome(
                "fail",
                note=f"built, but the library holds {targets}, not {_expected_sass(arch)}",
                reason_code="fi-wrong-arch",
                metrics=metrics,
                evidence=evidence,
            )
        local = result.get("local_capability")
        if arch == LOCAL and local and targets and not _fatbin.runs_on(targets, local):
            return outcome(
                "fail",
                note=f"built, but the library holds {targets}: nothing runs on {local}",
                reason_code="fi-wrong-arch",
                metrics=metrics,
                evidence=evidence,
            )
        return outcome("pass", metrics=metrics, evidence=evidence)
    code = fi.classify_jit_error(err)
    first = _headline(fi.error_lines(err) or [err.strip().splitlines()[-1] if err.strip() else stage])
    if stage == "link" and code == "fi-link-no-libcuda":
        return outcome(
            "partial",
            note=f"every object compiled for {', '.join(targets) or arch}; the final link failed: this toolkit "
            "has no libcuda.so stub (lib64/stubs), which a GPU host's driver provides",
            reason_code=code,
            metrics=metrics,
            evidence=evidence,
        )
    where = {
        "spec": "refused before compiling",
        "compile": "compile failed",
        "link": "link failed",
        "load": "built but failed to load",
        "import": "import flashinfer failed",
        "timeout": "timed out",
        "crash": "builder crashed",
    }.get(stage, stage)
    return outcome(
        "fail", note=f"{module} for {arch}: {where}: {first}", reason_code=code, metrics=metrics, evidence=evidence
    )


def run(ctx: RankContext) -> dict[str, Any]:
    module = ctx.param("module") or "vllm_comm"
    arch = ctx.param("arch") or LOCAL
    if module not in fi.JIT_GENERATORS:
        return outcome("fail", note=f"unknown module {module!r}", reason_code="probe-bug")
    cuda_home = _cuda_home()
    if cuda_home is None:
        return outcome(
            "skip", note="no nvcc in this environment: flashinfer cannot JIT anything here", reason_code="fi-no-nvcc"
        )
    local_cc = None
    if arch == LOCAL:
        import torch

        if not torch.cuda.is_available():
            return outcome("skip", note="no GPU visible: nothing local to compile for", reason_code="no-gpu")
        major, minor = torch.cuda.get_device_capability(0)
        local_cc = f"{major}.{minor}"
    cache = os.environ.get(CACHE_ENV) or str(ctx.workdir / "jit-cache")
    os.makedirs(cache, exist_ok=True)
    env = build_env(arch, cuda_home, cache)
    ctx.log(f"building {module} for {arch} with {cuda_home}/bin/nvcc, cache {cache}")
    result = fi.run_build_subprocess(module, env, timeout_s=SPEC.timeout_s - 60, load=arch == LOCAL)
    result["nvcc"] = fi.nvcc_version(cuda_home)
    if local_cc:
        result["local_capability"] = local_cc
    return verdict(module, arch, result, _objects_targets(result))
