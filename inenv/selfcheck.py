"""Self-check that runs inside a freshly built cell image: what is really installed there.

Standard library only: `provision build` mounts this file read-only into the container beside the
repository's `inenv/` package (whose ELF, fatbin and distribution-table modules it shares with the
probes) and runs it with the cell's Python (`python selfcheck.py [--compile]`); it prints one JSON object
on stdout. The host compares it with what the cell asked for (provision/verify.py). No GPU is needed:
compiled GPU architectures are read from the CUDA fatbin headers inside the shared objects, not from
`torch.cuda`, and keep their a/f suffix (``sm_120a`` runs only on 12.0, ``sm_120`` on every 12.x).
"""

from __future__ import annotations

import ctypes
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

try:
    from inenv import dists
    from inenv.kit import _elf, _fatbin
except ModuleNotFoundError:  # run as a script from a checkout: the repository root holds checks/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from inenv import dists
    from inenv.kit import _elf, _fatbin

# What `provision build` mounts next to this file inside the image, and hashes into the image tag.
SHARED = ("inenv/__init__.py", "inenv/dists.py", "inenv/kit/__init__.py", "inenv/kit/_elf.py",
          "inenv/kit/_fatbin.py")


def fatbin_archs(path: str | os.PathLike[str]) -> dict[str, list[str]]:
    """GPU code in a shared object: {"sass": ["sm_90a", ...], "ptx": ["compute_120", ...]}."""
    return _fatbin.by_kind(_fatbin.archs([path]))


def _dist_version(key: str) -> str | None:
    found = dists.installed(key)
    return found[1] if found else None


def _needed_cudart(path: Path) -> str | None:
    """CUDA runtime major a shared object links against (its DT_NEEDED libcudart.so.<major>)."""
    lib = _elf.linkage(str(path))
    majors = [n.rsplit(".", 1)[1] for n in (lib.needed if lib else ()) if re.fullmatch(r"libcudart\.so\.\d+", n)]
    return majors[0] if majors else None


def nccl_code_version(code: int) -> str:
    """NCCL's version code (ncclGetVersion) as a release: 23206 is 2.32.6, 2708 is 2.7.8 (the older code)."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def _mapped_file(address: int) -> str | None:
    """The file this process mapped at ``address`` (/proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                start, _, end = fields[0].partition("-")
                if len(fields) == 6 and int(start, 16) <= address < int(end, 16):
                    return fields[5].strip()
    except (OSError, ValueError):
        pass
    return None


def loaded_nccl() -> dict[str, Any]:
    """The NCCL library this process loaded (after torch's import): the object a needed libnccl.so.2
    resolves to, asked its version (ncclGetVersion) and where it lies. torch.cuda.nccl.version() is
    the NCCL torch was compiled against, whatever library is loaded. {} when no NCCL is loaded."""
    try:
        lib = ctypes.CDLL("libnccl.so.2", mode=os.RTLD_NOLOAD)
        get = lib.ncclGetVersion
    except (OSError, AttributeError):
        return {}
    code = ctypes.c_int(0)
    rc = get(ctypes.byref(code))
    if rc != 0:
        return {"nccl_error": f"ncclGetVersion returned {rc}"}
    return {"nccl": nccl_code_version(code.value),
            "nccl_lib": _mapped_file(ctypes.cast(get, ctypes.c_void_p).value or 0)}


def torch_facts() -> dict[str, Any]:
    try:
        import torch  # noqa: PLC0415 - the library under test, present only inside cell images
    except Exception as e:  # an import failure is a finding, not a crash of the self-check
        return {"error": f"import torch: {type(e).__name__}: {e}"}
    out: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda}
    try:
        out["nccl_built"] = ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception as e:
        out["nccl_built_error"] = str(e)[:200]
    out.update(loaded_nccl())
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cuda.so"
    if lib.exists():
        out["archs"] = fatbin_archs(lib)
    return out


def kernel_facts() -> dict[str, Any]:
    found = dists.installed("sgl_kernel")
    if found is None:
        return {}
    dist, version = found
    out: dict[str, Any] = {"version": version}
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
    out["archs"] = {"sass": _fatbin.by_kind(sass)["sass"]}
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


ENGINES = ("vllm", "sglang")  # serving engines an engine cell carries, by distribution name


def engine_facts() -> dict[str, str]:
    """Installed serving-engine distributions and their versions (metadata only: importing vLLM takes seconds)."""
    out: dict[str, str] = {}
    for name in ENGINES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return out


def collect(compile_test: bool = False) -> dict[str, Any]:
    return {
        "python": ".".join(map(str, sys.version_info[:3])),
        "torch": torch_facts(),
        "sgl_kernel": kernel_facts(),
        "flashinfer": {"version": v} if (v := _dist_version("flashinfer")) else {},
        "toolkit": toolkit_facts(compile_test),
        "engines": engine_facts(),
    }


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--archs":
        print(json.dumps(fatbin_archs(sys.argv[2])))
    else:
        print(json.dumps(collect(compile_test="--compile" in sys.argv)))
