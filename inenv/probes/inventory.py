"""inventory: what this environment is, and whether its binaries carry code for the local GPU.

Versions (torch and its CUDA, NCCL, sgl-kernel, flashinfer, nvcc), the GPU architectures compiled into
torch and sgl-kernel read from the binaries themselves (``torch.cuda.get_arch_list()`` is empty without a
GPU), whether the local GPU's architecture is among them, the peer-access matrix and multicast support
(read from the device attribute only; nothing is created). Without a GPU the GPU fields are absent and the
rest is still reported. When sgl-kernel or a serving engine (vLLM, SGLang) is installed it is imported for
real and each of its extension libraries is loaded (that binds their ops against this torch's ABI): a failure
fails the probe with the loader's error. Their binaries are judged too (inenv/kit/_torch_abi.py): torch
symbols (C++ or stable C ABI) their libraries import that this torch does not export fail it as
abi-mismatch, CUDA libraries of another CUDA major than torch's as cuda-major-mismatch, with or without a
GPU. A flashinfer that does not import fails it as flashinfer-import-error. Where the import stops at the
missing CUDA driver, the cell passes only when those binary checks proved the fit, and the note says what was
proven. The installed metadata is read (inenv/kit/_installed.py): files two distributions both own, or an
extension module built for another Python make a pass partial, each under its own reason, and so do packages
that must agree without saying so: an extension linking torch whose metadata names no torch
(undeclared-torch), and flashinfer-cubin or flashinfer-jit-cache at another release than flashinfer-python
(flashinfer-package-mismatch). Every distribution's requirements and the marker variables are recorded, and
the host judges them as ``pip check`` does (checks.run.hostjudge): matching symbol names do not prove a fit a
wheel's own pin rules out.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from inenv import dists, toolkit
from inenv.kit import _fatbin, _installed, _nccl, _torch_abi
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


def nccl_version_text(code: int) -> str:
    """NCCL_VERSION_CODE as a release: major*10000 + minor*100 + patch from 2.9, major*1000 + ... before."""
    major = code // 10000 if code >= 20900 else code // 1000
    minor, patch = ((code % 10000) // 100, code % 100) if code >= 20900 else ((code % 1000) // 100, code % 100)
    return f"{major}.{minor}.{patch}"


def env_path(path: str) -> str:
    """``path`` as the same environment writes it on any machine: inside this interpreter's prefix (its venv or
    installation) as ``$PREFIX/...``, inside the home folder as ``~/...``; a system path (``/usr/lib/...``) as
    it is."""
    for root, name in ((sys.prefix, "$PREFIX"), (os.path.expanduser("~"), "~")):
        root = root.rstrip("/")
        if root and root != "~" and (path == root or path.startswith(root + "/")):
            return name + path[len(root):]
    return path


def loaded_nccl() -> dict[str, Any] | None:
    """The NCCL library this process mapped (torch loads it at import, no GPU needed): its path, the release it
    says it is (ncclGetVersion), and the installed distribution whose files hold it. A cell with another NCCL
    wheel beside torch proves here which library the ranks use. None when no NCCL is mapped."""
    import ctypes
    import importlib.metadata as md

    path = _nccl.loaded_library(default="")
    if not path:
        return None
    out: dict[str, Any] = {"path": env_path(path)}
    try:
        code = ctypes.c_int()
        if ctypes.CDLL(path).ncclGetVersion(ctypes.byref(code)) == 0:
            out["version"] = nccl_version_text(code.value)
    except (OSError, AttributeError) as exc:
        out["error"] = str(exc)[:200]
    real = os.path.realpath(path)
    for dist in md.distributions():
        name = dist.metadata["Name"] or ""
        if "nccl" not in name.lower():
            continue
        for f in dist.files or ():
            if os.path.realpath(str(dist.locate_file(f))) == real:
                out["package"], out["package_version"] = name, dist.version
                return out
    return out


import_error_line = _torch_abi.import_error_line
sgl_kernel_import_reason = _torch_abi.failure_reason


# Packages whose compiled extensions link torch, judged against this torch: the kernel library and the serving
# engines (import name, name shown, distribution names). Each is imported for real and each of its extension
# libraries is loaded by the dynamic loader, since an engine's Python import loads none of them (vLLM's ops
# load on first use), and their binaries are read against this torch (inenv/kit/_torch_abi.py).
COMPILED: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("sgl_kernel", "sgl-kernel", dists.BY_KEY["sgl_kernel"].dists),
    ("vllm", "vLLM", ("vllm",)),
    ("sglang", "SGLang", ("sglang",)),
)


def import_module(module: str) -> str | None:
    """Import the package for real (sgl_kernel dlopens its ops against this torch): None, or why it failed."""
    try:
        importlib.import_module(module)  # the library under test; the import is the check
    except BaseException as exc:  # a failed import is the finding (some call sys.exit on a missing GPU)
        if isinstance(exc, KeyboardInterrupt):
            raise
        return f"{type(exc).__name__}: {exc}"
    return None


def load_libraries(paths: dict[str, str]) -> str | None:
    """Load each extension library the way Python's import does (every symbol bound now): None when all load,
    else the first failure that is not the missing CUDA driver, else the driver's."""
    import ctypes

    driver: str | None = None
    for rel, path in sorted(paths.items()):
        try:
            ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
        except OSError as exc:
            error = f"ImportError: {rel}: {exc}"
            if not _torch_abi.needs_driver(error):
                return error
            driver = driver or error
    return driver


