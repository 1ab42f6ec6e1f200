"""What the environment already has of a flashinfer JIT comm module, found where flashinfer looks, compiling
nothing: the modules of an installed flashinfer-jit-cache package (flashinfer's AOT artifacts, which it loads
first), then its own JIT cache, ``<FLASHINFER_WORKSPACE_BASE, else the home folder>/.cache/flashinfer/<flashinfer
version>/<arch folder, e.g. 90a>/cached_ops/<name>/<name>.so``. A JIT-cache library counts only when flashinfer
would load it without compiling: flashinfer rewrites the module's ``build.ninja`` when what it would write differs
(another toolkit, other flags or sources) and lets ninja rebuild whatever is older than its inputs, so the library
is current when the ``build.ninja`` beside it is the one this flashinfer writes now (written into a scratch folder
and compared, the user's cache untouched) and ``ninja -n`` finds nothing to do. Each is read back (the module's
entry points, SASS for the GPU) before it is taken.

Run as ``python -m inenv.kit._fi_existing [--have] MODULE... [--capability X.Y] [--load]``: flashinfer fixes its
target architectures when it is imported, so the answer comes from a fresh interpreter. It prints one line,
``_fi_build.RESULT_PREFIX`` + JSON.

In-environment side: standard library at import time; flashinfer is imported inside functions.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from inenv.kit import _carried, _compile_cache, _fatbin, _fi_build
from inenv.kit._flashinfer import JIT_GENERATORS, jit_generator, package_root, version

ENV_JIT_CACHE = "env-jit-cache"  # flashinfer's own JIT cache of this environment
JIT_CACHE_PACKAGE = "jit-cache-package"  # an installed flashinfer-jit-cache
ENV_SOURCES = {ENV_JIT_CACHE: "the environment's flashinfer JIT cache",
               JIT_CACHE_PACKAGE: "the installed flashinfer-jit-cache package"}


def jit_cache_root(env: Mapping[str, str]) -> Path:
    """flashinfer's cache folder in ``env``: ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer``, the base
    defaulting to the home folder (flashinfer.jit.env)."""
    base = env.get("FLASHINFER_WORKSPACE_BASE") or env.get("HOME") or str(Path.home())
    return Path(base) / ".cache" / "flashinfer"


def has_jit_cache_package() -> bool:
    try:
        return importlib.util.find_spec("flashinfer_jit_cache") is not None
    except (ImportError, ValueError):
        return False


def might_have(release: str | None, env: Mapping[str, str]) -> bool:
    """Whether there is anything to look for (read from folder names, flashinfer not imported): an installed
    flashinfer-jit-cache, or a library in the JIT cache of this flashinfer release for any arch folder."""
    if has_jit_cache_package():
        return True
    return bool(release) and any((jit_cache_root(env) / str(release)).glob("*/cached_ops/*/*.so"))


# --- in the interpreter that imports flashinfer --------------------------------------------------------------
def package_artifacts(spec: Any) -> list[dict[str, Any]]:
    """The flashinfer-jit-cache libraries flashinfer would load for ``spec`` (its AOT artifacts: every provider
    whose targets run on the arch list flashinfer resolved, best first), or, for a release that names no
    providers, its AOT path when that lies outside flashinfer's own package (a carried set lies inside)."""
    if not has_jit_cache_package():
        return []
    own = package_root()
    arts = getattr(spec, "aot_artifacts", None)
    out: list[dict[str, Any]] = []
    if arts is not None:
        for art in arts:
            path = Path(art.path)
            if own is not None and own in path.parents:
                continue
            archs = getattr(art, "cuda_architectures", None)
            out.append({"source": JIT_CACHE_PACKAGE, "library": str(path),
                        "provider": getattr(art, "provider_id", None),
                        "package_archs": sorted(archs) if archs else None, "current": True})
        return out
    path = Path(str(getattr(spec, "aot_path", "") or ""))
    if path.name and path.is_file() and not (own is not None and own in path.parents):
        out.append({"source": JIT_CACHE_PACKAGE, "library": str(path), "current": True})
    return out


_JIT_DIR_NAMES = ("FLASHINFER_JIT_DIR", "JIT_DIR")  # where flashinfer.jit.env keeps the cache's ops folder


@contextlib.contextmanager
def _jit_dir_at(env_module: Any, folder: Path) -> Any:
    """flashinfer's JIT ops folder pointed at ``folder`` for the block (a spec reads it at each call)."""
    saved = {n: getattr(env_module, n) for n in _JIT_DIR_NAMES if hasattr(env_module, n)}
    try:
        for n, old in saved.items():
            setattr(env_module, n, type(old)(folder) if isinstance(old, str | Path) else folder)
        yield saved
    finally:
        for n, old in saved.items():
            setattr(env_module, n, old)


