"""The labels of a Docker cell's kernel layer (common.build.kernellayer), read as untrusted input, and the build
context that writes them (provision.kernels.layer_context) on a real kernel set."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from common.build import kernellayer
from provision import kernels
from tests.test_carried import module_library

BASE = "sha256:" + "ab" * 32
GOOD = {kernellayer.BASE_LABEL: BASE, kernellayer.MODULES_LABEL: "moe_a2a=0123456789abcdef,vllm_comm=fedcba9876543210"}


def test_a_layer_of_ours_names_its_base_image_and_each_modules_digest() -> None:
    assert kernellayer.read(GOOD) == (BASE, {"moe_a2a": "0123456789abcdef", "vllm_comm": "fedcba9876543210"})
    assert kernellayer.read({**GOOD, kernellayer.MODULES_LABEL: ""}) == (BASE, {})  # a layer carrying nothing
    assert kernellayer.modules_value({"vllm_comm": "fedcba9876543210", "moe_a2a": "0123456789abcdef"}) \
        == "moe_a2a=0123456789abcdef,vllm_comm=fedcba9876543210"


@pytest.mark.parametrize("labels", [
    None, {}, "labels", {kernellayer.BASE_LABEL: BASE},  # no modules label: not our layer
    {**GOOD, kernellayer.BASE_LABEL: "stackprobe/cell:tag"},  # a tag is no image id
    {**GOOD, kernellayer.BASE_LABEL: BASE + "\n"},
    {**GOOD, kernellayer.MODULES_LABEL: "vllm_comm=fedcba98"},  # a short digest
    {**GOOD, kernellayer.MODULES_LABEL: "vllm_comm=fedcba9876543210,vllm_comm=0123456789abcdef"},  # twice
    {**GOOD, kernellayer.MODULES_LABEL: "Vllm comm=fedcba9876543210"},
    {**GOOD, kernellayer.MODULES_LABEL: 7},
])
def test_labels_of_another_shape_make_the_image_count_as_a_whole(labels: object) -> None:
    assert kernellayer.read(labels) is None  # type: ignore[arg-type]


def _carry(kset: Path, module: str, marker: str) -> tuple[dict[str, object], bytes]:
    folder = kset / module
    folder.mkdir(parents=True)
    lib = module_library(module, marker)
    rec = {"schema": 1, "module": module, "name": module, "sass": ["sm_90a"], "arch_list": "9.0a"}
    (folder / f"{module}.so").write_bytes(lib)
    (folder / "stackprobe-kernel.json").write_text(json.dumps(rec))
    return rec, lib


def test_the_layers_dockerfile_labels_the_base_and_the_digests_of_the_modules_it_copies(tmp_path: Path) -> None:
    kset = tmp_path / "set"
    rec, lib = _carry(kset, "vllm_comm", "one")
    (kset / "moe_alltoall").mkdir()  # a folder without a record: not ours, not copied, not labelled
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    kernels.layer_context(kset, ctx, BASE, "/opt/venv/aot")
    digest = hashlib.sha256(json.dumps(rec, sort_keys=True).encode() + b"\0" + lib).hexdigest()[:16]
    lines = (ctx / "Dockerfile").read_text().splitlines()
    assert lines[:2] == [f"FROM {BASE}", "COPY kernels/ /opt/venv/aot/"]
    assert f'{kernellayer.BASE_LABEL}="{BASE}"' in lines[2]
    assert f'{kernellayer.MODULES_LABEL}="vllm_comm={digest}"' in lines[2]
    # a base given as a tag (no image id to name): the set's digest only, so the image counts as a whole
    other = tmp_path / "ctx2"
    other.mkdir()
    kernels.layer_context(kset, other, "stackprobe/cell:tag", "/opt/venv/aot")
    text = (other / "Dockerfile").read_text()
    assert kernellayer.KERNELS_LABEL in text and kernellayer.BASE_LABEL not in text
