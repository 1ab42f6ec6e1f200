"""An overlay venv cell that names an NCCL release: the NCCL wheel goes into the overlay, a .pth file of the
overlay loads that library before torch is imported (torch's RPATH points at the base's), the self-check
reads the NCCL the interpreter loaded (ncclGetVersion, not torch's compile-time number) and the build fails
in one line when it is not the cell's. Stand-in NCCL libraries are compiled here with gcc."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from common.home import CODE_ROOT
from inenv.kit import linkage
from inenv.selfcheck import nccl_code_version
from provision import installer, overlay
from provision.options import BuildOptions
from provision.venvbuild import PTH, build_venv_cells
from provision.verify import mismatches

ENVS = CODE_ROOT / "envs"
NAMED = "cu130-torch2.11.0-sglnone-fi0.7.4-nccl2.32.6"  # matrices/h200-overlay-nccl.yaml's two cells
PINNED = "cu130-torch2.11.0-sglnone-fi0.7.4"
GCC = shutil.which("gcc")
needs_gcc = pytest.mark.skipif(GCC is None, reason="no gcc to compile a stand-in libnccl.so.2")


def stand_in_nccl(out: Path, code: int, also: tuple[str, ...] = ()) -> Path:
    """A shared object with soname libnccl.so.2 whose ncclGetVersion answers ``code``; every name in ``also``
    is exported as a function returning 0 (what torch's libraries need from NCCL to load)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.parent / "nccl_stand_in.c"
    src.write_text(f"int ncclGetVersion(int *v) {{ *v = {code}; return 0; }}\n"
                   + "".join(f"int {name}(void) {{ return 0; }}\n" for name in also if name != "ncclGetVersion"))
    subprocess.run([str(GCC), "-shared", "-fPIC", "-Wl,-soname,libnccl.so.2", "-o", str(out), str(src)], check=True)
    src.unlink()
    return out


def run(python: Path | str, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=installer.env(),
                          cwd=CODE_ROOT, timeout=300)


def lock_entry(name: str, version: str, *hashes: str) -> str:
    lines = [f"{name}=={version}"] + [f"    --hash=sha256:{h}" for h in hashes]
    return " \\\n".join(lines) + f"\n    # via {name}\n"


# ---- which entries go where --------------------------------------------------------------------------------


def test_a_cell_naming_an_nccl_release_installs_that_nccl_into_the_overlay_a_pinned_one_takes_the_bases() -> None:
    """The two committed cells of matrices/h200-overlay-nccl.yaml over a base holding torch 2.11.0+cu130 and its
    NCCL 2.28.9, with a wheels folder holding flashinfer 0.7.4 and NCCL 2.32.6."""
    base = {"torch": "2.11.0+cu130", "nvidia-nccl-cu13": "2.28.9", "triton": "3.7.0"}
    wheels = {("flashinfer-python", "0.7.4"), ("nvidia-nccl-cu13", "2.32.6")}
    picked = {}
    for cid in (NAMED, PINNED):
        folder = ENVS / cid
        cell = json.loads((folder / "cell.json").read_text())
        plan = overlay.plan(overlay.entries((folder / "requirements.lock").read_text()), {"sys_platform": "linux",
                            "platform_machine": "x86_64", "python_version": "3.11"}, base,
                            overlay.names((folder / "torch.lock").read_text()), overlay.own(cell["sources"]),
                            lambda e: (e.name, e.version) in wheels)
        picked[cid] = ({e.name: e.version for e in plan.install}, plan.base_json(), overlay.nccl_release(cell))
    installed, from_base, release = picked[NAMED]
    assert installed == {"flashinfer-python": "0.7.4", "nvidia-nccl-cu13": "2.32.6"} and release == "2.32.6"
    assert from_base["torch"] == "2.11.0+cu130" and "nvidia-nccl-cu13" not in from_base
    installed, from_base, release = picked[PINNED]
    assert installed == {"flashinfer-python": "0.7.4"} and release == ""
    assert from_base["nvidia-nccl-cu13"] == "2.28.9" and from_base["torch"] == "2.11.0+cu130"


def test_a_named_nccl_release_without_a_wheel_is_absent_not_the_bases() -> None:
    lock = overlay.entries(lock_entry("torch", "2.11.0") + lock_entry("nvidia-nccl-cu13", "2.32.6"))
    base = {"torch": "2.11.0+cu130", "nvidia-nccl-cu13": "2.28.9"}
    plan = overlay.plan(lock, {}, base, frozenset({"torch", "nvidia-nccl-cu13"}),
                        overlay.own({"torch": "registry", "nvidia-nccl-cu13": "registry"}), lambda e: False)
    assert not plan.install and plan.base_json() == {"torch": "2.11.0+cu130"}
    assert [(p.name, p.version, p.base_version) for p in plan.absent] == [("nvidia-nccl-cu13", "2.32.6", "2.28.9")]


# ---- the version the self-check reads, and the build's verdict on it ----------------------------------------


def test_nccl_version_codes_read_as_releases() -> None:
    # nccl.h: NCCL_VERSION(X,Y,Z) is X*10000+Y*100+Z from 2.9 on, X*1000+Y*100+Z before
    assert [nccl_code_version(c) for c in (23206, 22809, 21903, 2708)] == ["2.32.6", "2.28.9", "2.19.3", "2.7.8"]


def test_verify_fails_a_cell_whose_loaded_nccl_is_not_its_release() -> None:
    expected = {"cuda": "13.0", "torch": "2.11.0", "sgl_kernel": "none", "flashinfer": "none", "nccl": "2.32.6"}
    torch = {"version": "2.11.0+cu130", "cuda": "13.0", "nccl_built": "2.28.9"}
    assert mismatches(expected, {"torch": {**torch, "nccl": "2.32.6"}}, False, nccl="2.32.6") == []
    assert mismatches(expected, {"torch": {**torch, "nccl": "2.28.9"}}, False, nccl="2.32.6") == [
        "torch loads NCCL 2.28.9, the cell asks NCCL 2.32.6"]
    assert mismatches(expected, {"torch": torch}, False, nccl="2.32.6") == [
        "torch's NCCL version cannot be read (no answer), the cell asks NCCL 2.32.6"]
    # a cell that keeps torch's NCCL is not held to one
    assert mismatches(expected, {"torch": {**torch, "nccl": "2.28.9"}}, False) == []


# ---- the .pth file, in a real interpreter ------------------------------------------------------------------

READ = ("import json, os; from inenv.selfcheck import loaded_nccl; "
        "print(json.dumps([loaded_nccl(), [l.split()[-1] for l in open('/proc/self/maps') if 'libnccl' in l]]))")


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A venv (its python, its site-packages) without any NCCL."""
    root = tmp_path_factory.mktemp("ncclpth")
    uv = installer.uv()
    assert uv, "uv is a dependency of stackprobe"
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(root / "v")], check=True,
                   env=installer.env())
    python = root / "v" / "bin" / "python"
    site = Path(run(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    return python, site


@needs_gcc
def test_the_overlays_pth_loads_its_nccl_into_every_interpreter(venv: tuple[Path, Path]) -> None:
    python, site = venv
    lib = stand_in_nccl(site.joinpath(*overlay.NCCL_LIB), 23206)
    pth = site / overlay.NCCL_PTH
    try:
        proc = run(python, READ)  # without the .pth nothing loads it
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == [{}, []]
        pth.write_text(overlay.nccl_pth_text(str(lib)))
        proc = run(python, READ)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        found, mapped = json.loads(proc.stdout)
        assert found == {"nccl": "2.32.6", "nccl_lib": str(lib)} and set(mapped) == {str(lib)}
        # the preload comes before the base's .pth files (one of them may import torch)
        assert sorted([overlay.NCCL_PTH, PTH])[0] == overlay.NCCL_PTH
    finally:
        pth.unlink(missing_ok=True)
        shutil.rmtree(site / "nvidia")


def test_a_pth_whose_library_is_missing_or_broken_leaves_the_interpreter_working(venv: tuple[Path, Path]) -> None:
    python, site = venv
    lib = site.joinpath(*overlay.NCCL_LIB)
    pth = site / overlay.NCCL_PTH
    pth.write_text(overlay.nccl_pth_text(str(lib)))
    try:
        proc = run(python, READ)  # not there: nothing loaded, nothing said
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert json.loads(proc.stdout) == [{}, []]
        lib.parent.mkdir(parents=True)
        lib.write_text("not a shared object\n")
        proc = run(python, "print('still here')")
        assert proc.returncode == 0 and proc.stdout.strip() == "still here"
        assert overlay.NCCL_PTH in proc.stderr  # site names the .pth file whose line failed
    finally:
        pth.unlink(missing_ok=True)
        shutil.rmtree(site / "nvidia", ignore_errors=True)


# ---- a whole overlay build over this project's torch -------------------------------------------------------


def nccl_wheel(folder: Path, version: str, lib: Path) -> Path:
    """An nvidia-nccl-cu13 wheel holding ``lib`` where the registry's puts libnccl.so.2."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"nvidia_nccl_cu13-{version}.dist-info"
    files = {"/".join(overlay.NCCL_LIB): lib.read_bytes(),
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: nvidia-nccl-cu13\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: stackprobe-tests\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n"}
    record = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},{len(b)}"
              for p, b in files.items()]
    files[f"{dist}/RECORD"] = ("\n".join([*record, f"{dist}/RECORD,,"]) + "\n").encode()
    out = folder / f"nvidia_nccl_cu13-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for p, b in files.items():
            z.writestr(p, b)
    return out


