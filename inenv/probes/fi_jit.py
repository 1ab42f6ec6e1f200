"""fi-jit: does each flashinfer comm module compile for this GPU, and cross-compile for a target arch?

Each variant builds one JIT module (vllm_comm, trtllm_comm, moe_a2a, pcie_ipc) for one architecture in a
fresh interpreter (flashinfer fixes its arch list and toolkit at import), with the toolkit flashinfer
itself finds in this environment (``CUDA_HOME``, ``CUDA_PATH``, ``PATH``, ``/usr/local/cuda``:
``inenv.toolkit``): the environment is passed on untouched, so a ``CUDA_HOME`` without nvcc, or an older
nvcc first on ``PATH``, fails here as it fails for flashinfer. Every result records that toolkit (path,
version, how it was found) and flags an nvcc whose CUDA major differs from torch's.

``arch=local`` lets flashinfer pick the architecture of the visible GPU itself, the path a user takes; any
other value is passed as ``FLASHINFER_CUDA_ARCH_LIST`` (no GPU needed), which flashinfer may normalise
(``12.0`` becomes ``sm_120f``: ``inenv.gpuarch.flashinfer_sass``). Compile and link are reported apart: a
toolkit without a ``libcuda.so`` stub compiles every object but cannot link, which is ``partial``. A pass
needs proof: the built code is read back and must hold SASS for the requested architecture (output whose
architectures cannot be read is ``partial``), and the library's dynamic dependencies must let it load:
driver calls (``cu*``) need a ``libcuda.so.1`` dependency, which the linker drops when the link stub does
not export them. For ``arch=local`` the module is also loaded.

Nothing is compiled twice when a cache outlives the variant: the shared compile cache
(``STACKPROBE_COMPILE_CACHE``, ``inenv.kit._compile_cache``: a build with the same sources, flags,
compilers and the same bytes in every header it reads, in another cell or run, even of another flashinfer
release), or ninja finding every object up to date in ``STACKPROBE_JIT_CACHE``.
The result then says ``cached`` (metrics) and which build made the library (evidence ``cached_from``); the
library is still read back for proof.

One build for several targets: when the host lists every cross-compile target in
``STACKPROBE_FI_JIT_ARCHS`` (space separated) and such a cache is there, a variant first builds for the
whole list in one go (``FLASHINFER_CUDA_ARCH_LIST="12.0a 12.0f"``), so the next target's variant finds it
cached; each variant is still judged on the SASS of its own target in that library. A finished combined build
is handed to the other targets' variants of the same run and cell (``_compile_cache.hand_over``, keyed by the
host's run token): they take its result without an interpreter that imports flashinfer and torch only to find
the same cache entry (evidence ``handed_over``). When the combined
build fails, the variant builds for its own target alone, so one target nvcc or flashinfer refuses never
fails another, unless the failure cannot depend on the targets (no nvcc, no host compiler, flashinfer
does not import, a link failure after every object compiled): then the combined build's failure is the
answer; evidence ``built_for`` names the list the library was built (or failed to build) for.

A combined build gives nvcc one thread per target (``--threads N``, left out of the cache key). A combined
build whose every object compiled and whose link failed keeps its objects in the compile cache, so the next
target's variant (and a rerun) only links them again; its link is judged afresh, never shown as cached.

A build for the local GPU asks nvcc to spread each object's optimisation passes and ptxas over threads
(``-split-compile=N``: a quarter of the usable cores, at most 8; ``STACKPROBE_NVCC_SPLIT`` overrides it, 1 turns
it off) when its nvcc is CUDA 12 or later: one trtllm_comm object is a GPU host's longest compile (about four
minutes on one core), and the split takes a quarter to a half off it. The kernels are the same but some are laid
out otherwise (flashinfer 0.7.4's trtllm fusion object for sm_90a: 133 of its 1332 kernels differ in size), so
the flag is part of the cache key and of the evidence (``split_compile``): what is judged is flashinfer's sources
built with its own flags and the split. A compile that fails with the split is built again without it, and that
build is the answer (evidence ``split_compile_failed`` keeps the split's error lines).

For the GPU probes: the first ``arch=local`` variant of a cell also builds every other comm module for the
local GPU side by side, longest first (``inenv.probes.fiprebuild``), and waits for them; each local build
that passes and loads is published in the compile cache as flashinfer's AOT folder
(``_flashinfer.publish``), which the GPU probes point flashinfer at (``_flashinfer.use_prebuilt``), so they
load what was built and proved here instead of compiling inside their watchdog.

What the engine would load counts: for ``arch=local``, a module this environment already has for its GPU is
judged instead of compiled again (``_fi_existing.existing``): a library of an installed flashinfer-jit-cache, else
one in flashinfer's own JIT cache (``$FLASHINFER_WORKSPACE_BASE`` or the home folder, ``.cache/flashinfer/
<version>/<arch>/cached_ops``) that flashinfer would load as it is (its build.ninja the one this flashinfer
writes, ninja finding nothing to do). It is read back (the module's entry points, SASS for this GPU) and
loaded; one that is stale, lacks the entry points or holds no SASS for this GPU is compiled instead, and
the result says why (evidence ``environment_lacks``). Every result says where its module came from
(evidence ``module_from``): the environment's JIT cache, the flashinfer-jit-cache package, the cell's carried
set, stackprobe's compile cache, or compiled now.

Planning filter: ``STACKPROBE_FI_JIT_ONLY="vllm_comm@12.0a,trtllm_comm@local"`` keeps only those pairs
(CI compiles the smallest module for one arch). JIT cache: ``STACKPROBE_JIT_CACHE`` (reused between runs),
else the variant's scratch directory.
"""

