"""Build one flashinfer JIT comm module and say exactly what happened: which nvcc compiled it, for which
architectures, whether ninja compiled anything or found it all up to date, and what the library needs to load.

What the environment already has, compiling nothing, is found in _fi_existing.py.

Run as ``python -m inenv.kit._fi_build MODULE [--load]``: flashinfer fixes its target architectures
(``FLASHINFER_CUDA_ARCH_LIST``) and its toolkit when it is imported, so every (module, arch, toolkit)
needs a fresh interpreter. It prints one line, ``RESULT_PREFIX`` + JSON. Compile and link run as two ninja
steps so a link failure is told from a compile failure.

In-environment side: standard library at import time; flashinfer and torch are imported inside functions.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from inenv import toolkit
from inenv.kit import _compile_cache, _elf
from inenv.kit._flashinfer import JIT_GENERATORS, jit_generator, version

RESULT_PREFIX = "@@FI-JIT@@ "
RECORD = "stackprobe-build.json"  # written next to the objects of each build that compiled them
_TAIL = 3000
_UP_TO_DATE = "ninja: no work to do."

# --- error classification ---------------------------------------------------------------------------
# (reason_code, regex) in priority order; the first that matches names the failure.
JIT_SIGNATURES: tuple[tuple[str, str], ...] = (
    ("fi-arch-gate", r"No supported CUDA architectures found for major versions"),
    ("fi-nvcc-too-old", r"SM 12\.x requires CUDA >= 12\.9"),
    ("nvcc-unsupported-arch", r"Unsupported gpu architecture|not defined for option 'gpu-name'"),
    # any library but libcuda missing (-lcudart, whether or not -lcuda is missing too): CUDA_HOME is not a
    # toolkit root, so a driver's libcuda would not finish the link; libcuda alone missing: no stub here
    ("fi-link-missing-lib", r"cannot find -l(?!cuda\b)[\w.+-]+"),
    ("fi-link-no-libcuda", r"cannot find -lcuda\b"),
    ("fi-link-unresolved", r"undefined symbol: cu[A-Z]\w*"),
    ("fi-missing-header", r"fatal error: [\w./+-]+\.h(?:pp)?: No such file or directory"),
    ("fi-no-nvcc", r"Could not find nvcc|nvcc: not found|No such file or directory: '[^']*nvcc'"),
    # flashinfer compiles its .cpp files with the host C++ compiler; an image without one stops there
    ("fi-no-host-compiler", r"\b(?:c\+\+|g\+\+|gcc|cc|clang\+\+): not found"),
    ("fi-nvcc-error", r"error: |\berror\b.*\.cu\(|ptxas (fatal|error)"),
)


def classify_jit_error(text: str) -> str:
    for code, pattern in JIT_SIGNATURES:
        if re.search(pattern, text):
            return code
    return "fi-jit-error"


def missing_libraries(text: str) -> list[str]:
    """Every library the linker could not find (``cudart``, ``cuda``), in the order it named them."""
    return list(dict.fromkeys(re.findall(r"cannot find -l([\w.+-]+?)(?=[:\s]|$)", text)))


def signature_line(text: str) -> str | None:
    """The log line that named the failure (``/bin/sh: 1: .../nvcc: not found`` rather than ninja's FAILED)."""
    for _code, pattern in JIT_SIGNATURES:
        for line in text.splitlines():
            if re.search(pattern, line):
                return line.strip()
    return None


def error_lines(text: str, limit: int = 6) -> list[str]:
    """The lines of a build log a person needs to read first."""
    keep = [ln.strip() for ln in text.splitlines() if re.search(r"error|Error|fatal|cannot find|FAILED", ln)]
    return keep[:limit]


# --- ninja ------------------------------------------------------------------------------------------
def ninja_targets(text: str) -> tuple[list[str], list[str]]:
    """(object targets, final targets) of a flashinfer build.ninja."""
    objs: list[str] = []
    finals: list[str] = []
    for line in text.splitlines():
        m = re.match(r"build (\S+): (\S+)", line)
        if m is None:
            continue
        (objs if m.group(2) in ("compile", "cuda_compile") else finals).append(m.group(1))
    return objs, finals


def ninja_toolkit(text: str) -> dict[str, str]:
    """The ``cuda_home`` and ``nvcc`` a flashinfer build.ninja compiles with (``$cuda_home`` expanded)."""
    found = dict(re.findall(r"^(cuda_home|nvcc) = (.*)$", text, re.M))
    if "nvcc" in found and "cuda_home" in found:
        found["nvcc"] = found["nvcc"].replace("$cuda_home", found["cuda_home"])
    return found


def missing_tools(text: str) -> list[str]:
    """The compilers a flashinfer build.ninja names (``nvcc``, then the host compiler ``cxx``) that cannot be
    run here, each as the shell would report it (``.../nvcc: not found``). Checked before ninja starts, so a
    cell lacking both says so in the same order whichever job ninja would have started first."""
    cxx = re.search(r"^cxx = (.*)$", text, re.M)
    missing = []
    for command in (ninja_toolkit(text).get("nvcc", ""), cxx.group(1) if cxx else ""):
        tool = (command.split() or [""])[0]
        if not tool or "$" in tool:  # absent, or a variable only ninja knows: ninja's own run will tell
            continue
        usable = os.access(tool, os.X_OK) if os.sep in tool else shutil.which(tool) is not None
        if not usable:
            missing.append(f"{tool}: not found")
    return missing


def up_to_date(log: str) -> bool:
    """Whether a ninja step ran nothing because every output was newer than its inputs and command."""
    return _UP_TO_DATE in log


def _ninja_binary() -> str:
    """This interpreter's own ninja (the environment's ``ninja`` package) before any on PATH."""
    bindir = os.path.dirname(sys.executable)
    return os.environ.get("STACKPROBE_NINJA") or shutil.which("ninja", path=f"{bindir}{os.pathsep}"
                                                               f"{os.environ.get('PATH', '')}") or "ninja"


def _children_cpu_s() -> float:
    """User and system CPU seconds of this process's finished children (and theirs, as each waited for them)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _ninja(build_dir: str, targets: list[str]) -> tuple[int, str]:
    cmd = [_ninja_binary(), "-C", build_dir, *targets]
    jobs = os.environ.get("MAX_JOBS")
    if jobs:
        cmd[1:1] = ["-j", jobs]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        return 127, f"ninja: {exc}"
    return proc.returncode, (proc.stdout + proc.stderr)


# --- provenance of cached objects ---------------------------------------------------------------------
def write_record(build_dir: str, record: dict[str, Any]) -> None:
    # A read-only cache still builds; its next hit is then reported without a record.
    with contextlib.suppress(OSError):
        Path(build_dir, RECORD).write_text(json.dumps(record, sort_keys=True) + "\n")


def read_record(build_dir: str, objects: list[str]) -> dict[str, Any]:
    """What built the objects ninja found up to date: the record of that build, or, when it was built
    outside this builder, only when the newest object was written."""
    try:
        return dict(json.loads(Path(build_dir, RECORD).read_text()))
    except (OSError, ValueError):
        pass
    stamps = [os.path.getmtime(p) for p in (os.path.join(build_dir, o) for o in objects) if os.path.exists(p)]
    written = _compile_cache.iso(max(stamps)) if stamps else None
    return {"record": "none (built outside stackprobe)", "objects_written_at": written}


# --- one build, in this process -------------------------------------------------------------------------
def _flashinfer_cuda_home() -> dict[str, str]:
    """The toolkit flashinfer itself resolved (its answer, next to our reading of its rule)."""
    try:
        from flashinfer.jit import cpp_ext

        return {"flashinfer_cuda_home": str(cpp_ext.get_cuda_path())}
    except Exception as exc:  # older layouts, or no toolkit at all: flashinfer's own error is the fact
        return {"flashinfer_cuda_home_error": f"{type(exc).__name__}: {exc}"[:300]}


def _arch_dir() -> dict[str, str]:
    """The name of the folder flashinfer keeps this arch list's builds in (``90a``, ``120a_120f``): where a
    local build is published for the probes (``_flashinfer.publish``)."""
    try:
        from flashinfer.jit import env as jit_env

        return {"arch_dir": Path(jit_env.FLASHINFER_WORKSPACE_DIR).name}
    except Exception:  # a layout without it: nothing is published
        return {}


def _toolkit_used(mirror: toolkit.Toolkit, ninja: dict[str, str]) -> dict[str, Any]:
    """The toolkit that compiled: build.ninja's nvcc when it differs from the one our rule found."""
    if not ninja.get("nvcc") or ninja["nvcc"] == mirror.nvcc:
        return {"toolkit": mirror.as_dict()}
    used = toolkit.with_version(toolkit.Toolkit(ninja["nvcc"], ninja.get("cuda_home", ""), "build.ninja"))
    return {"toolkit": used.as_dict(), "toolkit_rule": mirror.as_dict()}


def _library(spec: Any) -> str:
    """The JIT output itself: get_library_path() answers with an AOT artifact when one is installed."""
    lib = getattr(spec, "jit_library_path", None)
    if lib is None and hasattr(spec, "get_library_path"):
        lib = spec.get_library_path()
    return str(lib or "")


def linkage(out: dict[str, Any]) -> None:
    """Add the size of ``out["library"]`` and what it needs at load time (its NEEDED entries, the driver
    functions it calls, those no libcuda.so.1 dependency resolves) to ``out``."""
    _linkage(out)


def _linkage(out: dict[str, Any]) -> None:
    lib = out.get("library") or ""
    out["library_bytes"] = os.path.getsize(lib) if lib and os.path.exists(lib) else 0
    if out["library_bytes"]:
        linked = _elf.linkage(lib)
        if linked is not None:
            out["needed"] = list(linked.needed)
            out["driver_calls"] = list(linked.driver_calls())
            out["unresolved_driver_calls"] = list(linked.unresolved_driver_calls())
        else:  # unread is not "needs nothing": whoever judges the library must know it was not read
            out["linkage_error"] = _elf.unread(lib) or "not read"


_EDGE = re.compile(r"\[\d+/\d+\] ")  # ninja's line for the next command it runs


def failure_excerpt(log: str, limit: int = _TAIL) -> str:
    """What a ninja log says about why it failed: the first ``FAILED:`` edge with its compiler output (its
    long command cut short) and the log's last line. The plain tail is not enough: with several jobs in
    flight, ninja prints the other commands after the failure, and one nvcc command line is over 1.5 kB,
    so the tail held command lines and no error (seen with flashinfer 0.7.4's moe_a2a, whose missing
    ``curand_kernel.h`` never reached the result)."""
    lines = log.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("FAILED:")), None)
    if start is None:
        return log[-limit:]
    end = next((j for j in range(start + 1, len(lines)) if _EDGE.match(lines[j])), len(lines))
    failed = lines[start:end]
    if len(failed) > 1 and len(failed[1]) > 300:
        failed[1] = failed[1][:300] + " ..."  # the command itself: its output says more
    if lines[-1] not in failed:
        failed.append(lines[-1])
    text = "\n".join(failed)
    return text if len(text) <= limit else text[: limit // 2] + "\n...\n" + text[-limit // 2:]


def _stopped(out: dict[str, Any], stage: str, error: str | BaseException) -> dict[str, Any]:
    """The result of a build that stopped at ``stage``: what was learnt before it, and why it stopped."""
    text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else failure_excerpt(error)
    return {**out, "stage": stage, "ok": False, "error": text[-_TAIL:]}


def _site_root() -> str:
    """The folder that holds the flashinfer package (site-packages, or a source tree on PYTHONPATH)."""
    import flashinfer

    return str(Path(flashinfer.__file__).resolve().parent.parent)


def _loads_from_path(spec: Any) -> bool:
    """Whether flashinfer can load a library from a path of our choosing (a cached one); without that only
    its own build directory is loaded, so a cache hit could not be what is loaded."""
    load_fn = getattr(spec, "load", None)
    try:
        return load_fn is not None and "so_path" in inspect.signature(load_fn).parameters
    except (TypeError, ValueError):
        return False


def _places(build_dir: str) -> dict[str, str]:
    """The folders that only say where a build happens, by the placeholder the cache writes for them: the
    build directory, the folder holding flashinfer, the JIT workspace, and the CUDA toolkit's folder
    (flashinfer's ``cuda_home``: a venv cell's own ``<venv>/cuda``). What the toolkit is stays in the key
    (nvcc's ``--version``) and in each entry's manifest (the toolkit headers a build read, by digest)."""
    home = toolkit.locate(os.environ, flashinfer=True).cuda_home
    system = ("/", "/usr", "/usr/local", "/opt")  # a toolkit there is no placeholder: these hold much else
    cuda = "" if not home or os.path.normpath(home) in system else home
    return {"$BUILD": build_dir, "$SITE": _site_root(), "$WORKSPACE": os.environ.get("FLASHINFER_WORKSPACE_BASE", ""),
            "$CUDA": cuda}


def _cache_key(module: str, text: str, places: dict[str, str], out: dict[str, Any]) -> str | None:
    """This build's key in the shared store; None (and why, in ``out``) when its inputs cannot be read."""
    t0 = time.monotonic()
    try:
        key = _compile_cache.key_of(_compile_cache.recipe(module, text, places, os.environ))
    except (OSError, AttributeError, TypeError) as exc:  # an unreadable input, or a flashinfer without __file__
        out["cache_error"] = f"key: {type(exc).__name__}: {exc}"[:300]
        return None
    out["cache_key_s"] = round(time.monotonic() - t0, 2)
    return key


def headers_read(build_dir: str, objs: list[str], text: str, places: dict[str, str]) -> tuple[dict[str, str], str]:
    """The manifest of a finished build: each header the compiler read for ``objs`` (``ninja -t deps``,
    recorded from nvcc's dependency output), or every include folder's files when ninja cannot say."""
    try:
        proc = subprocess.run([_ninja_binary(), "-C", build_dir, "-t", "deps", *objs], capture_output=True,
                              text=True, timeout=120)
        deps = _compile_cache.ninja_deps(proc.stdout) if proc.returncode == 0 else []
    except (OSError, subprocess.SubprocessError):
        deps = []
    if deps:
        return _compile_cache.manifest(deps, _compile_cache.sources(text), places), "ninja -t deps"
    return _compile_cache.tree_manifest(text, places), "include folders (ninja listed no headers)"


def _load(out: dict[str, Any], spec: Any) -> dict[str, Any] | None:
    """flashinfer's own loader, after CUDA is up (libcuda is then loaded, privately, by the runtime):
    exactly the state a probe or a server loads the module in. None when it loaded."""
    t2 = time.monotonic()
    try:
        import torch

        torch.zeros(1, device="cuda")
        if _loads_from_path(spec):
            spec.load(out["library"])
        else:
            spec.build_and_load()  # ninja has nothing left to do: the same build directory was just built
    except Exception as exc:
        return _stopped(out, "load", exc)
    out["load_s"] = round(time.monotonic() - t2, 1)
    out["loaded"] = True
    return None


def _ninja_build(out: dict[str, Any], module: str, build_dir: str, objs: list[str], finals: list[str],
                 t0: float) -> dict[str, Any] | None:
    """Compile, then link, with ninja in the build directory; None when both finished."""
    used = _children_cpu_s()
    rc, log = _ninja(build_dir, objs)
    out["compile_s"] = round(time.monotonic() - t0, 1)
    # CPU seconds of ninja and every compiler it ran: what the build costs whatever else shares the machine
    out["compile_cpu_s"] = round(_children_cpu_s() - used, 1)
    out["objects"] = len(objs)
    if rc != 0:
        return _stopped(out, "compile", log)
    out["cached"] = up_to_date(log)
    if out["cached"]:
        out["cached_by"] = "ninja"
        out["cached_from"] = read_record(build_dir, objs)
    else:
        write_record(build_dir, {"built_at": _compile_cache.iso(time.time()), "module": module,
                                 "flashinfer": out["flashinfer"], "toolkit": out["toolkit"], "gencode": out["gencode"]})
    t1 = time.monotonic()
    rc, log = _ninja(build_dir, finals)
    out["link_s"] = round(time.monotonic() - t1, 1)
    out["link_cached"] = up_to_date(log)
    if rc != 0:
        return _stopped(out, "link", log)
    return None


THREADS_ENV = "STACKPROBE_NVCC_THREADS"  # how many targets nvcc compiles at once (the host sets it)
# How many threads nvcc may spread one object's optimisation passes and ptxas over (``-split-compile=N``; fi-jit
# sets it for builds for the local GPU, where one object's compile is the run's critical path)
SPLIT_ENV = "STACKPROBE_NVCC_SPLIT"
SPLIT_FROM_MAJOR = 12  # nvcc has -split-compile from CUDA 11.8 on; older toolkits are left alone
EXTRA_CUDAFLAGS = "FLASHINFER_EXTRA_CUDAFLAGS"  # flashinfer (0.6.16 on) writes these into its ninja file
_SPLIT = re.compile(r"(?:^|\s)--?split-compile[= ](\d+)")


def nvcc_split(tk: toolkit.Toolkit) -> bool:
    """Ask flashinfer to give nvcc ``-split-compile=N`` (through :data:`EXTRA_CUDAFLAGS`, so the flag is in the
    ninja file: ninja rebuilds when it changes, and the cache key holds it) when :data:`SPLIT_ENV` asks for more
    than one thread, the toolkit's nvcc has the flag and the environment asks for no split of its own. Whether
    the build used it is read from the ninja file (:func:`split_of`): a flashinfer that ignores the variable
    builds whole. True when this asked for it."""
    n = os.environ.get(SPLIT_ENV, "")
    own = os.environ.get(EXTRA_CUDAFLAGS, "")
    if not n.isdigit() or int(n) < 2 or (tk.major or 0) < SPLIT_FROM_MAJOR \
            or "split-compile" in f"{own} {os.environ.get('NVCC_APPEND_FLAGS', '')}":
        return False
    os.environ[EXTRA_CUDAFLAGS] = f"{own} -split-compile={int(n)}".strip()
    return True


def split_of(text: str) -> int | None:
    """The thread count of the split compile a ninja file asks nvcc for; None when it asks for none."""
    found = _SPLIT.search(text)
    return int(found.group(1)) if found else None


def _nvcc_threads(text: str) -> None:
    """Let nvcc compile the targets of one object in parallel (``--threads N``) when asked and the ninja file
    does not set it already (flashinfer's own FLASHINFER_NVCC_THREADS); the flag is no part of the key."""
    n = os.environ.get(THREADS_ENV, "")
    if n.isdigit() and int(n) > 1 and "--threads" not in text:
        os.environ["NVCC_APPEND_FLAGS"] = f"{os.environ.get('NVCC_APPEND_FLAGS', '')} --threads {n}".strip()


def kept_names(build_dir: str, objs: list[str]) -> list[str]:
    """The objects by their path inside the build folder (a ninja file may name them absolutely, and another
    build of the same key has another folder); [] when one lies outside it (then none are kept)."""
    names = [os.path.relpath(os.path.join(build_dir, o), build_dir) for o in objs]
    return [] if any(n.startswith("..") for n in names) else names


def _chain(build_dir: str, targets: list[str]) -> list[str]:
    """The commands ninja would run to make ``targets``, in order (``ninja -t commands``)."""
    rc, log = _ninja(build_dir, ["-t", "commands", *targets])
    return log.splitlines() if rc == 0 else []


def _link_kept(out: dict[str, Any], kept: tuple[Path, dict[str, Any]], build_dir: str, objs: list[str],
               finals: list[str], t0: float) -> dict[str, Any] | None:
    """Link from objects an earlier build of this key compiled (its link failed): copy them in and run only
    the commands after the compiles. None when the link finished; the link's failure is this build's."""
    folder, record = kept
    compiles = set(_chain(build_dir, objs))
    link = [c for c in _chain(build_dir, finals) if c not in compiles]
    if not link:
        return _stopped(out, "link", "ninja -t commands listed no link command")
    _compile_cache.restore_objects(folder, kept_names(build_dir, objs), build_dir)
    origin = {k: v for k, v in record.items() if k not in ("manifest", "objects")}
    out.update({"compile_s": round(time.monotonic() - t0, 1), "compile_cpu_s": 0.0, "objects": len(objs),
                "objects_cached": True, "objects_from": origin})
    t1 = time.monotonic()
    for command in link:
        proc = subprocess.run(command, shell=True, cwd=build_dir, capture_output=True, text=True)
        if proc.returncode != 0:
            out["link_s"] = round(time.monotonic() - t1, 1)
            return _stopped(out, "link", f"FAILED: {Path(folder).name}\n{command}\n{proc.stdout}{proc.stderr}")
    out["link_s"] = round(time.monotonic() - t1, 1)
    out.update({"cached": True, "cached_by": "store-objects", "cached_from": origin})
    return None


def _keep_objects(out: dict[str, Any], module: str, store: Path, key: str, build_dir: str, objs: list[str],
                  names: list[str], text: str, places: dict[str, str]) -> None:
    """Keep the objects of a build that compiled and failed at the link, for the next build of its key."""
    items, how = headers_read(build_dir, objs, text, places)
    record = {**_compile_cache.provenance(), "flashinfer": out["flashinfer"], "module": module,
              "name": out.get("name"), "gencode": out["gencode"], "arch_list": out["arch_list"],
              "compile_s": out.get("compile_s"), "compile_cpu_s": out.get("compile_cpu_s"), "manifest_from": how}
    try:
        out["objects_stored"] = _compile_cache.store_objects(store, key, build_dir, names, record, items)
    except OSError as exc:
        out["cache_error"] = f"store objects: {type(exc).__name__}: {exc}"[:300]


def _store(out: dict[str, Any], module: str, store: Path, key: str, library: str,
           items: dict[str, str], how: str) -> None:
    """Put a finished build into the shared store; a store that cannot be written is said, not fatal."""
    record = {**_compile_cache.provenance(), "flashinfer": out["flashinfer"], "module": module,
              "name": out.get("name"), "toolkit": out["toolkit"], "gencode": out["gencode"],
              "arch_list": out["arch_list"], "compile_s": out.get("compile_s"), "link_s": out.get("link_s"),
              "manifest_from": how}
    try:
        entry, out["cache_stored"] = _compile_cache.store(store, key, library, record, items)
        out["cache_entry"] = os.path.basename(os.path.dirname(entry.library))
        out["cache_library"] = str(entry.library)  # outlives the build folder (a variant's scratch)
        out["cache_headers"] = len(items)
    except OSError as exc:
        out["cache_error"] = f"store: {type(exc).__name__}: {exc}"[:300]


def _jit_spec(out: dict[str, Any], module: str) -> tuple[Any, dict[str, Any] | None]:
    """flashinfer imported (which fixes the compilation context from the environment) and the module's JitSpec:
    (the spec, None), or (None, the result that stopped there)."""
    try:
        import flashinfer  # noqa: F401  (fixes the compilation context from the environment)
    except Exception as exc:
        return None, _stopped(out, "import", exc)
    out.update(_flashinfer_cuda_home())
    out.update(_arch_dir())
    gen = jit_generator(module)
    if gen is None:
        return None, _stopped(out, "absent", f"this flashinfer has no {module} JIT module")
    try:
        spec = gen()  # arch gates raise here
    except Exception as exc:
        return None, _stopped(out, "spec", exc)
    out["name"] = getattr(spec, "name", module)
    return spec, None


def _one_step(out: dict[str, Any], spec: Any, t0: float) -> dict[str, Any]:
    """A JitSpec without a ninja file of its own: flashinfer builds in one step, and whether it compiled
    anything is unknown. The library is still read back, so a pass needs its code like any other."""
    try:
        spec.build_and_load()
    except Exception as exc:
        return _stopped(out, "build", exc)
    out.update({"compile_s": round(time.monotonic() - t0, 1), "library": _library(spec), "one_step": True,
                "sources": [], "source_hash": _compile_cache.source_hash([], _site_root())})  # none listed
    build_dir = getattr(spec, "build_dir", None)
    if build_dir is not None:
        out["build_dir"] = str(build_dir)
    _linkage(out)
    return {**out, "stage": "done", "ok": True}


def _read_ninja(out: dict[str, Any], spec: Any, mirror: toolkit.Toolkit) -> tuple[str, str, list[str], list[str]]:
    """The module's ninja file written and read: (build folder, its text, object targets, final targets), with
    the sources, their hash, the gencode flags and the toolkit it names recorded in ``out``."""
    spec.write_ninja()
    ninja_path = Path(spec.ninja_path)
    build_dir = str(getattr(spec, "build_dir", None) or ninja_path.parent)  # 0.5.x has no build_dir
    out["build_dir"] = build_dir
    text = ninja_path.read_text()
    objs, finals = ninja_targets(text)
    site = _site_root()
    out["sources"] = _compile_cache.source_names(text, site)
    out["source_hash"] = _compile_cache.source_hash(out["sources"], site)
    out["gencode"] = sorted(set(re.findall(r"-gencode=\S+", text)))
    out.update(_toolkit_used(mirror, ninja_toolkit(text)))
    return build_dir, text, objs, finals


def _compile(out: dict[str, Any], module: str, spec: Any, ninja: tuple[str, str, list[str], list[str]],
             store: Path | None, key: str | None, places: dict[str, str], t0: float) -> dict[str, Any] | None:
    """Compile and link (or link the store's kept objects), note a compile in the store and store the library;
    the result that stopped, or None with ``out["library"]`` set. Runs while the build holds its key."""
    build_dir, text, objs, finals = ninja
    _nvcc_threads(text)
    names = kept_names(build_dir, objs)
    kept = _compile_cache.lookup_objects(store, key, names, places, _compile_cache.search_order(text)) \
        if store and key and names else None
    if kept is not None:
        stopped = _link_kept(out, kept, build_dir, objs, finals, t0)
    elif missing := missing_tools(text):
        stopped = _stopped(out, "compile", "\n".join(missing))
    else:
        stopped = _ninja_build(out, module, build_dir, objs, finals, t0)
    if stopped:
        if stopped.get("stage") == "link" and kept is None and store and key and names:
            _keep_objects(stopped, module, store, key, build_dir, objs, names, text, places)
            if not stopped.get("cached"):
                _compile_cache.note_compile(store, key, {**_compile_cache.provenance(), **stopped})
        return stopped  # a failed build is never stored as a library: it is proven again on every run
    out["library"] = _library(spec)
    if store and key and kept is None and not out.get("cached"):  # the compilers ran: counted once per key
        _compile_cache.note_compile(store, key, {**_compile_cache.provenance(), **out})
    if store and key and os.path.isfile(out["library"]):
        items, how = headers_read(build_dir, objs, text, places)
        _store(out, module, store, key, out["library"], items, how)
    return None


def build_module(module: str, load: bool = False) -> dict[str, Any]:
    """:func:`build`, with nvcc's split compile where it is asked for (:func:`nvcc_split`); when nvcc failed to
    compile with the split this code asked for, the build again without it: the answer is then the build
    flashinfer itself would run, and the result keeps the split's error lines (``split_compile_failed``)."""
    mirror = toolkit.resolve(flashinfer=True)
    own = os.environ.get(EXTRA_CUDAFLAGS)
    asked = nvcc_split(mirror)
    first = build(module, load, mirror)
    if not asked or not first.get("split_compile") or first.get("stage") != "compile":
        return first
    if own is None:
        os.environ.pop(EXTRA_CUDAFLAGS, None)
    else:
        os.environ[EXTRA_CUDAFLAGS] = own
    os.environ[SPLIT_ENV] = "1"
    again = build(module, load, mirror)
    again["split_compile_failed"] = error_lines(str(first.get("error", "")), 3)
    return again


def build(module: str, load: bool = False, mirror: toolkit.Toolkit | None = None) -> dict[str, Any]:
    """Build one comm module for the architectures flashinfer resolved at import; compile and link apart,
    then read what the library needs at load time and, with ``load`` (a GPU is visible), load it.

    With a shared store (``STACKPROBE_COMPILE_CACHE``) a build whose key is there is not compiled: the
    result names the stored library, which is read back like a fresh one, and the build that made it."""
    out: dict[str, Any] = {"module": module, "flashinfer": version(),
                           "arch_list": os.environ.get("FLASHINFER_CUDA_ARCH_LIST") or "local"}
    mirror = mirror or toolkit.resolve(flashinfer=True)
    out["toolkit"] = mirror.as_dict()
    t0 = time.monotonic()
    spec, stopped = _jit_spec(out, module)
    if stopped is not None:
        return stopped
    if not hasattr(spec, "write_ninja") or not hasattr(spec, "ninja_path"):
        return _one_step(out, spec, t0)
    ninja = _read_ninja(out, spec, mirror)
    build_dir, text = ninja[0], ninja[1]
    if (split := split_of(text)) is not None:
        out["split_compile"] = split
    store = _compile_cache.root()
    usable = store and (_loads_from_path(spec) or not load)
    places = _places(build_dir) if usable else {}
    key = _cache_key(module, text, places, out) if usable else None
    with contextlib.ExitStack() as held:
        if store and key:
            out["cache_key"] = key
            out["cache_wait_s"] = held.enter_context(_compile_cache.building(store, key))
            t1 = time.monotonic()
            hit, misses = _compile_cache.lookup(store, key, places, _compile_cache.search_order(text))
            out["cache_lookup_s"] = round(time.monotonic() - t1, 2)
            if misses:
                out["cache_misses"] = misses[:5]  # entries of this key whose headers differ here, and which
            if hit is not None:
                origin = {k: v for k, v in hit.record.items() if k != "manifest"}
                out.update({"cached": True, "cached_by": "store", "cached_from": origin, "library": hit.library,
                            "cache_entry": os.path.basename(os.path.dirname(hit.library)),
                            "compile_s": round(time.monotonic() - t0, 1)})
                _linkage(out)
                stopped = _load(out, spec) if load else None
                return stopped or {**out, "stage": "done", "ok": True}
        stopped = _compile(out, module, spec, ninja, store, key, places, t0)
        if stopped:
            return stopped
    _linkage(out)
    if load:
        stopped = _load(out, spec)
        if stopped:
            return stopped
    return {**out, "stage": "done", "ok": True}


def load_library(module: str, library: str) -> dict[str, Any]:
    """Load a library built elsewhere (a cell's carried module) with flashinfer's own loader for ``module``,
    compiling nothing: what it needs at load time, then the load itself."""
    out: dict[str, Any] = {"module": module, "flashinfer": version(), "library": library}
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:
        return _stopped(out, "import", exc)
    gen = jit_generator(module)
    if gen is None:
        return _stopped(out, "absent", f"this flashinfer has no {module} JIT module")
    try:
        spec = gen()
    except Exception as exc:
        return _stopped(out, "spec", exc)
    out["name"] = getattr(spec, "name", module)
    _linkage(out)
    if not _loads_from_path(spec) and Path(getattr(spec, "aot_path", "") or "") != Path(library):
        return _stopped(out, "load", "this flashinfer loads only its own build or AOT folder, not this library")
    stopped = _load(out, spec)
    return stopped or {**out, "stage": "done", "ok": True}


def run_build_subprocess(
    module: str, env: dict[str, str], timeout_s: float, python: str | None = None, load: bool = False,
    library: str | None = None,
) -> dict[str, Any]:
    """Run :func:`build_module` in a fresh interpreter with ``env`` (with ``library``: :func:`load_library`
    instead, which compiles nothing); a timeout or crash is a result too."""
    cmd = [python or sys.executable, "-m", "inenv.kit._fi_build", module, *(["--load"] if load else []),
           *(["--library", library] if library else [])]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-_TAIL:]
        text = tail.decode(errors="replace") if isinstance(tail, bytes) else str(tail)
        return {"module": module, "stage": "timeout", "ok": False, "error": f"no result in {timeout_s:.0f} s\n{text}"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX) :])
            result["log_tail"] = proc.stderr[-1500:]
            return result
    return {
        "module": module,
        "stage": "crash",
        "ok": False,
        "error": f"builder exited {proc.returncode} without a result\n{(proc.stdout + proc.stderr)[-_TAIL:]}",
    }


def _main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] in JIT_GENERATORS and argv[1:3] == ["--load", "--library"]:
        sys.stdout.write(RESULT_PREFIX + json.dumps(load_library(argv[0], argv[3]), default=str) + "\n")
        return 0
    if len(argv) in (1, 2) and argv[0] in JIT_GENERATORS and argv[1:] in ([], ["--load"]):
        result = build_module(argv[0], load=argv[1:] == ["--load"])
        sys.stdout.write(RESULT_PREFIX + json.dumps(result, default=str) + "\n")
        return 0
    names = ",".join(JIT_GENERATORS)
    sys.stderr.write(f"usage: python -m inenv.kit._fi_build {{{names}}} [--load [--library SO]]\n")
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
