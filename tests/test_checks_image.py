"""`checks run --image`: an existing image stackprobe did not build, probed as a cell named by what is inside it.

Real: an image built here FROM the registry-free base with this checkout's torch copied in (Debian's python3 is
3.11, as the venv's: the same wheel files import there), probed end to end with real gloo ranks in containers;
an image without torch and one without python3 are refused in one line with nothing written; a missing image
is refused in one line. The torch image is built once per torch install (its tag names the torch RECORD's
digest) and kept, so a later session reuses it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from checks.cli import main
from common import cellid
from tests.checks_helpers import fixture_env, report_md

SITE = Path(next(p for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir()))
# torch and every distribution it requires, from the venv (so the inventory finds no broken requirement), and
# nothing of the host side (rich, docker...).
KEEP = ("torch", "torch-*.dist-info", "torchgen", "functorch", "nvidia", "nvidia_*.dist-info", "typing_extensions.py",
        "typing_extensions-*.dist-info", "filelock", "filelock-*.dist-info", "sympy", "sympy-*.dist-info", "mpmath",
        "mpmath-*.dist-info", "networkx", "networkx-*.dist-info", "jinja2", "jinja2-*.dist-info", "markupsafe",
        "markupsafe-*.dist-info", "fsspec", "fsspec-*.dist-info", "triton", "triton-*.dist-info", "cuda",
        "cuda_*.dist-info", "setuptools", "setuptools-*.dist-info")


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def run_checks(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "checks.cli", "run", *args], capture_output=True, text=True,
                          env=fixture_env(), cwd=cwd, timeout=900)


@pytest.fixture(scope="module")
def torch_image(base_image: str, docker_available: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    record = next(SITE.glob("torch-*.dist-info")) / "RECORD"
    key = record.read_bytes() + base_image.encode() + " ".join(KEEP).encode()
    tag = f"stackprobe-test/torch-image:{hashlib.sha256(key).hexdigest()[:12]}"
    if subprocess.run([docker_available, "image", "inspect", tag], capture_output=True).returncode == 0:
        return tag
    ctx = tmp_path_factory.mktemp("torch-image")
    (ctx / "Dockerfile").write_text(f"FROM {base_image}\nCOPY . /usr/local/lib/python3.11/dist-packages/\n")
    # BuildKit reads <Dockerfile>.dockerignore beside the Dockerfile: the venv's folder is the context, untouched
    (ctx / "Dockerfile.dockerignore").write_text("*\n" + "".join(f"!{k}\n" for k in KEEP))
    proc = subprocess.run([docker_available, "build", "-q", "-f", str(ctx / "Dockerfile"), "-t", tag, str(SITE)],
                          capture_output=True, text=True, env={**os.environ, "DOCKER_BUILDKIT": "1"}, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tag


@pytest.fixture(scope="module")
def no_python_image(docker_available: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """An image holding one text file: no shell, no python3."""
    tag = "stackprobe-test/no-python:1"
    if subprocess.run([docker_available, "image", "inspect", tag], capture_output=True).returncode == 0:
        return tag
    tar = tmp_path_factory.mktemp("nopython") / "root.tar"
    with tarfile.open(tar, "w") as t:
        src = tar.with_name("hello")
        src.write_text("hello\n")
        t.add(src, arcname="hello")
    proc = subprocess.run([docker_available, "import", str(tar), tag], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return tag


def image_id(docker: str, tag: str) -> str:
    return subprocess.run([docker, "image", "inspect", "-f", "{{.Id}}", tag], capture_output=True, text=True,
                          check=True).stdout.strip()


def containers_of(docker: str, tag: str) -> list[str]:
    return subprocess.run([docker, "ps", "-a", "-q", "--filter", f"ancestor={tag}"], capture_output=True, text=True,
                          check=True).stdout.split()


@pytest.mark.docker
def test_an_existing_image_is_probed_as_a_cell_named_by_what_is_inside(torch_image: str, docker_available: str,
                                                                        tmp_path: Path) -> None:
    before = image_id(docker_available, torch_image)
    results = tmp_path / "results"
    p = run_checks("--image", torch_image, "--probe", "t-gloo-allreduce", "--probe", "t-trivial", "--probe",
                   "inventory", "--level", "full", "--results", str(results), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    [jsonl] = results.glob("*/*.jsonl")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    [cid] = {r["cell_id"] for r in rows}
    # what is inside: the venv's torch 2.11.0 (a CUDA 13.0 build), no sgl-kernel, no flashinfer, no nvcc
    parsed = cellid.parse(cid)
    assert parsed is not None and parsed.image and not parsed.local, cid
    assert cid == "image-cu130-torch2.11.0-sglnone-finone-nonvcc", cid
    by = {(r["probe_id"], r["variant"]): r for r in rows}
    assert by[("t-gloo-allreduce", "ranks=2")]["status"] == "pass"  # real gloo ranks inside the image
    assert by[("t-gloo-allreduce", "ranks=3")]["status"] == "pass"
    assert by[("t-trivial", "ranks=2")]["status"] == "pass"
    assert by[("inventory", "ranks=1")]["status"] == "pass", by[("inventory", "ranks=1")]
    for r in rows:
        assert r["evidence"]["image"] == torch_image and r["evidence"]["image_id"] == before
        assert r["evidence"]["inputs"]["env"] == f"image {before}"  # the image's digest decides reuse
        assert r["evidence"]["env"]["python"].startswith("3.11")  # Debian's python3 in the image, not the host's
    manifest = json.loads(jsonl.with_name(jsonl.name.replace(".jsonl", ".manifest.json")).read_text())
    assert manifest["executor"] == "docker"
    versions = manifest["cells"][cid]["versions"]
    assert versions["image"] == torch_image and versions["image_id"] == before
    assert versions["torch"].startswith("2.11.0") and versions["torch_cuda"] == "13.0"
    table = report_md(results / "compatibility.md")  # an image's cell: on the archive and its host's page
    assert f"`{cid}`<br>image: {torch_image}" in table  # the row names the image
    # nothing written into the image, no container left of it
    assert image_id(docker_available, torch_image) == before
    assert containers_of(docker_available, torch_image) == []


@pytest.mark.docker
def test_a_serving_images_entrypoint_and_user_do_not_get_in_the_way(torch_image: str, docker_available: str,
                                                                     tmp_path: Path) -> None:
    """A serving image starts its server from ENTRYPOINT and may run as another user: the probes still run."""
    tag = "stackprobe-test/serving-entrypoint:1"
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(f"FROM {torch_image}\nENTRYPOINT [\"python3\", \"-c\", \"raise SystemExit(3)\"]\n"
                                    "USER nobody\n")
    proc = subprocess.run([docker_available, "build", "-q", "-t", tag, str(ctx)], capture_output=True, text=True,
                          env={**os.environ, "DOCKER_BUILDKIT": "1"})
    assert proc.returncode == 0, proc.stderr
    results = tmp_path / "results"
    p = run_checks("--image", tag, "--probe", "t-gloo-allreduce", "--level", "full", "--results", str(results),
                   cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for f in results.glob("*/*.jsonl") for line in f.read_text().splitlines()]
    assert {(r["variant"], r["status"]) for r in rows} == {("ranks=2", "pass"), ("ranks=3", "pass")}
    assert containers_of(docker_available, tag) == []


@pytest.mark.docker
def test_an_image_without_torch_is_refused_in_one_line(base_image: str, tmp_path: Path) -> None:
    p = run_checks("--image", base_image, "--all", "--results", str(tmp_path / "results"), cwd=tmp_path)
    assert p.returncode == 2
    assert one_line(p.stderr) == (f"checks run: --image {base_image}: torch is not installed in the image; "
                                  "stackprobe runs its probes with the image's own python3 and torch")
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.docker
def test_an_image_without_python_is_refused_in_one_line(no_python_image: str, docker_available: str,
                                                        tmp_path: Path) -> None:
    p = run_checks("--image", no_python_image, "--all", "--results", str(tmp_path / "results"), cwd=tmp_path)
    assert p.returncode == 2
    assert one_line(p.stderr) == (f"checks run: --image {no_python_image}: the image has no python3 on its PATH; "
                                  "stackprobe runs its probes with the image's own python3 and torch")
    assert list(tmp_path.iterdir()) == []
    assert containers_of(docker_available, no_python_image) == []


@pytest.mark.docker
def test_a_missing_image_is_refused_in_one_line(docker_available: str, tmp_path: Path) -> None:
    p = run_checks("--image", "stackprobe-test/never-built:0", "--all", "--results", str(tmp_path / "r"), cwd=tmp_path)
    assert p.returncode == 2
    assert one_line(p.stderr) == ("checks run: --image stackprobe-test/never-built:0: no such image in the Docker "
                                  "daemon; `docker images` lists those there (pull or load it first)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("args", "wanted"), [
    (["--backend", "local"], "checks run: --image runs existing images with --backend docker (or slurm), not "
                             "--backend local"),
    (["--backend", "venv"], "checks run: --image runs existing images with --backend docker (or slurm), not "
                            "--backend venv"),
    (["--backend", "docker", "--python", "/usr/bin/python3"], "checks run: --image runs the image's own python3; "
                                                              "give --image or --python, not both"),
    (["--backend", "slurm", "--image", "b:2"], "checks run: with --backend slurm give one image (--image or "
                                               "--container-image)"),
    (["--backend", "slurm", "--container-image", "b:2"], "checks run: with --backend slurm give one image (--image "
                                                         "or --container-image)"),
])
def test_image_options_that_do_not_fit_are_refused(args: list[str], wanted: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--all", "--image", "a:1", *args, "--results", str(tmp_path / "r")]) == 2
    assert one_line(capsys.readouterr().err) == wanted
    assert not (tmp_path / "r").exists()


def test_image_names_are_split_on_commas_and_bad_ones_refused(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from checks.cli import parser, run_options

    argv = ["run", "--all", "--image", "a:1,b:2", "--image", "a:1", "--results", str(tmp_path)]
    opts = run_options(parser().parse_args(argv), argv)
    assert opts.images == ("a:1", "b:2") and opts.backend == "docker"  # auto: an image runs in a container
    argv = ["run", "--all", "--backend", "slurm", "--image", "a:1", "--results", str(tmp_path)]
    assert run_options(parser().parse_args(argv), argv).slurm.container_image == "a:1"  # slurm: the same meaning
    assert main(["run", "--all", "--image", "a:1,,b:2", "--results", str(tmp_path / "r")]) == 2
    assert "--image: give image names or ids, comma-separated" in one_line(capsys.readouterr().err)


def test_an_image_cell_id_is_read_back_and_names_its_engine() -> None:
    found = cellid.existing_image({"torch": "2.8.0+cu129", "torch_cuda": "12.9", "sgl_kernel": "0.3.9.post2",
                                   "flashinfer": "0.4.1", "nvcc": "12.9", "sglang": "0.5.2", "vllm": "0.10.1"})
    assert str(found) == "image-cu129-torch2.8.0-sgl0.3.9.post2-fi0.4.1-sglang0.5.2-nvcc12.9"
    assert cellid.parse(str(found)) == found
    bare = cellid.existing_image({"torch": "2.11.0", "torch_cuda": "13.0"})
    assert str(bare) == "image-cu130-torch2.11.0-sglnone-finone-nonvcc" and cellid.parse(str(bare)) == bare
    assert cellid.parse("image-local-cu130-torch2.11.0-sglnone-finone") is None


def test_slurm_reads_its_container_image_as_image_reads_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm's --container-image runs the same reading on a node; here srun (no pyxis on this machine) is
    stood in for by running the command it would start, in this venv's interpreter."""
    from checks.run.slurm import backend as slurm_backend
    from tests.checks_helpers import ROOT

    seen: list[list[str]] = []

    def srun_here(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        assert "--container-image=registry.example/serve:1" in cmd
        argv = cmd[cmd.index("python3") + 1:]
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})

    monkeypatch.setattr(slurm_backend, "_cmd", srun_here)
    cell = slurm_backend.image_cell("registry.example/serve:1", "gpu")
    assert cell.cell_id.startswith("image-cu130-torch2.11.0-sglnone-finone-"), cell.cell_id
    assert cell.image == "registry.example/serve:1" and cell.versions["image"] == "registry.example/serve:1"
    assert cell.versions["torch_cuda"] == "13.0" and "image_id" not in cell.versions
    assert len(seen) == 1