def ninja_now(spec: Any, build_dir: Path) -> str | None:
    """The build.ninja this flashinfer writes for ``spec`` now, as it would read in ``build_dir``: written by
    the spec itself into a scratch ops folder, so the environment's cache is not touched. None when it cannot
    be written there."""
    try:
        from flashinfer.jit import env as jit_env
    except Exception:
        return None
    with tempfile.TemporaryDirectory(prefix="stackprobe-fi-env-") as scratch, _jit_dir_at(jit_env, Path(scratch)):
        try:
            ninja_path = Path(spec.ninja_path)
            if Path(scratch) not in ninja_path.parents:
                return None  # this layout does not take its folder from flashinfer.jit.env at call time
            spec.write_ninja()
            text = ninja_path.read_text()
        except Exception:
            return None
    return as_placed(text, Path(scratch), build_dir.parent)


def as_placed(text: str, scratch: Path, ops: Path) -> str:
    """A build file written under the ops folder ``scratch`` as it reads under ``ops``: flashinfer names
    objects and the library by resolved paths, so the resolved folder maps to the resolved one, and any
    unresolved spelling to the unresolved one."""
    for written, real in ((scratch.resolve(), ops.resolve()), (scratch, ops)):
        text = text.replace(str(written), str(real))
    return text


def staleness(spec: Any, build_dir: Path) -> str:
    """Why flashinfer would compile again before loading the library in ``build_dir`` ("" when it would load
    it as it is)."""
    ninja = build_dir / "build.ninja"
    if not ninja.is_file():
        return "no build.ninja beside it: flashinfer builds it again before loading"
    now = ninja_now(spec, build_dir)
    if now is None:
        return "this flashinfer's build file for it could not be written to compare, so it is not known current"
    if now != ninja.read_text(errors="replace"):
        return ("its build.ninja is not the one this flashinfer writes (another toolkit, other flags or sources): "
                "flashinfer rewrites it and compiles again")
    rc, log = _fi_build._ninja(str(build_dir), ["-n"])
    if rc != 0:
        return f"ninja -n could not tell: {(log.strip().splitlines() or ['exit ' + str(rc)])[-1][:200]}"
    if not _fi_build.up_to_date(log):
        steps = len(re.findall(r"^\[\d+/\d+\]", log, re.M))
        return f"ninja would run {steps or 'some'} step(s) again: a source or header is newer than what was built"
    return ""


def jit_cached(spec: Any) -> dict[str, Any] | None:
    """The library of ``spec`` in this environment's JIT cache, whether flashinfer would load it as it is
    (``current``) and why not (``stale``); None when the cache holds none."""
    lib = Path(str(getattr(spec, "jit_library_path", "") or ""))
    if not lib.name or not lib.is_file():
        return None
    why = staleness(spec, lib.parent)
    return {"source": ENV_JIT_CACHE, "library": str(lib), "current": not why, **({"stale": why} if why else {})}


def _found_origin(found: Mapping[str, Any]) -> dict[str, Any]:
    """What is known of who made a found library: stackprobe's build record beside it when one is there, the
    package's provider, and when the file was written."""
    lib = Path(str(found["library"]))
    origin: dict[str, Any] = {"source": found["source"], "path": str(lib)}
    if found["source"] == ENV_JIT_CACHE:
        record = _fi_build.read_record(str(lib.parent), [])
        origin.update({k: v for k, v in record.items() if k in ("built_at", "flashinfer", "toolkit", "gencode")})
    for key in ("provider", "package_archs"):
        if found.get(key) is not None:
            origin[key] = found[key]
    with contextlib.suppress(OSError):
        origin.setdefault("built_at", _compile_cache.iso(lib.stat().st_mtime))
    return origin


def environment_refusal(module: str, library: Path, capability: str | None) -> str:
    """Why a library found here is not ``module`` for a GPU of ``capability`` ("" when it is): not a plain ELF
    shared object exporting the module's entry points (``_carried.library_refusal``), or no SASS in it that
    runs on that GPU (read back from its bytes). Without a capability only the entry points are judged."""
    why = _carried.library_refusal(module, library)
    if why or capability is None:
        return why
    sass = [t for t in _fatbin.archs([library]) if t.startswith("sm_")]
    if not _fatbin.runs_on(sass, capability):
        return f"it holds {', '.join(sass) or 'no readable SASS'}: nothing that runs on compute capability {capability}"
    return ""


