"""inventory: what this environment is, and whether its binaries carry code for the local GPU.

Versions (torch and its CUDA, NCCL, sgl-kernel, flashinfer, nvcc), the GPU architectures compiled into
torch and sgl-kernel read from the binaries themselves (``torch.cuda.get_arch_list()`` is empty without a
GPU), whether the local GPU's architecture is among them, the peer-access matrix and multicast support
(read from the device attribute only; nothing is created). Without a GPU the GPU fields are absent and the
rest is still reported. When sgl-kernel is installed it is imported for real (that loads its ops against
this torch's C++ ABI): a failed import fails the probe with the loader's error.
"""

from __future__ import annotations

import glob
import importlib.metadata as md
import importlib.util
import os
from pathlib import Path
from typing import Any

from checks.probe import ProbeSpec, RankContext, outcome
from checks.probes import _fatbin

SPEC = ProbeSpec(
    id="inventory",
    title="Environment inventory",
    feature="Which torch / CUDA / NCCL / sgl-kernel / flashinfer / nvcc does this environment hold, which GPU "
    "architectures are compiled into torch and sgl-kernel, and does my GPU's architecture run them?",
    ranks=(1,),
    needs_gpu=False,
    timeout_s=180.0,
)

_DISTS = {
    "torch": ("torch",),
    "flashinfer": ("flashinfer-python", "flashinfer"),
    "flashinfer_jit_cache": ("flashinfer-jit-cache",),
    "flashinfer_cubin": ("flashinfer-cubin",),
    "sgl_kernel": ("sglang-kernel", "sgl-kernel"),
    "nccl_wheel": ("nvidia-nccl-cu13", "nvidia-nccl-cu12"),
    "triton": ("triton", "pytorch-triton"),
}


def _dist_versions() -> dict[str, str]:
    out: dict[str, str] = {}
    for key, names in _DISTS.items():
        for name in names:
            try:
                out[key] = md.version(name)
                break
            except md.PackageNotFoundError:
                continue
    return out


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def binary_archs(package: str, patterns: tuple[str, ...]) -> dict[str, list[str]]:
    """Targets per shared library of a package, e.g. {"lib/libtorch_cuda.so": ["sm_90", ...]}."""
    root = _package_dir(package)
    if root is None:
        return {}
    out: dict[str, list[str]] = {}
    for pattern in patterns:
        for path in sorted(glob.glob(str(root / pattern), recursive=True)):
            targets = _fatbin.archs([path])
            if targets:
                out[os.path.relpath(path, root)] = targets
    return out


def _cuda_home() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return home
    return None


def _gpu_facts(torch: Any) -> dict[str, Any]:
    n = torch.cuda.device_count()
    gpus = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        gpus.append(
            {
                "index": i,
                "name": p.name,
                "capability": f"{p.major}.{p.minor}",
                "sm_count": p.multi_processor_count,
                "memory_gib": round(p.total_memory / 2**30, 1),
            }
        )
    peer = [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)] for i in range(n)]
    return {"gpus": gpus, "peer_access": peer, "multicast": [_multicast(i) for i in range(n)]}


def _multicast(index: int) -> bool | None:
    """CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED through torch's own query (an attribute read, no object)."""
    try:
        import torch
        from torch._C._distributed_c10d import _SymmetricMemory

        return bool(_SymmetricMemory.has_multicast_support(torch._C._autograd.DeviceType.CUDA, index))
    except Exception:
        return None


# The dynamic loader names a missing driver library before it resolves any symbol, so on a host without
# the CUDA driver an import failure says nothing about the kernel's fit with torch.
_NO_DRIVER = "libcuda.so.1"


def import_error_line(message: str) -> str:
    """The line of an import failure that says why: sgl_kernel wraps the loader's error in a long report."""
    lines = [ln.strip(" -") for ln in message.splitlines() if ln.strip(" -")]
    for key in ("undefined symbol", "cannot open shared object", "No module named"):
        hit = next((ln for ln in lines if key in ln), None)
        if hit:
            return hit[:400]
    return (lines[-1] if lines else message)[:400]


