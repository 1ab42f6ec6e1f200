"""The flashinfer comm modules a cell carries: compiled by `provision build` for the cell's declared GPU
architectures and installed where flashinfer loads ahead-of-time modules (``flashinfer/data/aot/<name>/
<name>.so``, flashinfer's ``FLASHINFER_AOT_DIR`` when no flashinfer-jit-cache is installed), each with a record
beside it (``<name>/stackprobe-kernel.json``): which module, for which architectures, the SASS read back from the
library, and which flashinfer, torch, nvcc and apache-tvm-ffi built it.

A kernel set is one folder of that layout. `provision build` fills ``.cache/kernels/<cell>/`` (host side) and
copies it into the cell; a GPU host that is given that folder installs it without compiling. The probes read
the installed set: fi-jit answers from a carried library that holds its target's SASS (read back from the
library's bytes, not taken from the record), and a GPU probe loads it as flashinfer would. A library that
holds no SASS for the local GPU is left out of what flashinfer sees (:func:`fitting_folder`), so flashinfer
compiles that module instead of loading code that cannot run here.

In-environment side: standard library only (the package folder is found without importing flashinfer).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import stat
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from inenv import toolkit
from inenv.envinfo import torch_cuda_version
from inenv.kit import _compile_cache, _elf, _fatbin

RECORD = "stackprobe-kernel.json"
SCHEMA = 1
MAX_RECORD_BYTES = 1 << 20  # a record is a few kB; anything larger is not one of ours
MAX_LIBRARY_BYTES = 2 << 30  # the largest comm module is tens of MB

# What each comm module's library exports for flashinfer's loader (tvm-ffi's ``__tvm_ffi_<name>``, from the
# ``TVM_FFI_DLL_EXPORT_TYPED_FUNC`` lines of the module's sources, the same in every release the matrix holds:
# csrc/vllm_custom_all_reduce.cu, trtllm_allreduce_fusion.cu, trtllm_moe_alltoall.cu (and 0.7's one-sided
# NVLink module, called through the same names), pcie_ipc_all_reduce.cu and the all-gather/reduce-scatter
# module's source). A library without them is not that module, whatever its record says.
FFI_PREFIX = "__tvm_ffi_"
ENTRY_POINTS: dict[str, tuple[str, ...]] = {
    "vllm_comm": ("init_custom_ar", "all_reduce"),
    "trtllm_comm": ("trtllm_allreduce_fusion",),
    "moe_a2a": ("moe_a2a_dispatch", "moe_a2a_combine"),
    "pcie_ipc": ("pcie_ipc_init", "pcie_ipc_all_reduce"),
    "pcie_ipc_ag_rs": ("pcie_ipc_all_gather", "pcie_ipc_reduce_scatter"),
}
# The facts that decide a carried library's bytes, as its record names them: a set is current for a cell only
# when each equals the cell's (``declared``: the target list asked for; ``source_hash``: the module's sources
# that flashinfer's build file compiles, by content; ``apache-tvm-ffi``: the release of the header-only ABI layer
# flashinfer inlines into every module it builds, :data:`TVM_FFI`).
TVM_FFI = "apache-tvm-ffi"
IDENTITY = ("flashinfer", "torch", "torch_cuda", "nvcc", TVM_FFI, "declared", "source_hash")
ABSENT = "none"  # the value of a fact whose package this environment does not have


@dataclass(frozen=True)
class Carried:
    """One carried module: its library and what its record says."""

    module: str
    name: str
    library: Path
    record: Mapping[str, Any]

    @property
    def sass(self) -> list[str]:
        value = self.record.get("sass")
        return [str(s) for s in value] if isinstance(value, list) else []

    @property
    def refused(self) -> dict[str, Any]:
        """The declared targets flashinfer's own gate left out of this build, with why (arch -> reason)."""
        value = self.record.get("refused")
        return dict(value) if isinstance(value, Mapping) else {}

    def runs_on(self, capability: str) -> bool:
        """Its recorded SASS runs on a GPU of ``capability`` ("9.0")."""
        return bool(self.sass) and _fatbin.runs_on(self.sass, capability)


def aot_dir() -> Path | None:
    """flashinfer's own AOT folder in this environment, found without importing it: ``data/aot`` in the
    package; None when flashinfer is not installed or flashinfer-jit-cache supplies the AOT folder (then its
    modules are what flashinfer loads, and a cell carries none)."""
    try:
        if importlib.util.find_spec("flashinfer_jit_cache") is not None:
            return None
        spec = importlib.util.find_spec("flashinfer")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "aot"


def _plain(path: Path, want: int) -> bool:
    """``path`` is itself a file or folder of type ``want`` (stat.S_IFREG, S_IFDIR): a link is not followed."""
    try:
        return stat.S_IFMT(os.lstat(path).st_mode) == want
    except OSError:
        return False


