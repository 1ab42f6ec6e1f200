"""Rendering: a locked cell and a base choice give the text of its Dockerfile (pure)."""

from __future__ import annotations

import functools
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from common.home import DATA_ROOT, WORK_ROOT
from inenv.probes.inventory import REMOVED_LIST
from provision.cudahome import DRIVER_NAME

# The cell template is read from the checkout's dockerfiles/ (the packaged copy for an installed wheel); the
# rendered Dockerfiles are written to dockerfiles/ of the checkout (of the current folder when installed).
TEMPLATES = DATA_ROOT / "dockerfiles"
DOCKERFILES = WORK_ROOT / "dockerfiles"
TEMPLATE = "cell.Dockerfile.j2"
# Exported only for the RUN steps that download; the secret is mounted there and never copied.
CERTENV = ('if [ -f /run/secrets/cacert ]; then export SSL_CERT_FILE=/run/secrets/cacert '
           'PIP_CERT=/run/secrets/cacert; fi; ')
SITE = "/opt/venv/lib/python3*/site-packages"  # Debian 12's Python 3.11 or Ubuntu 24.04's 3.12

# Files that neither `import torch`, `import sgl_kernel`, flashinfer's JIT, nvcc nor any probe touches,
# removed in the RUN that installs them (a later layer cannot give their bytes back). Globs under SITE.
TORCH_UNUSED = (
    # torch.linalg's solvers: only libtorch_cuda_linalg.so links them, and torch loads it on the first linalg call
    "nvidia/*/lib/libcusolver*.so*",
    # cuDNN's engines: torch links only the libcudnn.so.9 dispatcher, which loads them on the first cuDNN
    # operation; the probes run none. libcudnn_graph stays: it holds cudnnGetVersion, and without it
    # torch.backends.cudnn.version() aborts the process (seen with cuDNN 9.26).
    "nvidia/cudnn/lib/libcudnn_[!g]*.so*",
    # the CUPTI copies of triton's profiler (proton), loaded only when profiling
    "triton/backends/nvidia/lib/cupti*",
)
# The toolkit wheels' cuBLAS and cuRAND libraries: flashinfer's comm JIT modules link only cudart and libcuda
# (its gemm modules, which no probe builds, add cuBLAS); moe_a2a needs their headers, which stay.
TOOLKIT_UNUSED = ("/opt/cuda-wheels/nvidia/*/lib/libcublas*.so*", "/opt/cuda-wheels/nvidia/*/lib/libnvblas.so*",
                  "/opt/cuda-wheels/nvidia/*/lib/libcurand*.so*")
# nvidia-cutlass-dsl ships a CUDA 12 and a CUDA 13 build and loads the newest the driver supports; a CUDA 13
# cell runs only where the driver supports 13, so its CUDA 12 build is never loaded.
CUDA13_CELL_UNUSED = ("nvidia_cutlass_dsl/cu12",
                      "nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu12.*")
# sgl-kernel's FlashAttention-3 library (1.1 GB, the largest file of a cell): attention, not communication;
# `import sgl_kernel` does not load it (only `sgl_kernel.flash_attn` does) and no probe calls attention.
KERNEL_UNUSED = ("sgl_kernel/flash_ops*.so",)
# Every removal is listed in the image (REMOVED_LIST), so the inventory says what the image lacks.


@dataclass(frozen=True)
class Base:
    kind: str  # "nvidia" (toolkit and OS from the image) or "registry-free" (toolkit from wheels)
    image: str


@functools.cache
def _env(folder: Path = TEMPLATES) -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(folder)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, autoescape=False)


CELL_LABEL = "org.stackprobe.cell"  # names the cell an image was built for (provision prune reads it)


def image_tag(cell_id: str, digest: str) -> str:
    """The image reference `provision build` gives a cell's image: stackprobe/<cell id as a repository
    name>:<digest> (provision prune finds a cell's images by the repository part)."""
    repo = re.sub(r"[^a-z0-9._-]+", "-", cell_id.lower()).strip("-._")
    return f"stackprobe/{repo}:{digest}"


def labels(cell: dict[str, Any]) -> list[tuple[str, str]]:
    exp = cell["expected"]
    out = [(CELL_LABEL, cell["cell_id"])]
    out += [(f"org.stackprobe.{k}", str(exp[k])) for k in ("cuda", "torch", "torch_cuda", "sgl_kernel", "flashinfer")]
    return out


def _index_args(indexes: list[str], prerelease: bool) -> str:
    return "".join(f" --index {shlex.quote(u)}" for u in indexes) + (" --prerelease allow" if prerelease else "")


def torch_index_args(cell: dict[str, Any]) -> str:
    """The torch stage's index options: its torch build's alone (the PyTorch index, or none for the registry),
    so that stage is the same text, and so one shared layer, in every cell of that build."""
    where = cell.get("sources", {}).get("torch", "registry")
    return _index_args([] if where == "registry" else [where], bool(cell.get("prerelease")))


def _globs(paths: tuple[str, ...], root: str) -> list[str]:
    return [f"{root}/{p}" if root else p for p in paths]


def _rm(paths: tuple[str, ...], root: str = "") -> str:
    return "rm -rf " + " ".join(_globs(paths, root))


def removed(*groups: tuple[tuple[str, ...], str]) -> str:
    """The shell words that list every removed glob (each group: globs, their root) in REMOVED_LIST."""
    full = [g for paths, root in groups for g in _globs(paths, root)]
    return f"printf '%s\\n' {' '.join(shlex.quote(f) for f in full)} > {REMOVED_LIST}"


def render(cell: dict[str, Any], base: Base, buildkit: bool = True, folder: Path = TEMPLATES) -> str:
    """Dockerfile text for a locked cell (the cell.json mapping written by `provision lock`)."""
    cuda_major = int(str(cell.get("cell", {}).get("cuda", "0")).split(".")[0])
    toolkit = base.kind == "registry-free"
    kernel = cell.get("cell", {}).get("sgl_kernel", "none") != "none"
    # each removal: its globs, their root, and whether this cell's Dockerfile has the step that runs it
    removals = {"toolkit_unused": (TOOLKIT_UNUSED, "", toolkit), "torch_unused": (TORCH_UNUSED, SITE, True),
                "kernel_unused": (KERNEL_UNUSED, SITE, kernel),
                "cell_unused": (CUDA13_CELL_UNUSED, SITE, cuda_major >= 13)}
    return _env(folder).get_template(TEMPLATE).render(
        cell_id=cell["cell_id"],
        base_kind=base.kind,
        base_image=base.image,
        buildkit=buildkit,
        certenv=CERTENV,
        uv_version=cell["uv"],
        toolkit=toolkit,
        kernel=kernel,
        index_args=_index_args(cell["indexes"], bool(cell.get("prerelease"))),
        torch_index_args=torch_index_args(cell),
        **{name: _rm(paths, root) if used else "" for name, (paths, root, used) in removals.items()},
        removed=removed(*[(paths, root) for paths, root, used in removals.values() if used]),
        labels=labels(cell),
        driver_name=shlex.quote(DRIVER_NAME),
    )


def load_cell(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "cell.json").read_text())
