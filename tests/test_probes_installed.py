"""The installed-metadata judge (inenv/kit/_installed.py) and what inventory makes of it: its small PEP 440 /
PEP 508 evaluator against the `packaging` library, and real environments made by uv from wheels built here
(a wheel pinning another release of torch, two wheels owning the same files, an extension of another Python)
and, where the index or uv's cache has them, the real cuda-python 12.6.2.post1 and cuda-bindings 13.5.0."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from inenv.kit import _installed
from inenv.probes import inventory
from provision import installer

ROOT = Path(__file__).resolve().parents[1]

VERSIONS = ["2.9.1", "2.9.1+cu128", "2.14.1", "2.15.0", "2.15.0rc1", "2.15.0.dev20261130+cu130", "2.15.0.post1",
            "1!0.1", "12.6.2.post1", "13.4.4", "13.5.0", "0.4.10", "0.4.1", "2.0", "2.0.0", "2.0a1", "1.9.9"]
SPECIFIERS = ["==2.14.1", "==2.9.1", ">=2.14", "<2.15", ">2.15.0", "<=2.15.0", "!=2.15.0", "~=2.14.0", "~=2.14",
              "==2.15.*", "!=2.9.*", ">=12.8,<13", "~=13.4.4", "", ">=2.0,!=2.0.0", "<2.0", "==2.9.1+cu128",
              ">=0.4.1,<0.5"]
MARKERS = ["python_version >= '3.10'", "python_version < '3.11'", "sys_platform == 'win32'",
           "platform_machine == 'x86_64' and sys_platform == 'linux'", "extra == 'all'",
           "(python_version > '3.8' or os_name == 'nt') and platform_system != 'Darwin'",
           "'linux' in sys_platform", "implementation_name == 'cpython'", "python_full_version >= '3.11.7'"]


@pytest.mark.parametrize("spec", SPECIFIERS)
def test_specifiers_agree_with_packaging(spec: str) -> None:
    for v in VERSIONS:
        want = SpecifierSet(spec).contains(Version(v), prereleases=True)
        assert _installed.satisfies(v, spec) == want, (v, spec)


@pytest.mark.parametrize("marker", MARKERS)
def test_markers_agree_with_packaging(marker: str) -> None:
    env = _installed.environment()
    assert _installed.marker_true(marker, env) == Marker(marker).evaluate({"extra": ""})


def test_unreadable_input_is_never_taken_as_met() -> None:
    with pytest.raises(_installed.Unreadable):
        _installed.satisfies("not a version", ">=1")
    with pytest.raises(_installed.Unreadable):
        _installed.marker_true("python_version >= ", _installed.environment())


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes], requires: tuple[str, ...] = (),
               tag: str = "py3-none-any") -> Path:
    """A valid wheel holding ``files`` (path -> bytes), declaring ``requires`` as Requires-Dist."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name.replace('-', '_')}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    root = "true" if tag == "py3-none-any" else "false"
    body = {**files, f"{dist}/METADATA": meta.encode(),
            f"{dist}/WHEEL": f"Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: {root}\nTag: {tag}\n".encode()}
    record = []
    for path, data in body.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    wheel = folder / f"{name.replace('-', '_')}-{version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, data in body.items():
            z.writestr(path, data)
        z.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return wheel


def venv_with(tmp: Path, wheels: list[Path]) -> Path:
    uv = installer.uv()
    assert uv, "uv is a dependency of stackprobe"
    venv = tmp / "venv"
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, env=installer.env())
    subprocess.run([uv, "pip", "install", "--quiet", "--no-deps", "--python", str(venv / "bin" / "python"),
                    *map(str, wheels)], check=True, env=installer.env())
    return venv / "bin" / "python"


FINDINGS = ("import json, sys; from inenv.kit import _installed; from inenv.probes import inventory; "
            "snap = _installed.snapshot(); "
            "print(json.dumps({'snap': snap, 'findings': inventory.metadata_findings(snap), "
            "'packaging_loaded': 'packaging' in sys.modules}))")


