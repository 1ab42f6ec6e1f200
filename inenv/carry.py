"""Compile one flashinfer comm module for a list of GPU architectures into a kernel set (``kit._carried``): what
`provision build` runs inside a cell so the cell carries its kernels. A tool the host launches (the kit's
``fi-carry`` entry), not a probe's helper: no probe imports it.

    python -m inenv.carry MODULE --archs "9.0a 12.0a 12.0f" --out DIR [--timeout S]
    python -m inenv.carry --identity '{"MODULE": [source names]}'   # the facts a record must match

One build for the whole list (``FLASHINFER_CUDA_ARCH_LIST``), through the same builder fi-jit uses
(``_fi_build``, in a fresh interpreter) and so through the shared compile cache when the host names one
(``STACKPROBE_COMPILE_CACHE``): the same sources, flags and nvcc give the same library whether this or fi-jit
asked for it. A library is carried only when it proves itself as fi-jit's verdict would: it holds SASS for
every listed architecture (read back from its bytes) and every driver function it calls resolves through a
``libcuda.so.1`` dependency. It is copied to ``DIR/<name>/<name>.so`` with its record beside it, each written
atomically. A module this flashinfer lacks, or a build that fails, carries nothing; the printed result says
why (the reason code fi-jit would give), and fi-jit proves the failure again on the GPU host.

Prints one line, ``RESULT_PREFIX`` + JSON. In-environment side: standard library (flashinfer runs in the
builder's own interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from inenv import atomic, gpuarch
from inenv.envinfo import torch_cuda_version
from inenv.kit import _carried, _compile_cache, _fatbin, _fi_build
from inenv.kit._flashinfer import JIT_GENERATORS

RESULT_PREFIX = "@@FI-CARRY@@ "
DEFAULT_TIMEOUT_S = 4 * 3600.0


def missing_sass(archs: list[str], sass: list[str]) -> list[str]:
    """The listed architectures none of whose SASS is in the library."""
    return [a for a in archs if not gpuarch.flashinfer_sass(gpuarch.parse_target(a)) & set(sass)]


def judge(module: str, archs: list[str], result: dict[str, Any]) -> dict[str, Any]:
    """What the build result carries: ``ok`` with the library and its SASS, or why not (pure but for reading
    the library's bytes). Judged fail-closed: a library whose linkage could not be read is not carried."""
    out: dict[str, Any] = {"module": module, "arch_list": " ".join(archs), "stage": result.get("stage"),
                           "flashinfer": result.get("flashinfer")}
    for key in ("compile_s", "compile_cpu_s", "cached", "cached_by", "toolkit", "source_hash"):
        if key in result:
            out[key] = result[key]
    if result.get("stage") == "absent":
        return {**out, "ok": False, "reason_code": "fi-module-absent",
                "line": f"flashinfer {result.get('flashinfer')} has no {module} module"}
    if not result.get("ok"):
        err = str(result.get("error", ""))
        line = _fi_build.signature_line(err) or (_fi_build.error_lines(err) or [err.strip()[-300:]])[0]
        # a builder that stopped without a verdict on the module is stackprobe's own failure (``harness: true``
        # in the reason catalogue), tried again by the next kernel stage
        stage = result.get("stage")
        code = ("kernel-build-timeout" if stage == "timeout" else "harness-error" if stage == "crash"
                else _fi_build.classify_jit_error(err))
        return {**out, "ok": False, "reason_code": code, "line": line[:300]}
    library = str(result.get("cache_library") or result.get("library") or "")
    if not library or not os.path.isfile(library):
        return {**out, "ok": False, "reason_code": "fi-arch-unverified", "line": "the build named no library"}
    sass = [t for t in _fatbin.archs([library]) if t.startswith("sm_")]
    lacking = missing_sass(archs, sass)
    unresolved = result.get("unresolved_driver_calls") or []
    if lacking:
        return {**out, "ok": False, "reason_code": "fi-wrong-arch", "sass": sass, "lacking": lacking,
                "line": f"the library holds {sass}, nothing for {', '.join(lacking)}"}
    if "needed" not in result:
        why = result.get("linkage_error") or "the build result holds no linkage facts"
        return {**out, "ok": False, "reason_code": "fi-link-unread",
                "line": f"what the library needs at load time could not be read ({why}), so it is not carried"}
    if unresolved:
        return {**out, "ok": False, "reason_code": "fi-link-unresolved",
                "line": f"calls {', '.join(unresolved[:3])} with no libcuda.so.1 dependency"}
    return {**out, "ok": True, "name": str(result.get("name") or module), "library": library, "sass": sass,
            "library_bytes": os.path.getsize(library)}


def spec_refusal(module: str, arch: str, env: dict[str, str]) -> str:
    """Why flashinfer refuses to make ``module``'s build for ``arch`` alone ("" when it accepts it), asked in
    a fresh interpreter that imports flashinfer and makes the spec, compiling nothing."""
    code = ("import sys; from inenv.kit._flashinfer import jit_generator; g = jit_generator(sys.argv[1]); "
            "g() if g else None")
    try:
        proc = subprocess.run([sys.executable, "-c", code, module], env={**env, "FLASHINFER_CUDA_ARCH_LIST": arch},
                              capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{type(exc).__name__}: {exc}"[:300]
    if proc.returncode == 0:
        return ""
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else f"exit {proc.returncode}")[:300]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def refusal(module: str, arch: str, env: dict[str, str], lacking: bool) -> dict[str, str]:
    """Why a declared target is not in the build, as its record says it: flashinfer's own gate refusing a
    build for ``arch`` alone (``fi-arch-gate``, with flashinfer's words, whether it refused the list or left
    the target out of it silently), else a build that lacked the target though flashinfer accepts it
    (``fi-wrong-arch``)."""
    why = spec_refusal(module, arch, env)
    if why:
        return {"reason_code": "fi-arch-gate", "line": why}
    return {"reason_code": "fi-wrong-arch" if lacking else "fi-jit-error",
            "line": "flashinfer accepts this target alone, but the build for the list holds nothing for it"}


def _set_archs(env: dict[str, str], archs: list[str]) -> None:
    env["FLASHINFER_CUDA_ARCH_LIST"] = " ".join(archs)
    env[_fi_build.THREADS_ENV] = env["FLASHINFER_NVCC_THREADS"] = str(max(1, len(archs)))


def carry(module: str, archs: list[str], out_dir: Path, timeout_s: float) -> dict[str, Any]:
    """Build, judge and, when it proves itself, write the module into ``out_dir``; the judged result.
    Nothing compiled is thrown away: when flashinfer's gate builds the module for part of the list (refusing
    the list, or leaving targets out of the library), it is carried for that part, and each target left out
    is recorded with flashinfer's reason (``refused``)."""
    declared = list(archs)
    env = dict(os.environ)
    _set_archs(env, archs)
    root = str(Path(__file__).resolve().parents[1])  # the folder that holds the inenv package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    t0 = time.monotonic()
    refused: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory(prefix="stackprobe-carry-") as scratch:
        env.setdefault("FLASHINFER_WORKSPACE_BASE", scratch)
        result = _fi_build.run_build_subprocess(module, env, timeout_s=timeout_s)
        if result.get("stage") == "spec" and len(archs) > 1:
            # flashinfer refused the list before compiling: an arch gate. Carry what it accepts alone.
            refused = {a: {"reason_code": "fi-arch-gate", "line": why} for a in archs
                       if (why := spec_refusal(module, a, env))}
            kept = [a for a in archs if a not in refused]
            if kept and refused:
                archs = kept
                _set_archs(env, archs)
                result = _fi_build.run_build_subprocess(module, env, timeout_s=timeout_s)
        judged = judge(module, archs, result)
        if not judged["ok"] and judged.get("lacking") and len(judged["lacking"]) < len(archs):
            # the library holds part of the list (flashinfer's gate dropped the rest without a word): carry it
            for arch in judged["lacking"]:
                refused[arch] = refusal(module, arch, env, lacking=True)
            archs = [a for a in archs if a not in refused]
            judged = judge(module, archs, result)
        if refused:
            judged["refused"] = refused
        judged["declared"] = " ".join(declared)
        judged["wall_s"] = round(time.monotonic() - t0, 1)
        if not judged["ok"]:
            return judged
        name = judged["name"]
        tk = result.get("toolkit") if isinstance(result.get("toolkit"), dict) else {}
        record = _carried.record_for(module, name, {**result, "library_bytes": judged["library_bytes"]},
                                     judged["sass"], {
                                         "arch_list": " ".join(archs), "declared": " ".join(declared),
                                         "refused": refused,
                                         "torch": torch_version(), "torch_cuda": torch_cuda_version(),
                                         "nvcc": tk.get("version"), _carried.TVM_FFI: _carried.tvm_ffi_version(),
                                         "cell": os.environ.get(_compile_cache.CELL_ENV) or None,
                                         "built_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")})
        folder = out_dir / name
        atomic.write_bytes(folder / f"{name}.so", Path(judged["library"]).read_bytes())
        atomic.write_json(folder / _carried.RECORD, record)
    judged["written"] = str(folder / f"{name}.so")
    return judged


