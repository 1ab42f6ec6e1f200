"""Rendering: a locked cell and a base choice give the text of its Dockerfile (pure)."""

from __future__ import annotations

import functools
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

DOCKERFILES = Path(__file__).resolve().parent.parent / "dockerfiles"
TEMPLATE = "cell.Dockerfile.j2"
# Exported only for the RUN steps that download; the secret is mounted there and never copied.
CERTENV = ('if [ -f /run/secrets/cacert ]; then export SSL_CERT_FILE=/run/secrets/cacert '
           'PIP_CERT=/run/secrets/cacert; fi; ')


@dataclass(frozen=True)
class Base:
    kind: str  # "nvidia" (toolkit and OS from the image) or "registry-free" (toolkit from wheels)
    image: str


@functools.cache
def _env(folder: Path = DOCKERFILES) -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(folder)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, autoescape=False)


def labels(cell: dict[str, Any]) -> list[tuple[str, str]]:
    exp = cell["expected"]
    out = [("org.stackprobe.cell", cell["cell_id"])]
    out += [(f"org.stackprobe.{k}", str(exp[k])) for k in ("cuda", "torch", "torch_cuda", "sgl_kernel", "flashinfer")]
    return out


def render(cell: dict[str, Any], base: Base, buildkit: bool = True, folder: Path = DOCKERFILES) -> str:
    """Dockerfile text for a locked cell (the cell.json mapping written by `provision lock`)."""
    index_args = "".join(f" --index {shlex.quote(u)}" for u in cell["indexes"])
    if cell.get("prerelease"):
        index_args += " --prerelease allow"
    return _env(folder).get_template(TEMPLATE).render(
        cell_id=cell["cell_id"],
        base_kind=base.kind,
        base_image=base.image,
        buildkit=buildkit,
        certenv=CERTENV,
        uv_version=cell["uv"],
        toolkit=base.kind == "registry-free",
        index_args=index_args,
        labels=labels(cell),
    )


def load_cell(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "cell.json").read_text())
