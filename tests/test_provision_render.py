"""Dockerfile rendering against golden files; the layer order and the CA-bundle handling are asserted too."""

from __future__ import annotations

import json

import pytest
from test_provision_matrix import GOLDEN, check_golden

from provision.build import image_tag
from provision.render import Base, render

CASES = [
    ("cell-registry.json", Base("registry-free", "stackprobe/base-dev:bookworm"), True, "registry-free.Dockerfile"),
    ("cell-registry.json", Base("nvidia", "nvidia/cuda:13.0.2-devel-ubuntu24.04"), False, "nvidia-legacy.Dockerfile"),
    ("cell-nightly.json", Base("nvidia", "nvidia/cuda:13.0.2-devel-ubuntu24.04"), True, "nightly-nvidia.Dockerfile"),
]


@pytest.mark.parametrize(("cell", "base", "buildkit", "golden"), CASES)
def test_render_golden(cell: str, base: Base, buildkit: bool, golden: str) -> None:
    text = render(json.loads((GOLDEN / cell).read_text()), base, buildkit=buildkit)
    check_golden(golden, text)
    assert text.startswith("# Rendered by `provision build`") and f"FROM {base.image}\n" in text
    # layers from most to least shared: toolkit, torch, then the rest of the lock
    order = [text.find(s) for s in ("FROM", "toolkit.lock" if base.kind == "registry-free" else "FROM",
                                    "COPY torch.lock", "COPY requirements.lock", "LABEL")]
    assert order == sorted(order) and -1 not in order
    assert "ca-certificates.crt" not in text  # the bundle only ever arrives as a secret mount
    assert ("--mount=type=secret,id=cacert" in text) == buildkit
    assert ("--mount=type=cache,target=/root/.cache/uv" in text) == buildkit
    assert ("UV_NO_CACHE=1" in text) != buildkit


def test_nightly_render_passes_index_and_prerelease() -> None:
    text = render(json.loads((GOLDEN / "cell-nightly.json").read_text()), Base("nvidia", "x"), buildkit=True)
    assert "--index https://download.pytorch.org/whl/nightly/cu130 --prerelease allow" in text


def test_image_tag_is_a_valid_reference() -> None:
    assert image_tag("cu130-torch2.11.0-sgl0.4.2-fi0.6.8.post1", "0123456789ab") == \
        "stackprobe/cu130-torch2.11.0-sgl0.4.2-fi0.6.8.post1:0123456789ab"
    assert image_tag("cu130-torch2.9.1+cu130-sglnone-fiNONE", "abc") == \
        "stackprobe/cu130-torch2.9.1-cu130-sglnone-finone:abc"
