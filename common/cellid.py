"""The cell id (contract): one readable name per stack, built and read here only.

``cu130-torch2.11.0-sgl0.4.2-fi0.6.18`` for a provisioned cell (``-vllm0.33.0`` / ``-sglang0.5.23`` when it
also carries that serving engine, ``-nccl2.32.6`` when another NCCL wheel than torch's pin sits beside torch,
``-jitcache`` when it also installs flashinfer-jit-cache); an existing
environment run with ``checks run --backend local`` is ``local-cu130-torch2.11.0-sglnone-fi0.6.18-nvcc13.0``:
its toolkit is part of what it is (an image fixes nvcc; a local environment takes it from CUDA_HOME/PATH), and
``-nonvcc`` when no nvcc runs. An existing image stackprobe did not build (``checks run --image``) is
``image-cu129-torch2.8.0-sgl0.3.9-fi0.4.1-sglang0.5.2-nvcc12.9``: what was found inside it, its engine and nvcc
included.
Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NONE = "none"


@dataclass(frozen=True)
class CellId:
    cuda: str  # wheel variant: "cu130"; "nocuda" for a local CPU-only torch
    torch: str  # "2.11.0", "nightly"; "none" when absent
    sgl_kernel: str  # version or "none"
    flashinfer: str  # version or "none"
    jit_cache: bool = False
    local: bool = False
    nvcc: str | None = None  # local only: "13.0", "" (no nvcc runs); None leaves it out
    engine: str = ""  # "vllm0.33.0": the serving-engine release the cell carries; "" for none
    nccl: str = ""  # "2.32.6": the NCCL release put beside torch instead of the one torch pins; "" for torch's
    image: bool = False  # an existing image stackprobe did not build (nvcc given, as for local)

    def __str__(self) -> str:
        torch = "notorch" if self.torch == NONE else f"torch{self.torch}"
        parts = [self.cuda, torch, f"sgl{self.sgl_kernel}", f"fi{self.flashinfer}"]
        if self.local or self.image:
            parts.insert(0, "local" if self.local else "image")
        if self.engine:
            parts.append(self.engine)
        if self.nccl:
            parts.append(f"nccl{self.nccl}")
        if self.jit_cache:
            parts.append("jitcache")
        if self.nvcc is not None:
            parts.append(f"nvcc{self.nvcc}" if self.nvcc else "nonvcc")
        return "-".join(parts)


_PATTERN = re.compile(
    r"(?:(?P<local>local-)|(?P<image>image-))?(?P<cuda>cu\d+|nocuda)-(?:torch(?P<torch>[0-9A-Za-z._+]+)|notorch)"
    r"-sgl(?P<sgl>[0-9A-Za-z._+]+)-fi(?P<fi>[0-9A-Za-z._+]+)(?:-(?P<engine>(?:vllm|sglang)[0-9][0-9A-Za-z._+]*))?"
    r"(?:-nccl(?P<nccl>[0-9][0-9A-Za-z._+]*))?(?P<jit>-jitcache)?"
    r"(?:-nvcc(?P<nvcc>\d+\.\d+)|(?P<nonvcc>-nonvcc))?"
)


def parse(text: str) -> CellId | None:
    """The parts of a cell id, or None for a name this module did not make (versions are letters, digits and
    ``. _ +`` only, so a cell id is safe in a file name, a Markdown code span and a shell word)."""
    m = _PATTERN.fullmatch(text)
    if m is None:
        return None
    nvcc = m["nvcc"] if m["nvcc"] else ("" if m["nonvcc"] else None)
    return CellId(m["cuda"], m["torch"] or NONE, m["sgl"], m["fi"], bool(m["jit"]), bool(m["local"]), nvcc,
                  m["engine"] or "", m["nccl"] or "", bool(m["image"]))


def cuda_variant(version: str | None) -> str:
    """``13.0`` -> ``cu130``; no CUDA -> ``nocuda``."""
    return f"cu{str(version).replace('.', '')}" if version else "nocuda"


def local(versions: dict[str, str]) -> CellId:
    """The id of an existing environment from the versions it reports (``inenv.envinfo.versions``)."""
    torch = versions.get("torch")
    return CellId(
        cuda=cuda_variant(versions.get("torch_cuda")),
        torch=str(torch).split("+")[0] if torch else NONE,
        sgl_kernel=str(versions.get("sgl_kernel") or NONE),
        flashinfer=str(versions.get("flashinfer") or NONE),
        local=True,
        nvcc=str(versions.get("nvcc") or ""),
    )


ENGINES = ("sglang", "vllm")  # the serving engines an image's id names, the first found


def existing_image(versions: dict[str, str]) -> CellId:
    """The id of an existing image from what was found inside it: the versions of ``local`` and the first
    serving engine of ENGINES it holds (keys ``sglang``, ``vllm``)."""
    found = local(versions)
    engine = next((f"{name}{versions[name]}" for name in ENGINES if versions.get(name)), "")
    return CellId(found.cuda, found.torch, found.sgl_kernel, found.flashinfer, nvcc=found.nvcc, engine=engine,
                  image=True)
