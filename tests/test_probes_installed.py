"""The installed metadata (inenv/kit/_installed.py) and what is made of it: the host's requirement judge
(checks.run.hostjudge, with `packaging`) against a real `pip check` in the same environment, and real
environments made by uv from wheels built here (a wheel pinning another release of torch, two wheels owning the
same files, an extension of another Python) and, where the index or uv's cache has them, the real cuda-python
12.6.2.post1 and cuda-bindings 13.5.0."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from checks.results.result import Verdict
from checks.run import hostjudge
from inenv.status import Status
from provision import installer

ROOT = Path(__file__).resolve().parents[1]

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


def venv_with(tmp: Path, wheels: list[Path], seed: bool = False) -> Path:
    """A venv holding ``wheels`` (no dependencies resolved); ``seed``: with pip in it too."""
    uv = installer.uv()
    assert uv, "uv is a dependency of stackprobe"
    venv = tmp / "venv"
    subprocess.run([uv, "venv", "--quiet", *(["--seed"] if seed else []), "--python", sys.executable, str(venv)],
                   check=True, env=installer.env())
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
    assert got["packaging_loaded"] is False  # the environment under test needs no packaging
    assert got["snap"]["requirements"]["sglang-kernel"] == {
        "version": "0.4.10", "requires": ["torch==2.14.1", "tinywin ; sys_platform == 'win32'",
                                          "tinyall ; extra == 'all'"]}
    broken, unread = hostjudge.broken_requirements(got["snap"]["requirements"], got["snap"]["markers"])
    assert [b.as_dict() for b in broken] == [
        {"dist": "sglang-kernel", "version": "0.4.10", "requirement": "torch==2.14.1", "required": "torch",
         "installed": "2.15.0"}] and unread == []
    assert [(c["owners"], c["files"], c["folders"]) for c in got["snap"]["collisions"]] == [
        (["cuda-bindings==13.5.0", "cuda-python==12.6.2.post1"], 1, ["cuda/bindings/"])]
    tag = sys.implementation.cache_tag
    assert got["snap"]["foreign_extensions"] == ({} if tag == "cpython-310" else {"sglang-kernel==0.4.10": [foreign]})
    assert [c for c, _ in got["findings"]][:1] == ["file-collision"]  # the requirements are the host's to judge


def test_a_pass_with_a_violated_pin_becomes_partial_and_keeps_both_facts() -> None:
    sym = "import sgl_kernel needs the CUDA driver; all 121 torch symbols its libraries import are exported"
    installed = {"markers": {"python_version": "3.11", "sys_platform": "linux"}, "requirements": {
        "sglang-kernel": {"version": "0.4.10", "requires": ["torch==2.14.1"]},
        "torch": {"version": "2.15.0", "requires": []},
        "rich": {"version": "15", "requires": ["pygments>=2", "colorama ; sys_platform == 'win32'"]}}}
    out = hostjudge.judge("inventory", Verdict(Status.PASS, note=sym, evidence={"installed": installed}))
    assert (out.status, out.reason_code) == (Status.PARTIAL, "dependency-pin-violated")
    # the broken torch pin leads, before the other requirement (sorted first) and the probe's own note
    assert out.note == ("sglang-kernel 0.4.10 requires torch==2.14.1; 2.15.0 is installed; "
                        f"1 other declared requirement(s) not met (pygments); {sym}")
    assert "requirements" not in out.evidence["installed"] and out.evidence["installed"]["requirements_read"] == 3
    failed = hostjudge.judge("inventory", Verdict(Status.FAIL, "abi-mismatch", "abi",
                                                  evidence={"installed": installed}))
    assert (failed.status, failed.reason_code) == (Status.FAIL, "abi-mismatch")
    assert failed.note == ("sglang-kernel 0.4.10 requires torch==2.14.1; 2.15.0 is installed; abi; "
                           "1 other declared requirement(s) not met (pygments)")
    off_stack = {**installed["requirements"], "sglang-kernel": {"version": "0.4.10", "requires": []}}
    plain = hostjudge.judge("inventory", Verdict(Status.FAIL, "import-error", "import failed",
                                                 evidence={"installed": {**installed, "requirements": off_stack}}))
    assert plain.note == "import failed; rich 15 requires pygments>=2; pygments is absent"  # its own cause leads


def test_the_nccl_release_an_nccl_axis_cell_declares_is_not_a_broken_pin() -> None:
    """The twin cell puts NCCL 2.32.6 beside torch 2.15.0, which pins 2.30.7: on purpose, at exactly that release."""
    installed = {"markers": {"python_version": "3.11", "sys_platform": "linux"}, "requirements": {
        "torch": {"version": "2.15.0", "requires": ["nvidia-nccl-cu13==2.30.7 ; platform_system == 'Linux'"]},
        "nvidia-nccl-cu13": {"version": "2.32.6", "requires": []}}}
    verdict = Verdict(Status.PASS, evidence={"installed": installed})
    twin = hostjudge.judge("inventory", verdict, "cu132-torch2.15.0-sglnone-fi0.7.4-nccl2.32.6")
    assert twin.status is Status.PASS
    assert twin.evidence["installed"]["declared_overrides"][0]["installed"] == "2.32.6"
    assert twin.evidence["installed"]["broken_requirements"] == []
    # the same environment in a cell that declares no NCCL, or another release: a broken pin
    for cell in ("cu132-torch2.15.0-sglnone-fi0.7.4", "cu132-torch2.15.0-sglnone-fi0.7.4-nccl2.31.2"):
        out = hostjudge.judge("inventory", verdict, cell)
        assert (out.status, out.reason_code) == (Status.PARTIAL, "dependency-pin-violated"), cell
        assert out.note.startswith("torch 2.15.0 requires nvidia-nccl-cu13==2.30.7; 2.32.6 is installed")


def test_a_broken_stack_pin_leads_a_long_list_and_the_rest_is_counted() -> None:
    """vLLM 0.33.0 installed with --no-deps beside torch 2.15.0: 76 requirements unmet, sorted by name the
    torch pin is far down; it leads, with flashinfer's, and the other 74 are a count."""
    others = [f"dep{i:02d}>=1" for i in range(74)]
    installed = {"markers": {"python_version": "3.11", "sys_platform": "linux"}, "requirements": {
        "vllm": {"version": "0.33.0", "requires": [*others, "flashinfer-python==0.7.2.post1", "torch==2.14.0"]},
        "torch": {"version": "2.15.0", "requires": []}}}
    abi = {"torch_symbols_imported": 412, "torch_symbols_missing": 0}
    out = hostjudge.judge("inventory", Verdict(Status.FAIL, "import-error",
                                               "import vllm failed: No module named 'packaging'",
                                               evidence={"installed": installed, "vllm_abi": abi}))
    assert out.note.startswith("vllm 0.33.0 requires torch==2.14.0; 2.15.0 is installed (the 412 torch symbols "
                               "its extensions import all resolve in torch 2.15.0: the pin is broken, not the ABI); "
                               "vllm 0.33.0 requires flashinfer-python==0.7.2.post1; flashinfer-python is absent; "
                               "import vllm failed: No module named 'packaging'; "
                               "74 other declared requirement(s) not met (dep00, dep01, dep02, ...)"), out.note
    broke = hostjudge.judge("inventory", Verdict(Status.FAIL, "import-error", "x", evidence={
        "installed": installed, "vllm_abi": {**abi, "torch_symbols_missing": 3}}))
    assert broke.note.startswith("vllm 0.33.0 requires torch==2.14.0; 2.15.0 is installed; vllm 0.33.0 requires")
    assert "resolve" not in broke.note  # symbols missing: nothing said for the ABI here
    assert len(out.evidence["installed"]["broken_requirements"]) == 76  # the evidence keeps every one
    assert hostjudge.judge("fi-jit", Verdict(Status.PASS)) == Verdict(Status.PASS)  # no judge: as it came
    old = Verdict(Status.PASS, evidence={"installed": {"broken_requirements": []}})  # recorded no requirements
    assert hostjudge.judge("inventory", old) == old


