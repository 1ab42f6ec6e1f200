"""The CUDA toolkit a venv cell shows its code (host side): the same one its image has, so a cell id means
one environment on every backend. `provision build` runs the self-check with it, `checks run` the ranks."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

# What an image of the cell leaves unset: a host value would pick another toolkit or compiler than the cell's.
UNSET = ("CUDA_PATH", "FLASHINFER_NVCC")
# flashinfer's import loads ``$CUDA_LIB_PATH/libcudart.so.12`` globally when it exists, CUDA_LIB_PATH defaulting to
# /usr/local/cuda/targets/x86_64-linux/lib: in a venv cell that default is the host's toolkit, not the cell's.
CUDA_LIB = ("targets", "x86_64-linux", "lib")


# What a full venv cell's processes keep of the caller's environment, as an image's container would have it:
# who and where (the rest an image never sees: LD_LIBRARY_PATH, CPATH, LIBRARY_PATH, NVCC_APPEND_FLAGS,
# TORCH_CUDA_ARCH_LIST, PYTHONPATH, the caller's NCCL_* settings...), stackprobe's own settings, and of
# LD_LIBRARY_PATH only the folders holding the GPU driver's libcuda, which a container is given too.
KEEP = frozenset({"HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TERM", "TZ", "TMPDIR", "SHELL", "PATH"})
KEEP_PREFIXES = ("LC_", "STACKPROBE_")
DRIVER_LIB = "libcuda.so.1"


def base_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of ``environ`` a full venv cell starts from (KEEP, KEEP_PREFIXES, the driver's folders)."""
    out = {k: v for k, v in environ.items() if k in KEEP or k.startswith(KEEP_PREFIXES)}
    driver = [d for d in environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)
              if d and os.path.exists(os.path.join(d, DRIVER_LIB))]
    if driver:
        out["LD_LIBRARY_PATH"] = os.pathsep.join(driver)
    return out


def without_nvcc(path: str, keep: Sequence[str] = ()) -> str:
    """``path`` without the directories that hold an ``nvcc`` (a host toolkit's bin/, a wrapper script in
    /usr/local/bin), except those in ``keep``: flashinfer and torch take the first nvcc on PATH when CUDA_HOME
    is unset, and a build step may call plain ``nvcc``."""
    return os.pathsep.join(d for d in path.split(os.pathsep)
                           if d and (d in keep or not os.path.isfile(os.path.join(d, "nvcc"))))


def toolkit_home(record: Mapping[str, object]) -> str:
    """The cell's own CUDA_HOME: the toolkit assembled from the registry's wheels, else ``<venv>/cuda``, which
    then holds no nvcc (the registry's CUDA 12 nvcc wheels have only ptxas), as the image's /usr/local/cuda."""
    if record.get("cuda_home"):
        return str(record["cuda_home"])
    venv = record.get("venv") or os.path.dirname(os.path.dirname(str(record.get("python") or "")))
    return os.path.join(str(venv), "cuda")


def cell_env(record: Mapping[str, object], environ: Mapping[str, str], code_root: Path) -> tuple[tuple[str, str], ...]:
    """What a process in a venv cell gets on top of ``environ`` (an empty value unsets): the venv's scripts
    first on PATH (then the base's: its ninja, say); only ``code_root`` on PYTHONPATH, so the caller's path
    cannot put other packages in front of the cell's. A full cell is the environment its image is: CUDA_HOME
    (and flashinfer's CUDA_LIB_PATH) is the cell's own toolkit (an empty one where the registry has no nvcc),
    no host nvcc stays on PATH, and CUDA_PATH and FLASHINFER_NVCC are unset. An overlay cell (a base
    environment's torch and CUDA libraries) compiles with the toolkit the host has."""
    path = [str(p) for p in record.get("path") or [] if p]  # type: ignore[union-attr]
    host_path = environ.get("PATH", os.defpath)
    if record.get("base_python"):
        return (("PATH", os.pathsep.join([*path, host_path])), ("PYTHONPATH", str(code_root)),
                *((("CUDA_HOME", str(record["cuda_home"])),) if record.get("cuda_home") else ()))
    home = toolkit_home(record)
    own = [*path, os.path.join(home, "bin")]
    return (("PATH", without_nvcc(os.pathsep.join([*own, host_path]), keep=own)), ("PYTHONPATH", str(code_root)),
            ("CUDA_HOME", home), ("CUDA_LIB_PATH", os.path.join(home, *CUDA_LIB)), *((name, "") for name in UNSET))