def read_bytes(path: Path, limit: int) -> bytes | None:
    """A plain file's bytes, opened without following a link (O_NOFOLLOW) and at most ``limit`` of them;
    None when it is a link, not a plain file, larger, or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        data = f.read(limit + 1)
    return data if len(data) <= limit else None


def read_record(path: Path) -> dict[str, Any] | None:
    """A record, or None when it is missing, a link, too large, not JSON, not ours or of another schema."""
    raw = read_bytes(path, MAX_RECORD_BYTES)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("module"), str):
        return None
    return data


def library_refusal(module: str, library: Path) -> str:
    """Why ``library`` is not flashinfer's ``module`` ("" when it is): a link or not a plain file, not a
    64-bit ELF shared object this reader reads, or one without the module's entry points."""
    if not _plain(library, stat.S_IFREG):
        return "a link or not a plain file (links are not followed)"
    wanted = ENTRY_POINTS.get(module)
    if wanted is None:
        return f"{module} is not a comm module stackprobe carries"
    linked = _elf.linkage(str(library))
    if linked is None:
        return f"not a readable shared object: {_elf.unread(str(library)) or 'not read'}"
    if not linked.shared_object:
        return f"an ELF file of type {linked.elf_type}, not a shared object"
    missing = [n for n in wanted if FFI_PREFIX + n not in linked.defined]
    if missing:
        return f"exports none of {module}'s entry point(s) {', '.join(FFI_PREFIX + n for n in missing)}"
    return ""


def scan(folder: Path | None) -> tuple[dict[str, Carried], dict[str, str]]:
    """A kernel-set folder read as untrusted input: (every carried module whose folder, record and library
    are plain files and folders, the record ours and the library flashinfer's module of that name, by module;
    every entry left out with why, by folder name). Nothing is followed through a link."""
    out: dict[str, Carried] = {}
    refused: dict[str, str] = {}
    if folder is None or not folder.is_dir():
        return out, refused
    for entry in sorted(folder.iterdir()):
        record_path = entry / RECORD
        if not _plain(entry, stat.S_IFDIR):
            if entry.is_symlink() and entry.name[:1] != ".":
                refused[entry.name] = "a link (links are not followed)"
            continue
        if not os.path.lexists(record_path):
            continue  # not ours (flashinfer's own AOT module, say)
        rec = read_record(record_path)
        if rec is None:
            refused[entry.name] = "its record is a link, too large, not JSON or not a kernel record"
            continue
        name = entry.name
        if rec.get("name") != name:
            refused[name] = f"its record names {visible(str(rec.get('name')))!s}, not {name}"
            continue
        why = library_refusal(str(rec["module"]), entry / f"{name}.so")
        if why:
            refused[name] = why
            continue
        out[str(rec["module"])] = Carried(str(rec["module"]), name, entry / f"{name}.so", rec)
    return out, refused


def kernel_set(folder: Path | None) -> dict[str, Carried]:
    """Every carried module of a kernel-set folder that :func:`scan` accepts, by module."""
    return scan(folder)[0]


def differs(record: Mapping[str, Any], facts: Mapping[str, Any]) -> str:
    """The first fact of :data:`IDENTITY` given in ``facts`` whose recorded value is another, said as
    ``torch: 2.11.0+cu128 here, 2.11.0+cu130 in the record``; "" when every given fact matches. A fact the
    record lacks differs (an older record is rebuilt, never taken on trust)."""
    for key in IDENTITY:
        if key not in facts:
            continue
        want, have = facts[key], record.get(key, record.get("arch_list") if key == "declared" else None)
        if have is None or str(have) != str(want):
            shown = visible(str(have)) if have is not None else "none"
            return f"{key}: {visible(str(want))} wanted, {shown} in the record"
    return ""


_UNSEEN = {*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A),
           0x200E, 0x200F, 0x061C, 0xFEFF}


def visible(text: str, limit: int = 200) -> str:
    """Free text from a record (a kernel set may come from another machine) made safe to show: every control
    and bidirectional character written as its escape (``\\x1b``, ``\\u202e``), cut to ``limit``."""
    out = "".join(f"\\x{ord(c):02x}" if ord(c) < 0x100 and ord(c) in _UNSEEN
                  else f"\\u{ord(c):04x}" if ord(c) in _UNSEEN else c for c in text)
    return out if len(out) <= limit else out[: limit - 3] + "..."


def installed(module: str, folder: Path | None = None) -> Carried | None:
    """The carried ``module`` of this environment (or of ``folder``), or None."""
    return kernel_set(aot_dir() if folder is None else folder).get(module)


def record_for(module: str, name: str, result: Mapping[str, Any], sass: Iterable[str],
               extra: Mapping[str, Any]) -> dict[str, Any]:
    """The record of one carried library: the build result's facts that say what it is and how it was made."""
    keep = ("flashinfer", "arch_list", "toolkit", "compile_s", "compile_cpu_s", "library_bytes", "cached",
            "cached_by", "cache_key", "needed", "driver_calls", "gencode", "sources", "source_hash")
    return {"schema": SCHEMA, "module": module, "name": name, "sass": sorted(set(sass)),
            **{k: result[k] for k in keep if k in result}, **extra}


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def tvm_ffi_version() -> str:
    """apache-tvm-ffi's release here, read from its metadata (:data:`ABSENT` when it is not installed)."""
    return _dist_version(TVM_FFI) or ABSENT


