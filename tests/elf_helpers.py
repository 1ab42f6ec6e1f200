"""Tiny real shared objects for the tests: a stand-in torch library exporting c10 symbols, extensions that
import them, and libraries named like real dependencies (built with g++, deleted where the loader must
not find them)."""

from __future__ import annotations

import subprocess
from pathlib import Path

FOO, BAR, SIZE = "_ZN3c103fooEv", "_ZN3c103barEv", "_ZNK3c106Tensor4sizeEv"  # c10::foo(), c10::bar(), const
NO_DRIVER = "ImportError: libcuda.so.1: cannot open shared object file: No such file or directory"

TORCH_SRC = """
namespace c10 { void foo() {} struct Tensor { int size() const; }; int Tensor::size() const { return 1; } }
namespace other { void helper() {} }
"""


def build_so(out: Path, source: str, *link: str, soname: str | None = None) -> Path:
    src = out.with_suffix(".cc")
    src.write_text(source)
    cmd = ["g++", "-shared", "-fPIC", "-o", str(out), str(src), *(["-Wl,-soname," + soname] if soname else []), *link]
    subprocess.run(cmd, check=True, capture_output=True)
    return out


def build_stub(folder: Path, soname: str, source: str = "") -> Path:
    """A library named like a real dependency, to link against; deleted afterwards where the test wants the
    loader not to find it."""
    folder.mkdir(parents=True, exist_ok=True)
    return build_so(folder / soname, source or "void stub_marker() {}\n", soname=soname)


def build_ext(out: Path, calls: list[str], stubs: list[Path] = (), extra: str = "") -> Path:
    """An extension library calling the given C++ declarations, with DT_NEEDED on each stub."""
    decls = "\n".join(calls)
    body = "namespace c10 { void foo(); void bar(); struct Tensor { int size() const; }; }\n" + extra + "\n"
    body += f"int entry() {{ {decls} return 0; }}\n"
    links = [arg for s in stubs for arg in (f"-L{s.parent}", f"-l:{s.name}")]
    return build_so(out, body, "-Wl,--no-as-needed", *links)
