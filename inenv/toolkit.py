"""Which CUDA toolkit (nvcc) an environment compiles with, found the way flashinfer finds it.

Standard library only: imported on the host and inside environments (the inventory, the fi-jit probe,
the environment versions that name a ``--local`` cell).

flashinfer's JIT (``flashinfer/jit/cpp_ext.py`` ``get_cuda_path``; the same in every release read:
0.5.3, 0.6.8.post1, 0.6.16, 0.6.17, 0.6.18, 0.7.4) and ``torch.utils.cpp_extension`` look in one order:

1. ``CUDA_HOME``, else ``CUDA_PATH`` (taken as set, whether or not it holds an nvcc; an empty
   ``CUDA_HOME`` falls through to ``CUDA_PATH``, an empty ``CUDA_PATH`` is kept);
2. the first ``nvcc`` on ``PATH``, its home two directories up (symlinks not followed);
3. ``/usr/local/cuda`` when it exists.

flashinfer then runs ``$FLASHINFER_NVCC`` when set, else ``<home>/bin/nvcc``. A toolkit named by
``CUDA_HOME`` that lacks ``bin/nvcc`` (the registry's ``nvidia-cuda-nvcc-cu12`` wheel ships only ptxas and
libnvvm) is still the one flashinfer uses, and its builds fail; it is never skipped for a later candidate.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_HOME = "/usr/local/cuda"
_RELEASE = re.compile(r"release\s+(\d+\.\d+)")


@dataclass(frozen=True)
class Toolkit:
    """The toolkit a JIT build in this environment uses; ``version`` is None when its nvcc does not run."""

    nvcc: str  # the compiler that would run; "" when nothing was found
    cuda_home: str  # include/ and lib64/ come from here; "" when nothing was found
    found_by: str  # CUDA_HOME | CUDA_PATH | PATH | default | none; "+FLASHINFER_NVCC" when that overrides nvcc
    version: str | None = None  # "13.0", from `nvcc --version`
    error: str = ""  # why there is no version

    @property
    def found(self) -> bool:
        return self.found_by != "none"

    @property
    def major(self) -> int | None:
        return int(self.version.split(".")[0]) if self.version else None

    def label(self) -> str:
        """The toolkit part of a local cell id: ``nvcc13.0``, or ``nonvcc`` when no nvcc runs."""
        return f"nvcc{self.version}" if self.version else "nonvcc"

    def describe(self) -> str:
        """One phrase for a note: which nvcc, how it was found, and whether it runs."""
        if not self.found:
            return "no nvcc (no CUDA_HOME/CUDA_PATH, none on PATH, no /usr/local/cuda)"
        state = f"nvcc {self.version}" if self.version else f"not runnable: {self.error or 'no version'}"
        return f"{self.nvcc} (from {self.found_by}; {state})"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def from_dict(raw: Mapping[str, Any]) -> Toolkit:
    """A recorded toolkit (``Toolkit.as_dict``) read back; keys it lacks are left empty."""
    return Toolkit(str(raw.get("nvcc") or ""), str(raw.get("cuda_home") or ""), str(raw.get("found_by") or "none"),
                   raw.get("version") or None, str(raw.get("error") or ""))


Which = Callable[[str, str], str | None]


def _which(name: str, path: str) -> str | None:
    return shutil.which(name, path=path)


def locate(
    env: Mapping[str, str], which: Which = _which, exists: Callable[[str], bool] = os.path.exists,
    flashinfer: bool = True,
) -> Toolkit:
    """Where nvcc is, in flashinfer's order (module docstring); pure given ``which`` and ``exists``.
    ``flashinfer`` False: an environment without flashinfer, where ``FLASHINFER_NVCC`` means nothing."""
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home is not None:
        found_by = "CUDA_HOME" if env.get("CUDA_HOME") else "CUDA_PATH"
    else:
        on_path = which("nvcc", env.get("PATH", os.defpath))
        if on_path:
            home, found_by = os.path.dirname(os.path.dirname(on_path)), "PATH"
        elif exists(DEFAULT_HOME):
            home, found_by = DEFAULT_HOME, "default"
        else:
            return Toolkit(nvcc="", cuda_home="", found_by="none", error="no CUDA toolkit found")
    nvcc = os.path.join(home, "bin", "nvcc")
    override = env.get("FLASHINFER_NVCC") if flashinfer else None
    if override:
        nvcc, found_by = override, f"{found_by}+FLASHINFER_NVCC"
    return Toolkit(nvcc=nvcc, cuda_home=home, found_by=found_by)


def parse_release(text: str) -> str | None:
    """``13.0`` from `nvcc --version` output."""
    m = _RELEASE.search(text)
    return m.group(1) if m else None


def nvcc_release(nvcc: str, env: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """(version, error) of one nvcc, by running it."""
    try:
        proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30,
                              env=dict(env) if env is not None else None)
    except FileNotFoundError:
        return None, f"{nvcc}: not found"
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{nvcc}: {exc}"[:300]
    version = parse_release(proc.stdout)
    if version:
        return version, ""
    last = (proc.stderr or proc.stdout).strip().splitlines()
    return None, f"{nvcc} --version exited {proc.returncode}: {last[-1] if last else 'no output'}"[:300]


def with_version(tk: Toolkit, env: Mapping[str, str] | None = None) -> Toolkit:
    if not tk.found:
        return tk
    version, error = nvcc_release(tk.nvcc, env)
    return Toolkit(tk.nvcc, tk.cuda_home, tk.found_by, version, error)


def resolve(env: Mapping[str, str] | None = None, flashinfer: bool | None = None) -> Toolkit:
    """The toolkit of ``env`` (default: this process's environment), with its nvcc's version.
    ``flashinfer`` None: whether flashinfer is installed here decides if ``FLASHINFER_NVCC`` counts."""
    env = os.environ if env is None else env
    if flashinfer is None:
        import importlib.util

        flashinfer = importlib.util.find_spec("flashinfer") is not None
    return with_version(locate(env, flashinfer=flashinfer), env)


def major_mismatch(tk: Toolkit, torch_cuda: str | None) -> str:
    """A note when nvcc's CUDA major differs from the one torch was built with, else ""."""
    if tk.major is None or not torch_cuda:
        return ""
    torch_major = int(str(torch_cuda).split(".")[0])
    if tk.major == torch_major:
        return ""
    return (f"nvcc {tk.version} ({tk.nvcc}) is CUDA {tk.major} but torch is built with CUDA {torch_cuda}: "
            "what it builds links another CUDA major's runtime than torch's")
