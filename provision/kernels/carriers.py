"""Where a kernel job is built and its set installed: one carrier per backend behind one Protocol (Carrier), in
one registry (CARRIERS): a venv cell's interpreter, or a container of a Docker cell's image. Each runs the
kit's builder (``fi-carry``) in the cell and reads the cell's identity there; the CPU time of a container's
build is read from its cgroup."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from common.build import backend, kernellayer
from common.build.celltoolkit import base_env, cell_env
from common.build.kernellayer import BASE_LABEL, KERNELS_LABEL, MODULES_LABEL, modules_value
from common.caches import CODE_ROOT
from inenv import atomic, kernelprint, kit
from inenv.kit import CELL_ENV, COMPILE_CACHE_ENV
from inenv.kit import FI_CARRY_RESULT_PREFIX as RESULT_PREFIX
from provision.dockercli import Docker
from provision.kernels.jobs import Job, set_digest

JOB_LIMIT_S = 3 * 3600.0  # one module's build (trtllm_comm for three targets: about 45 min on 2 cores)

CODE_MOUNT = "/opt/stackprobe-code"

CACHE_MOUNT = "/opt/stackprobe-compile-cache"

OUT_MOUNT = "/opt/stackprobe-kernels"

# The CPU weight (cgroup cpu shares, of the default 1024) of a build container started by a stage that runs behind
# (niced: provision.kernels.detached): a container's processes are children of the container runtime, not of the
# `docker run` that asked for them, so they do not inherit its niceness; a weight this low lets the quick pass's
# containers, which have the default, go first, and the builds take what the quick pass leaves.
BEHIND_SHARES = 2


def behind() -> list[str]:
    """The `docker run` options that keep a build container behind the quick pass when this process runs niced."""
    try:
        niced = os.nice(0) > 0
    except OSError:
        niced = False
    return ["--cpu-shares", str(BEHIND_SHARES)] if niced else []


# The containers the stage's Docker builds run in (their cidfiles): a stopped stage kills them, since a
# container goes on when the `docker run` that started it is killed (provision.kernels.detached.stop_builds).
BUILDING: dict[Path, Docker] = {}
# Every build container of this process carries this label with the process's pid, so a stopped stage finds
# the ones whose `docker run` was still creating them when it was stopped, which no cidfile names yet.
STAGE_LABEL = "org.stackprobe.kernel-stage"
_BUILDS = threading.Lock()
_STOPPING = threading.Event()


def register(cidfile: Path, docker: Docker) -> bool:
    """Enter a build container about to start in :data:`BUILDING`; False once the stage is stopping (nothing new
    starts then: a worker whose build was just killed would otherwise start the next one)."""
    with _BUILDS:
        if _STOPPING.is_set():
            return False
        BUILDING[cidfile] = docker
        return True


def stopping() -> list[tuple[Path, Docker]]:
    """Refuse every build from now on (:func:`register`) and give the ones entered so far."""
    with _BUILDS:
        _STOPPING.set()
        return list(BUILDING.items())


def stage_label() -> str:
    return f"{STAGE_LABEL}={os.getpid()}"


def parse_result(stdout: str, rc: int, stderr: str) -> dict[str, Any]:
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            try:
                got = json.loads(line[len(RESULT_PREFIX):])
            except ValueError:
                break
            if isinstance(got, dict):
                return got
    tail = (stdout + stderr).strip().splitlines()[-3:]
    return {"ok": False, "reason_code": "harness-error", "line": f"the kernel builder exited {rc} without a result: "
            + " | ".join(tail)[-300:]}


def parse_identity(stdout: str, rc: int, stderr: str) -> dict[str, Any] | None:
    got = parse_result(stdout, rc, stderr)
    return got if "torch" in got else None


def identity_query(kernel_dir: Path) -> str:
    """The argument of the cell's identity query: each carried module's recorded source names."""
    wanted = {m: [str(n) for n in c.record.get("sources") or [] if isinstance(n, str)]
              for m, c in kit.kernel_set(kernel_dir).items()}
    return json.dumps(wanted, sort_keys=True)


class Carrier(Protocol):
    """Runs the kernel builder inside one built cell and installs a kernel set into it."""

    def compile(self, job: Job, out_dir: Path) -> dict[str, Any]: ...

    def running_cpu_s(self) -> float | None:
        """CPU seconds its builds running now have spent where this process cannot count them as its
        children's (a container's processes); 0.0 when it has none such, None when they cannot be read."""
        ...

    def identity(self, kernel_dir: Path) -> dict[str, Any] | None:
        """The cell's facts a carried record must match (``inenv.carry.identity``), read inside the cell;
        None when they cannot be read."""
        ...

    def install(self, kernel_dir: Path, rec: Mapping[str, Any]) -> dict[str, Any]:
        """Put the set into the cell; the record keys that change (a Docker cell: its image id)."""
        ...


def _env(rec: Mapping[str, Any], cache: Path | None, cell_id: str) -> dict[str, str]:
    out = {"PYTHONUNBUFFERED": "1", CELL_ENV: cell_id}
    if cache is not None:
        out[COMPILE_CACHE_ENV] = str(cache)
    return out


@dataclass(frozen=True)
class VenvCarrier:
    rec: Mapping[str, Any]
    cache: Path | None

    def running_cpu_s(self) -> float | None:
        return 0.0  # its builds are this process's descendants: tree_cpu_s counts them

    def _python_env(self) -> dict[str, str]:
        """The cell's environment, as its ranks get it: a full cell's from what its container would have of
        ours (no host NVCC_APPEND_FLAGS or CPATH changes what it compiles), an overlay cell's from its base's."""
        env = dict(os.environ) if self.rec.get("base_python") else base_env(os.environ)
        for name, value in cell_env(self.rec, os.environ, CODE_ROOT):
            if value:
                env[name] = value
            else:
                env.pop(name, None)
        return env | _env(self.rec, self.cache, str(self.rec.get("cell_id")))

    def compile(self, job: Job, out_dir: Path) -> dict[str, Any]:
        cmd = [str(self.rec["python"]), *kit.launch("fi-carry", job.module, "--archs", " ".join(job.archs),
                                                    "--out", str(out_dir), "--timeout", str(JOB_LIMIT_S))]
        try:
            proc = subprocess.run(cmd, cwd=CODE_ROOT, env=self._python_env(), capture_output=True, text=True,
                                  timeout=JOB_LIMIT_S + 120)
        except (OSError, subprocess.SubprocessError) as exc:
            return {"ok": False, "reason_code": "harness-error", "line": f"{type(exc).__name__}: {exc}"[:300]}
        return parse_result(proc.stdout, proc.returncode, proc.stderr)

    def identity(self, kernel_dir: Path) -> dict[str, Any] | None:
        cmd = [str(self.rec["python"]), *kit.launch("fi-carry", "--identity", identity_query(kernel_dir))]
        try:
            proc = subprocess.run(cmd, cwd=CODE_ROOT, env=self._python_env(), capture_output=True, text=True,
                                  timeout=300)
        except (OSError, subprocess.SubprocessError):
            return None
        return parse_identity(proc.stdout, proc.returncode, proc.stderr)

    def install(self, kernel_dir: Path, rec: Mapping[str, Any]) -> dict[str, Any]:
        proc = subprocess.run([str(self.rec["python"]), *kit.launch("aot-dir")], cwd=CODE_ROOT, env=self._python_env(),
                              capture_output=True, text=True, timeout=300)
        target = proc.stdout.strip()
        if proc.returncode != 0 or not target:
            raise OSError("the cell has no flashinfer AOT folder of its own (flashinfer-jit-cache installed, or "
                          "flashinfer not importable)")
        install_tree(kernel_dir, Path(target))
        return {}


def install_tree(kernel_dir: Path, target: Path) -> None:
    """Make ``target``'s carried modules exactly ``kernel_dir``'s: each library and record the reader accepts
    copied (atomically; read without following a link, so a link in the set never brings its target's bytes),
    a carried module missing from the set removed; modules without a record (not ours) stay."""
    wanted = kit.kernel_set(kernel_dir)
    for old in kit.kernel_set(target).values():
        if old.module not in wanted or wanted[old.module].name != old.name:
            shutil.rmtree(old.library.parent, ignore_errors=True)
    for c in wanted.values():
        copy_module(c, target / c.name)


def copy_module(c: kit.Carried, dest: Path) -> None:
    """One accepted module's library and record into ``dest`` (its folder), each read with O_NOFOLLOW."""
    data = kit.read_bytes(c.library, kit.MAX_LIBRARY_BYTES)
    if data is None:
        raise OSError(f"{c.library} is a link, not a plain file, or too large: not copied")
    if dest.is_symlink():  # a link where the module's folder goes: replaced, never written through
        dest.unlink()
    atomic.write_bytes(dest / f"{c.name}.so", data)
    atomic.write_json(dest / kit.KERNEL_RECORD, dict(c.record))


# Where a container's CPU time is kept: cgroup v1 (cpuacct.usage, nanoseconds) or v2 (cpu.stat usage_usec), under
# Docker's default cgroup parents (cgroupfs and systemd drivers).
_CGROUP_CPU = (("cpuacct/docker/{id}/cpuacct.usage", 1e-9), ("cpu,cpuacct/docker/{id}/cpuacct.usage", 1e-9),
               ("system.slice/docker-{id}.scope/cpu.stat", 1e-6), ("docker/{id}/cpu.stat", 1e-6))


def container_cpu_s(container_id: str, root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPU seconds a running container's processes have spent, from its cgroup; None when unreadable."""
    if not container_id.isalnum():
        return None
    for pattern, unit in _CGROUP_CPU:
        try:
            text = (root / pattern.format(id=container_id)).read_text()
        except OSError:
            continue
        if text.startswith("usage_usec"):
            text = text.split()[1]
        try:
            return int(text.split()[0]) * unit
        except (ValueError, IndexError):
            return None
    return None


@dataclass(frozen=True)
class DockerCarrier:
    rec: Mapping[str, Any]
    cache: Path | None
    docker: Docker
    running: dict[str, Path] = field(default_factory=dict)  # job -> the cidfile of its build's container

    def running_cpu_s(self) -> float | None:
        """The cgroups' CPU seconds of the containers building now; None when one exists and cannot be read."""
        total = 0.0
        for cidfile in list(self.running.values()):
            try:
                cid = cidfile.read_text().strip()
            except OSError:
                continue  # not started yet
            spent = container_cpu_s(cid)
            if spent is None:
                return None
            total += spent
        return total

    def compile(self, job: Job, out_dir: Path) -> dict[str, Any]:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="stackprobe-kernel-build-") as scratch:
            cidfile = Path(scratch) / "cid"
            if not register(cidfile, self.docker):  # a stopped stage kills the container too (stop_builds)
                return {"ok": False, "reason_code": "harness-error", "line": "the kernel stage was stopped"}
            self.running[job.module] = cidfile
            try:
                return self._compile(job, out_dir, cidfile)
            finally:
                self.running.pop(job.module, None)
                BUILDING.pop(cidfile, None)

    def _compile(self, job: Job, out_dir: Path, cidfile: Path) -> dict[str, Any]:
        args = ["run", "--rm", "--cidfile", str(cidfile), "--label", stage_label(), *behind(), "--network", "none",
                "-w", "/tmp",
                "-v", f"{CODE_ROOT / 'inenv'}:{CODE_MOUNT}/inenv:ro", "-v", f"{out_dir.resolve()}:{OUT_MOUNT}",
                "-e", f"PYTHONPATH={CODE_MOUNT}", "-e", "PYTHONDONTWRITEBYTECODE=1"]
        for name, value in _env(self.rec, None, str(self.rec.get("cell_id"))).items():
            args += ["-e", f"{name}={value}"]
        if self.cache is not None:
            self.cache.mkdir(parents=True, exist_ok=True)
            args += ["-v", f"{self.cache}:{CACHE_MOUNT}", "-e", f"{COMPILE_CACHE_ENV}={CACHE_MOUNT}"]
        image = str(self.rec.get("kernels_base") or self.rec.get("image_id") or self.rec["tag"])
        args += [image, "python", *kit.launch("fi-carry", job.module, "--archs", " ".join(job.archs),
                                              "--out", OUT_MOUNT, "--timeout", str(JOB_LIMIT_S))]
        try:
            proc = self.docker.run(*args, timeout=JOB_LIMIT_S + 300)
        except (OSError, subprocess.SubprocessError) as exc:
            return {"ok": False, "reason_code": "harness-error", "line": f"{type(exc).__name__}: {exc}"[:300]}
        return parse_result(proc.stdout, proc.returncode, proc.stderr)

    def identity(self, kernel_dir: Path) -> dict[str, Any] | None:
        image = str(self.rec.get("kernels_base") or self.rec.get("image_id") or self.rec["tag"])
        try:
            mount = f"{CODE_ROOT / 'inenv'}:{CODE_MOUNT}/inenv:ro"
            proc = self.docker.run("run", "--rm", "--network", "none", "-w", "/tmp", "-v", mount,
                                   "-e", f"PYTHONPATH={CODE_MOUNT}", image, "python",
                                   *kit.launch("fi-carry", "--identity", identity_query(kernel_dir)), timeout=300)
        except (OSError, subprocess.SubprocessError):
            return None
        return parse_identity(proc.stdout, proc.returncode, proc.stderr)

    def install(self, kernel_dir: Path, rec: Mapping[str, Any]) -> dict[str, Any]:
        """An image of the builder's image plus one layer holding the set, under the cell's tag."""
        base = str(rec.get("kernels_base") or rec.get("image_id") or "")
        tag = str(rec["tag"])
        if not base:
            raise OSError(f"no image id recorded for {tag}")
        probe = self.docker.run("run", "--rm", "--network", "none",
                                "-v", f"{CODE_ROOT / 'inenv'}:{CODE_MOUNT}/inenv:ro", "-e", f"PYTHONPATH={CODE_MOUNT}",
                                base, "python", *kit.launch("aot-dir"), timeout=300)
        target = probe.stdout.strip()
        if probe.returncode != 0 or not target.startswith("/"):
            raise OSError("the image has no flashinfer AOT folder of its own (flashinfer-jit-cache installed, or "
                          "flashinfer not importable)")
        with tempfile.TemporaryDirectory(prefix="stackprobe-kernel-layer-") as ctx:
            layer_context(kernel_dir, Path(ctx), base, target)
            proc = self.docker.run("build", "-q", "-t", tag, ctx, env=dict(os.environ, DOCKER_BUILDKIT="0"),
                                   timeout=1800)
        if proc.returncode != 0:
            raise OSError(f"docker build of the kernel layer exited {proc.returncode}: "
                          f"{(proc.stderr.strip().splitlines() or [''])[-1][:300]}")
        return {"kernels_base": base, "image_id": self.docker.image_id(tag)}


def layer_context(kernel_dir: Path, ctx: Path, base: str, target: str) -> None:
    """The build context of a Docker cell's kernel layer: the modules the kernel-set reader accepts, each
    library and record copied without following a link (never the set folder copied as it is), and the
    Dockerfile that puts them in the image's AOT folder ``target``, labelled with the set's digest and, where
    ``base`` is an image id, that id and each module's digest (common.build.kernellayer: what `checks run`
    compares, so a variant loading none of the modules keeps its results across the layer)."""
    for c in kit.kernel_set(kernel_dir).values():
        copy_module(c, ctx / "kernels" / c.name)
    (ctx / "kernels").mkdir(parents=True, exist_ok=True)
    labels = [f'{KERNELS_LABEL}="{set_digest(kernel_dir)}"']
    if kernellayer.is_image_id(base):
        labels += [f'{BASE_LABEL}="{base}"',
                   f'{MODULES_LABEL}="{modules_value(kernelprint.module_digests(ctx / "kernels"))}"']
    (ctx / "Dockerfile").write_text(f"FROM {base}\nCOPY kernels/ {target}/\nLABEL {' '.join(labels)}\n")


CARRIERS: dict[str, Callable[[Mapping[str, Any], Path | None, Docker], Carrier]] = {
    backend.VENV: lambda rec, cache, docker: VenvCarrier(rec, cache),
    backend.DOCKER: lambda rec, cache, docker: DockerCarrier(rec, cache, docker),
}
