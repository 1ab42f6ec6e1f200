"""What an ELF shared object holds for the dynamic linker: sections, DT_NEEDED, dynamic symbols.

Standard library only, so it runs in images without binutils, on the host and inside cell images alike
(the provision self-check imports it too). Uses:

- fi-jit tells a module that will load on a GPU host from one that calls CUDA driver functions
  (``cuPointerGetAttribute``...) without depending on ``libcuda.so.1``: the linker drops that dependency
  when the link-time libcuda stub does not export the called functions, and the module then fails at load
  time with "undefined symbol" wherever libcuda was loaded privately (as the CUDA runtime does).
- inventory judges sgl-kernel's fit with torch without a GPU: the C++ symbols its extensions import from
  torch's namespaces must be exported by this torch's libraries, and the CUDA libraries it needs must be
  of torch's CUDA major.
- the fatbin reader finds the ``.nv_fatbin`` section.

Symbol names are compared mangled (``_ZN3c10...``): equal mangled names are what the loader matches.
Only 64-bit little-endian ELF is read (x86-64 and aarch64 Linux); anything else gives ``None``, and
:func:`unread` says which it was (32-bit, big-endian, not ELF), so a caller that must judge fail-closed
names why it could not read a file instead of taking "nothing read" for "nothing needed".
Files are mapped, not read: torch's CUDA library is over a gigabyte and only its tables are needed.
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass

_DT_NULL = 0
_DT_NEEDED = 1
_DT_SONAME = 14
_DT_RPATH = 15
_DT_RUNPATH = 29
_ET_DYN = 3  # e_type of a shared object
_SHT_DYNSYM = 11
_SHT_DYNAMIC = 6
_SHN_UNDEF = 0
_STB_WEAK = 2
_SYM = struct.Struct("<IBBHQQ")  # st_name, st_info, st_other, st_shndx, st_value, st_size
_DYN = struct.Struct("<qQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
# Driver API entry points: cuInit, cuPointerGetAttribute... (the runtime's are cudaXxx, lower case).
_DRIVER_RE = re.compile(r"cu[A-Z]\w*")
# torch's C++ namespaces as they start a mangled name: c10::, at::, torch:: (and caffe2:: that c10 still
# uses), with const/volatile/ref qualifiers of member functions (_ZNK...) and the vtable/typeinfo of a
# class in them (_ZTV/_ZTI/_ZTS). Free functions of those namespaces take the same nested-name form.
_TORCH_NS = re.compile(r"_Z(?:T[VIS])?N[rVKRO]*(?:3c10|2at|5torch|6caffe2)")


@dataclass(frozen=True)
class Section:
    name: str
    type: int
    offset: int
    size: int
    link: int
    entsize: int


@dataclass(frozen=True)
class Linkage:
    needed: tuple[str, ...]  # DT_NEEDED, in file order
    undefined: tuple[str, ...]  # strong undefined dynamic symbols, sorted
    defined: frozenset[str] = frozenset()  # dynamic symbols this file exports
    runpath: tuple[str, ...] = ()  # DT_RUNPATH (else DT_RPATH) entries, $ORIGIN unexpanded
    soname: str | None = None
    elf_type: int = _ET_DYN  # e_type: 3 for a shared object, 2 an executable, 1 a relocatable object

    @property
    def shared_object(self) -> bool:
        return self.elf_type == _ET_DYN

    def driver_calls(self) -> tuple[str, ...]:
        return tuple(s for s in self.undefined if _DRIVER_RE.fullmatch(s))

    def unresolved_driver_calls(self) -> tuple[str, ...]:
        """Driver functions the module calls with no libcuda among its dependencies."""
        if any(n.startswith("libcuda.so") for n in self.needed):
            return ()
        return self.driver_calls()

    def torch_imports(self) -> tuple[str, ...]:
        """Undefined symbols in torch's C++ namespaces (c10::, at::, torch::), sorted."""
        return tuple(s for s in self.undefined if is_torch_symbol(s))


def is_torch_symbol(name: str) -> bool:
    return _TORCH_NS.match(name) is not None


def _is_elf64le(data: bytes | mmap.mmap) -> bool:
    return len(data) >= 64 and data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1


def _cstr(blob: bytes | mmap.mmap, offset: int, limit: int | None = None) -> str:
    end = blob.find(b"\0", offset, limit if limit is not None else len(blob))
    return bytes(blob[offset : end if end != -1 else (limit or len(blob))]).decode(errors="replace")


