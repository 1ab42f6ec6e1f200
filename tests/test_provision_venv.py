"""venv cells: real uv (and pip) environments built from a lock, overlays on a real base environment, the
self-check, build-venv.json, `checks run --backend venv` through the local executor, and the fallback when no
Docker daemon answers. The packages are tiny wheels made here; the base is a real venv holding some of them."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from unittest.mock import patch

import pytest

from checks.cli import main as checks_main
from checks.run import venvcell
from checks.run.executor import CODE_ROOT, LocalExecutor
from common.build import backend
from common.errors import InputError
from inenv import toolkit
from provision import cudahome, installer, overlay, wheeldir
from provision.options import BuildOptions
from provision.venvbuild import PTH, build_venv_cells
from tests.checks_helpers import FIXTURES

DEAD_DOCKER = "unix:///nonexistent/stackprobe-test-docker.sock"
# The id the test matrix resolves to; its folder holds a lock of tiny packages instead of the real one.
CELL = "cu130-torch2.11.0-sglnone-fi0.6.18"
MATRIX = 'matrix:\n  cuda: ["13.0"]\n  torch: ["2.11.0"]\n  sgl_kernel: [none]\n  flashinfer: ["0.6.18"]\n'


def make_wheel(folder: Path, name: str, version: str, body: str = "") -> Path:
    """A valid pure-Python wheel with one module ``<name>.py`` that knows its version."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": f"VERSION = {version!r}\n{body}",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: stackprobe-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    out = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return out


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def lock_entry(name: str, version: str, *hashes: str) -> str:
    lines = [f"{name}=={version}"] + [f"    --hash=sha256:{h}" for h in hashes]
    return " \\\n".join(lines) + f"\n    # via {name}\n"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Wheels, a base venv holding tinybase, tinystack, tinydiff 1.0 and tinyown 1.0, and a cell folder whose
    lock wants tinyown 2.0 (its own package), tinydiff 2.0 (no wheel) and tinyextra (nowhere)."""
    root = tmp_path_factory.mktemp("venvcells")
    pool, wheels = root / "pool", root / "wheels"
    for name in ("tinybase", "tinystack", "tinydiff", "tinyown"):
        make_wheel(pool, name, "1.0")
    own2 = make_wheel(wheels, "tinyown", "2.0", "def hello():\n    return 'overlay'\n")
    base = root / "base"
    uv = installer.uv()
    assert uv, "uv is a dependency of stackprobe"
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(base)], check=True, env=installer.env())
    subprocess.run([uv, "pip", "install", "--quiet", "--python", str(base / "bin" / "python"), "--no-index",
                    "--find-links", str(pool), "tinybase==1.0", "tinystack==1.0", "tinydiff==1.0", "tinyown==1.0"],
                   check=True, env=installer.env())
    envs = root / "envs"
    folder = envs / CELL
    folder.mkdir(parents=True)
    cell = {"cell_id": CELL, "expected": {"cuda": "13.0", "torch": "", "torch_cuda": "cu130", "sgl_kernel": "none",
                                          "flashinfer": "none"},
            "sources": {"torch": "registry", "tinyown": "registry"}, "indexes": [], "prerelease": False,
            "wheel_nvcc": True, "toolkit": "cuda-toolkit==13.0.2", "uv": "test"}
    (folder / "cell.json").write_text(json.dumps(cell))
    lock = (lock_entry("tinybase", "1.0", "0" * 64) + lock_entry("tinystack", "1.0", "1" * 64)
            + lock_entry("tinydiff", "2.0", "2" * 64) + lock_entry("tinyown", "2.0", sha(own2))
            + lock_entry("tinyextra", "1.0", "3" * 64) + "tinywin==1.0 ; sys_platform == 'win32'\n")
    (folder / "requirements.lock").write_text(lock)
    (folder / "torch.lock").write_text(lock_entry("tinystack", "1.0", "1" * 64))
    (folder / "toolkit.lock").write_text(lock_entry("cuda-toolkit", "13.0.2", "4" * 64))
    (folder / "requirements.in").write_text("tinyown==2.0\n")
    (root / "matrix.yaml").write_text(MATRIX)
    return {"root": root, "base": base / "bin" / "python", "wheels": wheels, "envs": envs, "folder": folder,
            "matrix": root / "matrix.yaml", "venvs": root / "venvs"}


def run_in(python: str, code: str) -> str:
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, env=installer.env())
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_overlay_cell_installs_only_its_own_packages_and_records_where_each_came_from(world: dict[str, Path]) -> None:
    opts = BuildOptions(world["matrix"], envs=world["envs"], backend="venv", base_python=str(world["base"]),
                        wheels=world["wheels"], venvs=world["venvs"])
    [rec] = build_venv_cells([world["folder"]], opts)
    assert rec["status"] == "built", rec["reason"]
    assert json.loads((world["folder"] / "build-venv.json").read_text()) == rec
    venv = world["venvs"] / CELL
    assert rec["backend"] == "venv" and rec["venv"] == str(venv) and rec["python"] == str(venv / "bin" / "python")
    assert rec["installer"] == "uv" and rec["base_python"] == str(world["base"])
    assert rec["installed"] == {"tinyown": {"version": "2.0", "from": "wheels", "lock_hash": True}}
    assert rec["from_base"] == {"tinybase": "1.0", "tinystack": "1.0", "tinydiff": "1.0"}
    assert rec["base_differs"] == {"tinydiff": {"base": "1.0", "lock": "2.0"}}
    assert rec["absent"] == {"tinyextra": "1.0"}  # tinywin's marker does not apply here
    assert "tinyextra==1.0" in rec["note"] and rec["from_base_summary"] == "tinybase, tinydiff, tinystack"
    assert rec["cuda_home"] is None and rec["path"] == [str(venv / "bin"), str(world["base"].parent)]
    assert rec["selfcheck"]["python"] == ".".join(map(str, sys.version_info[:3]))
    # the overlay's own tinyown 2.0 wins over the base's 1.0; the base's packages are seen, not copied
    py = rec["python"]
    out = run_in(py, "import importlib.metadata as md, tinyown, tinybase; "
                     "print(md.version('tinyown'), tinyown.hello(), tinybase.__file__)")
    version, hello, base_file = out.split()
    assert (version, hello) == ("2.0", "overlay") and base_file.startswith(str(world["base"].parent.parent))
    site = Path(run_in(py, "import sysconfig; print(sysconfig.get_paths()['purelib'])"))
    assert (site / PTH).exists() and not (site / "tinybase.py").exists() and (site / "tinyown.py").exists()
    # unchanged inputs: not rebuilt
    [again] = build_venv_cells([world["folder"]], opts)
    assert again["status"] == "skipped-unchanged" and again["installed"] == rec["installed"]


def test_a_cell_built_both_ways_keeps_both_builds(world: dict[str, Path], tmp_path: Path) -> None:
    """Each backend records its build in its own file: a venv build leaves the image's record as it was, and
    neither backend rebuilds because the other one built last."""
    from provision import cellrecord

    folder = tmp_path / "envs" / CELL
    shutil.copytree(world["folder"], folder, ignore=shutil.ignore_patterns("build*.json"))
    image = {"cell_id": CELL, "status": "built", "tag": "stackprobe/x:1", "image_id": "sha256:1"}
    (folder / "build.json").write_text(json.dumps(image))
    opts = BuildOptions(world["matrix"], envs=folder.parent, backend="venv", base_python=str(world["base"]),
                        wheels=world["wheels"], venvs=tmp_path / "venvs")
    [rec] = build_venv_cells([folder], opts)
    assert rec["status"] == "built", rec["reason"]
    assert json.loads((folder / "build.json").read_text()) == image
    assert json.loads((folder / "build-venv.json").read_text()) == rec
    assert cellrecord.previous(folder) == image and cellrecord.previous(folder, "venv") == rec
    [again] = build_venv_cells([folder], opts)
    assert again["status"] == "skipped-unchanged" and json.loads((folder / "build.json").read_text()) == image
    assert venvcell.read(folder.parent, CELL).state == "built"


def test_overlay_whose_base_lacks_the_cells_torch_fails_its_self_check(world: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    folder = tmp_path / "envs" / CELL
    shutil.copytree(world["folder"], folder)
    cell = json.loads((folder / "cell.json").read_text())
    cell["expected"]["torch"] = "2.11.0"
    (folder / "cell.json").write_text(json.dumps(cell))
    opts = BuildOptions(world["matrix"], envs=folder.parent, backend="venv", base_python=str(world["base"]),
                        wheels=world["wheels"], venvs=tmp_path / "venvs")
    [rec] = build_venv_cells([folder], opts)
    assert rec["status"] == "failed"
    assert rec["reason"].startswith("self-check: torch does not import: import torch: ModuleNotFoundError")


def test_overlay_with_pip_where_there_is_no_uv(world: dict[str, Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A lent GPU machine has a Python with pip and no uv: the base's pip installs into the overlay."""
    base = tmp_path / "pipbase"
    subprocess.run([sys.executable, "-m", "venv", str(base)], check=True, env=installer.env())
    pool = world["root"] / "pool"
    subprocess.run([str(base / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--find-links",
                    str(pool), "tinybase==1.0", "tinystack==1.0", "tinyown==1.0"], check=True, env=installer.env())
    monkeypatch.setattr(installer, "uv", lambda: None)
    opts = BuildOptions(world["matrix"], envs=world["envs"], backend="venv", base_python=str(base / "bin" / "python"),
                        wheels=world["wheels"], venvs=tmp_path / "venvs")
    folder = tmp_path / "envs" / CELL
    shutil.copytree(world["folder"], folder, ignore=shutil.ignore_patterns("build*.json"))
    [rec] = build_venv_cells([folder], opts)
    assert rec["status"] == "built", rec["reason"]
    assert rec["installer"] == "pip" and rec["installed"]["tinyown"]["version"] == "2.0"
    # the base has tinyown 1.0: pip must still put 2.0 into the overlay
    assert run_in(rec["python"], "import importlib.metadata as md; print(md.version('tinyown'))") == "2.0"
    assert rec["absent"] == {"tinydiff": "2.0", "tinyextra": "1.0"}


def test_full_cell_from_a_wheel_folder_says_it_has_no_toolkit_wheels(world: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "envs" / CELL
    shutil.copytree(world["folder"], folder, ignore=shutil.ignore_patterns("build*.json"))
    wheels = tmp_path / "wheels"
    shutil.copytree(world["wheels"], wheels)
    make_wheel(wheels, "tinybase", "1.0")
    opts = BuildOptions(world["matrix"], envs=folder.parent, backend="venv", wheels=wheels, venvs=tmp_path / "venvs")
    [rec] = build_venv_cells([folder], opts)
    assert rec["status"] == "built", rec["reason"]
    assert rec["base_python"] is None and rec["from_base"] == {} and rec["from_base_summary"] == ""
    assert rec["installed"]["tinybase"] == {"version": "1.0", "from": "wheels", "lock_hash": False}  # not its bytes
    assert set(rec["absent"]) == {"tinystack", "tinydiff", "tinyextra"}
    assert rec["cuda_home"] is None
    assert "the toolkit wheels of toolkit.lock are not all in" in rec["note"]


def test_checks_run_uses_venv_cells_when_docker_is_absent(world: dict[str, Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    if not (world["folder"] / "build-venv.json").exists():
        test_overlay_cell_installs_only_its_own_packages_and_records_where_each_came_from(world)
    monkeypatch.setenv("DOCKER_HOST", DEAD_DOCKER)
    monkeypatch.setenv("STACKPROBE_PROBE_PATH", str(FIXTURES))
    results = tmp_path / "results"
    argv = ["run", "--probe", "t-trivial", "--matrix", str(world["matrix"]), "--envs", str(world["envs"]),
            "--results", str(results), "--json", "--level", "full"]  # one pass, so one run and one manifest
    assert checks_main(argv) == 0
    out, err = capsys.readouterr()
    # a sentence naming where it looked, not the Docker SDK's exception
    assert f"checks: no Docker daemon answers (no socket at {DEAD_DOCKER}): " in err
    assert "Error while fetching" not in err and "FileNotFoundError" not in err
    assert "running the probes in venv cells (virtual environments) instead of Docker images" in err
    printed = json.loads(out)
    assert {(r["cell_id"], r["variant"], r["status"]) for r in printed} == {
        (CELL, "ranks=1", "pass"), (CELL, "ranks=2", "pass")}
    venv_python = str(world["venvs"] / CELL / "bin" / "python")
    # the interpreter as any machine writes it: its temporary folder as $TMPDIR
    in_tmp = Path(venv_python).relative_to(tempfile.gettempdir())
    assert all(r["evidence"]["command"].startswith(f"$TMPDIR/{in_tmp} -m inenv.worker") for r in printed)
    [manifest] = results.glob("*/*.manifest.json")
    m = json.loads(manifest.read_text())
    assert m["executor"] == "venv" and m["cells"][CELL]["image"] == venv_python
    assert m["cells"][CELL]["versions"]["from_base"] == "tinybase, tinydiff, tinystack"
    # --backend docker insists, and fails as it always did without a daemon
    assert checks_main([*argv[:1], "--backend", "docker", *argv[1:]]) == 2
    assert "Docker is not reachable" in capsys.readouterr().err


def test_provision_build_falls_back_to_venv_cells_in_one_line(world: dict[str, Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """No Docker daemon, no uv (a lent GPU machine): the committed lock is used as it is, and said so."""
    from common.api import resolve_all
    from provision.cli import main as provision_main
    from provision.lock import requirements_in

    envs = tmp_path / "envs"
    shutil.copytree(world["folder"], envs / CELL, ignore=shutil.ignore_patterns("build*.json"))
    [r] = resolve_all(world["matrix"], offline=True)
    assert r.cell_id == CELL
    (envs / CELL / "requirements.in").write_text(requirements_in(r))
    monkeypatch.setenv("DOCKER_HOST", DEAD_DOCKER)
    monkeypatch.setattr(installer, "uv", lambda: None)
    args = ["build", "--dry-run", "--matrix", str(world["matrix"]), "--envs", str(envs), "--no-reach-check", "--json",
            "--venvs", str(tmp_path / "venvs"), "--dockerfiles", str(tmp_path / "d")]
    with pytest.raises(SystemExit) as done:
        provision_main(args)
    out, err = capsys.readouterr()
    assert done.value.code == 0, err
    lines = [ln for ln in err.splitlines() if "Docker" in ln]
    assert len(lines) == 1 and lines[0].startswith("provision: no Docker daemon answers (") and "as venv cells " \
        "(virtual environments) instead of Docker images; the same locks, self-check and probes, so the same " \
        "verdicts" in lines[0]
    assert "start dockerd" not in err and "--dry-run" not in err
    [row] = json.loads(out)
    dockerfile = tmp_path / "d" / f"{CELL}.Dockerfile"
    assert row["status"] == "would-build" and row["reason"].startswith(f"venv {tmp_path / 'venvs' / CELL}; FROM ")
    assert row["reason"].endswith(str(dockerfile)) and "FROM " in dockerfile.read_text()  # rendered all the same
    with pytest.raises(SystemExit) as done:  # --backend docker insists (without --dry-run: it would only render)
        provision_main([a for a in args if a != "--dry-run"] + ["--backend", "docker"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "cannot talk to the Docker daemon" in err and "start dockerd" in err
    with pytest.raises(SystemExit) as done:
        provision_main([*args, "--backend", "docker", "--base-python", sys.executable])
    assert done.value.code == 2 and "use --backend venv" in capsys.readouterr().err
    # a changed requirement and no uv to lock it: that cell fails and says why
    (envs / CELL / "requirements.in").write_text("other\n")
    with pytest.raises(SystemExit) as done:
        provision_main(args)
    [row] = json.loads(capsys.readouterr().out)
    assert done.value.code == 0 and row["status"] == "failed" and "no uv here to lock it" in row["reason"]


def test_venv_cell_record_gives_the_ranks_its_path_and_cuda_home(tmp_path: Path) -> None:
    folder = tmp_path / CELL
    folder.mkdir()
    assert venvcell.read(tmp_path, CELL).state == "missing"
    (folder / "build.json").write_text(json.dumps({"status": "built", "tag": "stackprobe/x:1"}))
    got = venvcell.read(tmp_path, CELL)
    assert got.state == "missing" and f"no {folder / 'build-venv.json'}: run `provision build --backend venv" \
        in got.reason and "its Docker image stackprobe/x:1 is built" in got.reason
    rec = {"backend": "venv", "status": "failed", "reason": "self-check: torch is 2.9.1, the cell asks 2.11.0"}
    (folder / "build-venv.json").write_text(json.dumps(rec))
    assert venvcell.read(tmp_path, CELL) == venvcell.VenvCell("failed", reason=rec["reason"])
    rec = {"backend": "venv", "status": "built", "python": sys.executable, "path": ["/v/bin", "/base/bin"],
           "cuda_home": "/v/cuda", "from_base_summary": "torch, nvidia-*", "base_python": "/base/bin/python"}
    (folder / "build-venv.json").write_text(json.dumps(rec))
    got = venvcell.read(tmp_path, CELL, {"PATH": "/usr/bin"})
    assert got.state == "built" and got.python == sys.executable and got.from_base == "torch, nvidia-*"
    env = LocalExecutor(sys.executable, "venv", got.env).env()
    assert env["PATH"] == "/v/bin:/base/bin:/usr/bin" and env["CUDA_HOME"] == "/v/cuda"
    assert env["PYTHONPATH"] == str(CODE_ROOT)  # the caller's PYTHONPATH does not reach a venv cell
    rec["python"] = str(tmp_path / "gone" / "python")
    (folder / "build-venv.json").write_text(json.dumps(rec))
    assert "is gone" in venvcell.read(tmp_path, CELL).reason
    # the one record a checkout kept for both backends: a build.json of a venv cell is its venv record
    (folder / "build-venv.json").unlink()
    (folder / "build.json").write_text(json.dumps({**rec, "python": sys.executable}))
    assert venvcell.read(tmp_path, CELL, {"PATH": "/usr/bin"}).state == "built"


def host_with_wrapper_nvcc(root: Path) -> tuple[Path, Path]:
    """A host toolkit (``<root>/toolkit/bin/nvcc`` printing a CUDA 13.0 release line) and a wrapper script in
    ``<root>/wrapbin`` that execs it, as /usr/local/bin/nvcc does on this project's build machine."""
    real = root / "toolkit" / "bin" / "nvcc"
    real.parent.mkdir(parents=True)
    real.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    wrapper = root / "wrapbin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\nexec {real} \"$@\"\n")
    for f in (real, wrapper):
        f.chmod(0o755)
    return real.parent, wrapper.parent


def test_venv_cell_without_registry_nvcc_sees_its_own_empty_toolkit_not_the_hosts(tmp_path: Path) -> None:
    """A CUDA 12 cell's image has CUDA_HOME=/usr/local/cuda with no toolkit in it, so flashinfer finds no nvcc;
    the venv of the same cell must not reach the host's nvcc through PATH, CUDA_PATH or FLASHINFER_NVCC."""
    toolkit_bin, wrapbin = host_with_wrapper_nvcc(tmp_path / "host")
    venv = tmp_path / "venvs" / CELL
    (venv / "bin").mkdir(parents=True)
    host = {"PATH": f"{wrapbin}:{toolkit_bin}:/usr/bin:/bin", "CUDA_PATH": str(toolkit_bin.parent),
            "FLASHINFER_NVCC": str(wrapbin / "nvcc")}
    # what the host alone would give flashinfer: its toolkit, nvcc 13.0
    assert toolkit.resolve(host, flashinfer=True).version == "13.0"
    folder = tmp_path / "envs" / CELL
    folder.mkdir(parents=True)
    rec = {"backend": "venv", "status": "built", "python": sys.executable, "venv": str(venv),
           "path": [str(venv / "bin")], "cuda_home": None, "base_python": None}
    (folder / "build.json").write_text(json.dumps(rec))
    got = venvcell.read(tmp_path / "envs", CELL, host)
    with patch.dict("os.environ", host, clear=True):
        env = LocalExecutor(sys.executable, "venv", got.env).env()
    assert env["CUDA_HOME"] == str(venv / "cuda")
    assert env["CUDA_LIB_PATH"] == str(venv / "cuda" / "targets" / "x86_64-linux" / "lib")
    assert "CUDA_PATH" not in env and "FLASHINFER_NVCC" not in env
    assert env["PATH"].split(":") == [str(venv / "bin"), str(venv / "cuda" / "bin"), "/usr/bin", "/bin"]
    tk = toolkit.resolve(env, flashinfer=True)
    assert (tk.found_by, tk.nvcc, tk.version) == ("CUDA_HOME", str(venv / "cuda" / "bin" / "nvcc"), None)
    # a cell with the registry's nvcc keeps its own toolkit's bin on PATH, and the host's stays off it
    (venv / "cuda" / "bin").mkdir(parents=True)
    shutil.copy(toolkit_bin / "nvcc", venv / "cuda" / "bin" / "nvcc")
    rec["cuda_home"] = str(venv / "cuda")
    (folder / "build.json").write_text(json.dumps(rec))
    env = dict(venvcell.read(tmp_path / "envs", CELL, host).env)
    assert env["PATH"].split(":")[:3] == [str(venv / "bin"), str(venv / "cuda" / "bin"), "/usr/bin"]
    assert toolkit.resolve({**host, **env}, flashinfer=True).nvcc == str(venv / "cuda" / "bin" / "nvcc")


def test_overlay_plan_rules() -> None:
    lock = overlay.entries(lock_entry("torch", "2.11.0", "a" * 64) + lock_entry("nvidia-nccl-cu13", "2.28.9")
                           + lock_entry("flashinfer-python", "0.6.18") + lock_entry("numpy", "2.4.6")
                           + lock_entry("click", "8.5.1") + lock_entry("einops", "0.8.2")
                           + lock_entry("cuda-python", "13.4.4") + "colorama==0.4.6 ; sys_platform == 'win32'\n")
    base = {"torch": "2.11.0+cu130", "numpy": "2.5.2", "click": "8.5.1", "flashinfer-python": "0.6.17"}
    have = {"flashinfer-python", "einops"}
    plan = overlay.plan(lock, {"sys_platform": "linux"}, base, frozenset({"torch", "nvidia-nccl-cu13"}),
                        frozenset({"flashinfer-python"}), lambda e: e.name in have)
    assert [e.name for e in plan.install] == ["flashinfer-python", "einops"]
    assert plan.base_json() == {"torch": "2.11.0+cu130", "numpy": "2.5.2", "click": "8.5.1"}
    assert plan.differs_json() == {"torch": {"base": "2.11.0+cu130", "lock": "2.11.0"},
                                   "numpy": {"base": "2.5.2", "lock": "2.4.6"}}
    assert [(p.name, p.base_version) for p in plan.absent] == [("nvidia-nccl-cu13", None), ("cuda-python", None)]
    # a full cell (no base) installs whatever can be had
    full = overlay.plan(lock, {"sys_platform": "linux"}, None, frozenset(), frozenset(), lambda e: True)
    assert len(full.install) == 7 and not full.from_base and not full.absent
    assert overlay.summary(["torch", "triton", "nvidia-nccl-cu13", "nvidia-cublas", "cuda-bindings", "numpy",
                            "click"]) == "torch, triton, nvidia-*, cuda-* +2 others"
    assert overlay.summary(["torch", "nvidia-nccl-cu13"]) == "torch, nvidia-*"


def test_backend_choice() -> None:
    def boom() -> str | None:
        raise AssertionError("the daemon is asked only under auto")

    assert backend.choose("docker", boom) == backend.Choice("docker")
    assert backend.choose("venv", boom) == backend.Choice("venv")
    assert backend.choose("auto", boom, overlay=True) == backend.Choice("venv")
    assert backend.choose("auto", lambda: None) == backend.Choice("docker")
    fell = backend.choose("auto", lambda: "connection refused")
    assert fell.backend == "venv" and "\n" not in fell.line
    assert fell.line.startswith("no Docker daemon answers (connection refused): building the cells as venv cells")
    assert "same verdicts" in fell.line and "start dockerd" not in fell.line
    with pytest.raises(InputError, match="use --backend venv"):
        backend.choose("docker", boom, overlay=True)


def test_wheel_folder_tells_lock_bytes_from_local_builds(tmp_path: Path) -> None:
    w = make_wheel(tmp_path, "tinyown", "2.0")
    make_wheel(tmp_path, "Tiny_Other", "1.0.0")
    (tmp_path / "not-a-wheel.whl").write_text("x")
    found = wheeldir.scan(tmp_path)
    assert sorted((x.name, x.version) for x in found.wheels) == [("tiny-other", "1.0.0"), ("tinyown", "2.0")]
    assert found.has("tiny.other", "1.0") and not found.has("tinyown", "1.0")
    assert found.locked_bytes("tinyown", "2.0", frozenset({sha(w)})) is True
    assert found.locked_bytes("tinyown", "2.0", frozenset({"0" * 64})) is False
    assert found.locked_bytes("tinyown", "2.0", frozenset()) is None


def test_cuda_home_from_toolkit_wheels_links_the_tree_and_a_driver_stub(tmp_path: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    from inenv.kit import _elf

    part = tmp_path / "wheels" / "nvidia" / "cu13"
    (part / "bin").mkdir(parents=True)
    (part / "include").mkdir()
    (part / "lib").mkdir()
    (part / "bin" / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    (part / "bin" / "nvcc").chmod(0o755)
    (part / "include" / "cuda.h").write_text(
        "CUresult CUDAAPI cuInit(unsigned int Flags);\n#define cuMemAlloc cuMemAlloc_v2\n"
        "CUresult CUDAAPI cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr);\n")
    src = tmp_path / "rt.c"
    src.write_text("int cudart_here(void) { return 13; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(part / "lib" / "libcudart.so.13"), str(src)], check=True)
    (tmp_path / "wheels" / "nvidia" / "cu13" / ".metadata").mkdir()
    home = tmp_path / "venv" / "cuda"
    assert cudahome.assemble(tmp_path / "wheels", home) == ""
    assert (home / "bin" / "nvcc").resolve() == (part / "bin" / "nvcc").resolve()
    assert (home / "lib64" / "libcudart.so").resolve() == (part / "lib" / "libcudart.so.13").resolve()
    assert not (home / ".metadata").exists()
    stub = _elf.linkage(str(home / "lib" / "stubs" / "libcuda.so"))
    assert stub is not None and stub.soname == "libcuda.so.1"
    assert {"cuInit", "cuMemAlloc", "cuMemAlloc_v2", "cuPointerGetAttribute"} <= stub.defined
    assert cudahome.assemble(tmp_path / "wheels", home) == ""  # a rebuild replaces it


def test_venv_build_says_cell_n_of_n_its_steps_how_long_and_what_is_left(world: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    """The progress a Docker build shows, for venv cells: the count and the time its cells' last builds took,
    cell n of N with its last time, each step, a tick while it builds, and the time left after each."""
    second = CELL.replace("fi0.6.18", "fi0.6.19")
    folders = []
    for cid, last_s in ((CELL, 90.0), (second, 30.0)):
        folder = tmp_path / "envs" / cid
        shutil.copytree(world["folder"], folder, ignore=shutil.ignore_patterns("build*.json"))
        cell = json.loads((folder / "cell.json").read_text())
        cell["cell_id"] = cid
        (folder / "cell.json").write_text(json.dumps(cell))
        # an earlier build of other inputs (another hash): rebuilt, and its time is the estimate
        (folder / "build.json").write_text(json.dumps({"backend": "venv", "status": "built", "hash": "0ld",
                                                       "build_s": last_s}))
        folders.append(folder)
    venvs = tmp_path / "venvs"
    opts = BuildOptions(world["matrix"], envs=tmp_path / "envs", backend="venv", base_python=str(world["base"]),
                        wheels=world["wheels"], venvs=venvs)
    said: list[str] = []
    handed: list[dict] = []
    records = build_venv_cells(folders, opts, lambda cid, msg: said.append(f"{cid} {msg}".strip()), tick_s=0.05,
                               on_built=handed.append)
    assert [r["status"] for r in records] == ["built", "built"]
    # each built cell's record is handed on as its build ends (the early kernel carry takes it from there)
    assert [h["cell_id"] for h in handed] == [CELL, second] and handed == records
    assert said[0] == "venv cells: 2 to build; about 2m00s by their last builds"
    mine = [ln[len(CELL) + 1:] for ln in said if ln.startswith(CELL + " ") and not ln.startswith(CELL + " (cell")]
    assert mine[0] == (f"cell 1 of 2: building {venvs / CELL} (last build 1m30s; its last build recorded no inputs "
                       "to compare)")
    assert mine[1:4] == [f"making {venvs / CELL} over {world['base']}", "installing 1 package(s), 3 from the base",
                         "self-check"]
    assert mine[4].startswith("cell 1 of 2: built after ") and mine[4].endswith("· 1 of 2 done, about 30 s left")
    ends = [ln for ln in said if ln.startswith(second + " cell 2 of 2: built after ")]
    assert len(ends) == 1 and ends[0].endswith("· 2 of 2 done")
    ticks = [ln for ln in said if ln.startswith(f"{CELL} (cell 1 of 2) building for ")]
    # a tick may come before the first step is said (a loaded machine): then it names no step
    assert ticks and all(" of 1m30s last time" in ln for ln in ticks)
    assert any(" of 1m30s last time; at " in ln for ln in ticks)
    # nothing changed: nothing is built, and the build times stay for the next estimate
    again: list[str] = []
    handed.clear()
    rebuilt = build_venv_cells(folders, opts, lambda cid, msg: again.append(f"{cid} {msg}".strip()),
                               on_built=handed.append)
    assert [r["status"] for r in rebuilt] == ["skipped-unchanged"] * 2 and handed == []
    assert again[-1] == "venv cells: 0 to build, 2 unchanged"
    assert [r["build_s"] for r in rebuilt] == [r["build_s"] for r in records]


def test_a_committed_lock_naming_the_catalog_at_its_earlier_path_is_still_the_same_inputs(tmp_path: Path) -> None:
    """Where no index answers (a lent GPU host, UV_OFFLINE=1), the lock in envs/ is used when it was made from
    the same requirements; a requirements.in whose header names the catalog as provision/catalog.yaml is the
    same requirements as one naming common/catalog.yaml, or every committed lock would need an index."""
    from common import api
    from provision import venvbuild

    (r,) = [r for r in api.resolve_all(CODE_ROOT / "matrices" / "h200-overlay.yaml", offline=True)
            if r.cell_id == "cu130-torch2.11.0-sglnone-fi0.7.4"]
    folder = tmp_path / r.cell_id
    folder.mkdir()
    text = venvbuild.requirements_in(r)
    assert "common/catalog.yaml" in text
    (folder / "requirements.in").write_text(text.replace("common/catalog.yaml", "provision/catalog.yaml"))
    (folder / "requirements.lock").write_text("torch==2.11.0\n")
    (folder / "cell.json").write_text("{}")
    assert venvbuild._same_inputs(folder, r)
    (folder / "requirements.in").write_text(text.replace("flashinfer-python==0.7.4", "flashinfer-python==0.7.3"))
    assert not venvbuild._same_inputs(folder, r)


HOST_ONLY = {"LD_LIBRARY_PATH": "/opt/host/lib", "CPATH": "/opt/host/include", "LIBRARY_PATH": "/opt/host/lib",
             "NVCC_APPEND_FLAGS": "-I/opt/host/include", "NVCC_PREPEND_FLAGS": "-ccbin /opt/host/gcc",
             "TORCH_CUDA_ARCH_LIST": "8.0", "PYTHONPATH": "/opt/host/site", "PYTHONHOME": "/opt/host/py",
             "NCCL_ALGO": "Tree", "LD_PRELOAD": "/opt/host/libhook.so", "CUDA_PATH": "/opt/host/cuda"}


def test_a_full_venv_cells_processes_never_see_the_hosts_build_and_loader_variables(tmp_path: Path) -> None:
    """What a process of a full venv cell gets is what the cell's container would: none of the host variables
    above, its own PATH, PYTHONPATH and CUDA_HOME, the user's HOME and stackprobe's own settings; of
    LD_LIBRARY_PATH only a folder holding the driver's libcuda. An overlay cell runs in its base's (the host's)
    environment, so the host's variables reach it."""
    driver = tmp_path / "driver"
    driver.mkdir()
    (driver / "libcuda.so.1").write_bytes(b"")
    folder = tmp_path / "envs" / CELL
    folder.mkdir(parents=True)
    venv = tmp_path / "venvs" / CELL
    rec = {"backend": "venv", "status": "built", "python": sys.executable, "venv": str(venv),
           "path": [str(venv / "bin")], "cuda_home": None, "base_python": None}
    (folder / "build-venv.json").write_text(json.dumps(rec))
    host = {**HOST_ONLY, "LD_LIBRARY_PATH": f"/opt/host/lib:{driver}", "PATH": "/usr/bin:/bin", "HOME": "/root",
            "STACKPROBE_LEVEL": "quick", "LANG": "C.UTF-8"}
    got = venvcell.read(tmp_path / "envs", CELL, host)
    assert got.hermetic
    with patch.dict("os.environ", host, clear=True):
        env = LocalExecutor(sys.executable, "venv", got.env, hermetic=got.hermetic).env()
    seen = json.loads(subprocess.run([sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
                                     env=env, capture_output=True, text=True, check=True).stdout)
    for name in HOST_ONLY:
        if name in ("LD_LIBRARY_PATH", "PYTHONPATH"):
            continue
        assert name not in seen, name
    assert seen["LD_LIBRARY_PATH"] == str(driver)
    assert seen["PYTHONPATH"] == str(CODE_ROOT) and seen["CUDA_HOME"] == str(venv / "cuda")
    assert seen["HOME"] == "/root" and seen["STACKPROBE_LEVEL"] == "quick" and seen["LANG"] == "C.UTF-8"
    # an overlay cell: its base environment is the host's
    (folder / "build-venv.json").write_text(json.dumps({**rec, "base_python": "/usr/bin/python3"}))
    over = venvcell.read(tmp_path / "envs", CELL, host)
    assert not over.hermetic
    with patch.dict("os.environ", host, clear=True):
        env = LocalExecutor(sys.executable, "venv", over.env, hermetic=over.hermetic).env()
    assert env["NVCC_APPEND_FLAGS"] == HOST_ONLY["NVCC_APPEND_FLAGS"] and env["NCCL_ALGO"] == "Tree"
