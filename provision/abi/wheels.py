"""A wheel's shared objects, read for their dynamic tables only: from uv's cache when it holds the wheel
unpacked, else from the registry, one member at a time.

A torch wheel is 0.5-0.9 GB and its libraries are deflated, so a member cannot be entered in the middle: it
is streamed once from its first byte (one HTTP Range request for that member alone) and inflated as it
arrives. Only the parts of the ELF image the dynamic tables can live in are written, into a sparse temporary
file: the first 64 MiB, every loadable segment up to 64 MiB, the dynamic segment and the section headers
(patchelf, which the wheels' repair tools run, moves .dynstr into a segment of its own at the end of the
file). The code, the rodata and the GPU fat binaries never reach the disk. When the tables are found
elsewhere, the member is read again whole. The file is then read with the project's ELF reader
(inenv/kit/_elf.py) and removed; nothing of the member is kept but what the caller makes of it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import subprocess
import tempfile
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from inenv import kit
from provision import registry
from provision.lock import uv_bin

WINDOW = 64 << 20  # a segment up to this size is kept whole; the file's first WINDOW bytes always are
_HEAD = 1 << 16  # the ELF header and program headers lie in the first bytes
_PHDR = struct.Struct("<IIQQQQQQ")  # p_type, p_flags, p_offset, p_vaddr, p_paddr, p_filesz, p_memsz, p_align
_PT_LOAD, _PT_DYNAMIC = 1, 2
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # a zip local file header
_SHT_DYNSYM, _SHT_DYNAMIC = 11, 6


class Wheel(Protocol):
    filename: str
    key: str  # "sha256-<hex>"
    origin: str  # "uv cache" or "registry"

    def names(self) -> list[str]: ...

    def text(self, name: str) -> str: ...

    def linkage(self, name: str) -> kit.Linkage | None: ...

    def size_of(self, name: str) -> int: ...  # bytes read for this member (compressed, or on disk)


def keep_ranges(head: bytes, size: int) -> list[tuple[int, int]] | None:
    """The byte ranges of an ELF image that can hold its dynamic tables and section headers, from its first
    bytes; None when it is not 64-bit little-endian ELF. Pure."""
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return None
    phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
    out = [(0, min(WINDOW, size))]
    if shoff:
        out.append((shoff, size))
    for i in range(phnum):
        pos = phoff + i * phentsize
        if pos + _PHDR.size > len(head):
            break
        p_type, _flags, off, _va, _pa, filesz, _memsz, _align = _PHDR.unpack_from(head, pos)
        if p_type == _PT_DYNAMIC or (p_type == _PT_LOAD and filesz <= WINDOW):
            out.append((off, min(off + filesz, size)))
    return sorted(out)


def _covered(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    return any(a <= start and end <= b for a, b in ranges)


def tables_inside(path: str, ranges: list[tuple[int, int]]) -> bool:
    """Whether the dynamic symbol table, the dynamic section and their string tables lie in ``ranges``."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        secs = kit.sections_of(m)
        if secs is None:
            return False
        wanted = [s for s in secs if s.type in (_SHT_DYNSYM, _SHT_DYNAMIC)]
        wanted += [secs[s.link] for s in list(wanted) if s.link < len(secs)]
        return bool(wanted) and all(_covered(ranges, s.offset, s.offset + s.size) for s in wanted)


def _write_kept(f: object, ranges: list[tuple[int, int]] | None, pos: int, data: bytes) -> None:
    end = pos + len(data)
    for a, b in ranges or [(0, end)]:
        lo, hi = max(a, pos), min(b, end)
        if lo < hi:
            f.seek(lo)  # type: ignore[attr-defined]
            f.write(data[lo - pos : hi - pos])  # type: ignore[attr-defined]


def sparse_image(chunks: Iterable[bytes], size: int, out: Path, whole: bool = False) -> list[tuple[int, int]] | None:
    """Write the parts of an ELF image `keep_ranges` names (all of it with ``whole``) from its bytes in
    order into ``out``, a sparse file of the image's size. The ranges kept; None when not ELF (nothing past
    the first bytes is read then)."""
    head = bytearray()
    ranges: list[tuple[int, int]] | None = None
    pos = 0
    with open(out, "wb") as f:
        for chunk in chunks:
            if ranges is None:
                head += chunk
                if len(head) < min(_HEAD, size):
                    continue
                ranges = [(0, size)] if whole else keep_ranges(bytes(head), size)
                if ranges is None:
                    return None
                chunk, head = bytes(head), bytearray()
            _write_kept(f, ranges, pos, chunk)
            pos += len(chunk)
        if ranges is None:  # shorter than the head
            ranges = [(0, size)] if whole else keep_ranges(bytes(head), size)
            if ranges is None:
                return None
            _write_kept(f, ranges, 0, bytes(head))
        f.truncate(size)
    return ranges


