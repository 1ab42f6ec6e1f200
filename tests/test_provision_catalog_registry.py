"""`provision catalog check` against the real package index configured here (uv's default index).

A small catalog: two SGLang releases, two sgl-kernel releases (a CUDA 13 one with a torch pin in its wheel, a
CUDA 12.9 one without), two torch releases and one newest-release fact, with four facts deliberately wrong. The
check must report exactly those four, with the index's values, and leave the true ones alone. Released
wheels do not change, so the values asserted here stay true; only the newest release moves, and is asserted
as a lower bound. Skips only when the index cannot be reached (exit 2 saying so).

Wheel bytes are kept where `provision catalog check` keeps them (.cache/registry/wheels); the index pages
are kept too, in .cache/registry/pages-for-tests, so a later run of this test reads nothing from the network.
Delete that folder to check against today's pages.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

from common.catalog import CATALOG_PATH
from provision import registry
from provision.cli import main

PAGES = registry.CACHE / "pages-for-tests"


def _subset(tmp_path: Path) -> Path:
    raw = yaml.safe_load(CATALOG_PATH.read_text())
    sglang, kernels, torch = raw["sglang"]["releases"], raw["sgl_kernel"]["releases"], raw["torch"]["releases"]
    raw["sglang"]["releases"] = {"0.5.23": sglang["0.5.23"], "0.5.21": {**sglang["0.5.21"], "flashinfer": "0.6.17"}}
    raw["sgl_kernel"]["releases"] = {"0.4.10": kernels["0.4.10"],
                                     "0.4.1": {**kernels["0.4.1"], "registry_cuda": "13.0"}}
    raw["torch"]["releases"] = {"2.14.1": torch["2.14.1"], "2.15.0": {**torch["2.15.0"], "registry": "cu130"}}
    raw["newest"]["releases"] = {"torch": "2.0.0"}
    raw["vllm"]["releases"] = {"0.34.0": raw["vllm"]["releases"]["0.34.0"]}  # its pins, platform and unserved pin
    path = tmp_path / "subset.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _check(catalog: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(["catalog", "check", "--json", "--catalog", str(catalog)])
    out, err = capsys.readouterr()
    return int(e.value.code or 0), out, err


def test_catalog_check_on_the_real_index(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "default_store", lambda: registry.Store(registry.CACHE / "wheels", PAGES))
    catalog = _subset(tmp_path)
    at_start = registry.received_bytes()
    code, out, err = _check(catalog, capsys)
    if code == 2 and "index unreachable" in err:
        pytest.skip(err.strip())
    assert code == 1, err
    received = registry.received_bytes() - at_start
    before = registry.received_bytes()
    assert _check(catalog, capsys) == (code, out, err)  # again: the same report from the store alone
    assert registry.received_bytes() == before
    report = json.loads(out)
    got = {d["key"]: (d["recorded"], d["registry"]) for d in report["drift"]}
    newest = got.pop("newest.torch")
    assert newest[0] == "2.0.0" and Version(newest[1]) >= Version("2.15.0")
    assert got == {
        "sglang.releases[0.5.21].flashinfer": ("0.6.17", "0.6.18"),
        "sgl_kernel.releases[0.4.1].registry_cuda": ("13.0", "12.9"),
        "torch.releases[2.15.0].registry": ("cu130", "cu132"),
    }
    evidence = {d["key"]: d["evidence"] for d in report["drift"]}
    assert evidence["torch.releases[2.15.0].registry"].endswith("manylinux_2_28_x86_64.whl torch/version.py")
    assert "METADATA Requires-Dist" in evidence["sglang.releases[0.5.21].flashinfer"]
    assert "libcudart.so.12" in evidence["sgl_kernel.releases[0.4.1].registry_cuda"]
    # 1 newest + 2x3 pins + 2 kernel CUDA + 1 kernel torch (0.4.10's wheel pins torch 2.14.1) + 2 torch builds.
    assert report["checked"] == 18  # 12, the two SGLang wheels' platforms, vLLM 0.34.0's four facts
    assert report["unchecked"] == ["sgl_kernel.releases[0.4.1].torch: the wheel declares no torch and no "
                                   "catalogued SGLang release pins sglang-kernel 0.4.1"]
    assert received < 64 << 20  # byte ranges of the wheels only: their whole files are gigabytes
