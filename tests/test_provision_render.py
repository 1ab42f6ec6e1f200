"""Dockerfile rendering against golden files; the layer order and the CA-bundle handling are asserted too."""

from __future__ import annotations

import json

import pytest
from test_provision_matrix import GOLDEN, check_golden

from provision.render import Base, image_tag, render

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
    # uv keeps no cache in the build: no BuildKit cache mount holds a second copy of the host's wheels
    assert "--mount=type=cache" not in text and "UV_NO_CACHE=1" in text


def test_nightly_render_passes_index_and_prerelease() -> None:
    text = render(json.loads((GOLDEN / "cell-nightly.json").read_text()), Base("nvidia", "x"), buildkit=True)
    torch_stage, cell_stage = _stages(text)
    for stage in (torch_stage, cell_stage):
        assert "--index https://download.pytorch.org/whl/nightly/cu130 --prerelease allow" in stage


def _stages(text: str) -> tuple[str, str]:
    """(everything up to the cell's own packages, the rest)."""
    cut = text.index("COPY requirements.lock")
    return text[:cut], text[cut:]


def _torch_stage(text: str) -> str:
    """Everything up to what sits above torch (sgl-kernel, or the cell's other packages)."""
    return text[:min(text.find(s) for s in ("COPY kernel.lock", "COPY requirements.lock") if s in text)]


def _instructions(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if not ln.startswith("#")]


def _cell(base: dict, **changes: object) -> dict:
    out = json.loads(json.dumps(base))
    for dotted, value in changes.items():
        *path, key = dotted.split("__")
        node = out
        for part in path:
            node = node[part]
        node[key] = value
    return out


@pytest.mark.parametrize("base", [Base("registry-free", "stackprobe/base-dev:bookworm"),
                                  Base("nvidia", "nvidia/cuda:13.0.2-devel-ubuntu24.04")])
def test_the_torch_stage_depends_on_the_torch_build_alone(base: Base) -> None:
    """Two cells on one torch build (different flashinfer, sgl-kernel, and an extra index for one of them):
    every instruction up to the cell's own packages is the same (comments do not make layers), so Docker
    builds that layer once for both."""
    one = json.loads((GOLDEN / "cell-registry.json").read_text())
    other = _cell(one, cell_id="cu130-torch2.11.0-sglnone-fi0.7.4", expected__flashinfer="0.7.4",
                  expected__sgl_kernel="none", cell__flashinfer="0.7.4", cell__sgl_kernel="none",
                  indexes=["https://flashinfer.ai/whl/cu130"])
    a, b = (render(c, base) for c in (one, other))
    assert _instructions(_torch_stage(a)) == _instructions(_torch_stage(b))
    assert "COPY torch.lock" in _torch_stage(a)
    assert _stages(a)[1] != _stages(b)[1] and "https://flashinfer.ai/whl/cu130" in _stages(b)[1]
    # a torch build from the PyTorch index is another torch stage
    pytorch = _cell(one, sources__torch="https://download.pytorch.org/whl/cu130")
    assert "--index https://download.pytorch.org/whl/cu130" in _torch_stage(render(pytorch, base))


def test_the_sgl_kernel_stage_is_shared_by_cells_of_one_torch_build_and_kernel() -> None:
    """sgl-kernel (1.2 GB) goes in alone, above torch: cells that differ only in flashinfer share that layer
    too; a cell without sgl-kernel has no such stage."""
    one = json.loads((GOLDEN / "cell-registry.json").read_text())
    other = _cell(one, cell_id="cu130-torch2.11.0-sgl0.4.2-fi0.6.17", cell__flashinfer="0.6.17",
                  expected__flashinfer="0.6.17", indexes=["https://flashinfer.ai/whl/cu130"])
    a, b = (render(c, Base("registry-free", "stackprobe/base-dev:bookworm")) for c in (one, other))
    shared = _instructions(_stages(a)[0])
    assert shared == _instructions(_stages(b)[0])
    kernel = shared.index("COPY kernel.lock /opt/stackprobe/kernel.lock")
    assert shared.index("COPY torch.lock /opt/stackprobe/torch.lock") < kernel
    assert "--no-deps --require-hashes" in shared[kernel + 1] and "--index" not in shared[kernel + 1]
    assert "-r /opt/stackprobe/kernel.lock" in shared[kernel + 2]
    none = _cell(one, cell__sgl_kernel="none", expected__sgl_kernel="none")
    assert "kernel.lock" not in render(none, Base("registry-free", "stackprobe/base-dev:bookworm"))


def test_files_no_probe_uses_leave_in_the_run_that_installs_them() -> None:
    registry = json.loads((GOLDEN / "cell-registry.json").read_text())
    text = render(registry, Base("registry-free", "stackprobe/base-dev:bookworm"))
    runs = text.split("\nRUN ")
    toolkit = next(r for r in runs if "toolkit.lock" in r and "uv pip install" in r)
    torch = next(r for r in runs if "-r /opt/stackprobe/torch.lock" in r)
    cell = next(r for r in runs if "uv pip sync" in r)
    # removed after the install and before the CUDA_HOME links are made, so no link dangles
    assert toolkit.index("rm -rf /opt/cuda-wheels/nvidia/*/lib/libcublas*.so*") < toolkit.index("cp -rsn")
    assert "/site-packages/nvidia/*/lib/libcusolver*.so*" in torch and "nvidia/cudnn/lib/libcudnn_[!g]*.so*" in torch
    assert "libcudnn.so" not in torch  # the dispatcher torch links stays
    assert "triton/backends/nvidia/lib/cupti*" in torch
    assert "nvidia_cutlass_dsl/cu12" in cell  # a CUDA 13 cell drops cutlass-dsl's CUDA 12 build
    kernel = next(r for r in runs if "-r /opt/stackprobe/kernel.lock" in r)
    assert "sgl_kernel/flash_ops*.so" in kernel  # FA3's 1.1 GB library, gone from the layer that brings it
    listed = next(r for r in runs if "> /opt/stackprobe/removed" in r)
    for glob_ in ("libcublas*.so*", "libcusolver*.so*", "sgl_kernel/flash_ops*.so", "nvidia_cutlass_dsl/cu12"):
        assert f"{glob_}'" in listed  # every removal is listed in the image, quoted so the shell expands none
    cu128 = _cell(registry, cell__cuda="12.8")
    assert "nvidia_cutlass_dsl" not in render(cu128, Base("registry-free-notoolkit", "stackprobe/base:bookworm"))


def test_image_tag_is_a_valid_reference() -> None:
    assert image_tag("cu130-torch2.11.0-sgl0.4.2-fi0.6.8.post1", "0123456789ab") == \
        "stackprobe/cu130-torch2.11.0-sgl0.4.2-fi0.6.8.post1:0123456789ab"
    assert image_tag("cu130-torch2.9.1+cu130-sglnone-fiNONE", "abc") == \
        "stackprobe/cu130-torch2.9.1-cu130-sglnone-finone:abc"