from __future__ import annotations

import glob
import os
import re
import time
from pathlib import Path
from typing import Any

from inenv import gpuarch, toolkit
from inenv.envinfo import torch_cuda_version
from inenv.kit import _carried, _compile_cache, _fatbin, _fi_build, _fi_existing
from inenv.kit import _flashinfer as fi
from inenv.probe import LEVEL_ENV, QUICK, HostView, ProbeSpec, RankContext, Skip, Variant, outcome
from inenv.probes import fiprebuild

SPEC = ProbeSpec(
    id="fi-jit",
    title="flashinfer comm JIT (local GPU and cross-compile)",
    feature="Do flashinfer's allreduce-fusion, custom-AR, MoE-A2A and PCIe-IPC modules compile for my GPU "
    "and for a target architecture such as sm_120, with this environment's nvcc?",
    ranks=(1,),
    requires=("flashinfer",),
    needs_gpu=False,
    build_param="module",
    # On 2 cores trtllm_comm takes 450-1000 s of wall time for one target (by load) and 964 s for 12.0a and
    # 12.0f in one build; when that fails, the build for the variant's own target gets what is left of this
    timeout_s=3000.0,
)

ONLY_ENV = "STACKPROBE_FI_JIT_ONLY"
CACHE_ENV = "STACKPROBE_JIT_CACHE"
ARCHS_ENV = "STACKPROBE_FI_JIT_ARCHS"  # every cross-compile target of the run, for one combined build
LOCAL = "local"
QUICK_MODULE = "vllm_comm"  # the smallest comm module: all that `checks run --level quick` compiles


def plan(host: HostView, modules: tuple[str, ...] = fi.COMM_MODULES, only: str = "") -> list[Variant]:
    wanted = {tuple(p.strip().split("@", 1)) for p in only.split(",") if "@" in p}
    out: list[Variant] = []
    for module in modules:
        for arch in (LOCAL, *host.target_archs):
            if (wanted and (module, arch) not in wanted) or (host.level == QUICK and module != QUICK_MODULE):
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


def build_env(arch: str, cache: str) -> dict[str, str]:
    """The builder's environment: this one, with only the arch, the JIT cache and this code's path set.
    CUDA_HOME, CUDA_PATH and PATH stay as they are: which toolkit flashinfer finds is part of the answer."""
    env = dict(os.environ)
    env["FLASHINFER_WORKSPACE_BASE"] = cache
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_repo_root(), env.get("PYTHONPATH", "")) if p)
    if arch == LOCAL:
        env.pop("FLASHINFER_CUDA_ARCH_LIST", None)  # flashinfer's own detection is what is under test
    else:
        env["FLASHINFER_CUDA_ARCH_LIST"] = arch
    targets = len(arch.split()) if arch != LOCAL else 1
    if targets > 1:  # nvcc compiles each object for the targets in parallel; no part of the cache key
        env[_fi_build.THREADS_ENV] = env["FLASHINFER_NVCC_THREADS"] = str(targets)
    if arch == LOCAL:  # a value the caller set stays (1: off)
        env.setdefault(_fi_build.SPLIT_ENV, str(split_threads(usable_cpus())))
    return env