def _base_versions() -> tuple[str, str] | None:
    try:
        return md.version("torch"), md.version("nvidia-nccl-cu13")
    except md.PackageNotFoundError:
        return None


@needs_gcc
@pytest.mark.skipif(_base_versions() is None, reason="this interpreter has no torch with nvidia-nccl-cu13")
def test_an_overlay_over_this_projects_torch_loads_the_cells_nccl_and_fails_without_it(tmp_path: Path) -> None:
    """The overlay's base is the interpreter running the tests (torch with the NCCL it pins); the cell names
    NCCL 2.32.6, whose wheel here holds a stand-in library answering 2.32.6 and exporting what torch needs."""
    torch_version, base_nccl = _base_versions() or ("", "")
    torch_lib = Path(str(md.distribution("torch").locate_file("torch/lib")))
    needs = sorted({s for f in torch_lib.glob("*.so*") if (k := linkage(str(f))) for s in k.undefined
                    if s.startswith("nccl")})
    assert "ncclGetVersion" in needs
    wheels, no_wheels = tmp_path / "wheels", tmp_path / "no-wheels"
    wheel = nccl_wheel(wheels, "2.32.6", stand_in_nccl(tmp_path / "lib" / "libnccl.so.2", 23206, tuple(needs)))
    no_wheels.mkdir()
    torch_public = Version(torch_version).public
    folder = tmp_path / "envs" / NAMED
    folder.mkdir(parents=True)
    cell = {"cell_id": NAMED, "expected": {"cuda": "", "torch": torch_public, "torch_cuda": "", "sgl_kernel": "none",
                                           "flashinfer": "none", "nccl": "2.32.6"},
            "sources": {"torch": "registry", "nvidia-nccl-cu13": "registry"}, "indexes": [], "prerelease": False,
            "wheel_nvcc": True, "toolkit": "cuda-toolkit==13.0.2", "uv": "test"}
    (folder / "cell.json").write_text(json.dumps(cell))
    lock = lock_entry("torch", torch_public) + lock_entry("nvidia-nccl-cu13", "2.32.6", hashlib.sha256(
        wheel.read_bytes()).hexdigest())
    (folder / "requirements.lock").write_text(lock)
    (folder / "torch.lock").write_text(lock)
    (tmp_path / "matrix.yaml").write_text("matrix:\n  cuda: [\"13.0\"]\n  torch: [\"2.11.0\"]\n"
                                          "  sgl_kernel: [none]\n  flashinfer: [none]\n")

    def build(wheel_folder: Path) -> dict:
        opts = BuildOptions(tmp_path / "matrix.yaml", envs=folder.parent, backend="venv", base_python=sys.executable,
                            wheels=wheel_folder, venvs=tmp_path / "venvs")
        [rec] = build_venv_cells([folder], opts)
        return rec

    rec = build(wheels)
    assert rec["status"] == "built", rec["reason"]
    assert rec["installed"] == {"nvidia-nccl-cu13": {"version": "2.32.6", "from": "wheels", "lock_hash": True}}
    assert "nvidia-nccl-cu13" not in rec["from_base"] and rec["from_base"]["torch"] == torch_version
    preload = rec["nccl_preload"]
    assert preload.startswith(str(tmp_path / "venvs" / NAMED)) and preload.endswith("/nvidia/nccl/lib/libnccl.so.2")
    assert rec["versions"]["nccl"] == "2.32.6" and rec["selfcheck"]["torch"]["nccl_lib"] == preload
    # the base's NCCL wheel is still there, and the cell's build says so when its own is missing
    rec = build(no_wheels)
    assert rec["status"] == "failed"
    assert rec["reason"] == f"self-check: torch loads NCCL {base_nccl}, the cell asks NCCL 2.32.6"
    assert rec["absent"] == {"nvidia-nccl-cu13": "2.32.6"} and rec["versions"]["nccl"] == base_nccl