def judge_package(torch: Any, module: str, name: str, dist_names: tuple[str, ...], evidence: dict[str, Any],
                  ) -> _torch_abi.Judgement | None:
    """Import the package, load its extension libraries, read their binaries against this torch's libraries,
    and judge the pair; evidence under ``<module>_import``, ``<module>_abi``, ``<module>_built_for_torch``."""
    extensions = package_files(module, ("**/*.so",))
    error = import_module(module) or (load_libraries(extensions) if extensions else None)
    evidence[f"{module}_import"] = "ok" if error is None else error[:4000]
    fit = None
    if extensions:
        fit = _torch_abi.read_fit(extensions, package_files("torch", ("lib/*.so", "lib/*.so.*")).values(),
                                  torch.version.cuda)
        evidence[f"{module}_abi"] = fit.evidence()
    unfound: tuple[str, ...] = ()
    if error is not None and _torch_abi.needs_driver(error) and fit is not None:
        unfound = _torch_abi.not_found(fit)
        evidence[f"{module}_abi"]["libraries_not_found"] = list(unfound)
    found = next((d for d in dist_names if _has_dist(d)), None)
    built_for = dists.requires(found, "torch") if found else None
    if built_for is not None:
        evidence[f"{module}_built_for_torch"] = built_for or "any"
    if found and fit is not None and built_for is None and _torch_abi.links_torch(fit):
        evidence[f"{module}_undeclared_torch"] = True
    return _torch_abi.judge(fit, error, unfound, built_for or None, torch.__version__, name, module)


def _has_dist(name: str) -> bool:
    import importlib.metadata as md

    try:
        md.version(name)
    except md.PackageNotFoundError:
        return False
    return True


def package_set_findings(versions: dict[str, Any], evidence: dict[str, Any]) -> list[tuple[str, str]]:
    """(reason code, note) for packages installed together that declare no requirement on each other but must
    agree: a compiled extension that links torch without naming a torch release (an installer puts it beside any
    torch), and flashinfer's kernel packages (flashinfer-cubin, flashinfer-jit-cache) at another release than
    flashinfer-python, whose kernels they hold. Pure."""
    out: list[tuple[str, str]] = []
    for module, name, _ in COMPILED:
        abi = evidence.get(f"{module}_abi") or {}
        if evidence.get(f"{module}_undeclared_torch"):
            out.append(("undeclared-torch", f"{name} {versions.get(module) or ''} links torch "
                        f"({abi.get('torch_symbols_imported', 0)} torch symbols) but its wheel metadata declares no "
                        "torch requirement, so an installer puts it beside any torch release; it was judged "
                        f"against this torch {versions.get('torch_runtime') or versions.get('torch') or ''}"))
    fi = versions.get("flashinfer")
    for key, dist in (("flashinfer_cubin", "flashinfer-cubin"), ("flashinfer_jit_cache", "flashinfer-jit-cache")):
        other = versions.get(key)
        if fi and other and _public(str(other)) != _public(str(fi)):
            out.append(("flashinfer-package-mismatch", f"{dist} {other} is installed beside flashinfer-python {fi}: "
                        "its kernels are another release's"))
    return out


def _public(version: str) -> str:
    return version.split("+", 1)[0]


def metadata_findings(snap: dict[str, Any]) -> list[tuple[str, str]]:
    """(reason code, note) per finding of ``_installed.snapshot()`` that limits the verdict; pure."""
    out: list[tuple[str, str]] = []
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
    evidence = result["evidence"]
    return amend(result, metadata_findings(snap) + package_set_findings(evidence.get("versions") or {}, evidence))


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

        error = import_module("flashinfer")  # a flashinfer that fails to import is itself a finding
        if error is not None:
            evidence["flashinfer_import_error"] = error[:600]
        else:
            evidence["flashinfer_api"] = api_surface()
    if importlib.util.find_spec("torch") is None:
        return outcome(
            "skip", note="torch is not installed in this environment", reason_code="no-torch", evidence=evidence
        )
    import torch

    versions["torch_runtime"] = torch.__version__
    versions["torch_cuda"] = torch.version.cuda
    nccl_loaded = loaded_nccl()
    if nccl_loaded:
        evidence["nccl_loaded"] = nccl_loaded
    evidence["torch_arch_list"] = list(torch.cuda.get_arch_list())
    judged = [j for module, name, names in COMPILED if importlib.util.find_spec(module) is not None
              and (j := judge_package(torch, module, name, names, evidence)) is not None]
    bad = next((j for j in judged if j.status != "pass"), None)
    if "flashinfer_import_error" in evidence:  # every engine and probe using flashinfer stops here
        fi_fail = _torch_abi.Judgement("fail", "flashinfer-import-error",
                                       f"import flashinfer failed: {evidence['flashinfer_import_error']}")
        bad = bad or fi_fail
        judged.append(fi_fail)
    if not torch.cuda.is_available():
        note = "no GPU visible: versions and compiled architectures only; GPU fields absent"
        if bad is not None:
            others = [j.note for j in judged if j is not bad]
            return outcome(bad.status, note="; ".join([bad.note, *others]), reason_code=bad.reason_code,
                           metrics=metrics, evidence=evidence)
        return outcome("pass", note="; ".join([note, *(j.note for j in judged)]), metrics=metrics,
                       evidence=evidence)
    try:
        versions["nccl"] = _nccl.runtime_version(torch)
    except Exception as exc:
        evidence["nccl_error"] = str(exc)[:300]
    facts = _gpu_facts(torch)
    evidence.update(facts)
    cap = facts["gpus"][0]["capability"] if facts["gpus"] else None
    n = len(facts["gpus"])
    metrics["gpus"] = n
    metrics["peer_pairs"] = sum(facts["peer_access"][i][j] for i in range(n) for j in range(n) if i != j)
    failing = [j for j in judged if j.status != "pass"]  # with a driver present, a skip cannot arise
    problems = [j.note for j in failing]
    code = failing[0].reason_code if failing else "arch-not-compiled"
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
