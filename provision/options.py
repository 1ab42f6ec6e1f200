"""What one `provision build` was asked to do: the command line resolved once into a frozen
:class:`BuildOptions`, validated by :meth:`BuildOptions.check`; every builder takes it and changes nothing."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from common.build.backend import CHOICES
from common.errors import InputError
from common.home import CACHE_ROOT
from provision.lock import ENVS
from provision.render import DOCKERFILES

VENVS = CACHE_ROOT / "venvs"  # venv cells (provision/venvbuild.py)


@dataclass(frozen=True)
class BuildOptions:
    """One `provision build`: the cells selected, the builder, and how it builds."""

    matrix: Path
    cuda: str | None = None
    torch: str | None = None
    only: tuple[str, ...] = ()
    offline: bool = False
    dry_run: bool = False
    jobs: int = 1
    base: str = "auto"
    base_image: str | None = None
    envs: Path = ENVS
    dockerfiles: Path = DOCKERFILES
    json: bool = False
    toolkit: bool = True  # registry-free base: add the CUDA toolkit from wheels (nvcc for JIT)
    backend: str = "auto"  # auto | docker | venv (common/build/backend.py)
    base_python: str | None = None  # venv overlay cells: the environment whose torch stack they use
    wheels: Path | None = None  # venv cells: install from this folder of wheels instead of an index
    venvs: Path = VENVS
    ignore_disk: bool = False  # build even when the free space looks too small
    kernel_archs: tuple[str, ...] | None = None  # every cell's carried-kernel archs; None: the matrix's per cell
    kernel_jobs: int | None = None  # comm module builds at once; None: the cores, one per 8 GiB of memory
    wait_kernels: bool = False  # build the long comm modules in this run instead of after it returns

    def kernel_parallel(self, cores: int, memory_bytes: int) -> int:
        """How many comm module builds run at once: ``--kernel-jobs``, else the cores, at most one per 8 GiB
        (one nvcc of trtllm_comm for three targets holds several GiB)."""
        if self.kernel_jobs is not None:
            return self.kernel_jobs
        return max(1, min(cores, memory_bytes // (8 << 30)))

    @property
    def overlay(self) -> bool:
        return self.base_python is not None or self.wheels is not None

    def check(self) -> BuildOptions:
        """The options themselves when they are consistent; else InputError naming the option."""
        if self.jobs < 1:
            raise InputError("--jobs must be 1 or more")
        if self.kernel_jobs is not None and self.kernel_jobs < 1:
            raise InputError("--kernel-jobs must be 1 or more")
        if self.base_image and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$", self.base_image):
            raise InputError(f"--base-image '{self.base_image}' is not an image reference")
        if self.backend not in CHOICES:
            raise InputError(f"--backend {self.backend}: choose one of {', '.join(CHOICES)}")
        return self
