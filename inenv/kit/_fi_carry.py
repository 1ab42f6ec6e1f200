"""Compile one flashinfer comm module for a list of GPU architectures into a kernel set (``_carried``): what
`provision build` runs inside a cell so the cell carries its kernels.

    python -m inenv.kit._fi_carry MODULE --archs "9.0a 12.0a 12.0f" --out DIR [--timeout S]

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
    the library's bytes)."""
    out: dict[str, Any] = {"module": module, "arch_list": " ".join(archs), "stage": result.get("stage"),
                           "flashinfer": result.get("flashinfer")}
    for key in ("compile_s", "compile_cpu_s", "cached", "cached_by", "toolkit"):
        if key in result:
            out[key] = result[key]
    if result.get("stage") == "absent":
        return {**out, "ok": False, "reason_code": "fi-module-absent",
                "line": f"flashinfer {result.get('flashinfer')} has no {module} module"}
    if not result.get("ok"):
        err = str(result.get("error", ""))
        line = _fi_build.signature_line(err) or (_fi_build.error_lines(err) or [err.strip()[-300:]])[0]
        return {**out, "ok": False, "reason_code": _fi_build.classify_jit_error(err), "line": line[:300]}
    library = str(result.get("cache_library") or result.get("library") or "")
    if not library or not os.path.isfile(library):
        return {**out, "ok": False, "reason_code": "fi-arch-unverified", "line": "the build named no library"}
    sass = [t for t in _fatbin.archs([library]) if t.startswith("sm_")]
    lacking = missing_sass(archs, sass)
    unresolved = result.get("unresolved_driver_calls") or []
    if lacking:
        return {**out, "ok": False, "reason_code": "fi-wrong-arch", "sass": sass,
                "line": f"the library holds {sass}, nothing for {', '.join(lacking)}"}
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


def carry(module: str, archs: list[str], out_dir: Path, timeout_s: float) -> dict[str, Any]:
    """Build, judge and, when it proves itself, write the module into ``out_dir``; the judged result."""
    env = dict(os.environ)
    env["FLASHINFER_CUDA_ARCH_LIST"] = " ".join(archs)
    env[_fi_build.THREADS_ENV] = env["FLASHINFER_NVCC_THREADS"] = str(max(1, len(archs)))
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    t0 = time.monotonic()
    refused: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="stackprobe-carry-") as scratch:
        env.setdefault("FLASHINFER_WORKSPACE_BASE", scratch)
        result = _fi_build.run_build_subprocess(module, env, timeout_s=timeout_s)
        if result.get("stage") == "spec" and len(archs) > 1:
            # flashinfer refused the list before compiling: an arch gate. Carry what it accepts alone.
            refused = {a: why for a in archs if (why := spec_refusal(module, a, env))}
            kept = [a for a in archs if a not in refused]
            if kept and refused:
                archs = kept
                env["FLASHINFER_CUDA_ARCH_LIST"] = " ".join(archs)
                env[_fi_build.THREADS_ENV] = env["FLASHINFER_NVCC_THREADS"] = str(len(archs))
                result = _fi_build.run_build_subprocess(module, env, timeout_s=timeout_s)
        judged = judge(module, archs, result)
        if refused:
            judged["refused"] = refused
        judged["wall_s"] = round(time.monotonic() - t0, 1)
        if not judged["ok"]:
            return judged
        name = judged["name"]
        record = _carried.record_for(module, name, {**result, "library_bytes": judged["library_bytes"]},
                                     judged["sass"], {
                                         "arch_list": " ".join(archs),
                                         "torch": _version("torch"), "torch_cuda": torch_cuda_version(),
                                         "cell": os.environ.get(_compile_cache.CELL_ENV) or None,
                                         "built_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                                         **({"refused": refused} if refused else {})})
        folder = out_dir / name
        atomic.write_bytes(folder / f"{name}.so", Path(judged["library"]).read_bytes())
        atomic.write_json(folder / _carried.RECORD, record)
    judged["written"] = str(folder / f"{name}.so")
    return judged


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m inenv.kit._fi_carry")
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