def findings_in(python: Path) -> dict:
    proc = subprocess.run([str(python), "-c", FINDINGS], capture_output=True, text=True, cwd=ROOT,
                          env={**installer.env(), "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_pin_collision_and_foreign_extension_in_a_real_environment(tmp_path: Path) -> None:
    """sglang-kernel 0.4.10 pins torch==2.14.1 beside torch 2.15.0 and ships a cpython-310 extension; two
    distributions hold cuda/bindings/driver.py with different bytes and cuda/__init__.py with the same."""
    w = tmp_path / "wheels"
    foreign = "sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so"
    wheels = [
        make_wheel(w, "torch", "2.15.0", {"torch/__init__.py": b"__version__ = '2.15.0'\n"}),
        make_wheel(w, "sglang-kernel", "0.4.10", {"sgl_kernel/__init__.py": b"", foreign: b"\x7fELF"},
                   requires=("torch==2.14.1", "tinywin ; sys_platform == 'win32'", "tinyall ; extra == 'all'")),
        make_wheel(w, "cuda-python", "12.6.2.post1", {"cuda/__init__.py": b"", "cuda/bindings/driver.py": b"old\n"}),
        make_wheel(w, "cuda-bindings", "13.5.0", {"cuda/__init__.py": b"", "cuda/bindings/driver.py": b"new\n"}),
    ]
    got = findings_in(venv_with(tmp_path, wheels))
    assert got["packaging_loaded"] is False
    assert got["snap"]["broken_requirements"] == [
        {"dist": "sglang-kernel", "version": "0.4.10", "requirement": "torch==2.14.1", "required": "torch",
         "installed": "2.15.0"}]
    assert [(c["owners"], c["files"], c["folders"]) for c in got["snap"]["collisions"]] == [
        (["cuda-bindings==13.5.0", "cuda-python==12.6.2.post1"], 1, ["cuda/bindings/"])]
    tag = sys.implementation.cache_tag
    assert got["snap"]["foreign_extensions"] == ({} if tag == "cpython-310" else {"sglang-kernel==0.4.10": [foreign]})
    codes = [c for c, _ in got["findings"]]
    assert codes[:2] == ["dependency-pin-violated", "file-collision"]
    assert "sglang-kernel 0.4.10 requires torch==2.14.1, torch 2.15.0 is installed" in got["findings"][0][1]


def test_a_pass_with_a_violated_pin_becomes_partial_and_keeps_both_facts() -> None:
    sym = "import sgl_kernel needs the CUDA driver; all 121 torch C++ symbols its libraries import are exported"
    snap = {"broken_requirements": [{"dist": "sglang-kernel", "version": "0.4.10", "requirement": "torch==2.14.1",
                                     "required": "torch", "installed": "2.15.0"},
                                    {"dist": "rich", "version": "15", "requirement": "pygments>=2",
                                     "required": "pygments", "installed": None}]}
    out = inventory.amend({"status": "pass", "note": sym, "reason_code": "", "evidence": {}},
                          inventory.metadata_findings(snap))
    assert (out["status"], out["reason_code"]) == ("partial", "dependency-pin-violated")
    assert out["note"] == f"sglang-kernel 0.4.10 requires torch==2.14.1, torch 2.15.0 is installed; {sym}"
    assert "rich" not in out["note"]  # an unprobed package's requirement is evidence, not the verdict
    failed = inventory.amend({"status": "fail", "note": "abi", "reason_code": "abi-mismatch", "evidence": {}},
                             inventory.metadata_findings(snap))
    assert (failed["status"], failed["reason_code"]) == ("fail", "abi-mismatch") and failed["note"].startswith("abi; ")


def test_real_cuda_python_and_cuda_bindings_of_two_releases_collide(tmp_path: Path) -> None:
    uv = installer.uv()
    assert uv
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, env=installer.env())
    proc = subprocess.run([uv, "pip", "install", "--quiet", "--no-deps", "--python", str(venv / "bin" / "python"),
                           "cuda-python==12.6.2.post1", "cuda-bindings==13.5.0"], capture_output=True, text=True,
                          env=installer.env())
    if proc.returncode != 0:
        pytest.skip(f"neither the index nor uv's cache has these wheels here: {proc.stderr.strip()[-200:]}")
    [c] = findings_in(venv / "bin" / "python")["snap"]["collisions"]
    assert c["owners"] == ["cuda-bindings==13.5.0", "cuda-python==12.6.2.post1"]
    assert c["files"] > 20 and "cuda/bindings/" in c["folders"]
