"""Does a compiled torch extension (sgl-kernel) fit the torch beside it? Judged from the binaries.

Importing the extension is the real test, but without a CUDA driver the loader stops at ``libcuda.so.1``
before it resolves a single symbol, so a GPU-less host learns nothing from the import. The binaries still
say what the loader would check next:

- the symbols each extension library imports from torch, C++ ones of its namespaces (c10::, at::, torch::)
  and C ones of its stable ABI (aoti_torch_*, torch_*), must be exported by one of this torch's libraries
  (``torch/lib/*.so``); a torch of another release renames, drops or lacks some of them, and the import then
  fails with "undefined symbol";
- the CUDA libraries it needs (DT_NEEDED ``libcudart.so.12``, ``libnvrtc.so.12``...) carry the CUDA major
  in their soname and must be of torch's CUDA major: a CUDA 12 build beside a CUDA 13 torch needs
  libraries the cell does not have (and would load a second CUDA runtime if it had them).

``read_fit`` reads the files (the edge); ``judge`` turns what was read and the import's outcome into a
verdict (pure). Standard library only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from inenv.kit import _elf

DRIVER = "libcuda.so.1"
# Libraries whose soname major is the CUDA major (cuFFT, cuSOLVER, cuRAND... number theirs on their own).
_CUDA_MAJOR_LIB = re.compile(r"^lib(?:cudart|nvrtc|cublas|cublasLt|nvJitLink)\.so\.(\d+)$")
_UNDEFINED = re.compile(r"undefined symbol: (\S+)")
_DRIVER_FN = re.compile(r"cu[A-Z]\w*")
_SHOWN = 3  # missing symbols named in a note; the evidence keeps more
# torch's stable C ABI (the shim that vLLM's and torchaudio's extensions build against): C functions a torch
# release adds over time. An extension needing one this torch lacks fails to load as a C++ one does.
_STABLE_C = re.compile(r"(?:aoti_torch_|torch_)\w+")


def torch_symbol(name: str) -> bool:
    """A symbol only torch's libraries export: its C++ namespaces or its stable C ABI."""
    return _elf.is_torch_symbol(name) or _STABLE_C.fullmatch(name) is not None


@dataclass(frozen=True)
class Fit:
    """What the extension libraries need and what this torch offers."""

    libraries: tuple[str, ...]  # extension files read, relative to their package
    torch_symbols: int  # distinct torch symbols (C++ namespaces, stable C ABI) they import
    missing: dict[str, tuple[str, ...]]  # file -> imported torch symbols no torch library exports
    cuda_needed: tuple[str, ...]  # DT_NEEDED CUDA libraries with a CUDA-major soname, sorted
    torch_cuda: str | None  # torch.version.cuda, e.g. "13.0"
    not_elf: tuple[str, ...] = ()  # files that are not 64-bit ELF: nothing was read from them
    needed: tuple[str, ...] = ()  # every DT_NEEDED of the libraries, first-seen order
    search_dirs: tuple[str, ...] = ()  # their run paths, $ORIGIN expanded: where the loader looks first

    def missing_symbols(self) -> tuple[str, ...]:
        return tuple(sorted({s for syms in self.missing.values() for s in syms}))

    def cuda_mismatch(self) -> tuple[str, ...]:
        """The CUDA libraries needed whose major is not torch's (nothing when torch's CUDA is unknown)."""
        if not self.torch_cuda:
            return ()
        major = self.torch_cuda.split(".")[0]
        return tuple(lib for lib in self.cuda_needed if (m := _CUDA_MAJOR_LIB.match(lib)) and m.group(1) != major)

    def evidence(self) -> dict[str, object]:
        miss = self.missing_symbols()
        return {
            "libraries": list(self.libraries),
            "torch_symbols_imported": self.torch_symbols,
            "torch_symbols_missing": len(miss),
            "missing_examples": list(miss[:20]),
            "missing_by_library": {k: len(v) for k, v in self.missing.items()},
            "cuda_libraries_needed": list(self.cuda_needed),
            "torch_cuda": self.torch_cuda,
            "not_elf": list(self.not_elf),
        }