def torch_version() -> str | None:
    return _carried.torch_version()


def identity(sources: dict[str, list[str]]) -> dict[str, Any]:
    """The facts of this environment a carried module's record must match (``_carried.cell_facts``)."""
    return _carried.cell_facts(sources)


def _main(argv: list[str]) -> int:
    if argv[:1] == ["--identity"] and len(argv) == 2:
        try:
            wanted = json.loads(argv[1])
        except ValueError:
            wanted = None
        if not isinstance(wanted, dict) or not all(isinstance(v, list) for v in wanted.values()):
            sys.stderr.write("--identity: give a JSON object of module -> list of source names\n")
            return 2
        sys.stdout.write(RESULT_PREFIX + json.dumps(identity(wanted), default=str) + "\n")
        return 0
    p = argparse.ArgumentParser(prog="python -m inenv.carry")
    p.add_argument("module", choices=sorted(JIT_GENERATORS))
    p.add_argument("--archs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    args = p.parse_args(argv)
    try:
        archs = list(gpuarch.parse_targets(args.archs.replace(" ", ",")))
    except gpuarch.TargetError as exc:
        sys.stderr.write(f"--archs: {exc}\n")
        return 2
    if not archs:
        sys.stderr.write("--archs: give at least one architecture\n")
        return 2
    try:
        result = carry(args.module, archs, Path(args.out), args.timeout)
    except OSError as exc:
        result = {"module": args.module, "ok": False, "reason_code": "harness-error",
                  "line": f"writing the kernel set: {type(exc).__name__}: {exc}"[:300]}
    sys.stdout.write(RESULT_PREFIX + json.dumps(result, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