def existing(module: str, capability: str | None = None, load: bool = False) -> dict[str, Any]:
    """What flashinfer would load for ``module`` here without compiling, as a build result that compiled
    nothing (``cached_by`` names where it came from; ``found`` lists every place looked at, with why one is
    not current or not the module for a GPU of ``capability``), its linkage read and, with ``load``, loaded by
    flashinfer's own loader. ``stage`` is ``none`` when the environment has nothing flashinfer would load as
    it is that holds the module for this GPU."""
    out: dict[str, Any] = {"module": module, "flashinfer": version(),
                           "arch_list": os.environ.get("FLASHINFER_CUDA_ARCH_LIST") or "local"}
    try:
        import flashinfer  # noqa: F401  (fixes the arch list, and which providers count, from the environment)
    except Exception as exc:
        return _fi_build._stopped(out, "import", exc)
    out.update(_fi_build._arch_dir())
    gen = jit_generator(module)
    if gen is None:
        return _fi_build._stopped(out, "absent", f"this flashinfer has no {module} JIT module")
    try:
        spec = gen()
    except Exception as exc:
        return _fi_build._stopped(out, "spec", exc)
    out["name"] = getattr(spec, "name", module)
    t0 = time.monotonic()
    found = package_artifacts(spec)
    cached = jit_cached(spec)
    if cached is not None:
        found.append(cached)
    out["found"] = found
    out["lookup_s"] = round(time.monotonic() - t0, 2)
    for f in found:
        if f.get("current") and (why := environment_refusal(module, Path(str(f["library"])), capability)):
            f["refused"] = why
    # flashinfer's order: its AOT artifacts first, then its JIT cache
    chosen = next((f for f in found if f.get("current") and not f.get("refused")), None)
    if chosen is None:
        return {**out, "stage": "none", "ok": False}
    out.update({"library": chosen["library"], "cached": True, "cached_by": chosen["source"],
                "cached_from": _found_origin(chosen)})
    _fi_build.linkage(out)
    if load:
        if not _fi_build._loads_from_path(spec):
            return _fi_build._stopped(out, "load", "this flashinfer loads only its own build or AOT folder, "
                                                   "not a library named to it")
        stopped = _fi_build._load(out, spec)
        if stopped:
            return stopped
    return {**out, "stage": "done", "ok": True}


def existing_subprocess(module: str, env: dict[str, str], timeout_s: float, capability: str | None = None,
                   load: bool = False) -> dict[str, Any]:
    """:func:`existing` in a fresh interpreter with ``env``; a timeout or crash is a result too."""
    cmd = [sys.executable, "-m", "inenv.kit._fi_existing", module,
           *(["--capability", capability] if capability else []), *(["--load"] if load else [])]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"module": module, "stage": "timeout", "ok": False, "error": f"no answer in {timeout_s:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(_fi_build.RESULT_PREFIX):
            result: dict[str, Any] = json.loads(line[len(_fi_build.RESULT_PREFIX):])
            return result
    return {"module": module, "stage": "crash", "ok": False,
            "error": f"exited {proc.returncode} without an answer\n{(proc.stdout + proc.stderr)[-3000:]}"}


def have(modules: list[str], capability: str | None) -> dict[str, dict[str, Any]]:
    """Which of ``modules`` this environment has as flashinfer would load them and fit for a GPU of
    ``capability`` (nothing loaded), each with where (``source``: :data:`ENV_SOURCES`'s keys), its library,
    name, flashinfer's arch folder and release; one flashinfer import for all."""
    out: dict[str, dict[str, Any]] = {}
    for module in modules:
        found = existing(module, capability)
        if found.get("stage") == "done":
            out[module] = {"source": found.get("cached_by"), **{k: found.get(k) for k in
                                                                ("library", "name", "arch_dir", "flashinfer")}}
    return out


def have_subprocess(modules: list[str], env: dict[str, str], timeout_s: float,
                    capability: str | None = None) -> dict[str, dict[str, Any]]:
    """:func:`have` in a fresh interpreter with ``env``; {} when it gives no answer."""
    cmd = [sys.executable, "-m", "inenv.kit._fi_existing", "--have", *modules,
           *(["--capability", capability] if capability else [])]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {}
    for line in proc.stdout.splitlines():
        if line.startswith(_fi_build.RESULT_PREFIX):
            got = json.loads(line[len(_fi_build.RESULT_PREFIX):])
            return {str(k): v for k, v in got.items() if isinstance(v, dict)} if isinstance(got, dict) else {}
    return {}


def _existing_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m inenv.kit._fi_existing")
    ap.add_argument("module", nargs="*", help=f"one or more of {', '.join(JIT_GENERATORS)}")
    ap.add_argument("--have", action="store_true", help="say which of the modules the environment has (no load)")
    ap.add_argument("--capability", help="the GPU's compute capability, X.Y")
    ap.add_argument("--load", action="store_true")
    args = ap.parse_args(argv)
    if not args.module or any(m not in JIT_GENERATORS for m in args.module) or \
            (not args.have and len(args.module) != 1) or \
            (args.capability is not None and not re.fullmatch(r"\d+\.\d+", args.capability)):
        ap.print_usage(sys.stderr)
        return 2
    answer: Any = have(args.module, args.capability) if args.have else existing(args.module[0], args.capability,
                                                                                 args.load)
    sys.stdout.write(_fi_build.RESULT_PREFIX + json.dumps(answer, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_existing_main(sys.argv[1:]))
