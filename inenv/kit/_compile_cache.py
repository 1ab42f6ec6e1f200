"""A content-addressed store of built JIT libraries, shared by every cell and run that builds the same thing.

Lookup works like ccache's direct mode, in two steps:

1. A build's key is a SHA-256 over what is known before compiling: the module, its ninja file with the
   paths that only say where a build happens (its build directory, the site-packages holding flashinfer,
   the JIT workspace, the CUDA toolkit's folder) replaced by placeholders, the ``--version`` of the nvcc and
   host compiler the ninja file runs, the compiler flags the environment adds (``NVCC_APPEND_FLAGS``...),
   and the contents of every source the ninja file compiles.
2. Under that key each entry carries a manifest: every header the compiler read for it (``ninja -t deps``
   from the build that made it) with its digest. An entry is a hit only when each of those headers, at the
   same place in this environment, has the same bytes, and no folder earlier on the ``-I`` list now holds a
   header of the same name that would be read instead.

So a release that changed headers no comm module includes (most of flashinfer's include tree) shares the
build of one that did not, and one changed header anywhere a module reads is a miss. The flashinfer version
is not in the key; the entry's record says which version built it. When ninja cannot list the headers, the
manifest falls back to every file under the include folders inside the package (the stricter test).

An entry is a folder ``<key>/<manifest digest>``, holding the linked library and ``record.json`` (which
build made it, when, where, and the manifest). It is written into a temporary folder and renamed into
place, so a reader never sees half an entry and of two builders of one entry the first rename wins. Only
finished builds are stored as libraries: a failure is proven again on every run. A build that compiled every
object and failed at the link keeps its objects (:func:`store_objects`), so the next build of the same key
links again without compiling. ``STACKPROBE_COMPILE_CACHE`` names the
store; unset, nothing is shared.

In-environment side: standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inenv import atomic

ENV = "STACKPROBE_COMPILE_CACHE"
CELL_ENV = "STACKPROBE_CELL_ID"  # set by the host for each cell's worker; recorded as who built an entry
HOST_ENV = "STACKPROBE_HOST_ID"
RECORD = "record.json"
SCHEMA = 3  # bump when the key's recipe changes, so no entry made under another recipe is ever hit
# Environment variables nvcc or the compilers read that change what a build makes.
BUILD_ENV = ("NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "CPATH", "CPLUS_INCLUDE_PATH", "LIBRARY_PATH")

_INCLUDE = re.compile(r"(?:^|\s)(?:-I|-isystem\s+)(\S+)")
_SOURCE = re.compile(r"^build \S+: (?:compile|cuda_compile) (\S+)", re.M)
_VAR = re.compile(r"^(\w+) = (.*)$", re.M)


def root(env: Mapping[str, str] | None = None) -> Path | None:
    """The shared store, or None when none is configured."""
    value = (os.environ if env is None else env).get(ENV, "")
    return Path(value) if value else None


# --- the key ----------------------------------------------------------------------------------------
_FILE_DIGESTS: dict[str, str] = {}  # within one process: a header tree read once however often it is named
_TREE_DIGESTS: dict[str, str] = {}


def file_digest(path: str) -> str:
    if path not in _FILE_DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _FILE_DIGESTS[path] = h.hexdigest()
    return _FILE_DIGESTS[path]


def tree_digest(folder: str) -> str:
    """Every file under ``folder`` by relative path and content, in sorted order."""
    if folder not in _TREE_DIGESTS:
        h = hashlib.sha256()
        for here, dirs, files in os.walk(folder):
            dirs.sort()
            for name in sorted(files):
                path = os.path.join(here, name)
                if os.path.isfile(path):
                    h.update(f"{os.path.relpath(path, folder)}\0{file_digest(path)}\n".encode())
        _TREE_DIGESTS[folder] = h.hexdigest()
    return _TREE_DIGESTS[folder]


SITE = "$SITE"  # the placeholder of the folder that holds the flashinfer package


def source_names(text: str, site: str) -> list[str]:
    """The sources a flashinfer build.ninja compiles that flashinfer's package holds, by placed name
    (``$SITE/flashinfer/data/csrc/...``), sorted: what a module's source hash covers (generated sources in
    the JIT workspace follow from flashinfer's version, which is compared on its own)."""
    names = {place(s, {SITE: site}) for s in sources(text)}
    return sorted(n for n in names if n.startswith(SITE + "/"))


