"""Self-check that runs inside a freshly built cell image: what is really installed there.

Standard library only: this file is mounted read-only into the container and run with the cell's
Python (`python selfcheck.py [--compile]`); it prints one JSON object on stdout. The host compares it
with what the cell asked for (provision/verify.py). No GPU is needed: compiled GPU architectures are
read from the CUDA fatbin headers inside the shared objects, not from `torch.cuda`.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import mmap
import os
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

FATBIN_MAGIC = 0xBA55ED50
_KIND = {1: "ptx", 2: "elf"}


def elf_section(data: bytes | mmap.mmap, name: bytes) -> tuple[int, int] | None:
    """(offset, size) of a section of a 64-bit little-endian ELF file, or None."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shnum == 0:
        return None
    strtab_off, = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)
    for i in range(shnum):
        base = shoff + i * shentsize
        name_off, = struct.unpack_from("<I", data, base)
        off, size = struct.unpack_from("<QQ", data, base + 0x18)
        start = strtab_off + name_off
        end = data.find(b"\0", start)
        if data[start:end] == name:
            return off, size
    return None


def fatbin_archs(path: str | os.PathLike[str]) -> dict[str, list[str]]:
    """GPU code in a shared object: {"sass": ["sm_90", ...], "ptx": ["compute_120", ...]}.

    A fatbin is a header (magic, version, header size, payload size) followed by entries, each with
    its own header: kind (1 PTX, 2 ELF/SASS) at byte 0, header size at 4, payload size at 8, and
    the SM number at 28. The layout is undocumented but stable across CUDA 11-13; the unit tests
    check it against binaries that nvcc builds for known architectures.
    """
    sass: set[int] = set()
    ptx: set[int] = set()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        sec = elf_section(mm, b".nv_fatbin")
        start, end = (sec[0], sec[0] + sec[1]) if sec else (0, len(mm))
        magic = struct.pack("<I", FATBIN_MAGIC)
        pos = mm.find(magic, start, end)
        while pos != -1 and pos + 16 <= end:
            _, _ver, hsize, fsize = struct.unpack_from("<IHHQ", mm, pos)
            entry, stop = pos + hsize, min(pos + hsize + fsize, end)
            while entry + 32 <= stop:
                kind, _ev, ehsize, payload = struct.unpack_from("<HHIQ", mm, entry)
                arch, = struct.unpack_from("<I", mm, entry + 28)
                if ehsize < 32 or kind not in _KIND:
                    break
                (ptx if kind == 1 else sass).add(arch)
                entry += ehsize + payload
            pos = mm.find(magic, max(stop, pos + 4), end)
    return {"sass": [f"sm_{a}" for a in sorted(sass)], "ptx": [f"compute_{a}" for a in sorted(ptx)]}


def _dist_version(*names: str) -> str | None:
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            continue
    return None


def _module_dir(dist: str) -> Path | None:
    try:
        files = md.files(dist) or []
    except md.PackageNotFoundError:
        return None
    for f in files:
        if f.name.endswith(".so"):
            return Path(str(f.locate())).parent
    return None


def _needed_cudart(path: Path) -> str | None:
    """CUDA runtime major a shared object links against (libcudart.so.<major>)."""
    m = re.search(rb"libcudart\.so\.(\d+)", path.read_bytes()[:4_000_000])
    return m.group(1).decode() if m else None


def torch_facts() -> dict[str, Any]:
    try:
        import torch  # noqa: PLC0415 - the library under test, present only inside cell images
    except Exception as e:  # an import failure is a finding, not a crash of the self-check
        return {"error": f"import torch: {type(e).__name__}: {e}"}
    out: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda}
    try:
        out["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception as e:
        out["nccl_error"] = str(e)[:200]
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cuda.so"
    if lib.exists():
        out["archs"] = fatbin_archs(lib)
    return out


def kernel_facts() -> dict[str, Any]:
    version = _dist_version("sglang-kernel", "sgl-kernel")
    if version is None:
        return {}
    out: dict[str, Any] = {"version": version}
    dist = "sglang-kernel" if _dist_version("sglang-kernel") else "sgl-kernel"
    sass: set[str] = set()
    cudart: set[str] = set()
    try:
        files = md.files(dist) or []
    except md.PackageNotFoundError:
        files = []
    for f in files:
        if f.name.endswith(".so") and "common_ops" in f.name:
            p = Path(str(f.locate()))
            sass.update(fatbin_archs(p)["sass"])
            major = _needed_cudart(p)
            if major:
                cudart.add(major)
    out["archs"] = {"sass": sorted(sass, key=lambda s: int(s[3:]))}
    out["cudart_major"] = sorted(cudart)
    return out


def toolkit_facts(compile_test: bool) -> dict[str, Any]:
    home = os.environ.get("CUDA_HOME")
    if not home:
        return {}
    nvcc = Path(home) / "bin" / "nvcc"
    out: dict[str, Any] = {"cuda_home": home}
    if not nvcc.exists():
        out["error"] = f"{nvcc} missing"
        return out
    proc = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True)
    m = re.search(r"release (\d+\.\d+)", proc.stdout)
    out["nvcc"] = m.group(1) if m else None
    if compile_test:
        src = "#include <cuda/std/atomic>\n__global__ void k(int* p) { cuda::std::atomic_ref<int>(*p).fetch_add(1); }\n"
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "x.cu").write_text(src)
            c = subprocess.run([str(nvcc), "-arch=sm_120a", "-c", "x.cu", "-o", "x.o"], cwd=d,
                               capture_output=True, text=True)
            out["compile_sm_120a"] = "ok" if c.returncode == 0 else (c.stderr.strip().splitlines() or ["?"])[-1]
    return out


def collect(compile_test: bool = False) -> dict[str, Any]:
    return {
        "python": ".".join(map(str, sys.version_info[:3])),
        "torch": torch_facts(),
        "sgl_kernel": kernel_facts(),
        "flashinfer": {"version": v} if (v := _dist_version("flashinfer-python")) else {},
        "toolkit": toolkit_facts(compile_test),
    }


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--archs":
        print(json.dumps(fatbin_archs(sys.argv[2])))
    else:
        print(json.dumps(collect(compile_test="--compile" in sys.argv)))