@dataclass(frozen=True)
class Judgement:
    status: str  # pass, fail or skip
    reason_code: str  # "" for pass
    note: str


def read_fit(extensions: dict[str, str], torch_libraries: Iterable[str], torch_cuda: str | None) -> Fit:
    """``extensions``: name to show -> path. Reads every extension and every torch library's tables."""
    exports = _elf.exported(lib for p in torch_libraries if (lib := _elf.linkage(p)) is not None)
    missing: dict[str, tuple[str, ...]] = {}
    imported: set[str] = set()
    cuda: set[str] = set()
    needed: dict[str, None] = {}
    dirs: dict[str, None] = {}
    not_elf: list[str] = []
    for name, path in sorted(extensions.items()):
        lib = _elf.linkage(path)
        if lib is None:
            not_elf.append(name)
            continue
        wanted = tuple(sorted(x for x in lib.undefined if torch_symbol(x)))
        imported.update(wanted)
        gone = tuple(s for s in wanted if s not in exports)
        if gone:
            missing[name] = gone
        cuda.update(n for n in lib.needed if _CUDA_MAJOR_LIB.match(n))
        needed.update(dict.fromkeys(lib.needed))
        origin = os.path.dirname(os.path.abspath(path))
        dirs.update(dict.fromkeys(d.replace("$ORIGIN", origin).replace("${ORIGIN}", origin) for d in lib.runpath))
    return Fit(libraries=tuple(n for n in sorted(extensions) if n not in not_elf), torch_symbols=len(imported),
               missing=missing, cuda_needed=tuple(sorted(cuda)), torch_cuda=torch_cuda, not_elf=tuple(not_elf),
               needed=tuple(needed), search_dirs=tuple(dirs))


def import_error_line(message: str) -> str:
    """The line of an import failure that says why: sgl_kernel wraps the loader's error in a long report."""
    lines = [ln.strip(" -") for ln in message.splitlines() if ln.strip(" -")]
    for key in ("undefined symbol", "cannot open shared object", "No module named"):
        hit = next((ln for ln in lines if key in ln), None)
        if hit:
            return hit[:400]
    return (lines[-1] if lines else message)[:400]


def needs_driver(error: str) -> bool:
    """The import stopped at the CUDA driver library, before any symbol was resolved."""
    return f"{DRIVER}: cannot open shared object file" in error


def failure_reason(error: str) -> str:
    """Reason code of an import failure from its loader line alone (no binaries read)."""
    m = _UNDEFINED.search(import_error_line(error))
    if m:
        symbol = m.group(1)
        if _DRIVER_FN.fullmatch(symbol):
            return "driver-symbol-unresolved"  # a link-stub or driver-age problem, not torch's ABI
        return "abi-mismatch" if torch_symbol(symbol) else "undefined-symbol"
    line = import_error_line(error)
    if (m := re.search(r"(lib[\w.+-]+\.so\.\d+): cannot open shared object file", line)) and _CUDA_MAJOR_LIB.match(
            m.group(1)):
        return "cuda-major-mismatch"
    if needs_driver(error):
        return "no-cuda-device"
    return "import-error"


def _built_for(requirement: str | None) -> str:
    if requirement:
        return f"its wheel was built for torch{requirement}"
    return "its wheel metadata names no torch release, so the one it was built for is unknown here"


def _examples(symbols: Sequence[str]) -> str:
    more = f" and {len(symbols) - _SHOWN} more" if len(symbols) > _SHOWN else ""
    return ", ".join(symbols[:_SHOWN]) + more


def links_torch(fit: Fit) -> bool:
    """The extensions import torch symbols or need one of torch's libraries (libtorch*, libc10*)."""
    return fit.torch_symbols > 0 or any(n.startswith(("libtorch", "libc10")) for n in fit.needed)