def source_hash(names: list[str], site: str) -> str | None:
    """A digest of each placed source's name and bytes under ``site``; None when one is not a plain file
    there (a link is not followed)."""
    h = hashlib.sha256()
    for name in sorted(names):
        path = unplace(name, {SITE: site})
        if not name.startswith(SITE + "/") or ".." in name.split("/") or os.path.islink(path) \
                or not os.path.isfile(path):
            return None
        h.update(f"{name}\0{file_digest(path)}\n".encode())
    return h.hexdigest()[:32]


LEDGER = ".compiled.jsonl"  # one line for each build that ran the compilers into this store (not a hit)


def note_compile(store_dir: Path, key: str, facts: Mapping[str, Any]) -> None:
    """Append one line for a build that compiled objects under ``key`` (module, targets, who, CPU seconds):
    the store's counter of compiles, read by :func:`compiles`. One short write in append mode, so builds
    in parallel never interleave their lines; a store that cannot be written counts nothing."""
    line = json.dumps({"key": key, **{k: facts.get(k) for k in ("module", "arch_list", "cell", "compile_cpu_s",
                                                                 "built_at")}},
                      sort_keys=True, default=str) + "\n"
    try:
        fd = os.open(store_dir / LEDGER, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def compiles(store_dir: Path) -> dict[str, int]:
    """How many times each key was compiled into this store (a key compiled twice is work done twice)."""
    counts: dict[str, int] = {}
    try:
        lines = (store_dir / LEDGER).read_text(errors="replace").splitlines()
    except OSError:
        return counts
    for line in lines:
        try:
            key = json.loads(line).get("key")
        except (ValueError, AttributeError):
            continue
        if isinstance(key, str):
            counts[key] = counts.get(key, 0) + 1
    return counts


def ninja_vars(text: str) -> dict[str, str]:
    return dict(_VAR.findall(text))


def expand(value: str, variables: Mapping[str, str]) -> str:
    """``$cuda_home/include`` with the ninja file's own top-level variables put in."""
    return re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), m.group(0)), value)


def sources(text: str) -> list[str]:
    """What the ninja file compiles."""
    return _SOURCE.findall(text)


def include_dirs(text: str) -> list[str]:
    """Every ``-I`` and ``-isystem`` directory, with ninja variables expanded, in the order given."""
    variables = ninja_vars(text)
    joined = text.replace("$\n", " ")  # ninja's line continuation
    out: list[str] = []
    for raw in _INCLUDE.findall(joined):
        path = expand(raw, variables)
        if path not in out:
            out.append(path)
    return out


_NAME_GOES_ON = r"(?![\w.+-])"  # a path followed by one of these is another folder: /cuda-wheels, not /cuda


def normalise(text: str, places: Mapping[str, str]) -> str:
    """The ninja file with each place (placeholder -> path) written as its placeholder, longest path first
    so that a build directory inside the workspace becomes ``$BUILD``, not ``$WORKSPACE/...``. A place is
    replaced only where its folder name ends, so ``<venv>/cuda-wheels`` is not read as ``$CUDA-wheels``."""
    for name, path in sorted(places.items(), key=lambda kv: -len(kv[1])):
        folder = path.rstrip("/")
        if folder:
            text = re.sub(re.escape(folder) + _NAME_GOES_ON, lambda _m, holder=name: holder, text)
    return text


def _inside(path: str, places: Mapping[str, str]) -> bool:
    real = os.path.realpath(path)
    return any(p and (real + "/").startswith(os.path.realpath(p).rstrip("/") + "/") for p in places.values())


def tool_version(command: str) -> str:
    """``COMMAND --version`` as printed (the release and build lines), or why it did not run."""
    try:
        proc = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{command}: {type(exc).__name__}"
    return f"{command} exit {proc.returncode}: {proc.stdout.strip()}"


_THREADS = re.compile(r"\s*(?:--threads[= ]|-t[= ]?)\d+\b")


