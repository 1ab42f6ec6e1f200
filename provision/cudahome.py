"""A CUDA_HOME assembled from the registry's CUDA toolkit wheels, for venv cells (no Docker, no system CUDA).

The same layout the registry-free base image makes in /usr/local/cuda: every ``nvidia/<part>/`` folder of
the installed wheels linked into one tree (bin/nvcc, include/ with CCCL, nvvm/, lib/ with cudart),
``lib64`` beside ``lib``, an unversioned ``.so`` link for every versioned library, and a libcuda link stub
so JIT modules link without a driver. The stub defines every driver function ``cuda.h`` names: a stub that
lacks a function the module calls lets the linker drop the ``libcuda.so.1`` dependency, and the module
then fails to load on a GPU host (undefined symbol).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

# A driver function's name in cuda.h. The one recipe of the libcuda link stub: this module builds it for venv
# cells, the Dockerfile (provision.render) greps the image's own cuda.h with the same pattern, and
# tools/prebuild_fi_aot.sh asks `python -m provision.cudahome stub-source`.
DRIVER_NAME = r"\bcu[A-Z][A-Za-z0-9_]*\b"
_DRIVER_NAME = re.compile(DRIVER_NAME)


def link_tree(src: Path, dst: Path) -> None:
    """``cp -rsn src/. dst/``: folders made, files (and links to folders) linked, existing names kept."""
    for root, dirs, files in os.walk(src):
        here = dst / Path(root).relative_to(src)
        here.mkdir(parents=True, exist_ok=True)
        linked_dirs = [d for d in dirs if (Path(root) / d).is_symlink()]
        for name in [*files, *linked_dirs]:
            target = here / name
            if not (target.exists() or target.is_symlink()):
                target.symlink_to(Path(root) / name)
        dirs[:] = [d for d in dirs if d not in linked_dirs]


def unversioned_links(lib: Path) -> None:
    """``libcudart.so`` -> ``libcudart.so.13`` and the like, where the wheel ships only versioned names."""
    for f in sorted(lib.glob("lib*.so.[0-9]*")):
        plain = lib / (f.name.split(".so.", 1)[0] + ".so")
        if not (plain.exists() or plain.is_symlink()):
            plain.symlink_to(f.name)


def stub_source(cuda_h: str) -> str:
    return "".join(f"void {n}(void){{}}\n" for n in sorted(set(_DRIVER_NAME.findall(cuda_h))))


def build_stub(home: Path, cc: str | None = None) -> str:
    """Write ``lib/stubs/libcuda.so``; "" when done, else why not."""
    cc = cc or shutil.which("gcc") or shutil.which("cc")
    header = home / "include" / "cuda.h"
    if not cc:
        return "no C compiler for the libcuda link stub (JIT modules compile but do not link)"
    if not header.exists():
        return f"{header} missing: no libcuda link stub"
    stubs = home / "lib" / "stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="stackprobe-stub-") as d:
        src = Path(d) / "stub.c"
        src.write_text(stub_source(header.read_text(errors="replace")))
        proc = subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stubs / "libcuda.so"),
                               str(src)], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"libcuda stub: {cc} exited {proc.returncode}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"
    return ""


def assemble(wheels: Path, home: Path) -> str:
    """Make ``home`` from toolkit wheels installed under ``wheels`` (a ``--target`` folder); returns a note
    ("" when complete). Raises OSError when the wheels hold no ``nvidia/`` tree."""
    parts = sorted(p for p in (wheels / "nvidia").iterdir() if p.is_dir() and p.name != "__pycache__")
    if home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True)
    for part in parts:
        link_tree(part, home)
    for junk in (".metadata", "__pycache__"):
        shutil.rmtree(home / junk, ignore_errors=True)
    if not (home / "lib64").exists() and (home / "lib").is_dir():
        (home / "lib64").symlink_to("lib")
    if (home / "lib").is_dir():
        unversioned_links(home / "lib")
    return build_stub(home)


if __name__ == "__main__":  # `python -m provision.cudahome stub-source CUDA_H`: the stub's C source on stdout
    import sys

    if sys.argv[1:2] != ["stub-source"] or len(sys.argv) != 3:
        sys.exit("usage: python -m provision.cudahome stub-source PATH/TO/cuda.h")
    sys.stdout.write(stub_source(Path(sys.argv[2]).read_text(errors="replace")))
