"""What a shared object needs from the dynamic linker: its DT_NEEDED libraries and undefined symbols.

Standard library only, so it also runs in images without binutils. fi-jit uses it to tell a module that
will load on a GPU host from one that calls CUDA driver functions (``cuPointerGetAttribute``...) without
depending on ``libcuda.so.1``: the linker drops that dependency when the link-time libcuda stub does not
export the called functions, and the module then fails at load time with "undefined symbol" wherever
libcuda was loaded privately (as the CUDA runtime does).
Only 64-bit little-endian ELF is read (x86-64 and aarch64 Linux); anything else gives ``None``.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

_DT_NEEDED = 1
_DT_NULL = 0
_SHT_DYNSYM = 11
_SHT_DYNAMIC = 6
_SHN_UNDEF = 0
_STB_WEAK = 2
# Driver API entry points: cuInit, cuPointerGetAttribute... (the runtime's are cudaXxx, lower case).
_DRIVER_RE = re.compile(r"cu[A-Z]\w*")


@dataclass(frozen=True)
class Linkage:
    needed: tuple[str, ...]
    undefined: tuple[str, ...]  # strong undefined symbols, sorted

    def driver_calls(self) -> tuple[str, ...]:
        return tuple(s for s in self.undefined if _DRIVER_RE.fullmatch(s))

    def unresolved_driver_calls(self) -> tuple[str, ...]:
        """Driver functions the module calls with no libcuda among its dependencies."""
        if any(n.startswith("libcuda.so") for n in self.needed):
            return ()
        return self.driver_calls()


def _cstr(blob: bytes, offset: int) -> str:
    end = blob.find(b"\0", offset)
    return blob[offset : end if end != -1 else len(blob)].decode(errors="replace")


def linkage(path: str) -> Linkage | None:
    """DT_NEEDED and strong undefined dynamic symbols of one ELF file; None if it is not 64-bit LE ELF."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for i in range(shnum):
        base = shoff + i * shentsize
        if base + 64 > len(data):
            return None
        _name, sh_type, _flags, _addr, off, size, link, _info, _align, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", data, base
        )
        sections.append((sh_type, off, size, link, entsize))

    def strtab(index: int) -> bytes:
        _t, off, size, _l, _e = sections[index]
        return data[off : off + size]

    needed: list[str] = []
    undefined: set[str] = set()
    for sh_type, off, size, link, entsize in sections:
        if sh_type == _SHT_DYNAMIC:
            names = strtab(link)
            for pos in range(off, off + size, entsize or 16):
                tag, value = struct.unpack_from("<qQ", data, pos)
                if tag == _DT_NULL:
                    break
                if tag == _DT_NEEDED:
                    needed.append(_cstr(names, value))
        elif sh_type == _SHT_DYNSYM:
            names = strtab(link)
            for pos in range(off + (entsize or 24), off + size, entsize or 24):  # entry 0 is the null symbol
                st_name, st_info, _other, st_shndx = struct.unpack_from("<IBBH", data, pos)
                if st_shndx == _SHN_UNDEF and st_info >> 4 != _STB_WEAK and st_name:
                    undefined.add(_cstr(names, st_name))
    return Linkage(needed=tuple(needed), undefined=tuple(sorted(undefined)))