def without_threads(text: str) -> str:
    """``text`` without nvcc's thread-count flag (``--threads N``, ``--threads=N``, ``-t N``): how many
    targets nvcc compiles at once does not change what it makes, so it is no part of a key."""
    return _THREADS.sub("", text)


def recipe(module: str, text: str, places: Mapping[str, str], env: Mapping[str, str]) -> dict[str, Any]:
    """What the key is a hash of, spelt out (so a miss can be explained by comparing two recipes)."""
    variables = ninja_vars(text)
    srcs = sorted(set(sources(text)))
    # each compiler by its version; the folder it is run from is a place like any other (``$CUDA/bin/nvcc``)
    tools = {name: normalise(tool_version(expand(variables[name], variables)), places)
             for name in ("nvcc", "cxx") if name in variables}
    return {
        "schema": SCHEMA,
        "module": module,
        # nvcc's targets as a set: a flashinfer that lists them in set order writes another file for the same build
        "ninja": re.sub(r"-gencode=\S+", "-gencode", without_threads(normalise(text, places))),
        "gencode": sorted(set(re.findall(r"-gencode=\S+", text))),
        "tools": tools,
        "env": {k: v for k in BUILD_ENV if (v := without_threads(env.get(k, "")).strip())},
        "sources": {normalise(s, places): file_digest(s) for s in srcs},
    }


def key_of(recipe_: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(recipe_, sort_keys=True).encode()).hexdigest()


# --- the manifest: the headers a build read ---------------------------------------------------------
TREE = "tree:"  # a manifest item that stands for every file under a folder (the fallback)


def ninja_deps(output: str) -> list[str]:
    """The files ``ninja -t deps`` lists under its targets (indented lines), in order, each once."""
    return list(dict.fromkeys(line.strip() for line in output.splitlines() if line[:1].isspace() and line.strip()))


def place(path: str, places: Mapping[str, str]) -> str:
    """``path`` as a manifest names it: inside a place, by that place's placeholder."""
    return normalise(os.path.normpath(path), places)


def unplace(name: str, places: Mapping[str, str]) -> str:
    for holder, path in places.items():
        if path and (name == holder or name.startswith(holder + "/")):
            return path.rstrip("/") + name[len(holder):]
    return name


def manifest(headers: list[str], sources_: list[str], places: Mapping[str, str]) -> dict[str, str]:
    """Each header a build read (not its sources: those are in the key) by placed name, with its digest."""
    own = {os.path.normpath(s) for s in sources_}
    return {place(h, places): file_digest(h) for h in headers if os.path.normpath(h) not in own and os.path.isfile(h)}


def tree_manifest(text: str, places: Mapping[str, str]) -> dict[str, str]:
    """The fallback when the headers are unknown: every include folder inside a place, and each source's own
    folder (``#include "x.h"``), by the digest of all it holds."""
    trees = sorted(d for d in search_order(text) if _inside(d, places) and os.path.isdir(d))
    return {TREE + place(d, places): tree_digest(d) for d in trees}


def search_order(text: str) -> list[str]:
    """Where the compiler looks for a header, first to last, as far as the ninja file says: each source's own
    folder (``#include "x.h"``), then the ``-I``/``-isystem`` folders in order."""
    out: list[str] = []
    for folder in [os.path.dirname(s) for s in sources(text)] + include_dirs(text):
        if folder not in out:
            out.append(folder)
    return out


def shadowed(path: str, include_order: list[str]) -> str | None:
    """An earlier ``-I`` folder's file of the same relative name as ``path``, which the compiler would now
    read instead; None when there is none."""
    real = os.path.realpath(path)
    for i, folder in enumerate(include_order):
        base = folder.rstrip("/") + "/"
        if path.startswith(base):
            rel = path[len(base):]
            for earlier in include_order[:i]:
                other = os.path.join(earlier, rel)
                if os.path.isfile(other) and os.path.realpath(other) != real:
                    return other
            return None
    return None


