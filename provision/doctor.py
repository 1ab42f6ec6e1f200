"""`provision doctor`: does this machine have what the main job needs, and how to fix what it lacks.

The main job (`provision build && checks run --all`) builds and runs its cells with one of two backends, and
doctor reports each:

- Docker images: a Docker engine it can talk to, a docker CLI that speaks BuildKit (the CA bundle as a build
  secret), debootstrap and an apt mirror for the registry-free base images (unless they are built already),
  disk for the images, and on a GPU host the GPUs inside containers (the NVIDIA container runtime behind
  ``--gpus``) and an unlimited memlock for NCCL and CUDA IPC.
- venv cells (virtual environments): uv (it locks and installs), a C compiler for the libcuda link stub that
  CUDA 13 cells' JIT modules link against, and disk for uv's cache, whose files the cells share.

It says which backend ``--backend auto`` takes here (Docker when its daemon answers, else venv cells) and
exits 0 when that backend can build: what a backend that will not be used lacks is information.

``gather`` looks at the machine (subprocesses, the file system); ``diagnose`` turns what it found into one
verdict per prerequisite with the fix (pure, tested with recorded facts).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from common import memlock
from common.api import plan_cells
from common.build import buildrecord
from provision import installer
from provision.baseimage import DEFAULT_TAG, DEV_TAG, apt_mirror
from provision.cellrecord import previous
from provision.dockercli import Docker, docker_cli
from provision.options import VENVS

GB = 1_000_000_000
# Docker images, measured on the default matrix's images (`docker history`, `docker system df -v`): a torch
# build's layers (uv, the CUDA toolkit wheels, torch and its CUDA wheels) are 4.5-5.5 GB shared by the cells on
# it, each cell adds 0.5-2.2 GB (sgl-kernel 1.2-1.5 GB of it, shared by the cells of one torch build and
# sgl-kernel); the build keeps no uv cache. The default matrix (3 torch builds, 5 cells, the base images) grew
# the Docker root by 19.8 GB built from nothing on a 2-core machine; this rule says 22.5 GB.
DISK_PER_TORCH = 5_500_000_000
DISK_PER_CELL = 1 * GB
DISK_BASE = 1 * GB
# venv cells: uv unpacks each wheel once into its cache and links the files into every venv that installs
# it (hard links on one file system), so a torch build's files count once however many cells use it.
# Measured here: a built torch 2.9.1+cu128 venv cell holds 8.7 GB, of which torch, triton and the CUDA 12
# wheels 6.6 GB, sgl-kernel 1.3 GB (shared by the cells of one torch build and sgl-kernel), cutlass-dsl
# 0.5 GB, flashinfer 0.1 GB; a CUDA 13 torch 2.11.0 cell without sgl-kernel unpacks to 5.4 GB in uv's
# cache. The default matrix's five venv cells on three torch builds grew the disk by 18.5 GB built from a
# cold cache on a 2-core machine; this rule says 19.5 GB.
VENV_PER_TORCH = 5_500_000_000
VENV_PER_CELL = 600_000_000
OK, WARN, FAIL, INFO = "ok", "warn", "FAIL", "info"
DOCKER, VENV, HOST = "docker", "venv", ""  # which backend a check is for ("": both)
TITLES = {DOCKER: "Docker images (--backend docker)", VENV: "venv cells, virtual environments (--backend venv)",
          HOST: "this host"}


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | FAIL | info
    detail: str
    fix: str = ""
    backend: str = HOST  # docker | venv | "" (both)

    def line(self, width: int = 24) -> str:
        fix = f" — fix: {self.fix}" if self.fix else ""
        return f"{self.status:<4}  {self.name:<{width}}  {self.detail}{fix}"


@dataclass(frozen=True)
class Facts:
    """What the machine showed. A None means the question could not be asked (the reason is beside it)."""

    docker_cli: str | None = None
    daemon_version: str | None = None
    daemon_error: str = ""
    buildkit: bool = False
    docker_root: str | None = None
    free_bytes: int | None = None
    debootstrap: str | None = None
    apt_mirror_error: str = ""  # "" when a Debian mirror is configured
    is_root: bool = True
    base_images: tuple[str, ...] = ()  # registry-free base images already present
    torch_stacks: int = 0  # distinct (CUDA, torch) pairs among the cells still to build
    cells_to_build: int = 0
    cells_total: int = 0
    gpus: int = 0
    gpu_error: str = ""  # why nvidia-smi found none
    runtimes: tuple[str, ...] = ()
    cdi_specs: tuple[str, ...] = ()
    probe_image: str | None = None  # a local image the container checks ran in
    gpu_in_container: str | None = None  # None: not tried; "": worked; else the error
    memlock_in_container: str | None = None  # None: not tried; "": worked; else the error
    uv: str | None = None  # the uv that locks and installs venv cells
    cc: str | None = None  # the C compiler that builds the libcuda link stub
    venv_root: str | None = None  # where the bytes of venv cells land (uv's cache)
    venv_free_bytes: int | None = None
    venv_torch_stacks: int = 0  # distinct torch builds among the venv cells still to build
    venv_cells_to_build: int = 0
    venv_copies: bool = False  # uv's cache and the venvs are on different file systems: files are copied
    notes: tuple[str, ...] = field(default_factory=tuple)


def need_bytes(f: Facts, backend: str = DOCKER) -> int:
    """Disk the cells still to build take with ``backend``, by the per-torch and per-cell sizes measured above."""
    if backend == VENV:
        return f.venv_torch_stacks * VENV_PER_TORCH + f.venv_cells_to_build * VENV_PER_CELL
    if not f.cells_to_build:
        return 0
    base = 0 if f.base_images else DISK_BASE
    return base + f.torch_stacks * DISK_PER_TORCH + f.cells_to_build * DISK_PER_CELL


def gb(n: int) -> str:
    """Bytes as a user reads them: 20 GB, 6.7 GB."""
    return f"{n / GB:.0f} GB" if n % GB == 0 or n >= 10 * GB else f"{n / GB:.1f} GB"


def _docker(f: Facts) -> list[Check]:
    return [replace(c, backend=DOCKER) for c in _engine(f)]


def _engine(f: Facts) -> list[Check]:
    if f.docker_cli is None:
        return [Check("docker CLI", FAIL, "not found",
                      "install Docker (Debian/Ubuntu: apt-get install docker.io)")]
    out = [Check("docker CLI", OK, f.docker_cli)]
    if f.daemon_version is None:
        denied = "permission denied" in f.daemon_error
        fix = ("add yourself to the docker group (usermod -aG docker $USER, then log in again)" if denied else
               "start the engine (systemctl start docker, or run dockerd as root)")
        out.append(Check("Docker engine", FAIL, f"not reachable: {f.daemon_error or 'no answer'}", fix))
        return out
    out.append(Check("Docker engine", OK, f"version {f.daemon_version}"))
    out.append(Check("BuildKit", OK, "the CLI builds with DOCKER_BUILDKIT=1 and --secret") if f.buildkit else
               Check("BuildKit", WARN, "this docker CLI cannot build with BuildKit: builds run without the "
                     "host's CA bundle",
                     "use a CLI that speaks BuildKit (Debian's docker.io, or install the buildx plugin)"))
    return out


def _base(f: Facts) -> Check:
    return replace(_debootstrap(f), backend=DOCKER)


def _debootstrap(f: Facts) -> Check:
    if f.base_images:
        return Check("debootstrap", OK, f"not needed now: base image(s) present ({', '.join(f.base_images)})")
    if f.debootstrap is None:
        return Check("debootstrap", FAIL, "not found; the registry-free base images are made with it",
                     "apt-get install debootstrap (or put nvidia/cuda:<ver>-devel-ubuntu24.04 images on this "
                     "machine and build with --base nvidia)")
    if f.apt_mirror_error:
        return Check("debootstrap", FAIL, f"{f.debootstrap}, but {f.apt_mirror_error}",
                     "configure a Debian mirror in /etc/apt/sources.list(.d)")
    if not f.is_root:
        return Check("debootstrap", FAIL, f"{f.debootstrap}, but it needs root to make a root file system",
                     "run `provision base` once as root")
    return Check("debootstrap", OK, f"{f.debootstrap} (the base images are made on the first build, about 1 min)")


def _disk(f: Facts) -> Check:
    need = need_bytes(f)
    what = (f"{f.cells_to_build} of {f.cells_total} cells still to build ({f.torch_stacks} torch build(s) of "
            f"{gb(DISK_PER_TORCH)} + {gb(DISK_PER_CELL)} per cell) need about {gb(need)}")
    if not f.cells_to_build:
        return Check("disk", OK, f"every cell of the matrix is built ({f.cells_total})", backend=DOCKER)
    if f.free_bytes is None:
        return Check("disk", INFO, f"{what}; free space under {f.docker_root or 'the Docker root'} unknown",
                     backend=DOCKER)
    free = f"{gb(f.free_bytes)} free under {f.docker_root}"
    if f.free_bytes < need:
        return Check("disk", FAIL, f"{free}; {what}",
                     "free space there (docker image prune; docker builder prune), or build fewer cells "
                     "(--only, --cuda)", backend=DOCKER)
    if f.free_bytes < need * 1.5:
        return Check("disk", WARN, f"{free}; {what}: little room left after", backend=DOCKER)
    return Check("disk", OK, f"{free}; {what}", backend=DOCKER)


def _venv(f: Facts) -> list[Check]:
    out = [Check("uv", OK, f"{f.uv} (locks the cells and installs them from its cache)", backend=VENV) if f.uv else
           Check("uv", FAIL, "not found; venv cells are locked and installed with it",
                 "install uv (pip install uv, or its standalone installer)", backend=VENV)]
    out.append(Check("C compiler", OK, f"{f.cc} (builds the libcuda link stub CUDA 13 cells' JIT modules link "
                     "against)", backend=VENV) if f.cc else
               Check("C compiler", WARN, "none (gcc, cc): CUDA 13 venv cells build, but their JIT modules compile "
                     "and do not link, so the fi-jit probes fail", "apt-get install gcc", backend=VENV))
    need = need_bytes(f, VENV)
    copies = "; uv's cache and the venvs are on different file systems, so each venv copies its files" \
        if f.venv_copies else ""
    if not f.venv_cells_to_build:
        out.append(Check("disk", OK, f"every cell of the matrix is built ({f.cells_total})", backend=VENV))
        return out
    what = (f"{f.venv_cells_to_build} of {f.cells_total} cells still to build ({f.venv_torch_stacks} torch "
            f"build(s) of {gb(VENV_PER_TORCH)} + {gb(VENV_PER_CELL)} per cell, the cells sharing uv's cache) "
            f"need about {gb(need)}{copies}")
    where = f.venv_root or "uv's cache"
    if f.venv_free_bytes is None:
        out.append(Check("disk", INFO, f"{what}; free space under {where} unknown", backend=VENV))
    elif f.venv_free_bytes < need:
        out.append(Check("disk", FAIL, f"{gb(f.venv_free_bytes)} free under {where}; {what}",
                         "free space there (provision prune; uv cache prune), or build fewer cells (--only, --cuda)",
                         backend=VENV))
    else:
        status = WARN if f.venv_free_bytes < need * 1.5 else OK
        after = ": little room left after" if status == WARN else ""
        out.append(Check("disk", status, f"{gb(f.venv_free_bytes)} free under {where}; {what}{after}",
                         backend=VENV))
    return out


def _gpu(f: Facts) -> list[Check]:
    if not f.gpus:
        return [Check("GPUs", INFO, f"none on this host ({f.gpu_error or 'nvidia-smi found none'}): GPU probes "
                      "will skip and compile probes still run")]
    out = [Check("GPUs", OK, f"{f.gpus} on the host")]
    runtime = "nvidia" in f.runtimes or bool(f.cdi_specs)
    how = "nvidia runtime" if "nvidia" in f.runtimes else f"CDI specs {', '.join(f.cdi_specs)}" if f.cdi_specs else ""
    toolkit_fix = ("install the NVIDIA Container Toolkit (nvidia-container-toolkit), run "
                   "`nvidia-ctk runtime configure --runtime=docker` and restart dockerd")
    if f.gpu_in_container is None:
        if not runtime:
            out.append(Check("GPUs in containers", FAIL, "the Docker engine has no NVIDIA runtime or CDI spec, so "
                             "--gpus cannot give containers the GPUs", toolkit_fix))
        else:
            out.append(Check("GPUs in containers", INFO, f"{how} present; not tried (no local image yet): run "
                             "`provision doctor` again after `provision build`"))
    elif f.gpu_in_container:
        out.append(Check("GPUs in containers", FAIL, f"docker run --gpus all failed: {f.gpu_in_container}",
                         toolkit_fix))
    else:
        out.append(Check("GPUs in containers", OK, f"docker run --gpus all {f.probe_image} sees them"))
    return out


def _memlock(f: Facts) -> Check:
    return replace(_container_memlock(f), backend=DOCKER)


def _container_memlock(f: Facts) -> Check:
    if f.memlock_in_container is None:
        return Check("memlock in containers", INFO, "not tried (no local image yet or no engine)")
    if f.memlock_in_container:
        return Check("memlock in containers", WARN, f"--ulimit memlock=-1 refused ({f.memlock_in_container}): runs "
                     "go on with the daemon's limit and say so", memlock.FIX)
    return Check("memlock in containers", OK, "unlimited, as the runs ask")


def _gpus(f: Facts) -> list[Check]:
    """GPUs on the host (both backends), then in containers (Docker's)."""
    host, *containers = _gpu(f)
    return [host, *(replace(c, backend=DOCKER) for c in containers)]


def diagnose(f: Facts) -> list[Check]:
    """One check per prerequisite: Docker's in the order a fix unblocks the next, then the venv cells', then
    the host's."""
    notes = [Check("note", INFO, n) for n in f.notes]
    docker = _docker(f) + ([_base(f)] if f.daemon_version is None else [_base(f), _disk(f)])
    gpus = _gpus(f)
    if f.daemon_version is not None:
        gpus.append(_memlock(f))
    return docker + _venv(f) + gpus + notes


def auto_backend(f: Facts) -> tuple[str, str]:
    """(the backend `--backend auto` takes here, why): Docker when its daemon answers, else venv cells."""
    if f.daemon_version is not None:
        return DOCKER, f"a Docker daemon answers (version {f.daemon_version})"
    why = "no docker CLI" if f.docker_cli is None else f.daemon_error or "no answer"
    return VENV, f"no Docker daemon answers ({why})"


def exit_code(checks: Sequence[Check], backend: str | None = None) -> int:
    """0 when nothing ``backend`` (or, when None, any backend) builds with failed, 1 otherwise. Warnings
    and notes never fail."""
    return 1 if any(c.status == FAIL and (backend is None or c.backend in (HOST, backend)) for c in checks) else 0


# --- gathering (side effects) --------------------------------------------------------------------------------
def _run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:240] if lines else ""


