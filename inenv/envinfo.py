"""What an environment holds, read cheaply. In-environment side: standard library only.

``versions()`` reads package metadata and never imports the libraries under test (importing torch
costs seconds; this runs once per variant). ``inspect_runtime()`` does import torch, for the facts only
a live runtime knows: the GPUs it sees, peer access between them, multicast support.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from inenv import dists, toolkit
from inenv.kit import _nccl


def torch_cuda_version() -> str | None:
    """torch.version.cuda read from the installed file, without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    try:
        m = re.search(r"^cuda\s*(?::\s*\S+)?\s*=\s*['\"]([^'\"]+)['\"]", path.read_text(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


def nvcc_version() -> str | None:
    """The version of the nvcc a JIT build here would run (found as flashinfer finds it), or None."""
    return toolkit.resolve().version


def versions() -> dict[str, Any]:
    """Versions of python and of each library under test that is importable here; cheap."""
    out: dict[str, Any] = {"python": platform.python_version()}
    for lib in dists.LIBRARIES:
        if lib.module and importlib.util.find_spec(lib.module) is None:
            continue  # metadata left behind by a removed package is not a library this environment has
        found = dists.installed(lib.key)
        if found:
            out[lib.key] = found[1]
            if lib.key == "nccl":
                out["nccl_package"] = found[0]
    cuda = torch_cuda_version() if "torch" in out else None
    if cuda:
        out["torch_cuda"] = cuda
    nvcc = nvcc_version()
    if nvcc:
        out["nvcc"] = nvcc
    return out


def runtime_versions() -> dict[str, Any]:
    """Versions that only a loaded library can tell; only for libraries this process already imported."""
    import sys

    out: dict[str, Any] = {}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = getattr(torch, "__version__", None)
        out["torch_cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
        try:
            if torch.cuda.is_available():
                out["nccl"] = _nccl.runtime_version(torch)
        except Exception as exc:  # a broken CUDA runtime is itself worth recording
            out["nccl_error"] = str(exc)[:200]
    for name in ("flashinfer", "sgl_kernel"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__version__", None):
            out[name] = str(mod.__version__)
    return {k: v for k, v in out.items() if v is not None}


def gpu_count_hint() -> int:
    """GPUs visible to this environment without initialising CUDA (the ranks do that)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                return len([ln for ln in out.stdout.splitlines() if ln.startswith("GPU ")])
        except (OSError, subprocess.SubprocessError):
            pass
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def inspect_runtime() -> dict[str, Any]:
    """Versions plus what torch sees: GPUs, compute capability, peer access, multicast."""
    info: dict[str, Any] = {"versions": versions(), "gpus": [], "peer_access": [], "multicast": []}
    if importlib.util.find_spec("torch") is None:
        info["torch_error"] = "torch is not installed in this environment"
        return info
    if gpu_count_hint() == 0:  # nothing torch could add but its import time (seconds)
        info["cuda_available"] = False
        return info
    try:
        import torch
    except Exception as exc:
        info["torch_error"] = f"import torch failed: {exc}"[:300]
        return info
    info["versions"].update(runtime_versions())
    try:
        info["arch_list"] = list(torch.cuda.get_arch_list())
        if not torch.cuda.is_available():
            info["cuda_available"] = False
            return info
        info["cuda_available"] = True
        n = torch.cuda.device_count()
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append(
                {
                    "index": i,
                    "name": p.name,
                    "compute_capability": f"{p.major}.{p.minor}",
                    "sm_count": p.multi_processor_count,
                    "memory_bytes": int(p.total_memory),
                }
            )
        info["peer_access"] = [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)]
                               for i in range(n)]
        info["multicast"] = [_multicast(torch, i) for i in range(n)]
    except Exception as exc:
        info["cuda_error"] = str(exc)[:300]
    return info


def _multicast(torch: Any, index: int) -> bool | None:
    try:
        from torch._C._distributed_c10d import _SymmetricMemory

        return bool(_SymmetricMemory.has_multicast_support(torch._C._autograd.DeviceType.CUDA, index))
    except Exception:
        return None


def fingerprint() -> dict[str, Any]:
    """What this environment is, for `checks run` to tell whether it changed since a result was recorded:
    the interpreter, every installed distribution (name, version, and a digest of its RECORD, which lists
    the hash of each file it installed), the toolkit a JIT build would use and the host compiler. Reading
    RECORD files costs milliseconds; nothing is imported."""
    import hashlib
    import importlib.metadata
    import sys

    rows = sorted(f"{d.metadata['Name'] or ''} {d.version} {d.locate_file('')} "
                  f"{hashlib.sha256((d.read_text('RECORD') or '').encode()).hexdigest()}"
                  for d in importlib.metadata.distributions())
    tk = toolkit.resolve()
    cxx = shutil.which("c++") or shutil.which("g++")
    try:
        cxx_version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.split(
            "\n")[0] if cxx else ""
    except (OSError, subprocess.SubprocessError):
        cxx_version = ""
    return {"python": sys.version, "executable": sys.executable,
            "distributions": hashlib.sha256("\n".join(rows).encode()).hexdigest(), "count": len(rows),
            "nvcc": [tk.nvcc, tk.version], "cxx": [cxx or "", cxx_version]}