def mismatch(items: Mapping[str, str], places: Mapping[str, str], include_order: list[str]) -> str | None:
    """The first manifest item this environment does not match (why an entry is no hit); None when all do."""
    for name, digest in sorted(items.items()):
        if name.startswith(TREE):
            folder = unplace(name[len(TREE):], places)
            if not os.path.isdir(folder) or tree_digest(folder) != digest:
                return f"{name[len(TREE):]} differs"
            continue
        path = unplace(name, places)
        try:
            same = file_digest(path) == digest
        except OSError:
            return f"{name} is missing"
        if not same:
            return f"{name} differs"
        other = shadowed(path, include_order)
        if other:
            return f"{other} would be read instead of {name}"
    return None


def manifest_id(items: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(dict(items), sort_keys=True).encode()).hexdigest()[:16]


# --- the store --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    key: str
    library: str  # the cached shared object, read in place
    record: dict[str, Any]


def _entry(folder: Path, key: str) -> Entry | None:
    try:
        record = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return None
    library = folder / str(record.get("library_name", ""))
    return Entry(key, str(library), record) if record.get("library_name") and library.is_file() else None


def lookup(store: Path, key: str, places: Mapping[str, str] | None = None,
           include_order: list[str] | None = None) -> tuple[Entry | None, list[str]]:
    """The entry under ``key`` whose manifest this environment matches, newest first, with why each other
    entry missed (the first item that differs)."""
    folder = store / key
    try:
        candidates = sorted((p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")),
                            key=lambda p: -p.stat().st_mtime)
    except OSError:
        return None, []
    misses: list[str] = []
    for sub in candidates:
        entry = _entry(sub, key)
        if entry is None:
            continue
        why = mismatch(entry.record.get("manifest") or {}, places or {}, include_order or [])
        if why is None:
            return entry, misses
        misses.append(f"{sub.name}: {why}")
    return None, misses


def iso(ts: float) -> str:
    """A POSIX time as build records write it: UTC, to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def provenance(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Who is building: the cell (when the host said) and the host, at this moment."""
    env = os.environ if env is None else env
    return {"built_at": iso(time.time()), "cell": env.get(CELL_ENV) or None,
            "host": env.get(HOST_ENV) or socket.gethostname()}


def store(store_dir: Path, key: str, library: str, record: Mapping[str, Any],
          items: Mapping[str, str] | None = None) -> tuple[Entry, bool]:
    """Put a built library under ``key`` with the manifest ``items`` (the headers it read): (the entry,
    whether this call wrote it). When another builder got there first, its entry stands."""
    items = dict(items or {})
    folder = store_dir / key
    final = folder / manifest_id(items)
    found = _entry(final, key)
    if found is not None:
        return found, False
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        name = os.path.basename(library)
        shutil.copy2(library, tmp / name)
        body = {**record, "key": key, "library_name": name, "manifest": items}
        (tmp / RECORD).write_text(json.dumps(body, sort_keys=True) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            found = _entry(final, key)  # a rename onto a folder that now exists: the other builder won
            if found is None:
                raise
            return found, False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    entry = _entry(final, key)
    if entry is None:
        raise OSError(f"{final}: stored but not readable back")
    return entry, True


# --- objects of a build that compiled and failed at the link -----------------------------------------
# Under the same key as a finished build, in ``<key>/objects-<manifest digest>``: every object the ninja file
# compiles, and a record with ``"kind": "objects"``. Such an entry has no library, so :func:`lookup` never
# takes it for a build; the next build of the key (the next target of one combined build, a rerun) copies
# the objects in and runs only the link, which is judged afresh every time.
OBJECTS = "objects-"


def store_objects(store_dir: Path, key: str, build_dir: str, objects: list[str], record: Mapping[str, Any],
                  items: Mapping[str, str] | None = None) -> bool:
    """Keep the compiled ``objects`` (paths relative to ``build_dir``) under ``key``; whether this call
    wrote them (False when they are there already or one is missing)."""
    items = dict(items or {})
    final = store_dir / key / (OBJECTS + manifest_id(items))
    if (final / RECORD).is_file() or not all(os.path.isfile(os.path.join(build_dir, o)) for o in objects):
        return False
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for o in objects:
            dest = tmp / o
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.join(build_dir, o), dest)
        body = {**record, "key": key, "kind": "objects", "objects": list(objects), "manifest": items}
        (tmp / RECORD).write_text(json.dumps(body, sort_keys=True) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            return False  # another builder stored them first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def lookup_objects(store: Path, key: str, objects: list[str], places: Mapping[str, str] | None = None,
                   include_order: list[str] | None = None) -> tuple[Path, dict[str, Any]] | None:
    """The folder and record of stored objects under ``key`` that hold every one of ``objects`` and whose
    headers this environment matches, newest first; None when there are none."""
    try:
        candidates = sorted((p for p in (store / key).iterdir() if p.name.startswith(OBJECTS)),
                            key=lambda p: -p.stat().st_mtime)
    except OSError:
        return None
    for folder in candidates:
        try:
            record = json.loads((folder / RECORD).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict) or not all((folder / o).is_file() for o in objects):
            continue
        if mismatch(record.get("manifest") or {}, places or {}, include_order or []) is None:
            return folder, record
    return None


def restore_objects(folder: Path, objects: list[str], build_dir: str) -> None:
    for o in objects:
        dest = os.path.join(build_dir, o)
        os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
        shutil.copy2(folder / o, dest)


@contextlib.contextmanager
def building(store_dir: Path, key: str) -> Iterator[float]:
    """Hold the key while building it, so a second builder of the same key (another cell in parallel)
    waits for the first one's entry instead of compiling it again; yields the seconds waited. Where the
    store cannot be locked (a read-only mount, a file system without flock) it builds without waiting."""
    t0 = time.monotonic()
    try:
        locks = store_dir / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        fd = os.open(locks / key, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield 0.0
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when this process ends, however it ends
        yield round(time.monotonic() - t0, 1)
    finally:
        os.close(fd)


# --- one combined build, handed to the other targets of its run ------------------------------------------
# A combined build (every cross-compile target in one go) answers for each of its targets. Its own variant
# leaves the build's result here; a variant of another target of that list, in the same run and cell, takes
# it instead of starting an interpreter that imports flashinfer and torch (5-30 s on a loaded 2-core
# machine) only to compute the same key and find that entry. The token is the host's, new for every run, so
# a result never crosses into another run, and the reader still judges its own target on the library's code.
RUN_ENV = "STACKPROBE_HANDOFF_TOKEN"
HANDOFF = ".handoff"
HANDOFF_KEEP_S = 86400.0  # folders of runs older than this are removed by the next writer


def _handoff_path(module: str, arch_list: str, env: Mapping[str, str]) -> Path | None:
    store_dir, token = root(env), env.get(RUN_ENV, "")
    if store_dir is None or not re.fullmatch(r"[0-9a-f]{8,64}", token):
        return None
    who = json.dumps([env.get(CELL_ENV, ""), module, arch_list.split()], separators=(",", ":"))
    return store_dir / HANDOFF / token / (hashlib.sha256(who.encode()).hexdigest()[:32] + ".json")


def hand_over(module: str, arch_list: str, result: Mapping[str, Any], env: Mapping[str, str] | None = None) -> bool:
    """Leave a finished combined build's result for the other targets of ``arch_list`` in this run and
    cell. False when there is no run token or store, or it cannot be written (the readers then build)."""
    env = os.environ if env is None else env
    path = _handoff_path(module, arch_list, env)
    if path is None:
        return False
    try:
        text = json.dumps({"module": module, "arch_list": arch_list, "result": dict(result),
                           "written_at": iso(time.time())}, default=str)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(path, text)  # a reader sees the whole record or none
    except (OSError, TypeError, ValueError):
        return False
    now = time.time()
    with contextlib.suppress(OSError):
        for old in path.parent.parent.iterdir():
            if old != path.parent and now - old.stat().st_mtime > HANDOFF_KEEP_S:
                shutil.rmtree(old, ignore_errors=True)
    return True


def handed(module: str, arch_list: str, env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The result a combined build of ``arch_list`` left in this run and cell (:func:`hand_over`), or None.
    Only a finished build whose library is still there is handed on."""
    env = os.environ if env is None else env
    path = _handoff_path(module, arch_list, env)
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, dict) or data.get("module") != module or data.get("arch_list") != arch_list:
        return None
    library = result.get("library")
    if not result.get("ok") or not isinstance(library, str) or not os.path.isfile(library):
        return None
    return {**result, "handed_at": data.get("written_at")}