PIP_CHECK = "import subprocess, sys; print(subprocess.run([sys.executable, '-m', 'pip', 'check'], " \
            "capture_output=True, text=True).stdout)"


def test_the_requirement_judge_agrees_with_pip_check_in_a_real_environment(tmp_path: Path) -> None:
    """Legal forms a hand-written evaluator gets wrong: names spelt differently, ~= and ===, pre-releases and
    local labels, markers on versions and extras, a requirement on a missing distribution behind a true and a
    false marker. pip itself (installed into the same venv) says which are broken; the judge must say the same."""
    w = tmp_path / "wheels"
    wheels = [
        make_wheel(w, "Foo_Bar", "1.0rc1", {"foo_bar/__init__.py": b""}),
        make_wheel(w, "base-lib", "2.9.1+cu128", {"base_lib/__init__.py": b""}),
        make_wheel(w, "app", "3.0", {"app/__init__.py": b""}, requires=(
            "foo.bar>=0.9", "base_lib==2.9.1", "BASE-LIB~=2.9.0", "base-lib===2.9.1",
            "foo-bar<1.0 ; python_version >= '3'", "missing-one ; python_version >= '3'",
            "missing-two ; python_version < '3'", "missing-three ; extra == 'all'",
            "base-lib>=3 ; platform_system == 'Linux' or platform_system == 'Darwin'")),
    ]
    python = venv_with(tmp_path, wheels, seed=True)
    said = subprocess.run([str(python), "-c", PIP_CHECK], capture_output=True, text=True, check=True).stdout
    missing = re.compile(r"^(\S+) \S+ requires (\S+), which is not installed\.$")
    conflict = re.compile(r"^(\S+) \S+ has requirement .+, but you have (\S+) \S+\.$")
    pip_broken = Counter()
    for line in said.splitlines():
        if m := missing.match(line) or conflict.match(line):
            pip_broken[(canonicalize_name(m[1]), canonicalize_name(m[2]))] += 1
    snap = findings_in(python)["snap"]
    broken, unread = hostjudge.broken_requirements(snap["requirements"], snap["markers"])
    ours = Counter((canonicalize_name(b.dist), b.required) for b in broken)
    assert unread == [] and pip_broken, said
    assert ours == pip_broken, (said, [b.describe() for b in broken])
    assert ours[("app", "missing-one")] == 1 and ours[("app", "foo-bar")] == 1 and ours[("app", "base-lib")] == 2
    assert not any(r in ("missing-two", "missing-three") for _, r in ours)


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