def _inflate(raw: Iterator[bytes], method: int) -> Iterator[bytes]:
    if method == zipfile.ZIP_STORED:
        yield from raw
        return
    if method != zipfile.ZIP_DEFLATED:
        raise registry.RegistryError(f"wheel member compressed with zip method {method}, which is not read here")
    z = zlib.decompressobj(-15)
    for block in raw:
        out = z.decompress(block)
        if out:
            yield out
        if z.eof:
            return
    yield z.flush()


@dataclass
class RemoteWheel:
    """A wheel on the registry: its zip directory read with byte ranges (kept in the registry store), each
    shared object streamed once."""

    filename: str
    url: str
    origin: str = "registry"
    _zip: zipfile.ZipFile | None = field(default=None, repr=False)

    @property
    def key(self) -> str:
        return registry.wheel_key(self.url)

    @property
    def zip(self) -> zipfile.ZipFile:
        if self._zip is None:
            self._zip = registry._wheel(self.url, registry.default_store())
        return self._zip

    def names(self) -> list[str]:
        return self.zip.namelist()

    def text(self, name: str) -> str:
        return self.zip.read(name).decode(errors="replace")

    def size_of(self, name: str) -> int:
        return self.zip.getinfo(name).compress_size

    def _member(self, info: zipfile.ZipInfo) -> Iterator[bytes]:
        """The member's stored bytes: one range from its local header to its end."""
        slack = 30 + len(info.filename.encode()) + 4096  # local header, name, extra field
        raw = registry.stream(self.url, info.header_offset, info.header_offset + slack + info.compress_size - 1)
        buf = b""
        while len(buf) < 30 and (block := next(raw, b"")):
            buf += block
        fields = _LOCAL.unpack_from(buf, 0) if len(buf) >= 30 else (0,)
        if fields[0] != 0x04034B50:
            raise registry.RegistryError(f"{self.filename}: {info.filename} has no local header where the "
                                         "zip directory says")
        start = 30 + fields[9] + fields[10]
        while len(buf) < start and (block := next(raw, b"")):
            buf += block
        left = info.compress_size
        first = buf[start : start + left]
        left -= len(first)
        yield first
        for block in raw:
            if left <= 0:
                break
            yield block[:left]
            left -= min(left, len(block))
        if left > 0:
            raise registry.RegistryError(f"{self.filename}: the index stopped sending {info.filename} "
                                         f"{left} bytes before its end")

    def linkage(self, name: str) -> kit.Linkage | None:
        info = self.zip.getinfo(name)
        with tempfile.TemporaryDirectory(prefix="stackprobe-abi-") as tmp:
            out = Path(tmp) / "image.so"
            ranges = sparse_image(_inflate(self._member(info), info.compress_type), info.file_size, out)
            if ranges is None:
                return None
            if not tables_inside(str(out), ranges):
                sparse_image(_inflate(self._member(info), info.compress_type), info.file_size, out, whole=True)
            return kit.linkage(str(out))


@dataclass(frozen=True)
class CachedWheel:
    """A wheel uv's cache holds unpacked (its files read in place)."""

    filename: str
    key: str
    root: Path
    origin: str = "uv cache"

    def names(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file())

    def text(self, name: str) -> str:
        return (self.root / name).read_text(errors="replace")

    def size_of(self, name: str) -> int:
        return 0  # nothing read over the network

    def linkage(self, name: str) -> kit.Linkage | None:
        return kit.linkage(str(self.root / name))


def uv_cache_dir() -> Path | None:
    """uv's cache folder (UV_CACHE_DIR, else what `uv cache dir` says); None when there is none."""
    named = os.environ.get("UV_CACHE_DIR")
    if named:
        return Path(named)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        proc = subprocess.run([uv_bin(), "cache", "dir"], capture_output=True, text=True, timeout=30)
        if proc.returncode == 0 and proc.stdout.strip():
            return Path(proc.stdout.strip())
    return None


def in_uv_cache(cache: Path | None, package: str, filename: str, sha256: str) -> CachedWheel | None:
    """The unpacked wheel ``filename`` in uv's cache, when uv's record of it names the same sha256 (the file
    the registry lists); None otherwise. uv keeps ``wheels-v*/<index>/<name>/<version>-<tags>`` (a link to the
    unpacked archive) beside ``<version>-<tags>.http``, its record of the download."""
    if cache is None or not sha256:
        return None
    stem = filename.removesuffix(".whl").split("-", 1)[-1]
    for record in sorted(cache.glob(f"wheels-v*/*/{package}/{stem}.http")):
        try:
            if sha256.encode() not in record.read_bytes():
                continue
        except OSError:
            continue
        root = record.with_suffix("")
        if root.is_dir():
            return CachedWheel(filename, f"sha256-{sha256}", root.resolve())
    return None
