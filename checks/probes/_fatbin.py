"""GPU architectures compiled into a binary, read from its embedded CUDA fat binaries.

Standard library only: images without a GPU report an empty ``torch.cuda.get_arch_list()`` and often
have no ``cuobjdump``, yet the fat binary headers say exactly which SASS and PTX a library carries.
Header layout as written by nvcc/fatbinary: a container header (magic 0xBA55ED50, version, header size,
payload size) followed by entries (kind 1 = PTX, 2 = ELF/SASS; the architecture as major*10+minor;
flag bits 0x100000 = arch-specific ``a`` target, 0x200000 = family ``f`` target).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections import Counter
from collections.abc import Iterable

_MAGIC = struct.pack("<I", 0xBA55ED50)
_KINDS = {1: "compute", 2: "sm"}
_FLAG_ARCH_SPECIFIC = 0x100000
_FLAG_FAMILY = 0x200000


def _suffix(flags: int) -> str:
    if flags & _FLAG_FAMILY:
        return "f"
    if flags & _FLAG_ARCH_SPECIFIC:
        return "a"
    return ""


def entries(path: str) -> Counter[str]:
    """Count of fatbin entries per target name (``sm_90a``, ``compute_120`` ...) in one file."""
    found: Counter[str] = Counter()
    if os.path.getsize(path) == 0:
        return found
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        size = len(m)
        pos = m.find(_MAGIC)
        while pos != -1 and pos + 16 <= size:
            _version, header, payload = struct.unpack_from("<HHQ", m, pos + 4)
            end = min(pos + header + payload, size)
            e = pos + header
            while e + 48 <= end:
                kind, _, eheader, esize = struct.unpack_from("<HHIQ", m, e)
                arch = struct.unpack_from("<I", m, e + 28)[0]
                flags = struct.unpack_from("<Q", m, e + 40)[0]
                if eheader == 0 or kind not in _KINDS:
                    break
                found[f"{_KINDS[kind]}_{arch}{_suffix(flags)}"] += 1
                e += eheader + esize
            pos = m.find(_MAGIC, max(end, pos + 4))
    return found


def archs(paths: Iterable[str]) -> list[str]:
    """Sorted union of targets over several files (numeric order, SASS before PTX)."""
    total: Counter[str] = Counter()
    for p in paths:
        try:
            total.update(entries(p))
        except (OSError, ValueError, struct.error):
            continue
    return sorted(total, key=_order)


def _order(name: str) -> tuple[int, int, str]:
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