def _daemon_error(text: str) -> str:
    """The daemon's refusal in `docker run` output (which also holds the CLI's own chatter), in short."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = next((ln for ln in lines if "Error response from daemon" in ln), None) or _last_line(text)
    return memlock.daemon_reason(line.split("Error response from daemon:", 1)[-1])


def _matrix_needs(matrix: Path, envs: Path, docker: str) -> tuple[int, int, int]:
    """(cells still to build, distinct (CUDA, torch) pairs among them, resolved cells in all)."""
    cells = [c for c in plan_cells(matrix) if c.status == "resolved"]
    todo = []
    for c in cells:
        rec = previous(envs / c.cell_id)
        tag = rec.get("tag")
        built = buildrecord.runnable(rec) and tag and _run(
            [docker, "image", "inspect", "--format", "{{.Id}}", str(tag)], 30)
        if not (built and built.returncode == 0):
            todo.append(c)
    stacks = {(c.cuda, c.versions.get("torch", "")) for c in todo}
    return len(todo), len(stacks), len(cells)


def _venv_needs(matrix: Path, envs: Path) -> tuple[int, int]:
    """(venv cells still to build, torch builds among them that no built venv cell has in uv's cache)."""
    todo, present = [], set()
    for c in (c for c in plan_cells(matrix) if c.status == "resolved"):
        rec = previous(envs / c.cell_id, VENV)
        stack = (c.cuda, c.versions.get("torch", ""))
        if rec.get("backend") == "venv" and buildrecord.runnable(rec) and rec.get(
                "venv") and Path(str(rec["venv"])).is_dir():
            present.add(stack)
        else:
            todo.append(stack)
    return len(todo), len(set(todo) - present)


def _existing(path: Path) -> Path | None:
    return next((p for p in (path, *path.parents) if p.exists()), None)


def _venv_facts(matrix: Path, envs: Path, venvs: Path) -> dict[str, object]:
    """uv, the C compiler, and the disk where venv cells' bytes land (uv's cache)."""
    kw: dict[str, object] = {"cc": shutil.which("gcc") or shutil.which("cc")}
    uv = installer.uv()
    if uv is None:
        return kw
    version = _run([uv, "--version"], 30)
    words = version.stdout.split() if version and version.returncode == 0 else []
    kw["uv"] = f"{uv} ({' '.join(words[:2])})" if words else uv
    cache = _run([uv, "cache", "dir"], 30)
    root = Path(cache.stdout.strip()) if cache and cache.returncode == 0 and cache.stdout.strip() else None
    if root is not None and (here := _existing(root)) is not None:
        kw["venv_root"] = str(root)
        with contextlib.suppress(OSError):
            kw["venv_free_bytes"] = shutil.disk_usage(here).free
            other = _existing(venvs)
            kw["venv_copies"] = other is not None and other.stat().st_dev != here.stat().st_dev
    with contextlib.suppress(Exception):  # a broken matrix is `provision plan`'s to explain
        kw["venv_cells_to_build"], kw["venv_torch_stacks"] = _venv_needs(matrix, envs)
    return kw


def gather(matrix: Path, envs: Path, venvs: Path | None = None) -> Facts:
    """Ask the machine; every question that cannot be asked leaves its field at the default."""
    kw: dict[str, object] = {"debootstrap": shutil.which("debootstrap"), "is_root": os.geteuid() == 0,
                             **_venv_facts(matrix, envs, venvs or VENVS)}
    with contextlib.suppress(Exception):  # the cells of the matrix, whatever the backend
        kw["cells_total"] = sum(1 for c in plan_cells(matrix) if c.status == "resolved")
    try:
        apt_mirror()
    except Exception as exc:  # any reason: the check says it
        kw["apt_mirror_error"] = str(exc)
    smi = _run(["nvidia-smi", "-L"], 30)
    if smi is None:
        kw["gpu_error"] = "nvidia-smi not found"
    elif smi.returncode != 0:
        kw["gpu_error"] = _last_line(smi.stderr or smi.stdout) or f"nvidia-smi exited {smi.returncode}"
    else:
        kw["gpus"] = sum(1 for ln in smi.stdout.splitlines() if ln.startswith("GPU "))
    kw["cdi_specs"] = tuple(str(p) for d in ("/etc/cdi", "/var/run/cdi") for p in sorted(Path(d).glob("*nvidia*"))
                            if Path(d).is_dir())
    cli = docker_cli()
    if shutil.which(cli) is None and not os.path.exists(cli):
        return Facts(**kw)
    kw["docker_cli"] = cli
    info = _run([cli, "info", "--format", "{{.ServerVersion}}|{{.DockerRootDir}}|{{json .Runtimes}}"], 60)
    if info is None or info.returncode != 0:
        kw["daemon_error"] = _last_line(info.stderr) if info else "docker info timed out"
        return Facts(**kw)
    version, root, runtimes = (info.stdout.strip().split("|", 2) + ["", "", ""])[:3]
    kw["daemon_version"] = version
    kw["docker_root"] = root
    kw["runtimes"] = tuple(sorted(k for k in json.loads(runtimes or "{}")))
    with contextlib.suppress(OSError):  # a remote engine: its disk is not ours to measure
        kw["free_bytes"] = shutil.disk_usage(root).free
    kw["buildkit"] = Docker(cli=cli).buildkit()
    present = [t for t in (DEFAULT_TAG, DEV_TAG) if (p := _run([cli, "image", "inspect", t], 30)) and p.returncode == 0]
    kw["base_images"] = tuple(present)
    try:
        kw["cells_to_build"], kw["torch_stacks"], kw["cells_total"] = _matrix_needs(matrix, envs, cli)
    except Exception as exc:  # a broken matrix is `provision plan`'s to explain
        kw["notes"] = (f"matrix not read: {exc}",)
    image = present[0] if present else None
    if image:
        kw["probe_image"] = image
        ml = _run([cli, "run", "--rm", "--network", "none", "--ulimit", "memlock=-1:-1", image, "true"], 120)
        kw["memlock_in_container"] = "" if ml and ml.returncode == 0 else _daemon_error(
            ml.stderr if ml else "timed out")
        if kw.get("gpus"):
            g = _run([cli, "run", "--rm", "--network", "none", "--gpus", "all", image, "nvidia-smi", "-L"], 120)
            kw["gpu_in_container"] = "" if g and g.returncode == 0 else _daemon_error(
                (g.stderr or g.stdout) if g else "timed out")
    return Facts(**kw)


def report(checks: Sequence[Check], backend: str | None = None, why: str = "", auto: bool = True) -> list[str]:
    """The lines `provision doctor` prints: the checks under their backend, which backend builds here and
    why, then whether it is ready or what to fix first. ``backend`` None judges every check."""
    width = max(len(c.name) for c in checks)
    lines = []
    for group in (DOCKER, VENV, HOST):
        members = [c for c in checks if c.backend == group]
        if members:
            lines += [f"{TITLES[group]}:", *(f"  {c.line(width)}" for c in members)]
    if backend is None:
        failed = [c for c in checks if c.status == FAIL]
        lines.append(f"{len(failed)} problem(s) to fix before `provision build`" if failed else
                     "ready: `uv run provision build && uv run checks run --all`")
        return lines
    name = "Docker images" if backend == DOCKER else "venv cells"
    lines.append(f"`--backend auto` builds {name} here: {why}" if auto else f"--backend {backend}: {name}")
    failed = [c for c in checks if c.status == FAIL and c.backend in (HOST, backend)]
    other = sum(1 for c in checks if c.status == FAIL and c.backend not in (HOST, backend))
    aside = (f"; the {other} FAIL(s) under {TITLES[DOCKER if backend == VENV else VENV]} matter only for "
             f"--backend {DOCKER if backend == VENV else VENV}") if other else ""
    option = "" if auto else f" --backend {backend}"
    lines.append(f"{len(failed)} problem(s) to fix before `provision build{option}`" if failed else
                 f"ready: `uv run provision build{option} && uv run checks run --all{option}` ({name}){aside}")
    return lines


def to_json(checks: Sequence[Check], backend: str, why: str) -> dict[str, object]:
    """`provision doctor --json`: the backend that builds here and why, whether it can, and every check."""
    return {"backend": backend, "why": why, "ready": exit_code(checks, backend) == 0,
            "checks": [{"backend": c.backend or "host", "name": c.name, "status": c.status, "detail": c.detail,
                        "fix": c.fix} for c in checks]}