def judge(fit: Fit | None, error: str | None, unloadable: Sequence[str], built_for: str | None,
          torch_version: str, name: str = "sgl-kernel", module: str = "") -> Judgement | None:
    """The verdict on the extension, or None when nothing speaks against it and nothing needs saying.

    ``error``: why ``import`` failed (None: it succeeded). ``unloadable``: libraries it needs, other than
    the driver, that the loader does not find here (asked only when the import stopped at the driver).
    ``built_for``: the torch requirement in the wheel's metadata ("==2.9.1"), None if it names none.
    Symbols and CUDA majors are judged even when the import succeeded: sgl-kernel loads one of its
    per-architecture libraries, and the others still fail on the GPUs that select them.
    """
    module = module or name.replace("-", "_")
    failed = f"import {module} failed: {import_error_line(error)}; " if error and not needs_driver(error) else ""
    built = _built_for(built_for)
    if fit is not None:
        gone = fit.missing_symbols()
        mismatch = fit.cuda_mismatch()
        if gone:
            also = f"; it also needs {', '.join(mismatch)}, not torch's CUDA {fit.torch_cuda}" if mismatch else ""
            return Judgement("fail", "abi-mismatch",
                             f"{failed}{name} does not fit torch {torch_version}: {', '.join(sorted(fit.missing))} "
                             f"import {len(gone)} of {fit.torch_symbols} torch symbols that no library of "
                             f"this torch exports ({_examples(gone)}); {built}{also}")
        if mismatch:
            return Judgement("fail", "cuda-major-mismatch",
                             f"{failed}{name} is a build for another CUDA major: it needs {', '.join(mismatch)}, "
                             f"torch {torch_version} is CUDA {fit.torch_cuda}; {built}")
    if error is None:
        return None
    if failed:
        return Judgement("fail", failure_reason(error), failed.removesuffix("; "))
    if unloadable:
        return Judgement("fail", "import-error",
                         f"import {module} stopped at {DRIVER} (no CUDA driver here), and {', '.join(unloadable)}, "
                         "which it also needs, cannot be found here either")
    if fit is None or fit.torch_symbols == 0 or fit.not_elf:
        why = ("no extension library was found" if fit is None or not (fit.libraries or fit.not_elf)
               else f"{', '.join(fit.not_elf)} could not be read" if fit.not_elf
               else "its libraries import no torch symbol to check")
        return Judgement("skip", "no-gpu",
                         f"import {module} needs the CUDA driver ({DRIVER}), absent here, and its binaries could "
                         f"not stand in for the import ({why}): its fit with this torch is not proven")
    cuda = (f"the CUDA libraries they need ({', '.join(fit.cuda_needed)}) are CUDA {fit.torch_cuda.split('.')[0]} "
            "like torch's, " if fit.cuda_needed and fit.torch_cuda else "")
    return Judgement("pass", "",
                     f"import {module} needs the CUDA driver ({DRIVER}), absent here, so it was judged from its "
                     f"binaries: all {fit.torch_symbols} torch symbols its {len(fit.libraries)} extension "
                     f"libraries import are exported by torch {torch_version}, {cuda}and every other library "
                     "they need is found here")


def not_found(fit: Fit) -> tuple[str, ...]:
    """The libraries the extensions need, other than the driver, that the dynamic loader cannot find here:
    each is opened the loader's way (their run paths first, then by name: libraries torch already loaded,
    LD_LIBRARY_PATH, the system's). One that is found but itself stops at the driver counts as found."""
    import ctypes

    missing = []
    for name in fit.needed:
        if name == DRIVER:
            continue
        placed = [os.path.join(d, name) for d in fit.search_dirs if os.path.exists(os.path.join(d, name))]
        for candidate in placed or [name]:
            try:
                ctypes.CDLL(candidate)
                break
            except OSError as exc:
                if DRIVER in str(exc):
                    break
        else:
            missing.append(name)
    return tuple(missing)
