"""The probe kit's public face: what code outside ``inenv/`` may use of the helpers the probes share.

The helpers (``inenv/kit/_*.py``) are private to the in-environment side: each is hashed into every probe that
imports it, so a rename there changes probe hashes. The host side (provision, checks, common) and the
benchmarks reach them only through the names below, so such a rename is answered here, once. A layer test
(tests/test_architecture.py) refuses an import of ``inenv.kit._*`` anywhere outside ``inenv/``.

Each name is read on first use (PEP 562): importing this package (as every probe importing a helper does)
defines the two tables below and loads no helper, which is why the probe hash (checks/results/provenance.py)
leaves this file out.

Processes the host starts in a cell's Python (a carried kernel's build, the AOT folder's place, the JIT cache a
user's environment has) are launched through ``launch``, the one place that names a helper's module as text.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> (helper module, its attribute); a dotted module is one of inenv's own, not a kit helper.
PUBLIC: dict[str, tuple[str, str]] = {
    # the shared compile cache (_compile_cache): the variables the host sets for a cell's ranks and builds
    "COMPILE_CACHE_ENV": ("_compile_cache", "ENV"),  # the folder of the shared store
    "CELL_ENV": ("_compile_cache", "CELL_ENV"),  # the cell a worker runs for, recorded as who built an entry
    "HOST_ENV": ("_compile_cache", "HOST_ENV"),  # the host a worker runs on
    "HANDOFF_TOKEN_ENV": ("_compile_cache", "RUN_ENV"),  # the run whose targets share one combined build
    "COMPILE_LEDGER": ("_compile_cache", "LEDGER"),  # the store's one line per build that ran the compilers
    # flashinfer's comm modules (_flashinfer)
    "COMM_MODULES": ("_flashinfer", "COMM_MODULES"),  # every comm module flashinfer can JIT-build
    "modules_for": ("_flashinfer", "modules_for"),  # the modules a probe's variant builds
    "unpublished": ("_flashinfer", "unpublished"),  # modules a release publishes no prebuilt kernels for
    "package_root": ("_flashinfer", "package_root"),  # the installed flashinfer's folder, without importing it
    "unknown_without_import": ("_fi_pcie", "unknown_without_import"),  # an API the install lacks, read from files
    # the lines the launched helpers print their result on (_fi_build and _fi_existing, inenv.carry)
    "FI_BUILD_RESULT_PREFIX": ("_fi_build", "RESULT_PREFIX"),
    "FI_CARRY_RESULT_PREFIX": ("inenv.carry", "RESULT_PREFIX"),
    # SASS targets (_fatbin)
    "runs_on": ("_fatbin", "runs_on"),  # whether a list of targets runs on a GPU of a compute capability
    # a carried kernel set (_carried): its record, identity and the checks its loader makes
    "Carried": ("_carried", "Carried"),
    "KERNEL_RECORD": ("_carried", "RECORD"),  # the record file beside a set's libraries
    "KERNEL_IDENTITY": ("_carried", "IDENTITY"),  # the facts a set must share with the cell to load
    "TVM_FFI": ("_carried", "TVM_FFI"),
    "MAX_LIBRARY_BYTES": ("_carried", "MAX_LIBRARY_BYTES"),
    "kernel_set": ("_carried", "kernel_set"),
    "differs": ("_carried", "differs"),
    "read_bytes": ("_carried", "read_bytes"),
    "visible": ("_carried", "visible"),  # outside text cut and made printable for one line
    # ELF reading (_elf) and torch's ABI (_torch_abi), standard library only
    "Linkage": ("_elf", "Linkage"),
    "linkage": ("_elf", "linkage"),
    "sections_of": ("_elf", "sections_of"),
    "is_torch_symbol": ("_elf", "is_torch_symbol"),
    "torch_symbol": ("_torch_abi", "torch_symbol"),
    "CUDA_MAJOR_LIB": ("_torch_abi", "_CUDA_MAJOR_LIB"),  # a CUDA library soname that names its major version
    # NCCL called directly (_nccl), for the benchmarks that run in a cell
    "DirectComm": ("_nccl", "DirectComm"),
    "loaded_library": ("_nccl", "loaded_library"),
}

# What the host runs in a cell's Python, as the arguments after the interpreter.
ENTRIES: dict[str, tuple[str, ...]] = {
    "fi-build": ("-m", "inenv.kit._fi_build"),  # flashinfer's JIT build of one module
    "fi-existing": ("-m", "inenv.kit._fi_existing"),  # the modules the environment has, compiling nothing
    "fi-carry": ("-m", "inenv.carry"),  # a carried kernel's build, or the identity of a built set
    "aot-dir": ("-c", "from inenv.kit._carried import aot_dir; print(aot_dir() or '')"),  # where sets install
}

__all__ = [*PUBLIC, "ENTRIES", "launch"]


def launch(entry: str, *args: str) -> list[str]:
    """The arguments after a cell's interpreter that run ``entry`` of ENTRIES with ``args``."""
    return [*ENTRIES[entry], *args]


def __getattr__(name: str) -> Any:
    if name not in PUBLIC:
        raise AttributeError(f"module 'inenv.kit' has no attribute {name!r}")
    module, attr = PUBLIC[name]
    value = getattr(importlib.import_module(module if "." in module else f"{__name__}.{module}"), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *PUBLIC])