# A build for the local GPU spreads each object's optimisation and ptxas over this share of the host's cores:
# the comm modules build side by side (fiprebuild), and the probes' rank processes run beside them
SPLIT_SHARE = 4


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def split_threads(cpus: int) -> int:
    """The threads nvcc splits one object's compile over on a host of ``cpus`` usable cores (1: no split), at
    most 8: on 2 cores, flashinfer 0.7.4's trtllm fusion object for sm_90a took 229 s whole and 170 s split in
    two (its optimisation 90 -> 66 s, ptxas 87 -> 51 s); its host compile (37 s) and fatbinary (12 s) do not split."""
    return max(1, min(8, cpus // SPLIT_SHARE))


def combined_archs(arch: str, listed: str) -> str:
    """The arch list to build first for ``arch``: every listed target in one build when ``arch`` is one
    of two or more, else "" (build for ``arch`` alone). Listed names are normalised like ``arch``."""
    names: list[str] = []
    for part in listed.replace(",", " ").split():
        try:
            name = str(gpuarch.parse_target(part))
        except gpuarch.TargetError:
            continue
        if name not in names:
            names.append(name)
    return " ".join(names) if arch in names and len(names) > 1 else ""


def _objects_targets(result: dict[str, Any]) -> list[str]:
    lib = result.get("library") or ""
    if lib and os.path.exists(lib):
        return _fatbin.archs([lib])
    build_dir = result.get("build_dir") or ""
    return _fatbin.archs(glob.glob(os.path.join(build_dir, "*.o"))) if build_dir else []


def expected_sass(arch: str) -> frozenset[str]:
    """SASS that proves a build for ``arch``: ``12.0a`` -> sm_120a; ``12.0`` -> sm_120, sm_120a or sm_120f."""
    return gpuarch.flashinfer_sass(gpuarch.parse_target(arch))


def _headline(lines: list[str]) -> str:
    """The first error line from its error keyword on (compiler lines start with long paths)."""
    line = lines[0]
    m = re.search(r"(?:fatal )?error\b.*|\w*Error\b.*", line)
    return (m.group(0) if m else line)[:300]


def _toolkit(result: dict[str, Any]) -> toolkit.Toolkit | None:
    raw = result.get("toolkit")
    return toolkit.from_dict(raw) if isinstance(raw, dict) else None


# Failures where which toolkit flashinfer found is the first thing to look at.
_TOOLKIT_CODES = frozenset(
    {"fi-no-nvcc", "fi-nvcc-too-old", "nvcc-unsupported-arch", "fi-nvcc-error", "fi-link-missing-lib"}
)


# A compile that cannot find a header: the first suspect is the toolkit flashinfer looked in.
_HEADER_CODES = frozenset({"fi-missing-header"})


def _wrong_root(result: dict[str, Any], code: str) -> str:
    """Why a header went missing when the toolkit root flashinfer derived (its CUDA_HOME) is not the one the
    nvcc that ran lives in: the cause, with the fix. "" when the two agree or either is unknown."""
    fi_home, root = str(result.get("flashinfer_cuda_home") or ""), str(result.get("nvcc_root") or "")
    if code not in _HEADER_CODES or not fi_home or not root or os.path.normpath(fi_home) == os.path.normpath(root):
        return ""
    return (f"flashinfer looks for the CUDA headers under {fi_home} (its CUDA_HOME), but the nvcc it runs lives "
            f"in {root}: set CUDA_HOME={root} so both are one toolkit")


def _proof(arch: str, result: dict[str, Any], targets: list[str]) -> tuple[str, str, str] | None:
    """Why a finished build does not prove the requested architecture: (status, reason, note), or None."""
    where = result.get("library") or result.get("build_dir") or "the build"
    if arch == LOCAL:
        local = result.get("local_capability")
        if not local:
            return "partial", "fi-arch-unverified", "built, but the local GPU's compute capability is unknown"
        if not targets:
            return "partial", "fi-arch-unverified", f"built, but no CUDA code could be read from {where}"
        if not _fatbin.runs_on(targets, local):
            return "fail", "fi-wrong-arch", f"built, but the library holds {targets}: nothing runs on {local}"
        return None
    want = expected_sass(arch)
    named = " or ".join(sorted(want))
    if not targets:
        return "partial", "fi-arch-unverified", f"built, but no CUDA code could be read from {where}: {named} unproven"
    if not want & set(targets):
        return "fail", "fi-wrong-arch", f"built, but the library holds {targets}, not {named}"
    return None


def cached_note(result: dict[str, Any]) -> str:
    """Where a build that compiled nothing came from: the shared compile cache (which cell or host built it,
    when, with which flashinfer, for which targets) or objects ninja found up to date."""
    raw = result.get("cached_from") or {}
    # what a build record or kernel record says is free text from wherever it was made: shown escaped
    origin = {k: _carried.visible(str(v)) if isinstance(v, str) else v for k, v in raw.items()} \
        if isinstance(raw, dict) else {}
    stamp = origin.get("built_at") or origin.get("objects_written_at") or "an unrecorded time"
    if result.get("cached_by") == "store-objects":
        who = origin.get("cell") or origin.get("host") or "an unrecorded build"
        return (f"cached: linked here from objects in the compile cache, compiled {stamp} by {who} for "
                f"{origin.get('arch_list')} (that build failed at the link)")
    if result.get("cached_by") == "run":
        return (f"cached: built {stamp} in this run by the variant {origin.get('variant')} of this cell, "
                f"one build for {origin.get('arch_list')}")
    if result.get("cached_by") == "carried":
        return (f"carried: the cell's own {origin.get('name') or 'module'} (built {stamp} by provision build "
                f"with nvcc {origin.get('nvcc') or '?'} for {origin.get('arch_list')}); nothing compiled here")
    if result.get("cached_by") in _fi_existing.ENV_SOURCES:
        extra = f", provider {origin.get('provider')}" if origin.get("provider") else ""
        where = _fi_existing.ENV_SOURCES[str(result["cached_by"])]
        return (f"from {where}: {origin.get('path')} (written {stamp}{extra}), what flashinfer loads here; "
                "nothing compiled")
    if result.get("cached_by") == "store":
        who = origin.get("cell") or origin.get("host") or "an unrecorded build"
        return (f"cached: from the compile cache, built {stamp} by {who} with flashinfer "
                f"{origin.get('flashinfer')} for {origin.get('arch_list')}")
    return f"cached: ninja found every object up to date (built {stamp})"


MODULE_FROM = {**_fi_existing.ENV_SOURCES, "carried": "the cell's carried kernel set",
               "store": "stackprobe's compile cache",
               "store-objects": "stackprobe's compile cache (objects), linked now",
               "run": "this run's build for another target", "ninja": "stackprobe's JIT cache (ninja up to date)"}


def module_from(result: dict[str, Any]) -> str:
    """Where the module a result judges came from (:data:`MODULE_FROM`), or ``compiled now``."""
    return MODULE_FROM.get(str(result.get("cached_by")), "compiled now") if result.get("cached") else "compiled now"


def verdict(module: str, arch: str, result: dict[str, Any], targets: list[str]) -> dict[str, Any]:
    """Map one build result to an outcome; pure, so it is tested on recorded results."""
    stage = result.get("stage", "")
    err = str(result.get("error", ""))
    cached = bool(result.get("cached"))
    keys = ("link_s", "library_bytes", "objects") if cached else ("compile_s", "compile_cpu_s", "link_s",
                                                                    "library_bytes", "objects")
    metrics: dict[str, Any] = {k: result[k] for k in keys if k in result}
    tk = _toolkit(result)
    evidence: dict[str, Any] = {
        "module": module,
        "arch": arch,
        "flashinfer": result.get("flashinfer"),
        "nvcc": tk.version if tk else result.get("nvcc"),
        "toolkit": result.get("toolkit"),
        "local_capability": result.get("local_capability"),
        "gencode": result.get("gencode", []),
        "stage": stage,
        "targets_in_output": targets,
    }
    for key in ("toolkit_rule", "flashinfer_cuda_home", "flashinfer_cuda_home_error", "nvcc_root", "torch_cuda",
                "one_step", "absent_by", "split_compile", "split_compile_failed"):
        if key in result:
            evidence[key] = result[key]
    warning = toolkit.major_mismatch(tk, result.get("torch_cuda")) if tk else ""
    if warning:
        evidence["toolkit_warning"] = warning
    for key in ("library", "cache_key", "cache_entry", "cache_headers", "cache_misses", "cache_error",
                "combined_attempt", "objects_cached", "objects_from", "objects_stored", "handed_over"):
        if key in result:
            evidence[key] = result[key]
    if result.get("arch_list"):
        evidence["built_for"] = result["arch_list"]
    if cached:
        metrics["cached"] = True  # nothing was compiled in this run; compile_s would time nothing
        evidence["cached_from"] = result.get("cached_from")
    if stage not in ("absent", "import"):
        evidence["module_from"] = module_from(result)
    if err:
        evidence["error_lines"] = _fi_build.error_lines(err)
        evidence["error_tail"] = err[-1500:]

    def done(status: str, note: str = "", reason_code: str = "") -> dict[str, Any]:
        note = "; ".join(p for p in (note, cached_note(result) if cached else "", warning) if p)
        return outcome(status, note=note, reason_code=reason_code, metrics=metrics, evidence=evidence)

    if stage == "absent":
        return done("skip", f"flashinfer {result.get('flashinfer')} has no {module} module", "fi-module-absent")
    for key in ("needed", "driver_calls", "loaded"):
        if key in result:
            evidence[key] = result[key]
    if stage == "done":
        unresolved = result.get("unresolved_driver_calls") or []
        if unresolved:
            return done(
                "fail",
                f"built, but it calls {len(unresolved)} CUDA driver function(s) ({', '.join(unresolved[:3])}) "
                "with no libcuda.so.1 dependency: it will not load where libcuda is loaded privately, as the "
                "CUDA runtime does (the link-time libcuda stub lacks those symbols)",
                "fi-link-unresolved",
            )
        unproven = _proof(arch, result, targets)
        if unproven:
            return done(unproven[0], unproven[2], unproven[1])
        return done("pass")
    code = _fi_build.classify_jit_error(err)
    named = _fi_build.signature_line(err)
    last = err.strip().splitlines()[-1] if err.strip() else stage
    first = _headline([named] if named else _fi_build.error_lines(err) or [last])
    missing = _fi_build.missing_libraries(err)
    if missing:
        evidence["missing_libraries"] = missing
    if stage == "link" and code == "fi-link-missing-lib":
        home = f"{tk.cuda_home} (from {tk.found_by})" if tk and tk.cuda_home else "the CUDA_HOME flashinfer took"
        return done(
            "fail",
            f"every object compiled for {', '.join(targets) or arch}; the final link could not find "
            f"{', '.join('-l' + lib for lib in missing)}: {home} is not a toolkit root (no lib64/ with the CUDA "
            "runtime), so a GPU host's driver would not finish this link; set CUDA_HOME to the toolkit root",
            code,
        )
    if stage == "link" and code == "fi-link-no-libcuda":
        origin = result.get("objects_from") or {}
        how = (f" (objects from the compile cache, compiled {origin.get('built_at') or 'earlier'} by "
               f"{origin.get('cell') or origin.get('host') or 'an unrecorded build'})"
               if result.get("objects_cached") else "")
        home = f" ({tk.cuda_home}, CUDA_HOME from {tk.found_by})" if tk and tk.cuda_home else ""
        return done(
            "partial",
            f"every object compiled for {', '.join(targets) or arch}{how}; the final link failed: this toolkit"
            f"{home} has no libcuda.so stub (lib64/stubs), which a GPU host's driver provides",
            code,
        )
    wrong_root = _wrong_root(result, code)
    if wrong_root:
        return done("fail", f"{module} for {arch}: compile failed: {first}; {wrong_root}", "fi-toolkit-root")
    where = {
        "spec": "refused before compiling",
        "compile": "compile failed",
        "link": "link failed",
        "build": "build failed",
        "load": "built but failed to load",
        "import": "import flashinfer failed",
        "timeout": "timed out",
        "crash": "builder crashed",
    }.get(stage, stage)
    note = f"{module} for {arch}: {where}: {first}"
    if tk and code in _TOOLKIT_CODES:
        note += f" [nvcc: {tk.describe()}]"
    return done("fail", note, code)


def run(ctx: RankContext) -> dict[str, Any]:
    module = ctx.param("module") or "vllm_comm"
    arch = ctx.param("arch") or LOCAL
    if module not in fi.JIT_GENERATORS:
        return outcome("fail", note=f"unknown module {module!r}", reason_code="probe-bug")
    if arch != LOCAL:
        try:
            arch = str(gpuarch.parse_target(arch))
        except gpuarch.TargetError as exc:
            return outcome("fail", note=f"arch: {exc}", reason_code="probe-bug")
    if fi.generator_named_in_sources(module) is False:  # decided without the 10-30 s import of flashinfer
        absent = {"module": module, "flashinfer": fi.version(), "stage": "absent", "ok": False,
                  "absent_by": f"no Python source of this flashinfer names {module}'s generator"}
        return verdict(module, arch, absent, [])
    carried, why_not = carried_for_cell(module)
    if carried is not None:
        answered = from_carried(ctx, module, arch, carried)
        if answered is not None:
            return answered
    elif why_not:
        ctx.log(f"the carried {module} is not used: {why_not}")
    lacks: list[dict[str, Any]] = []
    if arch == LOCAL and _fi_existing.might_have(fi.version(), os.environ):
        local_cc = _local_cc()
        if local_cc is None:
            return _no_gpu()
        answered, lacks = from_environment(ctx, module, local_cc)
        if answered is not None:
            return answered
    cache = os.environ.get(CACHE_ENV) or str(ctx.workdir / "jit-cache")
    env = build_env(arch, cache)
    tk = toolkit.resolve(env, flashinfer=True)
    if not tk.found:
        return outcome(
            "skip",
            note="no nvcc in this environment: flashinfer cannot JIT anything here",
            reason_code="fi-no-nvcc",
            evidence={"toolkit": tk.as_dict()},
        )
    local_cc = _local_cc() if arch == LOCAL else None
    if arch == LOCAL and local_cc is None:
        return _no_gpu()
    os.makedirs(cache, exist_ok=True)
    # a quick pass builds only this module: the others' local builds would hold its answer for minutes
    quick = os.environ.get(LEVEL_ENV) == QUICK
    side = _prebuild_others(ctx, module, cache, local_cc) if arch == LOCAL and local_cc and not quick else None
    lasting = bool(_compile_cache.root() or os.environ.get(CACHE_ENV))  # a combined build outlives this variant
    combined = combined_archs(arch, os.environ.get(ARCHS_ENV, "")) if lasting and arch != LOCAL else ""
    result = _build(ctx, module, arch, combined, cache, tk)
    result.setdefault("toolkit", tk.as_dict())  # a builder that died early still says which toolkit it had
    if tk.nvcc:  # the toolkit the nvcc that runs belongs to, links followed: where its headers are
        result.setdefault("nvcc_root", os.path.dirname(os.path.dirname(os.path.realpath(tk.nvcc))))
    torch_cuda = torch_cuda_version()
    if torch_cuda:
        result["torch_cuda"] = torch_cuda
    if local_cc:
        result["local_capability"] = local_cc
    out = verdict(module, arch, result, _objects_targets(result))
    if lacks:
        out["evidence"]["environment_lacks"] = lacks
    if side is not None:
        out["evidence"]["side_builds"] = _await_side_builds(side)
    if arch == LOCAL and out["status"] == "pass":
        # what the GPU probes of this cell load instead of compiling it again (_flashinfer.use_prebuilt)
        where = fiprebuild.publish_loaded(module, result)
        if where:
            out["evidence"]["published_for_probes"] = where
    return out


def environment_env() -> dict[str, str]:
    """The environment flashinfer loads modules in here: this one untouched (its FLASHINFER_WORKSPACE_BASE or
    home folder, its flashinfer-jit-cache), with this code's path added and the arch list left to flashinfer's
    own detection, as for a local build."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_repo_root(), env.get("PYTHONPATH", "")) if p)
    env.pop("FLASHINFER_CUDA_ARCH_LIST", None)
    return env


def lacking(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each library the environment has that flashinfer would not load as it is, or that is not the module for
    this GPU, with why (paths and reasons as read: they name the environment's own folders)."""
    return [{"source": f.get("source"), "library": _carried.visible(str(f.get("library")), 400),
             "why": _carried.visible(str(f.get("stale") or f.get("refused")), 400)}
            for f in found if isinstance(f, dict) and (f.get("stale") or f.get("refused"))]


def from_environment(ctx: RankContext, module: str, capability: str, env: dict[str, str] | None = None,
                     load: bool = True) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The verdict on what this environment already has of ``module`` for a GPU of ``capability``
    (``_fi_existing.existing``: found where flashinfer looks, read back and loaded as flashinfer loads it),
    published for the GPU probes when it passes; None when it has nothing flashinfer would load as it is for this GPU,
    with each library looked at and why it is not taken (the variant then compiles)."""
    env = environment_env() if env is None else env
    result = _fi_existing.existing_subprocess(module, env, timeout_s=max(120.0, SPEC.timeout_s / 10),
                                           capability=capability, load=load)
    found = [f for f in result.get("found") or [] if isinstance(f, dict)]
    lacks = lacking(found)
    for f in lacks:
        where = _fi_existing.ENV_SOURCES.get(str(f['source']), f['source'])
        ctx.log(f"{f['library']} ({where}) is not used: {f['why']}")
    if result.get("stage") in ("none", "import", "absent", "spec", "timeout", "crash"):
        if result.get("stage") != "none":
            ctx.log(f"looking for {module} in this environment stopped at {result.get('stage')}: "
                    f"{str(result.get('error', ''))[-300:]}")
        return None, lacks
    result["local_capability"] = capability
    torch_cuda = torch_cuda_version()
    if torch_cuda:
        result["torch_cuda"] = torch_cuda
    ctx.log(f"{module}: {_fi_existing.ENV_SOURCES.get(str(result.get('cached_by')), '?')} has {result.get('library')}")
    out = verdict(module, LOCAL, result, _objects_targets(result))
    out["evidence"]["environment_found"] = [{k: f.get(k) for k in ("source", "library", "provider")} for f in found]
    if lacks:
        out["evidence"]["environment_lacks"] = lacks
    if out["status"] == "pass":
        where = fiprebuild.publish_loaded(module, result)
        if where:
            out["evidence"]["published_for_probes"] = where
    return out, lacks


def _local_cc() -> str | None:
    """The compute capability of the visible GPU 0 ("9.0"), or None when torch sees no GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return f"{major}.{minor}"


def _no_gpu() -> dict[str, Any]:
    return outcome("skip", note="no GPU visible: nothing local to compile for", reason_code="no-gpu")


def carried_result(module: str, carried: _carried.Carried) -> dict[str, Any]:
    """A carried library as a finished build that compiled nothing here (``cached_by: carried``), with what it
    needs at load time read from its bytes; the record says which build made it."""
    rec = carried.record
    toolkit_rec = rec.get("toolkit") if isinstance(rec.get("toolkit"), dict) else None
    origin = {k: rec.get(k) for k in ("name", "arch_list", "flashinfer", "torch", "built_at", "cell", "sass")}
    origin["nvcc"] = toolkit_rec.get("version") if toolkit_rec else None
    out: dict[str, Any] = {"module": module, "name": carried.name, "flashinfer": fi.version(), "stage": "done",
                           "ok": True, "library": str(carried.library), "cached": True, "cached_by": "carried",
                           "cached_from": origin, "arch_list": rec.get("arch_list")}
    if toolkit_rec:
        out["toolkit"] = toolkit_rec
    _fi_build.linkage(out)
    return out


def carried_for_cell(module: str) -> tuple[_carried.Carried | None, str]:
    """The cell's carried ``module`` when the kernel-set reader accepts it (no link, an ELF shared object with
    the module's entry points) and its record is this cell's (``_carried.usable``: flashinfer, torch with its
    CUDA build, nvcc and the module's sources as they are here); else None and why (escaped: the record may
    come from elsewhere)."""
    found, refused = _carried.usable(_carried.aot_dir())
    carried = found.get(module)
    if carried is not None:
        return carried, ""
    left_out = [f"{name}: {why}" for name, why in sorted(refused.items())]
    return None, _carried.visible("the kernel set left out " + "; ".join(left_out), 600) if left_out else ""


def from_carried(ctx: RankContext, module: str, arch: str, carried: _carried.Carried) -> dict[str, Any] | None:
    """The verdict on the cell's carried ``module`` when it holds SASS for ``arch`` (the local GPU's, for
    ``local``: loaded there as a probe loads it); None when it holds none, and the variant builds as usual."""
    local_cc = _local_cc() if arch == LOCAL else None
    if arch == LOCAL:
        if local_cc is None:
            return _no_gpu()
        if not carried.runs_on(local_cc):
            ctx.log(f"the carried {carried.name} holds {carried.sass}, nothing for {local_cc}: building it here")
            return None
    elif not expected_sass(arch) & set(carried.sass) or arch not in str(carried.record.get("arch_list")).split():
        ctx.log(f"the carried {carried.name} was built for {_carried.visible(str(carried.record.get('arch_list')))}"
                f" ({carried.sass}), not {arch}: building it here")
        return None
    result = carried_result(module, carried)
    if arch == LOCAL:
        ctx.log(f"loading the carried {carried.library}")
        env = build_env(LOCAL, str(ctx.workdir / "jit-cache"))
        loaded = _fi_build.run_build_subprocess(module, env, timeout_s=max(60.0, SPEC.timeout_s / 10), load=True,
                                                library=str(carried.library))
        if not loaded.get("ok"):
            result = {**result, **{k: v for k, v in loaded.items() if k in ("stage", "ok", "error")}}
        else:
            result.update({k: loaded[k] for k in ("loaded", "load_s") if k in loaded})
        result["local_capability"] = local_cc
    torch_cuda = torch_cuda_version()
    if torch_cuda:
        result["torch_cuda"] = torch_cuda
    out = verdict(module, arch, result, _objects_targets(result))
    out["evidence"]["carried"] = str(carried.library)
    return out


def _prebuild_others(ctx: RankContext, module: str, cache: str,
                     local_cc: str) -> tuple[Any, list[str], float] | None:
    """Start, once per cell, flashinfer release and run, from the variant of the module whose build is the longest
    (``fiprebuild.longest``), the local builds of every other comm module side by side into the compile cache
    (``fiprebuild``), beside this variant's own build: the GPU probes load them (``_flashinfer.use_prebuilt``),
    and each module's own variant then finds its build done instead of compiling in turn. Nothing a variant
    starts outlives it (``checks.run.isolate``), so this variant waits for them before it ends
    (:func:`_await_side_builds`). None when nothing was started."""
    root = fi.prebuilt_root()
    if _compile_cache.root() is None or root is None:
        return None
    carried = _carried.usable(_carried.aot_dir())[0]
    unbuilt = [m for m in fi.COMM_MODULES if not (m in carried and carried[m].runs_on(local_cc))]
    if module in unbuilt and fiprebuild.longest(unbuilt) != module:
        # the longest build's variant starts them: a variant waits for its side builds before it ends, and the
        # GPU probes that load a short module wait for its variant (on a 1x H100 pcie_ipc's variant, 11 s of
        # compiling, ended after trtllm_comm's 280 s side build, and every probe loading it waited as long)
        return None
    marker = root / f".prebuild-{fi.version() or 'unknown'}"
    try:
        if marker.exists() and time.time() - marker.stat().st_mtime < SPEC.timeout_s:
            return None
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{os.getpid()}\n")
    except OSError:
        return None
    others = [m for m in unbuilt if m != module]
    if others and _fi_existing.might_have(fi.version(), os.environ):  # what the environment has, its variant loads
        have = _fi_existing.have_subprocess(others, environment_env(), timeout_s=300.0, capability=local_cc)
        for m, found in have.items():
            # the GPU probes are told it needs no compile; its own variant reads it back and loads it
            where = fi.publish(str(found.get("name") or m), str(found.get("library") or ""),
                               found.get("flashinfer"), str(found.get("arch_dir") or ""))
            if where:
                fi.mark_published(m, where)
            ctx.log(f"this environment has {m} ({_fi_existing.ENV_SOURCES.get(str(found.get('source')), '?')}): "
                    f"not built side by side{'' if where else ', and not published for the GPU probes'}")
        others = [m for m in others if m not in have]
    if not others:
        return None
    # a workspace of their own: a probe that compiles a module itself meanwhile never shares a build folder
    # with them (the workspace is a placeholder in the key, so their builds are the variants' cache hits)
    proc = fiprebuild.start(others, build_env(LOCAL, os.path.join(cache, "prebuild")))
    ctx.log(f"started the local builds of {', '.join(others)} side by side" if proc else
            "could not start the local builds of the other modules")
    return (proc, others, time.monotonic()) if proc else None


def _await_side_builds(side: tuple[Any, list[str], float]) -> dict[str, Any]:
    """Wait for the side builds (within this variant's watchdog, less a minute for the verdict); what they
    were, how long they took from their start and which of them are published for the GPU probes. A build
    still running then is stopped: its module's variant builds it."""
    proc, modules, t0 = side
    try:
        rc = proc.wait(timeout=max(1.0, t0 + SPEC.timeout_s - 120 - time.monotonic()))
    except Exception:
        proc.kill()
        rc = None
    missing = set(fi.unpublished(modules, fi.version() or "unknown", os.environ))
    return {"modules": modules, "exit": rc, "wall_s": round(time.monotonic() - t0, 1),
            "published": [m for m in modules if m not in missing]}


# Failures no arch list changes: flashinfer did not import or has no such module, nvcc or the host compiler
# is missing, or every object compiled and the link failed. The combined build's failure then answers for
# each target; a build for one target alone would only repeat it (after compiling it all again, for a link).
ARCH_INDEPENDENT_STAGES = frozenset({"import", "absent"})
ARCH_INDEPENDENT_CODES = frozenset({"fi-no-nvcc", "fi-no-host-compiler", "fi-link-no-libcuda", "fi-link-missing-lib"})


def arch_independent(failed: dict[str, Any]) -> bool:
    return failed.get("stage") in ARCH_INDEPENDENT_STAGES or failed.get("reason_code") in ARCH_INDEPENDENT_CODES


def _combined_failure(arch: str, arch_list: str, result: dict[str, Any]) -> dict[str, Any] | None:
    """Why a combined build does not answer for ``arch``, or None when it does. It may have finished
    without ``arch``: flashinfer keeps the targets of the majors a module supports and drops the rest, where
    a build for ``arch`` alone is refused, and that refusal is the answer."""
    if result.get("ok"):
        targets = _objects_targets(result)
        if not targets or expected_sass(arch) & set(targets):
            return None  # unreadable output is judged as it would be for a build of its own
        return {"arch_list": arch_list, "stage": "done", "reason_code": "fi-wrong-arch",
                "line": f"the combined build holds {targets}, nothing for {arch}"}
    err = str(result.get("error", ""))
    return {"arch_list": arch_list, "stage": result.get("stage"), "reason_code": _fi_build.classify_jit_error(err),
            "line": _fi_build.signature_line(err) or err.strip()[-300:]}


def as_handed(given: dict[str, Any]) -> dict[str, Any]:
    """A combined build's result as another of its targets reports it: nothing compiled for this variant,
    so it is cached, from where the build's own variant had it (the compile cache, ninja) or from that
    variant's compile in this run."""
    made_there = ("handed_by", "handed_at", "log_tail", "compile_s", "compile_cpu_s", "link_s", "objects")
    out = {k: v for k, v in given.items() if k not in made_there}
    out["handed_over"] = {"by_arch": given.get("handed_by"), "at": given.get("handed_at")}
    if not given.get("cached"):
        out.update({"cached": True, "cached_by": "run",
                    "cached_from": {"arch_list": given.get("arch_list"), "built_at": given.get("handed_at"),
                                    "cell": os.environ.get(_compile_cache.CELL_ENV) or None,
                                    "flashinfer": given.get("flashinfer"), "compile_s": given.get("compile_s"),
                                    "compile_cpu_s": given.get("compile_cpu_s"),
                                    "variant": f"module={given.get('module')},arch={given.get('handed_by')}"}})
    return out


def _build(ctx: RankContext, module: str, arch: str, combined: str, cache: str,
           tk: toolkit.Toolkit) -> dict[str, Any]:
    """The build that answers for ``arch``: the combined one when it is asked for and finishes, else one
    for ``arch`` alone (the failed combined attempt is kept in the result)."""
    deadline = time.monotonic() + SPEC.timeout_s - 60
    failed: dict[str, Any] | None = None
    for arch_list in (combined, arch) if combined else (arch,):
        given = _compile_cache.handed(module, arch_list) if arch_list == combined else None
        if given is not None:
            ctx.log(f"{module} for {arch_list}: this run's combined build, handed over")
            result = as_handed(given)
        else:
            ctx.log(f"building {module} for {arch_list} with {tk.describe()}, cache {cache}")
            result = _fi_build.run_build_subprocess(module, build_env(arch_list, cache),
                                                    timeout_s=max(1.0, deadline - time.monotonic()),
                                                    load=arch == LOCAL)
            if arch_list == combined and result.get("ok"):  # the stored library: the build folder may go
                library = result.get("cache_library") or result.get("library")
                _compile_cache.hand_over(module, arch_list, {**result, "library": library, "handed_by": arch})
        if arch_list == arch:
            break
        failed = _combined_failure(arch, arch_list, result)
        if failed is None or arch_independent(failed):
            failed = None  # the combined result is the answer (evidence built_for names its list)
            break
    if failed:
        result["combined_attempt"] = failed
    return result


# --- declared fields: what this probe records, and the roles checks report and checks advise read them by
# (inenv.probe.Field: name, unit, meaning, role). Left out of the probe hash: it changes no verdict.
METRICS = (
    ("compile_s", "s", "wall time of compiling the module's sources", "compile-time"),
    ("compile_cpu_s", "s", "CPU time of the compilers", None),
    ("link_s", "s", "wall time of the final link", None),
    ("library_bytes", "bytes", "size of the linked module", None),
    ("objects", "count", "object files the build produced", None),
    ("cached", "bool", "the module came from the compile cache; nothing was compiled in this run", "cached"),
)
# One target each, cold, on this project's 2-core machine (flashinfer 0.6.16-0.7.4): trtllm_comm 880-1030 s,
# moe_a2a 140-370 s, the rest under a minute. Started longest first, the long builds of different cells overlap
# instead of one running alone at the end.
BUILD_COST = (("trtllm_comm", 950.0), ("moe_a2a", 340.0), ("pcie_ipc_ag_rs", 35.0), ("pcie_ipc", 18.0),
              ("vllm_comm", 14.0))
