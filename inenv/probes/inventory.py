"""inventory: what this environment is, and whether its binaries carry code for the local GPU.

Versions (torch and its CUDA, NCCL, sgl-kernel, flashinfer, nvcc), the GPU architectures compiled into
torch and sgl-kernel read from the binaries themselves (``torch.cuda.get_arch_list()`` is empty without a
GPU), whether the local GPU's architecture is among them, the peer-access matrix and multicast support
(read from the device attribute only; nothing is created). Without a GPU the GPU fields are absent and the
rest is still reported. When sgl-kernel is installed it is imported for real (that loads its ops against
this torch's C++ ABI): a failed import fails the probe with the loader's error. Its binaries are judged
too (inenv/kit/_torch_abi.py): torch C++ symbols its libraries import that this torch does not export
fail it as abi-mismatch, CUDA libraries of another CUDA major than torch's as cuda-major-mismatch, with or
without a GPU. Where the import stops at the missing CUDA driver, the cell passes only when those binary
checks proved the fit, and the note says what was proven. The installed metadata is judged as ``pip check``
judges it (inenv/kit/_installed.py): a requirement of or on a probed package that is not met, files two
distributions both own, or an extension module built for another Python make a pass partial, each under its
own reason, since matching symbol names do not prove a fit the wheel's own pin rules out.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from pathlib import Path
from typing import Any

from inenv import dists, toolkit
from inenv.kit import _fatbin, _installed, _torch_abi
from inenv.probe import ProbeSpec, RankContext, outcome

# Where a stackprobe image lists the files it removed because no probe or import uses them (globs, one per
# line): the libraries read below are then what the image holds, not all the packages ship.
REMOVED_LIST = "/opt/stackprobe/removed"


def removed_from_image(path: str = REMOVED_LIST) -> list[str]:
    try:
        return [line for line in Path(path).read_text().splitlines() if line.strip()]
    except OSError:
        return []


SPEC = ProbeSpec(
    id="inventory",
    title="Environment inventory",
    feature="Which torch / CUDA / NCCL / sgl-kernel / flashinfer / nvcc does this environment hold, which GPU "
    "architectures are compiled into torch and sgl-kernel, and does my GPU's architecture run them?",
    ranks=(1,),
    needs_gpu=False,
    timeout_s=180.0,
)



def _dist_versions() -> dict[str, str]:
    """Installed version of every library in the shared table (``nccl``: the wheel's, until torch says)."""
    return {lib.key: found[1] for lib in dists.LIBRARIES if (found := dists.installed(lib.key))}


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def package_files(package: str, patterns: tuple[str, ...]) -> dict[str, str]:
    """Files of an installed package matching glob patterns: path relative to the package -> path."""
    root = _package_dir(package)
    if root is None:
        return {}
    return {os.path.relpath(path, root): path for pattern in patterns
            for path in sorted(glob.glob(str(root / pattern), recursive=True))}


def binary_archs(package: str, patterns: tuple[str, ...]) -> dict[str, list[str]]:
    """Targets per shared library of a package, e.g. {"lib/libtorch_cuda.so": ["sm_90a", ...]}."""
    out: dict[str, list[str]] = {}
    for rel, path in package_files(package, patterns).items():
        targets = _fatbin.archs([path])
        if targets:
            out[rel] = targets
    return out


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


import_error_line = _torch_abi.import_error_line
sgl_kernel_import_reason = _torch_abi.failure_reason


def import_sgl_kernel() -> str | None:
    """Import sgl_kernel for real (it dlopens its ops against this torch): None, or why it failed."""
    try:
        import sgl_kernel  # noqa: F401, PLC0415 - the library under test; the import is the check
    except Exception as exc:  # a failed import is the finding
        return f"{type(exc).__name__}: {exc}"
    return None


def judge_sgl_kernel(torch: Any, evidence: dict[str, Any]) -> _torch_abi.Judgement | None:
    """Import sgl_kernel, read its binaries against this torch's libraries, and judge the pair."""
    error = import_sgl_kernel()
    evidence["sgl_kernel_import"] = "ok" if error is None else error[:4000]
    extensions = package_files("sgl_kernel", ("**/*.so",))
    fit = None
    if extensions:
        fit = _torch_abi.read_fit(extensions, package_files("torch", ("lib/*.so", "lib/*.so.*")).values(),
                                  torch.version.cuda)
        evidence["sgl_kernel_abi"] = fit.evidence()
    unfound: tuple[str, ...] = ()
    if error is not None and _torch_abi.needs_driver(error) and fit is not None:
        unfound = _torch_abi.not_found(fit)
        evidence["sgl_kernel_abi"]["libraries_not_found"] = list(unfound)
    found = dists.installed("sgl_kernel")
    built_for = dists.requires(found[0], "torch") if found else None
    if built_for is not None:
        evidence["sgl_kernel_built_for_torch"] = built_for or "any"
    return _torch_abi.judge(fit, error, unfound, built_for or None, torch.__version__)


# The distributions the probes test: a requirement they declare, or one declared on them, that this environment
# does not meet is its own finding, whatever their binaries say.
PROBED = frozenset(_installed.normal(d) for key in ("torch", "sgl_kernel", "flashinfer")
                   for d in dists.BY_KEY[key].dists)


def metadata_findings(snap: dict[str, Any]) -> list[tuple[str, str]]:
    """(reason code, note) per finding of ``_installed.snapshot()`` that limits the verdict; pure."""
    out: list[tuple[str, str]] = []
    broken = [_installed.Broken(**b) for b in snap.get("broken_requirements") or []]
    pins = [b for b in broken if _installed.normal(b.dist) in PROBED or b.required in PROBED]
    if pins:
        out.append(("dependency-pin-violated", "; ".join(b.describe() for b in pins)))
    for c in snap.get("collisions") or []:
        owners = " and ".join(c["owners"])
        folders = ", ".join(c["folders"][:3]) + (" ..." if len(c["folders"]) > 3 else "")
        out.append(("file-collision", f"{owners} both own {c['files']} file(s) with different contents "
                                      f"({folders}): the later install overwrote the other's, and uninstalling "
                                      "either deletes files the other needs"))
    foreign = snap.get("foreign_extensions") or {}
    if foreign:
        files = [f"{f} ({dist})" for dist, fs in sorted(foreign.items()) for f in fs]
        out.append(("ext-python-mismatch", f"{len(files)} extension module(s) built for another Python than "
                                           f"this {snap.get('python', 'interpreter')}, which never imports them: "
                                           f"{', '.join(files[:3])}" + (" ..." if len(files) > 3 else "")))
    return out


def amend(result: dict[str, Any], findings: list[tuple[str, str]]) -> dict[str, Any]:
    """A pass with findings becomes partial under the first finding's code, its note led by the findings (the
    table shortens long notes from the end); a fail or skip keeps its own code and note, findings after it."""
    if not findings:
        return result
    notes = [n for _, n in findings]
    if result["status"] == "pass":
        result["status"], result["reason_code"] = "partial", findings[0][0]
        result["note"] = "; ".join(p for p in (*notes, result["note"]) if p)
    else:
        result["note"] = "; ".join(p for p in (result["note"], *notes) if p)
    result["evidence"]["metadata_findings"] = [c for c, _ in findings]
    return result


def run(ctx: RankContext) -> dict[str, Any]:
    snap = _installed.snapshot()
    result = _run(ctx, snap)
    return amend(result, metadata_findings(snap))


def _run(ctx: RankContext, snap: dict[str, Any]) -> dict[str, Any]:
    versions: dict[str, Any] = _dist_versions()
    evidence: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    tk = toolkit.resolve()
    if tk.found:
        versions["nvcc"] = tk.version
        evidence["cuda_home"] = tk.cuda_home
        evidence["toolkit"] = tk.as_dict()
    evidence["versions"] = versions
    evidence["installed"] = snap
    gone = removed_from_image()
    if gone:
        evidence["removed_from_image"] = gone
    torch_bins = binary_archs("torch", ("lib/libtorch_cuda.so", "lib/libtorch_cuda_linalg.so"))
    sgl_bins = binary_archs("sgl_kernel", ("**/*.so",))
    evidence["torch_binary_archs"] = torch_bins
    if sgl_bins:
        evidence["sgl_kernel_binary_archs"] = sgl_bins
    if importlib.util.find_spec("flashinfer") is not None and importlib.util.find_spec("torch") is not None:
        from inenv.kit._flashinfer import api_surface

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
    sgl = None
    if "sgl_kernel" in versions or importlib.util.find_spec("sgl_kernel") is not None:
        sgl = judge_sgl_kernel(torch, evidence)
    if not torch.cuda.is_available():
        note = "no GPU visible: versions and compiled architectures only; GPU fields absent"
        if sgl is not None and sgl.status != "pass":
            return outcome(sgl.status, note=sgl.note, reason_code=sgl.reason_code, metrics=metrics,
                           evidence=evidence)
        return outcome("pass", note=f"{note}; {sgl.note}" if sgl else note, metrics=metrics, evidence=evidence)
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
    code = "arch-not-compiled"
    if sgl is not None and sgl.status != "pass":  # with a driver present, a skip cannot arise; a fail is one
        problems.append(sgl.note)
        code = sgl.reason_code
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
        return outcome("fail", note="; ".join(problems), reason_code=code, metrics=metrics, evidence=evidence)
    return outcome("pass", metrics=metrics, evidence=evidence)


# --- declared fields: what this probe records, and the roles checks report and checks advise read them by
# (inenv.probe.Field: name, unit, meaning, role). Left out of the probe hash: it changes no verdict.
METRICS = (
    ("gpus", "count", "GPUs torch sees", None),
    ("peer_pairs", "count", "ordered GPU pairs with peer access", None),
)
