"""One table of distribution names: the worker's environment facts, the inventory probe and the image
self-check read the same libraries from the same metadata."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

READ_ALL = """
import json
from inenv import dists, envinfo
from inenv.probes import inventory
from inenv import selfcheck
print(json.dumps({"envinfo": envinfo.versions(), "inventory": inventory._dist_versions(),
                  "selfcheck_kernel": selfcheck._dist_version("sgl_kernel"),
                  "selfcheck_flashinfer": selfcheck._dist_version("flashinfer"),
                  "built_for": dists.requires("sglang-kernel", "torch"),
                  "cubin_needs": dists.requires("flashinfer-cubin", "torch")}))
"""


def _dist(site: Path, name: str, version: str, *requires: str, package: str | None = None) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", *(f"Requires-Dist: {r}\n" for r in requires)]
    (info / "METADATA").write_text("".join(lines))
    if package:
        (site / package).mkdir()
        (site / package / "__init__.py").write_text("")


def test_every_reader_sees_the_same_libraries(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _dist(site, "sglang-kernel", "0.4.1", "torch==2.9.1", "pytest; extra == 'test'", package="sgl_kernel")
    _dist(site, "flashinfer-python", "0.6.18", "cuda-python>=12.0", package="flashinfer")
    _dist(site, "flashinfer-cubin", "0.6.18", "torch; extra == 'all'")
    _dist(site, "cuda-python", "12.6.2.post1")
    _dist(site, "cuda-bindings", "13.5.0")
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "CUDA_HOME": str(tmp_path / "none")}
    proc = subprocess.run([sys.executable, "-c", READ_ALL], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    libraries = {k: v for k, v in seen["envinfo"].items() if k not in ("python", "torch_cuda", "nvcc", "nccl_package")}
    assert libraries == seen["inventory"]
    assert {"sgl_kernel": "0.4.1", "flashinfer": "0.6.18", "flashinfer_cubin": "0.6.18",
            "cuda_python": "12.6.2.post1", "cuda_bindings": "13.5.0"}.items() <= libraries.items()
    assert (seen["selfcheck_kernel"], seen["selfcheck_flashinfer"]) == ("0.4.1", "0.6.18")
    assert seen["built_for"] == "==2.9.1"
    assert seen["cubin_needs"] is None  # a requirement of an optional extra says nothing about the wheel