def sections_of(data: bytes | mmap.mmap) -> tuple[Section, ...] | None:
    """Section headers of a mapped 64-bit little-endian ELF image, with their names; None if not one."""
    if not _is_elf64le(data):
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shnum == 0 or shentsize < _SHDR.size or shoff + shnum * shentsize > len(data):
        return None
    raw = [_SHDR.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
    names_off = raw[shstrndx][4] if shstrndx < shnum else 0
    names_end = names_off + (raw[shstrndx][5] if shstrndx < shnum else 0)
    out = []
    for name, sh_type, _flags, _addr, off, size, link, _info, _align, entsize in raw:
        label = _cstr(data, names_off + name, names_end) if names_off else ""
        out.append(Section(label, sh_type, off, size, link, entsize))
    return tuple(out)


def _dynamic(data: bytes | mmap.mmap, secs: tuple[Section, ...]) -> tuple[list[str], list[str], str | None]:
    needed: list[str] = []
    rpath: list[str] = []
    runpath: list[str] = []
    soname = None
    for s in secs:
        if s.type != _SHT_DYNAMIC or s.link >= len(secs):
            continue
        strtab = secs[s.link]
        names = bytes(data[strtab.offset : strtab.offset + strtab.size])
        for pos in range(s.offset, min(s.offset + s.size, len(data)) - _DYN.size + 1, s.entsize or _DYN.size):
            tag, value = _DYN.unpack_from(data, pos)
            if tag == _DT_NULL:
                break
            if tag == _DT_NEEDED:
                needed.append(_cstr(names, value))
            elif tag == _DT_SONAME:
                soname = _cstr(names, value)
            elif tag == _DT_RPATH:
                rpath += _cstr(names, value).split(":")
            elif tag == _DT_RUNPATH:
                runpath += _cstr(names, value).split(":")
    return needed, [p for p in (runpath or rpath) if p], soname


def _symbols(data: bytes | mmap.mmap, secs: tuple[Section, ...]) -> tuple[set[str], set[str]]:
    defined: set[str] = set()
    undefined: set[str] = set()
    for s in secs:
        if s.type != _SHT_DYNSYM or s.link >= len(secs):
            continue
        strtab = secs[s.link]
        names = bytes(data[strtab.offset : strtab.offset + strtab.size])
        table = bytes(data[s.offset : s.offset + s.size])
        step = s.entsize or _SYM.size
        for pos in range(step, len(table) - _SYM.size + 1, step):  # entry 0 is the null symbol
            st_name, st_info, _other, st_shndx, _value, _size = _SYM.unpack_from(table, pos)
            if not st_name:
                continue
            if st_shndx != _SHN_UNDEF:
                defined.add(_cstr(names, st_name))
            elif st_info >> 4 != _STB_WEAK:
                undefined.add(_cstr(names, st_name))
    return defined, undefined


def unread(path: str) -> str:
    """Why :func:`linkage` gives None for ``path``, in words ("" when it reads it): missing, empty, not ELF,
    32-bit or big-endian ELF (not read by this module), or headers that point outside the file."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as exc:
        return f"cannot be opened ({type(exc).__name__}: {exc.strerror or exc})"
    if not head:
        return "empty file"
    if head[:4] != b"\x7fELF":
        return "not an ELF file"
    if len(head) < 64 or head[4] not in (1, 2) or head[5] not in (1, 2):
        return "a truncated or malformed ELF header"
    if head[4] != 2:
        return "32-bit ELF, which this reader does not read (only 64-bit little-endian)"
    if head[5] != 1:
        return "big-endian ELF, which this reader does not read (only 64-bit little-endian)"
    return "" if linkage(path) is not None else "ELF headers that point outside the file"


def linkage(path: str) -> Linkage | None:
    """DT_NEEDED, run path, and the defined and strong undefined dynamic symbols of one ELF file; None
    if it is not 64-bit little-endian ELF (or is empty, or its headers point outside it)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            secs = sections_of(m)
            if secs is None:
                return None
            needed, runpath, soname = _dynamic(m, secs)
            defined, undefined = _symbols(m, secs)
            elf_type, = struct.unpack_from("<H", m, 0x10)
    except (ValueError, struct.error):  # an empty file cannot be mapped; a truncated one runs off the end
        return None
    return Linkage(needed=tuple(needed), undefined=tuple(sorted(undefined)), defined=frozenset(defined),
                   runpath=tuple(runpath), soname=soname, elf_type=elf_type)


def fatbin_spans(data: bytes | mmap.mmap) -> list[tuple[int, int]] | None:
    """(start, end) of the sections that hold CUDA fat binaries (``.nv_fatbin``, and ``__nv_relfatbin``
    of relocatable device code); None when the data is not ELF or names no such section."""
    secs = sections_of(data)
    if secs is None:
        return None
    spans = [(s.offset, s.offset + s.size) for s in secs if s.name in (".nv_fatbin", "__nv_relfatbin")]
    return spans or None


def exported(libraries: Iterable[Linkage]) -> frozenset[str]:
    """Every dynamic symbol a set of libraries defines."""
    out: set[str] = set()
    for lib in libraries:
        out |= lib.defined
    return frozenset(out)