def import_sgl_kernel() -> str | None:
    """Import sgl_kernel for real (it dlopens its ops against this torch): None, or why it failed."""
    try:
        import sgl_kernel  # noqa: F401, PLC0415 - the library under test; the import is the check
    except Exception as exc:  # a failed import is the finding
        return f"{type(exc).__name__}: {exc}"
    return None


def sgl_kernel_import_reason(error: str) -> str:
    return "abi-mismatch" if "undefined symbol" in error else "import-error"


def run(ctx: RankContext) -> dict[str, Any]:
    versions: dict[str, Any] = _dist_versions()
    evidence: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    home = _cuda_home()
    if home:
        from checks.probes._flashinfer import nvcc_version

        versions["nvcc"] = nvcc_version(home)
        evidence["cuda_home"] = home
    evidence["versions"] = versions
    torch_bins = binary_archs("torch", ("lib/libtorch_cuda.so", "lib/libtorch_cuda_linalg.so"))
    sgl_bins = binary_archs("sgl_kernel", ("**/*.so",))
    evidence["torch_binary_archs"] = torch_bins
    if sgl_bins:
        evidence["sgl_kernel_binary_archs"] = sgl_bins
    if importlib.util.find_spec("flashinfer") is not None and importlib.util.find_spec("torch") is not None:
        from checks.probes._flashinfer import api_surface

        try:
            evidence["flashinfer_api"] = api_surface()
        except Exception as exc:  # a flashinfer that fails to import is itself a finding
            evidence["flashinfer_import_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if importlib.util.find_spec("torch") is None:
        return outcome(
            "skip", note="torch is not installed in this environment", reason_code="no-torch", evidence=evidence
        )
    import torch

    versions["torch_runtime"] = torch.__version__
    versions["torch_cuda"] = torch.version.cuda
    evidence["torch_arch_list"] = list(torch.cuda.get_arch_list())
    sgl_error = None
    if "sgl_kernel" in versions or importlib.util.find_spec("sgl_kernel") is not None:
        sgl_error = import_sgl_kernel()
        evidence["sgl_kernel_import"] = "ok" if sgl_error is None else sgl_error[:4000]
    if not torch.cuda.is_available():
        note = "no GPU visible: versions and compiled architectures only; GPU fields absent"
        if sgl_error is not None and _NO_DRIVER in sgl_error:
            note += f"; import sgl_kernel not judged: {_NO_DRIVER} (the CUDA driver) is absent here"
        elif sgl_error is not None:
            return outcome("fail", note=f"import sgl_kernel failed: {import_error_line(sgl_error)}",
                           reason_code=sgl_kernel_import_reason(sgl_error), metrics=metrics, evidence=evidence)
        return outcome("pass", note=note, metrics=metrics, evidence=evidence)
    try:
        nccl = torch.cuda.nccl.version()
        versions["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception as exc:
        evidence["nccl_error"] = str(exc)[:300]
    facts = _gpu_facts(torch)
    evidence.update(facts)
    cap = facts["gpus"][0]["capability"] if facts["gpus"] else None
    n = len(facts["gpus"])
    metrics["gpus"] = n
    metrics["peer_pairs"] = sum(facts["peer_access"][i][j] for i in range(n) for j in range(n) if i != j)
    problems: list[str] = []
    if sgl_error is not None:
        problems.append(f"import sgl_kernel failed: {import_error_line(sgl_error)}")
    if cap:
        torch_targets = sorted({t for ts in torch_bins.values() for t in ts}) or list(evidence["torch_arch_list"])
        evidence["torch_runs_on_gpu"] = _fatbin.runs_on(torch_targets, cap)
        if not evidence["torch_runs_on_gpu"]:
            problems.append(f"torch has no code for compute capability {cap} ({', '.join(torch_targets)})")
        if sgl_bins:
            fits = {lib: _fatbin.runs_on(ts, cap) for lib, ts in sgl_bins.items()}
            evidence["sgl_kernel_runs_on_gpu"] = fits
            if not any(fits.values()):
                problems.append(f"no sgl-kernel library has code for compute capability {cap}")
    if problems:
        code = sgl_kernel_import_reason(sgl_error) if sgl_error is not None else "arch-not-compiled"
        return outcome("fail", note="; ".join(problems), reason_code=code, metrics=metrics, evidence=evidence)
    return outcome("pass", metrics=metrics, evidence=evidence)
