"""Which distributions publish each library under test, and which of them an environment holds.

Standard library only: read from package metadata without importing the libraries (importing torch costs
seconds). One table for every reader: the worker's environment facts (envinfo), the inventory probe and
the provision self-check inside a freshly built image.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Library:
    key: str  # the name results use ("sgl_kernel")
    dists: tuple[str, ...]  # distribution names, newest spelling first
    module: str | None = None  # import name, when one exists whose absence means the library is absent


# sglang-kernel is sgl-kernel renamed at 0.4.0; flashinfer-python replaced the flashinfer name; NCCL's
# wheel carries the CUDA major in its name. cuda-python 12.6.x and older ship cuda/bindings/ themselves,
# so a cuda-python of another major than cuda-bindings overwrites its files: both versions are facts.
LIBRARIES: tuple[Library, ...] = (
    Library("torch", ("torch",), "torch"),
    Library("flashinfer", ("flashinfer-python", "flashinfer"), "flashinfer"),
    Library("flashinfer_jit_cache", ("flashinfer-jit-cache",)),
    Library("flashinfer_cubin", ("flashinfer-cubin",)),
    Library("sgl_kernel", ("sglang-kernel", "sgl-kernel"), "sgl_kernel"),
    Library("triton", ("triton", "pytorch-triton"), "triton"),
    Library("nccl", ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")),
    Library("cuda_bindings", ("cuda-bindings",)),
    Library("cuda_python", ("cuda-python",)),
)
BY_KEY = {lib.key: lib for lib in LIBRARIES}
_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*)$")


def installed(key: str) -> tuple[str, str] | None:
    """(distribution name, version) of the library ``key`` in this environment, or None."""
    import importlib.metadata as md  # ~70 ms to import; the ranks never need it

    for name in BY_KEY[key].dists:
        try:
            return name, md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def requires(dist: str, package: str) -> str | None:
    """The version specifier ``dist``'s metadata puts on ``package`` ("==2.9.1"), "" when it names the
    package without one, None when it does not name it (or ``dist`` is absent). Requirements of an
    optional extra are left out: they say nothing about what the wheel itself needs."""
    import importlib.metadata as md

    try:
        reqs = md.requires(dist) or []
    except md.PackageNotFoundError:
        return None
    for req in reqs:
        spec, _, marker = req.partition(";")
        m = _REQUIREMENT.match(spec)
        if m and "extra" not in marker and _normal(m.group(1)) == _normal(package):
            return m.group(2).strip().strip("()").strip()
    return None


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