def torch_version() -> str | None:
    """torch's full version with its local label (``2.11.0+cu130``): its ``version.py``, not imported."""
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        try:
            text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
            m = re.search(r"^__version__\s*(?::\s*\S+)?\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
            if m:
                return m.group(1)
        except OSError:
            pass
    return _dist_version("torch")


def cell_facts(sources: Mapping[str, list[str]]) -> dict[str, Any]:
    """The facts of this environment a carried module's record must match (:data:`IDENTITY`), read without
    importing flashinfer or torch: flashinfer's version, torch's with its CUDA build, nvcc's (found as
    flashinfer finds it), apache-tvm-ffi's, and per module the hash of the sources its record names
    (``sources``: module -> placed names) as they are here."""
    spec = importlib.util.find_spec("flashinfer")
    site = str(Path(next(iter(spec.submodule_search_locations))).parent) if spec and \
        spec.submodule_search_locations else ""
    tk = toolkit.resolve(flashinfer=True)
    return {"flashinfer": _dist_version("flashinfer-python", "flashinfer"), "torch": torch_version(),
            "torch_cuda": torch_cuda_version(), "nvcc": tk.version, "nvcc_error": tk.error if not tk.version else "",
            TVM_FFI: tvm_ffi_version(),
            "source_hash": {m: _compile_cache.source_hash(list(names), site) if site else None
                            for m, names in sources.items()}}


def _names(carried: Carried) -> list[str]:
    return [str(n) for n in carried.record.get("sources") or [] if isinstance(n, str)]


def not_here(carried: Carried, here: Mapping[str, Any] | None = None) -> str:
    """Why ``carried``'s record is not this environment's ("" when it is: the same flashinfer, torch with its
    CUDA build, nvcc, apache-tvm-ffi and module sources), escaped; ``here``: :func:`cell_facts` read already."""
    here = here if here is not None else cell_facts({carried.module: _names(carried)})
    facts = {k: here.get(k) for k in ("flashinfer", "torch", "torch_cuda", "nvcc", TVM_FFI)}
    facts["source_hash"] = (here.get("source_hash") or {}).get(carried.module)
    return differs(carried.record, facts)


def usable(folder: Path | None) -> tuple[dict[str, Carried], dict[str, str]]:
    """The carried modules of ``folder`` this environment may load (the reader accepts them and their
    records are this environment's), and every entry left out with why, by folder name."""
    found, refused = scan(folder)
    here = cell_facts({m: _names(c) for m, c in found.items()}) if found else {}
    out = {}
    for module, c in found.items():
        why = not_here(c, here)
        if why:
            refused[c.name] = f"its record is not this cell's ({why})"
        else:
            out[module] = c
    return out, refused


def _sweep(scratch: Path) -> None:
    """Remove the link folders of processes that have ended (``aot-<cc>-<pid>-*``): links only, nothing else."""
    for old in scratch.glob("aot-*-*-*"):
        parts = old.name.split("-")
        if len(parts) < 4 or not parts[2].isdigit() or old.is_symlink() or not old.is_dir():
            continue
        if int(parts[2]) != os.getpid() and os.path.exists(f"/proc/{parts[2]}"):
            continue
        for link in old.glob("*/*.so"):
            if link.is_symlink():
                link.unlink()
        for folder in sorted(old.glob("*"), reverse=True):
            with contextlib.suppress(OSError):
                folder.rmdir()
        with contextlib.suppress(OSError):
            old.rmdir()


def fitting_folder(folder: Path, capability: str, scratch: Path, extra: Mapping[str, Path] = {}) -> Path | None:
    """A folder laid out as flashinfer's AOT folder holding links to the carried modules of ``folder`` this
    environment may load (:func:`usable`) whose SASS runs on ``capability`` and to ``extra`` (name -> library:
    modules built here for this GPU), inside ``scratch``; None when every carried module is usable and runs
    here and nothing is extra (``folder`` itself serves).
    Links, so nothing is copied; a new folder for each call (another cell, process or set never shares one,
    so nothing of an earlier call is linked)."""
    carried, refused = usable(folder)
    fits = {c.name: c.library for c in carried.values() if c.runs_on(capability)}
    if len(fits) == len(carried) and not refused and not extra:
        return None
    scratch.mkdir(parents=True, exist_ok=True)
    _sweep(scratch)
    target = Path(tempfile.mkdtemp(prefix=f"aot-{capability.replace('.', '')}-{os.getpid()}-", dir=scratch))
    for name, library in {**fits, **extra}.items():
        link = target / name / f"{name}.so"
        try:
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(Path(library).resolve())
        except OSError:
            continue
    return target
