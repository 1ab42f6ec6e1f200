"""Real builds on the real dockerd: a registry-only CUDA 13.0 cell of the default matrix (SGLang 0.5.23's
stack), its self-check, a no-op rebuild (also from a checkout without its build record), the CA bundle and
uv's cache kept out of the image, the files no probe uses left out, and a mislabelled cell that the
self-check rejects.

Each test is one sequence of steps so pytest-xdist never builds the same image twice at once.
Images are removed at the end unless STACKPROBE_KEEP_IMAGES=1.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import docker_cli

from checks.run.container import DockerExecutor
from common.catalog import load as load_catalog
from common.matrix import Cell
from common.resolve import RESOLVED, resolve
from provision import kernels
from provision.build import build_locked
from provision.buildsession import build_cells
from provision.cli import main
from provision.dockercli import CA_BUNDLE, Docker
from provision.lock import lock_cell, uv_version
from provision.options import BuildOptions

pytestmark = [pytest.mark.docker, pytest.mark.slow]
KEEP = os.environ.get("STACKPROBE_KEEP_IMAGES") == "1"
REAL = "cu130-torch2.14.1-sgl0.4.10-fi0.7.2"


def _tags(cell: str) -> set[str]:
    out = subprocess.run([docker_cli(), "images", "--filter", f"label=org.stackprobe.cell={cell}", "--format",
                          "{{.Repository}}:{{.Tag}}"], capture_output=True, text=True).stdout
    return set(out.split())


def _rm(tag: str | None, keep: set[str] = frozenset()) -> None:
    """Remove an image the test made; one that existed before (a user's `provision build`) stays."""
    if tag and not KEEP and tag not in keep:
        subprocess.run([docker_cli(), "image", "rm", tag], capture_output=True)


def _labels(tag: str) -> dict[str, str]:
    out = subprocess.run([docker_cli(), "image", "inspect", "--format", "{{json .Config.Labels}}", tag],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_real_cell_builds_checks_itself_and_rebuild_is_a_noop(tmp_path: Path, base_image: str) -> None:
    matrix = tmp_path / "m.yaml"
    matrix.write_text("matrix:\n  cuda: ['13.0']\n  torch: ['2.14.1']\n  sgl_kernel: ['0.4.10']\n"
                      "  flashinfer: ['0.7.2']\n")
    opts = BuildOptions(matrix, envs=tmp_path / "envs", dockerfiles=tmp_path / "df", json=True, base="registry-free",
                        ignore_disk=True,  # the cell is cached here; the disk gate has its own tests
                        kernel_archs=())  # its kernels are carried below, one module, not all five for three targets
    docker = Docker(cli=docker_cli())
    tag = None
    before = _tags(REAL)
    record = tmp_path / "envs" / REAL / "build.json"
    try:
        assert build_cells(opts, docker) == 0
        rec = json.loads(record.read_text())
        tag = rec["tag"]
        if rec.get("adopted"):  # this machine has the image already (a `provision build` here): build it anyway
            assert docker.builds == 0 and rec["status"] == "skipped-unchanged"
            subprocess.run([docker_cli(), "image", "rm", tag], capture_output=True, check=True)
            record.unlink()
            docker = Docker(cli=docker_cli())
            assert build_cells(opts, docker) == 0
            rec = json.loads(record.read_text())
            assert rec["tag"] == tag
        assert rec["status"] == "built", rec["reason"]
        assert docker.builds == 1
        assert rec["versions"]["torch"] == "2.14.1+cu130" and rec["versions"]["torch_cuda"] == "13.0"
        assert rec["versions"]["sgl_kernel"] == "0.4.10" and rec["versions"]["flashinfer"] == "0.7.2"
        assert rec["versions"]["nccl"].startswith("2.")
        sc = rec["selfcheck"]
        assert sc["toolkit"]["nvcc"] == "13.0" and sc["toolkit"]["compile_sm_120a"] == "ok"
        # the a/f suffix survives: sgl-kernel 0.4.10 carries arch-specific sm_120a SASS, torch plain sm_120 too
        assert "sm_120" in sc["torch"]["archs"]["sass"] and "sm_120a" in sc["sgl_kernel"]["archs"]["sass"]
        assert sc["sgl_kernel"]["cudart_major"] == ["13"]
        assert _labels(tag)["org.stackprobe.cell"] == REAL and _labels(tag)["org.stackprobe.torch"] == "2.14.1"
        assert (tmp_path / "df" / f"{REAL}.Dockerfile").read_text().startswith("# Rendered by")

        # the CA bundle reached the build as a secret: no layer, no history entry, no file holds it
        history = subprocess.run([docker_cli(), "history", "--no-trunc", "--format", "{{.CreatedBy}}", tag],
                                 capture_output=True, text=True, check=True).stdout
        assert "ca-certificates.crt" not in history and "BEGIN CERTIFICATE" not in history
        host = CA_BUNDLE.read_bytes()
        finder = (
            "import os,sys,hashlib\n"
            f"n={len(host)};h='{hashlib.sha256(host).hexdigest()}'\n"
            "for r,ds,fs in os.walk('/'):\n"
            "  ds[:]=[d for d in ds if r!='/' or d not in ('proc','sys','dev')]\n"
            "  for f in fs:\n"
            "    p=os.path.join(r,f)\n"
            "    try:\n"
            "      if os.path.isfile(p) and not os.path.islink(p) and os.path.getsize(p)==n and "
            "hashlib.sha256(open(p,'rb').read()).hexdigest()==h: print(p)\n"
            "    except OSError: pass\n"
            "print('secrets', os.path.exists('/run/secrets/cacert'))\n"
        )
        found = subprocess.run([docker_cli(), "run", "--rm", "--network", "none", "--entrypoint", "python3", tag,
                                "-c", finder], capture_output=True, text=True, check=True).stdout.split("\n")
        assert found[0] == "secrets False", found
        # no uv cache in the build, and the files no probe uses are not in the image (while what `import
        # torch` links is); the check runs in the image, so it also proves the image imports torch without them
        assert "--mount=type=cache" not in history
        look = ("import glob, os, site; sp = site.getsitepackages()[0]; g = lambda p: sorted(glob.glob(f'{sp}/{p}'))\n"
                "print(len(g('nvidia/*/lib/libcusolver*.so*')), len(g('nvidia/cudnn/lib/libcudnn_e*')),"
                " len(g('nvidia/cudnn/lib/libcudnn.so.9')), len(g('nvidia/cudnn/lib/libcudnn_graph.so.9')),"
                " len(g('nvidia_cutlass_dsl/cu12')), len(g('nvidia_cutlass_dsl/cu13')),"
                " len(glob.glob('/opt/cuda-wheels/nvidia/*/lib/libcublas*.so*')),"
                " len(glob.glob('/usr/local/cuda/include/cublas_v2.h')), os.path.isdir('/root/.cache/uv'),"
                " len(g('sgl_kernel/flash_ops*')), len(g('sgl_kernel/*/common_ops*')),"
                " 'sgl_kernel/flash_ops*.so' in open('/opt/stackprobe/removed').read())\n"
                "import torch; print(torch.__version__, torch.backends.cudnn.version() > 0)\n")
        seen = subprocess.run([docker_cli(), "run", "--rm", "--network", "none", "--entrypoint",
                               "/opt/venv/bin/python", tag, "-c", look], capture_output=True, text=True, check=True)
        assert seen.stdout.split("\n")[:2] == ["0 0 1 1 0 1 0 1 False 0 2 True", "2.14.1+cu130 True"], seen

        # second build: nothing changed, so no build is invoked and the record says so
        again = Docker(cli=docker_cli())
        assert build_cells(opts, again) == 0
        assert again.builds == 0
        rec2 = json.loads((tmp_path / "envs" / REAL / "build.json").read_text())
        assert rec2["status"] == "skipped-unchanged" and rec2["tag"] == tag
        assert rec2["versions"] == rec["versions"]

        # a checkout without the record (a fresh clone, or envs/ cleaned) finds the image under its digest tag:
        # it is not built again, and its self-check runs again for the record
        record.unlink()
        fresh = Docker(cli=docker_cli())
        assert build_cells(opts, fresh) == 0
        assert fresh.builds == 0
        rec3 = json.loads(record.read_text())
        assert rec3["status"] == "skipped-unchanged" and rec3["tag"] == tag and rec3["adopted"] is True
        assert rec3["versions"] == rec["versions"] and rec3["image_id"] == rec["image_id"]
        assert rec3["selfcheck"]["toolkit"]["compile_sm_120a"] == "ok"

        # a record whose image the tag does not name today (another checkout on this daemon built the tag again) is
        # not taken as it is: the image under the tag is adopted, self-checked again, and its id recorded
        stale = dict(rec3, image_id="sha256:" + "0" * 64)
        record.write_text(json.dumps(stale))
        other = Docker(cli=docker_cli())
        assert build_cells(opts, other) == 0
        assert other.builds == 0
        rec4 = json.loads(record.read_text())
        assert rec4["adopted"] is True and rec4["image_id"] == rec["image_id"] == other.image_id(tag)

        # the cell carries its kernels: vllm_comm compiled in a container of the image for 12.0a, then one
        # more layer under the same tag; a second pass compiles nothing and builds no layer
        kset = tmp_path / "kernels"
        said: list[str] = []
        [carried] = kernels.carry([rec3], {REAL: ("12.0a",)}, 1, tmp_path / "envs", lambda c, m: said.append(m),
                                  fresh, kernels_root=kset, cache=tmp_path / "cc", modules=("vllm_comm",))
        k = carried["kernels"]
        assert k["installed"] is True, k
        assert k["modules"]["vllm_comm"]["carried"] is True and k["modules"]["vllm_comm"]["sass"] == ["sm_120a"]
        assert carried["kernels_base"] == rec["image_id"] and carried["image_id"] != rec["image_id"]
        assert _labels(tag)[kernels.KERNELS_LABEL] == k["digest"] and _labels(tag)["org.stackprobe.cell"] == REAL
        # the layer names the image below it and the module's digest (its record and library, hashed here), so
        # `checks run` sees the image below the layer for a variant that loads no carried module
        folder = kset / REAL / "vllm_comm"
        rec_json = json.dumps(json.loads((folder / "stackprobe-kernel.json").read_text()), sort_keys=True)
        by_hand = hashlib.sha256(rec_json.encode() + b"\0" + (folder / "vllm_comm.so").read_bytes()).hexdigest()[:16]
        assert _labels(tag)["org.stackprobe.kernels.base"] == rec["image_id"]
        assert _labels(tag)["org.stackprobe.kernels.modules"] == f"vllm_comm={by_hand}"
        seen_env = DockerExecutor(tag).fingerprint()
        assert seen_env is not None and seen_env.of(()) == f"image {rec['image_id']}"
        assert seen_env.of(("vllm_comm",)) == f"image {rec['image_id']} kernels vllm_comm={by_hand}"
        on_disk = json.loads(record.read_text())
        assert on_disk["kernels"] == k and on_disk["image_id"] == carried["image_id"]
        inside = subprocess.run([docker_cli(), "run", "--rm", "--network", "none", "--entrypoint",
                                 "/opt/venv/bin/python", tag, "-c",
                                 "import glob, json; [r] = glob.glob('/opt/venv/lib/python3*/site-packages/flashinfer/"
                                 "data/aot/vllm_comm/stackprobe-kernel.json'); print(json.load(open(r))['arch_list'])"],
                                capture_output=True, text=True)
        assert inside.stdout.strip() == "12.0a", inside.stderr
        [again_k] = kernels.carry([on_disk], {REAL: ("12.0a",)}, 1, tmp_path / "envs", lambda c, m: said.append(m),
                                  fresh, kernels_root=kset, cache=tmp_path / "cc", modules=("vllm_comm",))
        assert again_k["image_id"] == carried["image_id"] and again_k["kernels"]["digest"] == k["digest"]
        # compiled once: one start line ("kernels: [1/1] vllm_comm for 12.0a") over both passes
        assert sum(m.startswith("kernels: [") and "] vllm_comm for 12.0a" in m for m in said) == 1, said
    finally:
        _rm(tag, before)


def test_mislabelled_cell_is_rejected_by_the_selfcheck(tmp_path: Path, base_image: str) -> None:
    """A catalog that wrongly says the registry's torch 2.9.1 is a CUDA 13.0 build: the cell resolves, the
    image builds (on the torch layer the default matrix's CUDA 12.8 cell has, when it is here), and the
    self-check fails it because the torch inside is CUDA 12.8."""
    cat = load_catalog()
    lying = replace(cat, torch=dict(cat.torch, **{"2.9.1": replace(cat.torch["2.9.1"], registry="cu130")}))
    r = resolve(Cell("13.0", "2.9.1", "none", "none"), lying)
    assert r.status == RESOLVED and r.indexes == ()
    envs = tmp_path / "envs"
    lock_cell(r, envs, uv_version())
    opts = BuildOptions(tmp_path / "unused.yaml", envs=envs, dockerfiles=tmp_path / "df", toolkit=False)
    docker = Docker(cli=docker_cli())
    rec = build_locked([envs / r.cell_id], opts, docker)[0]
    try:
        assert docker.builds == 1
        assert rec["status"] == "failed"
        assert "self-check: torch.version.cuda is 12.8, the cell is CUDA 13.0" in rec["reason"]
        assert rec["versions"]["torch_cuda"] == "12.8"
        assert docker.image_id(rec["tag"]) is None  # the wrong image does not keep a valid tag
        on_disk = json.loads((envs / r.cell_id / "build.json").read_text())
        assert on_disk["status"] == "failed" and on_disk["reason"] == rec["reason"]
    finally:
        _rm(rec.get("tag"))


def test_no_daemon_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch, docker_available: str) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-such.sock")
    with pytest.raises(SystemExit) as exc:
        main(["build", "--backend", "docker", "--only", REAL, "--no-reach-check", "--json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("provision: cannot talk to the Docker daemon") and err.count("\n") == 1, err
