"""GPU architectures compiled into a binary, read from its embedded CUDA fat binaries.

Standard library only, on the host and inside cell images alike (the provision self-check imports it):
images without a GPU report an empty ``torch.cuda.get_arch_list()`` and often have no ``cuobjdump``, yet
the fat binary headers say exactly which SASS and PTX a library carries.
Header layout as written by nvcc/fatbinary (undocumented, stable across CUDA 11-13; the tests check it
against what nvcc builds): a container header (magic 0xBA55ED50, version, header size, payload size)
followed by entries, each with its own header: kind (1 = PTX, 2 = ELF/SASS) at byte 0, header size at 4,
payload size at 8, the architecture as major*10+minor at 28, flags at 40 (0x100000 = arch-specific ``a``
target, 0x200000 = family ``f`` target). The suffix matters: ``sm_90a`` SASS runs only on 9.0 and
``sm_120f`` on the whole 12.x family, unlike plain ``sm_90``.
In an ELF file only its fatbin sections are scanned (no stray magic in data), else the whole file.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections import Counter
from collections.abc import Iterable

from inenv.kit import _elf

_MAGIC = struct.pack("<I", 0xBA55ED50)
_KINDS = {1: "compute", 2: "sm"}
_FLAG_ARCH_SPECIFIC = 0x100000
_FLAG_FAMILY = 0x200000
_ENTRY_MIN = 48  # bytes of an entry header this reader needs (through the flags)


def _suffix(flags: int) -> str:
    if flags & _FLAG_FAMILY:
        return "f"
    if flags & _FLAG_ARCH_SPECIFIC:
        return "a"
    return ""


def _scan(m: mmap.mmap, start: int, stop: int, found: Counter[str]) -> None:
    pos = m.find(_MAGIC, start, stop)
    while pos != -1 and pos + 16 <= stop:
        _version, header, payload = struct.unpack_from("<HHQ", m, pos + 4)
        end = min(pos + header + payload, stop)
        e = pos + header
        while e + _ENTRY_MIN <= end:
            kind, _, eheader, esize = struct.unpack_from("<HHIQ", m, e)
            arch = struct.unpack_from("<I", m, e + 28)[0]
            flags = struct.unpack_from("<Q", m, e + 40)[0]
            if eheader < _ENTRY_MIN or kind not in _KINDS:
                break
            found[f"{_KINDS[kind]}_{arch}{_suffix(flags)}"] += 1
            e += eheader + esize
        pos = m.find(_MAGIC, max(end, pos + 4), stop)


def entries(path: str | os.PathLike[str]) -> Counter[str]:
    """Count of fatbin entries per target name (``sm_90a``, ``compute_120`` ...) in one file."""
    found: Counter[str] = Counter()
    if os.path.getsize(path) == 0:
        return found
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        for start, stop in _elf.fatbin_spans(m) or [(0, len(m))]:
            _scan(m, start, min(stop, len(m)), found)
    return found


def archs(paths: Iterable[str | os.PathLike[str]]) -> list[str]:
    """Sorted union of targets over several files (numeric order, SASS before PTX); unreadable files add
    nothing."""
    total: Counter[str] = Counter()
    for p in paths:
        try:
            total.update(entries(p))
        except (OSError, ValueError, struct.error):
            continue
    return sorted(total, key=order)


def by_kind(targets: Iterable[str]) -> dict[str, list[str]]:
    """{"sass": ["sm_90a", ...], "ptx": ["compute_120", ...]}, each in ``order``."""
    ts = sorted(set(targets), key=order)
    return {"sass": [t for t in ts if t.startswith("sm_")], "ptx": [t for t in ts if t.startswith("compute_")]}


def order(name: str) -> tuple[int, int, str]:
    """Sort key: architecture number, then SASS before PTX, then the name (``sm_90`` < ``sm_90a``)."""
    kind, _, rest = name.partition("_")
    digits = "".join(ch for ch in rest if ch.isdigit())
    return (int(digits or 0), 0 if kind == "sm" else 1, name)


def runs_on(targets: Iterable[str], capability: str) -> bool:
    """Whether code for a GPU of ``capability`` ("9.0") is present: SASS of the same major and a minor
    not above it (plain ``sm_XY``; ``a`` only for the exact arch; ``f`` within the family), or PTX the
    driver can JIT (any ``compute_`` target not above it, arch-specific PTX only for the exact arch)."""
    major, minor = (int(x) for x in capability.split("."))
    want = major * 10 + minor
    for t in targets:
        kind, _, rest = t.partition("_")
        suffix = rest[-1] if rest and rest[-1] in "af" else ""
        num = int(rest.rstrip("af"))
        if kind == "sm":
            if suffix == "a" and num == want:
                return True
            if suffix in ("", "f") and num // 10 == major and num % 10 <= minor:
                return True
        elif kind == "compute":
            if suffix == "" and num <= want:
                return True
            if suffix and num == want:
                return True
    return False
