"""The flashinfer comm modules a cell carries: compiled by `provision build` for the cell's declared GPU
architectures and installed where flashinfer loads ahead-of-time modules (``flashinfer/data/aot/<name>/
<name>.so``, flashinfer's ``FLASHINFER_AOT_DIR`` when no flashinfer-jit-cache is installed), each with a record
beside it (``<name>/stackprobe-kernel.json``): which module, for which architectures, the SASS read back from the
library, and which flashinfer, torch and nvcc built it.

A kernel set is one folder of that layout. `provision build` fills ``.cache/kernels/<cell>/`` (host side) and
copies it into the cell; a GPU host that is given that folder installs it without compiling. The probes read
the installed set: fi-jit answers from a carried library that holds its target's SASS (read back from the
library's bytes, not taken from the record), and a GPU probe loads it as flashinfer would. A library that
holds no SASS for the local GPU is left out of what flashinfer sees (:func:`fitting_folder`), so flashinfer
compiles that module instead of loading code that cannot run here.

In-environment side: standard library only (the package folder is found without importing flashinfer).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inenv.kit import _fatbin

RECORD = "stackprobe-kernel.json"
SCHEMA = 1
MAX_RECORD_BYTES = 1 << 20  # a record is a few kB; anything larger is not one of ours


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


def read_record(path: Path) -> dict[str, Any] | None:
    """A record, or None when it is missing, too large, not JSON, not ours or of another schema."""
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("module"), str):
        return None
    return data


def kernel_set(folder: Path | None) -> dict[str, Carried]:
    """Every carried module of a kernel-set folder whose record and library are both there, by module."""
    out: dict[str, Carried] = {}
    if folder is None or not folder.is_dir():
        return out
    for record_path in sorted(folder.glob(f"*/{RECORD}")):
        rec = read_record(record_path)
        if rec is None:
            continue
        name = record_path.parent.name
        library = record_path.parent / f"{name}.so"
        if rec.get("name") == name and library.is_file():
            out[str(rec["module"])] = Carried(str(rec["module"]), name, library, rec)
    return out


def installed(module: str, folder: Path | None = None) -> Carried | None:
    """The carried ``module`` of this environment (or of ``folder``), or None."""
    return kernel_set(aot_dir() if folder is None else folder).get(module)


def record_for(module: str, name: str, result: Mapping[str, Any], sass: Iterable[str],
               extra: Mapping[str, Any]) -> dict[str, Any]:
    """The record of one carried library: the build result's facts that say what it is and how it was made."""
    keep = ("flashinfer", "arch_list", "toolkit", "compile_s", "compile_cpu_s", "library_bytes", "cached",
            "cached_by", "cache_key", "needed", "driver_calls", "gencode")
    return {"schema": SCHEMA, "module": module, "name": name, "sass": sorted(set(sass)),
            **{k: result[k] for k in keep if k in result}, **extra}


def fitting_folder(folder: Path, capability: str, scratch: Path, extra: Mapping[str, Path] = {}) -> Path | None:
    """A folder laid out as flashinfer's AOT folder holding links to the carried modules of ``folder`` whose
    SASS runs on ``capability`` and to ``extra`` (name -> library: modules built here for this GPU), inside
    ``scratch``; None when every carried module runs here and nothing is extra (``folder`` itself serves).
    Links, so nothing is copied; the folder is made anew each time, so a module dropped from the set is gone."""
    carried = kernel_set(folder)
    fits = {c.name: c.library for c in carried.values() if c.runs_on(capability)}
    if len(fits) == len(carried) and not extra:
        return None
    target = scratch / f"aot-{capability.replace('.', '')}-{os.getpid()}"
    for name, library in {**fits, **extra}.items():
        link = target / name / f"{name}.so"
        try:
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(Path(library).resolve())
        except OSError:
            continue
    return target
