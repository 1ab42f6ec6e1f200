"""The last stage of `provision build`: each built cell with flashinfer carries its comm modules, compiled for
the cell's declared GPU architectures (``kernel_archs`` in matrix.yaml, ``--kernel-archs``), so a GPU host
loads them instead of compiling (inenv.kit._carried, inenv.kit._fi_carry).

    plan (pure) -> compile into .cache/kernels/<cell>/ -> install into the cell -> the cell's record says so

Each module of a cell is one job: one build for the whole arch list, run inside the cell (its venv's
interpreter, or a container of its image) through the builder fi-jit uses and the shared compile cache, so
the same sources, flags and nvcc give one object whoever asks. A job whose kernel set already holds that
module for the same list, flashinfer and torch compiles nothing: a kernel set made on another machine and
copied into ``.cache/kernels/<cell>/`` (a GPU host given the CPU machine's folder) is installed as it is.
Jobs run ``--jobs`` at a time, the longest first (fi-jit's declared build costs); the jobs of one build
(the same module, flashinfer, CUDA and list in several cells) run one after another, so the second finds
the first's library in the compile cache instead of holding a slot waiting for it.

Installing: a venv cell gets the set copied into flashinfer's AOT folder; a Docker cell gets an image of one
more layer (the set copied in), under the same tag, built from the image the builder made (its id is kept in
the record, so a new set replaces the layer instead of stacking another). The record's ``kernels`` key: the
list, per module carried or why not, the bytes carried.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from common import backend, buildrecord, kernelstage, reasons
from common.buildrecord import BuildStatus
from common.caches import CODE_ROOT, compile_cache_dir
from common.celltoolkit import base_env, cell_env
from common.home import CACHE_ROOT
from common.progress import Ticker, duration
from inenv import atomic, gpuarch, kit, lifetime
from inenv.kit import CELL_ENV, COMM_MODULES, COMPILE_CACHE_ENV
from inenv.kit import FI_CARRY_RESULT_PREFIX as RESULT_PREFIX
from inenv.probes.fi_jit import BUILD_COST, QUICK_MODULE
from provision.dockercli import Docker

# `provision build` carries the quick module in its own run (what `checks run`'s quick pass loads) and the
# long ones after it returns (`python -m provision.kernels JOB`, at the end of this file), so the first table
# does not wait for them
QUICK_MODULES = (QUICK_MODULE,)
LONG_MODULES = tuple(m for m in COMM_MODULES if m not in QUICK_MODULES)
KERNELS = CACHE_ROOT / "kernels"  # one kernel set per cell: <cell id>/<name>/<name>.so + record
STAGE_TICK_S = 30.0  # the kernel stage says where it is at least this often: no silence of a minute
JOB_LIMIT_S = 3 * 3600.0  # one module's build (trtllm_comm for three targets: about 45 min on 2 cores)
CODE_MOUNT = "/opt/stackprobe-code"
CACHE_MOUNT = "/opt/stackprobe-compile-cache"
OUT_MOUNT = "/opt/stackprobe-kernels"
KERNELS_LABEL = "org.stackprobe.kernels"


@dataclass(frozen=True)
class Job:
    cell_id: str
    module: str
    archs: tuple[str, ...]
    flashinfer: str
    torch_cuda: str
    cost: float

    @property
    def build(self) -> tuple[str, ...]:
        """What cells share: the module, flashinfer, CUDA and arch list (the compile cache does the rest)."""
        return (self.module, self.flashinfer, self.torch_cuda, *self.archs)


def plan(cells: Sequence[Mapping[str, Any]], modules: Sequence[str] = COMM_MODULES) -> list[list[Job]]:
    """The jobs of every cell that has flashinfer and a non-empty arch list, grouped by build, the longest
    group first (pure). ``cells``: cell id, flashinfer version, torch's CUDA, arch list."""
    costs = dict(BUILD_COST)
    groups: dict[tuple[str, ...], list[Job]] = {}
    for c in cells:
        if c.get("flashinfer") in (None, "", "none") or not c.get("archs"):
            continue
        for module in modules:
            job = Job(str(c["cell_id"]), module, tuple(c["archs"]), str(c["flashinfer"]), str(c.get("torch_cuda")),
                      costs.get(module, 0.0) * len(c["archs"]))
            groups.setdefault(job.build, []).append(job)
    return sorted(groups.values(), key=lambda g: -g[0].cost)


def facts_for(job: Job, identity: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What a carried ``job.module`` must have been built from to be current for the cell (``kit.KERNEL_IDENTITY``):
    the cell's facts as its identity query read them, the job's flashinfer and target list; None when the
    cell's identity is unknown (then nothing is current: the module is built)."""
    if not isinstance(identity, Mapping):
        return None
    hashes = identity.get("source_hash") if isinstance(identity.get("source_hash"), Mapping) else {}
    return {"flashinfer": job.flashinfer, "torch": identity.get("torch"), "torch_cuda": identity.get("torch_cuda"),
            "nvcc": identity.get("nvcc"), kit.TVM_FFI: identity.get(kit.TVM_FFI),
            "declared": " ".join(job.archs), "source_hash": hashes.get(job.module)}


def current(kernel_dir: Path, job: Job, identity: Mapping[str, Any] | None) -> tuple[kit.Carried | None, str]:
    """The module of ``job`` in the kernel set when everything that decides its bytes is the cell's (flashinfer,
    torch with its CUDA build, nvcc, apache-tvm-ffi, the declared target list, the module's sources) and its SASS
    answers every declared target flashinfer's gate did not refuse, with "" ; else None and which fact differed
    (or why the set holds none)."""
    found = kit.kernel_set(kernel_dir).get(job.module)
    if found is None:
        return None, "not in the kernel set"
    facts = facts_for(job, identity)
    if facts is None:
        return None, "the cell's identity (torch, nvcc, sources) could not be read"
    why = kit.differs(found.record, facts) or uncovered(found, job.archs)
    return (None, why) if why else (found, "")


def uncovered(found: kit.Carried, archs: Sequence[str]) -> str:
    """The first declared target that the module's recorded SASS does not answer (none of the SASS flashinfer
    compiles that target into, gpuarch.flashinfer_sass) and that flashinfer's gate did not refuse, said as
    ``sass: sm_90a wanted for 9.0a, sm_75 in the record``; "" when every target is answered."""
    have = set(found.sass)
    for arch in archs:
        if arch in found.refused:
            continue
        try:
            wanted = gpuarch.flashinfer_sass(gpuarch.parse_target(arch))
        except gpuarch.TargetError:
            return f"declared target {kit.visible(arch)} is not a GPU architecture"
        if not wanted & have:
            shown = ", ".join(kit.visible(s) for s in found.sass) or "none"
            return f"sass: {' or '.join(sorted(wanted))} wanted for {arch}, {shown} in the record"
    return ""


def known_failure(rec: Mapping[str, Any], job: Job) -> dict[str, Any] | None:
    """The answer the cell's last kernel stage gave for ``job`` when the module was not carried for a reason
    of the cell's own (no nvcc, a module this flashinfer lacks, an architecture gate) and nothing it was
    decided from has changed: the cell is unchanged since (its build was skipped) and the list is the same.
    None otherwise: a failure of stackprobe's own (the reason catalogue's ``harness`` flag: the builder's
    error, a time-out) is always tried again."""
    kernels = rec.get("kernels")
    if BuildStatus.of(rec) is not BuildStatus.UNCHANGED or not isinstance(kernels, Mapping):
        return None
    row = (kernels.get("modules") or {}).get(job.module) if isinstance(kernels.get("modules"), Mapping) else None
    if (kernels.get("arch_list") != " ".join(job.archs) or not isinstance(row, Mapping)
            or row.get("carried") is not False):
        return None
    code = str(row.get("reason_code") or "")
    if not code or retried(code):
        return None
    return {"ok": False, "reason_code": code, "line": row.get("line"), "from": "the cell's last kernel stage"}


def retried(code: str) -> bool:
    """Whether a module not carried for ``code`` is built again by the next kernel stage: the one rule for
    what is tried again, the catalogue's ``harness`` flag (stackprobe's own failure), and any code the
    catalogue does not know."""
    catalogue = reasons.default()
    return code in catalogue.harness_codes or catalogue.get(code) is None


def ready_answer(kernel_dir: Path, job: Job, rec: Mapping[str, Any],
                 identity: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, str]:
    """What a job answers without compiling: the module its kernel set holds for the same inputs, or the
    cell's own known failure; None when it must be built, with why (the fact that differed)."""
    have, why = current(kernel_dir, job, identity)
    if have is not None:
        return {"ok": True, "name": have.name, "sass": have.sass, "from": "kernel set", "refused": have.refused,
                "library_bytes": have.library.stat().st_size}, ""
    if (lacking := no_nvcc(identity)) is not None:
        return lacking, why
    return known_failure(rec, job), why


def no_nvcc(identity: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The answer of every module of a cell whose identity query found no nvcc where flashinfer looks for one
    (a CUDA 12 cell from the registry ships none): nothing can compile there, so no build is started for it
    and its row says why. None when the cell has an nvcc or its identity is unknown."""
    if not isinstance(identity, Mapping) or identity.get("nvcc") or not identity.get("nvcc_error"):
        return None
    error = " ".join(str(identity.get("nvcc_error")).split())[:300]
    return {"ok": False, "reason_code": "fi-no-nvcc", "line": f"no nvcc in this cell ({error}): nothing to compile "
            "with, so no build was started", "from": "the cell's identity"}


def set_digest(kernel_dir: Path) -> str:
    """A digest of a kernel set's records (each names its library's build); "" for an empty set."""
    carried = kit.kernel_set(kernel_dir).values()
    recs = sorted((c.name, json.dumps(dict(c.record), sort_keys=True)) for c in carried)
    return hashlib.sha256(json.dumps(recs).encode()).hexdigest()[:16] if recs else ""


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
        """The cell's facts a carried record must match (``_fi_carry.identity``), read inside the cell;
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
            self.running[job.module] = cidfile
            BUILDING[cidfile] = self.docker  # a stopped stage kills the container too (stop_builds)
            try:
                return self._compile(job, out_dir, cidfile)
            finally:
                self.running.pop(job.module, None)
                BUILDING.pop(cidfile, None)

    def _compile(self, job: Job, out_dir: Path, cidfile: Path) -> dict[str, Any]:
        args = ["run", "--rm", "--cidfile", str(cidfile), "--network", "none", "-w", "/tmp",
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
    Dockerfile that puts them in the image's AOT folder ``target``."""
    for c in kit.kernel_set(kernel_dir).values():
        copy_module(c, ctx / "kernels" / c.name)
    (ctx / "kernels").mkdir(parents=True, exist_ok=True)
    (ctx / "Dockerfile").write_text(
        f"FROM {base}\nCOPY kernels/ {target}/\nLABEL {KERNELS_LABEL}=\"{set_digest(kernel_dir)}\"\n")


CARRIERS: dict[str, Callable[[Mapping[str, Any], Path | None, Docker], Carrier]] = {
    backend.VENV: lambda rec, cache, docker: VenvCarrier(rec, cache),
    backend.DOCKER: lambda rec, cache, docker: DockerCarrier(rec, cache, docker),
}


def torch_of(rec: Mapping[str, Any]) -> str | None:
    return (rec.get("versions") or {}).get("torch")


def cell_identity(rec: Mapping[str, Any], carrier: Carrier, kernel_dir: Path) -> dict[str, Any] | None:
    """The cell's identity facts: those its last kernel stage read when neither the cell (its build was
    skipped) nor its kernel set has changed since, else read again inside the cell."""
    prev = rec.get("kernels") if isinstance(rec.get("kernels"), Mapping) else {}
    stored = prev.get("identity")
    if (BuildStatus.of(rec) is BuildStatus.UNCHANGED and isinstance(stored, Mapping)
            and prev.get("digest") == set_digest(kernel_dir)):
        return dict(stored)
    return carrier.identity(kernel_dir)


def pending(records: Sequence[dict[str, Any]], archs_of: Mapping[str, tuple[str, ...]], docker: Docker | None = None,
            kernels_root: Path | None = None, cache: Path | None = None, modules: Sequence[str] = COMM_MODULES,
            carriers: Mapping[str, Carrier] | None = None) -> list[Job]:
    """The jobs :func:`carry` would build (no current module in the kernel set, no kept failure of the cell's
    own), compiling nothing: what decides whether the long modules need a stage at all."""
    kernels_root = kernels_root or KERNELS
    built = {str(r["cell_id"]): r for r in records if buildrecord.runnable(r)}
    rows = [{"cell_id": cid, "flashinfer": (r.get("versions") or {}).get("flashinfer"),
             "torch_cuda": (r.get("versions") or {}).get("torch_cuda"), "archs": archs_of.get(cid, ())}
            for cid, r in built.items()]
    jobs = [j for g in plan(rows, modules) for j in g]
    cells = sorted({j.cell_id for j in jobs})
    carriers = dict(carriers) if carriers is not None else {
        cid: CARRIERS[str(built[cid].get("backend") or backend.DOCKER)](built[cid], cache, docker or Docker())
        for cid in cells}
    identities = {cid: cell_identity(built[cid], carriers[cid], kernels_root / cid) for cid in cells}
    return [j for j in jobs
            if ready_answer(kernels_root / j.cell_id, j, built[j.cell_id], identities[j.cell_id])[0] is None]


def prune(kernel_dir: Path, rec: Mapping[str, Any], archs: tuple[str, ...],
          identity: Mapping[str, Any] | None) -> list[str]:
    """Remove from a cell's kernel set every module whose record is not the cell's (whichever part of the
    stage builds it again), so what is installed is only ever the cell's own; a line per module removed, with why.
    Nothing is removed while the cell's facts are unknown (the cell then refuses it at run time)."""
    if identity is None:
        return []
    versions = rec.get("versions") or {}
    out = []
    for module, c in sorted(kit.kernel_set(kernel_dir).items()):
        job = Job(str(rec.get("cell_id")), module, archs, str(versions.get("flashinfer")),
                  str(versions.get("torch_cuda")), 0.0)
        have, why = current(kernel_dir, job, identity)
        if have is None and why:
            shutil.rmtree(c.library.parent, ignore_errors=True)
            out.append(f"kernels: {module} in the kernel set is not this cell's ({why}): removed, built again")
    return out


def carry(records: Sequence[dict[str, Any]], archs_of: Mapping[str, tuple[str, ...]], jobs: int, envs: Path,
          report: Callable[[str, str], None], docker: Docker | None = None,
          kernels_root: Path | None = None, cache: Path | None = None,
          modules: Sequence[str] = COMM_MODULES, carriers: Mapping[str, Carrier] | None = None,
          tick_s: float = STAGE_TICK_S) -> list[dict[str, Any]]:
    """Compile and install every built cell's kernels; each record gains ``kernels`` (and is rewritten).
    ``carriers``: one per cell id, instead of the backend's (tests)."""
    kernels_root = kernels_root or KERNELS
    cache = cache if cache is not None else compile_cache_dir(None, False)
    built = {str(r["cell_id"]): r for r in records if buildrecord.runnable(r)}
    rows = [{"cell_id": cid, "flashinfer": (r.get("versions") or {}).get("flashinfer"),
             "torch_cuda": (r.get("versions") or {}).get("torch_cuda"), "archs": archs_of.get(cid, ())}
            for cid, r in built.items()]
    groups = plan(rows, modules)
    if not groups:
        return list(records)
    planned = {j.cell_id for g in groups for j in g}
    carriers = dict(carriers) if carriers is not None else {
        cid: CARRIERS[str(r.get("backend") or backend.DOCKER)](r, cache, docker or Docker())
        for cid, r in built.items() if cid in planned}
    identities = {cid: cell_identity(built[cid], carriers[cid], kernels_root / cid) for cid in sorted(planned)}
    for cid in sorted(planned):  # a set copied in is installed only as far as it is this cell's
        for why in prune(kernels_root / cid, built[cid], archs_of.get(cid, ()), identities[cid]):
            report(cid, why)
    digests = {cid: set_digest(kernels_root / cid) for cid in planned}
    answered: dict[tuple[str, str], dict[str, Any]] = {}
    for job in (j for g in groups for j in g):
        answer, why = ready_answer(kernels_root / job.cell_id, job, built[job.cell_id], identities[job.cell_id])
        if answer is not None:
            answered[(job.cell_id, job.module)] = answer
        elif why != "not in the kernel set":
            report(job.cell_id, f"kernels: {job.module} is built again: {why}")
    todo = [j for g in groups for j in g if (j.cell_id, j.module) not in answered]
    def live() -> float | None:
        spent = [carriers[c].running_cpu_s() for c in sorted({j.cell_id for j in todo})]
        return None if any(v is None for v in spent) else sum(v for v in spent if v is not None)

    progress = StageProgress(todo, jobs, learned_costs(envs), live)
    report("", f"kernels: {len(todo)} module build(s) in {len({j.cell_id for j in todo})} cell(s), "
               f"{jobs} at a time, longest first; {progress.left_text()}")
    results: dict[tuple[str, str], dict[str, Any]] = {}
    lock = threading.Lock()

    def one(job: Job) -> None:
        kernel_dir = kernels_root / job.cell_id
        got = answered.get((job.cell_id, job.module))
        if got is None:
            progress.begin(job)
            report(job.cell_id, f"kernels: {progress.position(job)} {job.module} for {' '.join(job.archs)}")
            t0 = time.monotonic()
            try:
                got = carriers[job.cell_id].compile(job, kernel_dir)
            finally:
                progress.end(job)
            got.setdefault("wall_s", round(time.monotonic() - t0, 1))
            built = len(str(got.get("arch_list") or "").split()) if got.get("ok") else None
            progress.spent(float(got.get("compile_cpu_s") or 0.0) if not got.get("cached") else 0.0, job, built)
            if not got.get("ok"):
                _drop(kernel_dir, job.module)
            refused = got.get("refused") or {}
            gate = (f"; refused by flashinfer's gate: {', '.join(sorted(refused))} "
                    f"({'; '.join(sorted({str(v.get('reason_code')) for v in refused.values()}))})"
                    if isinstance(refused, Mapping) and refused else "")
            report(job.cell_id, f"kernels: {job.module} " + (
                f"carried for {got.get('arch_list')} ({got.get('library_bytes', 0) / 1e6:.1f} MB, "
                f"{got.get('wall_s')} s){gate}" if got.get("ok")
                else f"not carried: {got.get('reason_code')}: {got.get('line', '')}{gate}"))
        with lock:
            results[(job.cell_id, job.module)] = got

    t0 = time.monotonic()
    with Ticker(lambda line: report("", line), tick_s) as ticker, \
            ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        if todo:
            ticker.start("kernels", lambda elapsed: progress.tick_line(elapsed))
        for f in [pool.submit(lambda g=g: [one(j) for j in g]) for g in groups]:
            f.result()
        ticker.stop("kernels")
    stage_s = round(time.monotonic() - t0, 1)
    for cid in sorted(planned):  # a set that changed is judged by the facts of what it now holds, next time
        if set_digest(kernels_root / cid) != digests[cid]:
            identities[cid] = carriers[cid].identity(kernels_root / cid)
    out = []
    for r in records:
        cid = str(r.get("cell_id"))
        if cid not in built or not archs_of.get(cid) or not any(k[0] == cid for k in results):
            out.append(r)
            continue
        out.append(finish(r, carriers[cid], envs / cid, kernels_root / cid, archs_of[cid],
                          {m: v for (c, m), v in results.items() if c == cid}, report, stage_s,
                          identities.get(cid)))
    return out


def learned_costs(envs: Path) -> dict[str, float]:
    """CPU seconds per target of each module, as this host's earlier kernel stages measured them (the build
    records under ``envs``, read by the one reader): the mean over every build that compiled (a cached or
    reused one is left out)."""
    seen: dict[str, list[float]] = {}
    for folder in sorted(p for p in envs.iterdir() if p.is_dir()) if envs.is_dir() else ():
        read: set[Path] = set()
        for of in backend.RECORD_NAMES:
            loaded = buildrecord.read(folder, of)
            if loaded.record is None or loaded.path in read:  # a venv cell's build.json is read once
                continue
            read.add(loaded.path)
            for module, per_target in loaded.record.compile_costs.items():
                seen.setdefault(module, []).append(per_target)
    return {m: sum(v) / len(v) for m, v in seen.items()}


def tree_cpu_s(pid: int | None = None) -> float:
    """CPU seconds of this process's children: those that ended (their whole trees, as each waited for its
    own) and every live descendant so far, read from /proc; what runs in a container is not ours to read."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = usage.ru_utime + usage.ru_stime
    root = pid or os.getpid()
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    ours = {root}
    changed = True
    while changed:
        changed = False
        for p, parent in parents.items():
            if parent in ours and p not in ours:
                ours.add(p)
                changed = True
    return total + sum(times[p] for p in ours if p != root and p in times)


OVERRUN = 0.25  # a build past its estimate is taken to be this fraction of what it has spent from its end


class StageProgress:
    """What the kernel stage says while it runs: which module and target of how many is compiling, the CPU
    seconds spent, and the time left. A job's cost is, first, what this stage measured for its module (CPU
    seconds per target of the builds that finished in it), else this host's earlier builds (``learned``), else
    fi-jit's declared cost (a prior) scaled by how this stage's builds compared with their own estimates.

    The time left moves smoothly: a running build counts what it has spent (the stage's CPU seconds less the
    ended builds', shared among the running ones by how long each has run), and one past its estimate counts
    :data:`OVERRUN` of what it has spent as still to come, so its share grows while it overruns; such a build
    also scales the declared costs of the rest as a finished one would, from the estimate it started with, so
    its end changes the scale by no more than its last seconds did."""

    def __init__(self, todo: Sequence[Job], jobs: int, learned: Mapping[str, float],
                 live: Callable[[], float | None] = lambda: 0.0) -> None:
        self.live = live  # CPU seconds of running builds outside this process's tree (None: unreadable)
        self.todo, self.jobs, self.learned = list(todo), max(1, jobs), dict(learned)
        self.declared = dict(BUILD_COST)  # CPU seconds per target fi-jit declares for each module
        self.index = {(j.cell_id, j.module): i + 1 for i, j in enumerate(self.todo)}
        self.running: dict[tuple[str, str], float] = {}
        self.finished: set[tuple[str, str]] = set()
        self.measured: dict[str, list[float]] = {}  # module -> CPU seconds per target, this stage's builds
        self.scale_pairs: list[tuple[float, float]] = []  # (estimated, measured) CPU seconds of finished builds
        self.started_at: dict[tuple[str, str], float] = {}  # each running build's estimate when it began
        self.cpu0 = tree_cpu_s()
        self.reported_cpu = 0.0
        self.lock = threading.Lock()

    def scale(self, overrun: Sequence[tuple[float, float]] = ()) -> float | None:
        """Measured over estimated CPU seconds of the builds that finished in this stage and of the running ones
        past their estimate (``overrun``: (estimate, spent so far)); before either, this host's earlier builds
        over fi-jit's declared costs for the same modules (the quick module built in ``provision build`` gives
        one); None when neither exists."""
        pairs = [*self.scale_pairs, *overrun]
        estimated = sum(e for e, _ in pairs)
        if estimated > 0:
            return sum(m for _, m in pairs) / estimated
        both = [(self.declared[m], per) for m, per in self.learned.items() if self.declared.get(m, 0.0) > 0]
        declared = sum(d for d, _ in both)
        return sum(per for _, per in both) / declared if declared > 0 else None

    def cost(self, job: Job, factor: float | None = None) -> tuple[float, bool]:
        """(CPU seconds this job should take, whether from this host's own builds: this stage's or earlier);
        ``factor``: the declared costs' scale (default: :meth:`scale` of the finished builds)."""
        seen = self.measured.get(job.module)
        if seen:
            return sum(seen) / len(seen) * len(job.archs), True
        per = self.learned.get(job.module)
        if per is not None:
            return per * len(job.archs), True
        factor = self.scale() if factor is None else factor
        return job.cost * (factor if factor is not None else 1.0), False

    def begin(self, job: Job) -> None:
        estimate = self.cost(job)[0]
        with self.lock:
            self.running[(job.cell_id, job.module)] = time.monotonic()
            self.started_at[(job.cell_id, job.module)] = estimate

    def end(self, job: Job) -> None:
        with self.lock:
            self.running.pop((job.cell_id, job.module), None)
            self.finished.add((job.cell_id, job.module))

    def spent(self, cpu_s: float, job: Job | None = None, built: int | None = None) -> None:
        """A build ended having spent ``cpu_s`` compiling (0 for a cached one) on ``built`` of ``job``'s targets
        (all of them when None; fewer when flashinfer's gate refused some); the measurement then serves the
        jobs still to come."""
        with self.lock:
            self.reported_cpu += cpu_s
            if job is None or cpu_s <= 0 or not job.archs:
                return
            targets = min(built, len(job.archs)) if built else len(job.archs)
            began = self.started_at.pop((job.cell_id, job.module), None)
            estimate = (self.cost(job)[0] if began is None else began) * targets / len(job.archs)
            self.measured.setdefault(job.module, []).append(cpu_s / targets)
            if estimate > 0:
                self.scale_pairs.append((estimate, cpu_s))

    def position(self, job: Job) -> str:
        return f"[{self.index.get((job.cell_id, job.module), 0)}/{len(self.todo)}]"

    def cpu_s(self, running: float | None) -> float:
        """CPU seconds the stage's compiles spent so far: read from /proc where the builds are our processes,
        else (builds in containers) as each finished build reported it plus ``running``, what the running
        containers' cgroups say (``live()``, read once by the caller)."""
        return max(tree_cpu_s() - self.cpu0, self.reported_cpu + (running or 0.0))

    def spent_by_running(self, running_cpu: float | None, now: float) -> dict[tuple[str, str], float]:
        """CPU seconds each running build has spent: the stage's CPU seconds (``running_cpu``: the running
        containers' reading, as :meth:`cpu_s` takes it) less what the ended builds reported, shared by how long
        each has run; with no reading, each build's wall seconds (one core each)."""
        with self.lock:
            walls = {k: max(0.0, now - t) for k, t in self.running.items()}
        if running_cpu is None or not walls:
            return walls
        spent = max(0.0, self.cpu_s(running_cpu) - self.reported_cpu)
        total = sum(walls.values())
        return {k: spent * w / total if total > 0 else spent / len(walls) for k, w in walls.items()}

    def left_s(self, running_cpu: float | None = 0.0) -> tuple[float, str]:
        """Seconds left (the jobs not finished, less what the running ones have spent, over the parallel
        slots) and what the estimate stands on (``running_cpu``: see :meth:`spent_by_running`)."""
        now = time.monotonic()
        done = self.spent_by_running(running_cpu, now)
        with self.lock:
            overrun = [(self.started_at[k], d) for k, d in done.items() if k in self.started_at
                       and d > self.started_at[k] > 0]
        factor = self.scale(overrun)
        total, own, prior = 0.0, 0, 0
        with self.lock:
            for j in self.todo:
                key = (j.cell_id, j.module)
                if key in self.finished:
                    continue
                cost, learned = self.cost(j, factor)
                own, prior = own + learned, prior + (not learned)
                if key in done:
                    cost = self.started_at.get(key, cost)
                    total += cost - done[key] if done[key] <= cost else OVERRUN * done[key]
                else:
                    total += cost
        declared = ("fi-jit's declared build costs: no build of these modules here yet" if factor is None else
                    f"fi-jit's declared build costs x{factor:.2f} as this stage's finished builds ran"
                    if self.scale_pairs else
                    f"fi-jit's declared build costs x{factor:.2f} as this stage's running builds past their "
                    "estimate ran" if overrun else
                    f"fi-jit's declared build costs x{factor:.2f} as this host's builds of "
                    f"{', '.join(sorted(self.learned))} ran")
        basis = ("by this host's earlier kernel builds" if not prior else
                 f"by {declared}" if not own else
                 f"by this host's builds for {own}, {declared} for {prior}")
        cores = max(1, min(self.jobs * 2, os.cpu_count() or 1))
        return total / cores, basis

    def left_text(self, running_cpu: float | None = 0.0) -> str:
        seconds, basis = self.left_s(running_cpu)
        if not self.todo:
            return "nothing to compile"
        return f"about {duration(seconds)} left ({basis})"

    def tick_line(self, elapsed: float) -> str:
        now = time.monotonic()
        with self.lock:
            running = sorted(self.running.items(), key=lambda kv: kv[1])
            done = len(self.finished)
        what = "; ".join(f"{self.position(self._job(k))} {k[1]} for {' '.join(self._job(k).archs)} in {k[0]} "
                         f"({duration(now - t)})" for k, t in running) or "between builds"
        running_cpu = self.live()
        spent = (f"{self.cpu_s(running_cpu):.0f} CPU-s spent by the builds that ended (a running container's "
                 f"could not be read), {duration(elapsed)} in" if running_cpu is None else
                 f"{self.cpu_s(running_cpu):.0f} CPU-s spent in {duration(elapsed)}")
        return f"kernels: {done}/{len(self.todo)} done, compiling {what}; {spent}; {self.left_text(running_cpu)}"

    def _job(self, key: tuple[str, str]) -> Job:
        return next(j for j in self.todo if (j.cell_id, j.module) == key)


def _drop(kernel_dir: Path, module: str) -> None:
    stale = kit.kernel_set(kernel_dir).get(module)
    if stale is not None:
        shutil.rmtree(stale.library.parent, ignore_errors=True)


def module_rows(rec: Mapping[str, Any]) -> tuple[str, ...]:
    """The modules a cell's build record has a kernel row for (carried or not, with why)."""
    summary = rec.get("kernels")
    mods = summary.get("modules") if isinstance(summary, Mapping) else None
    return tuple(str(m) for m in mods) if isinstance(mods, Mapping) else ()


def module_row(v: Mapping[str, Any], targets: int) -> dict[str, Any]:
    """One module's line of the record's ``kernels``: carried (for which targets, the targets flashinfer's gate
    refused and why) or why not; the compilers' CPU seconds when it compiled here (what later estimates learn)."""
    refused = v.get("refused") if isinstance(v.get("refused"), Mapping) else {}
    row: dict[str, Any] = ({"carried": True, "sass": v.get("sass"), "bytes": v.get("library_bytes"),
                            "arch_list": v.get("arch_list")} if v.get("ok")
                           else {"carried": False, "reason_code": v.get("reason_code"), "line": v.get("line")})
    if refused:
        row["refused"] = dict(refused)
    if not v.get("cached") and v.get("from") is None and v.get("compile_cpu_s"):
        row.update({"compile_cpu_s": v.get("compile_cpu_s"), "targets": targets})
    return row


def finish(rec: dict[str, Any], carrier: Carrier, folder: Path, kernel_dir: Path, archs: tuple[str, ...],
           modules: Mapping[str, Mapping[str, Any]], report: Callable[[str, str], None],
           stage_s: float = 0.0, identity: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Install the cell's set and rewrite its record with ``kernels``: per module whether it is carried (and
    for which targets), the compilers' CPU seconds this build spent on it (0 for a set reused or a cached
    build), the cell's identity facts the set was judged by; ``stage_s`` the kernel stage's wall time."""
    summary: dict[str, Any] = {
        "arch_list": " ".join(archs), "folder": str(kernel_dir), "digest": set_digest(kernel_dir),
        "stage_s": stage_s,
        "compile_cpu_s": round(sum(float(v.get("compile_cpu_s") or 0.0) for v in modules.values()
                                   if not v.get("cached") and v.get("from") != "kernel set"), 1),
        "bytes": sum(c.library.stat().st_size for c in kit.kernel_set(kernel_dir).values()),
        "modules": {m: module_row(v, len(archs)) for m, v in sorted(modules.items())}}
    prev_rows = (rec.get("kernels") or {}).get("modules") if isinstance(rec.get("kernels"), Mapping) else None
    if isinstance(prev_rows, Mapping) and (rec.get("kernels") or {}).get("arch_list") == summary["arch_list"]:
        # the other part of the stage (the quick module, or the long ones) keeps its rows
        summary["modules"] = dict(sorted({**{m: r for m, r in prev_rows.items() if m in COMM_MODULES},
                                          **summary["modules"]}.items()))
        summary["compile_cpu_s"] = round(summary["compile_cpu_s"] + sum(
            float(r.get("compile_cpu_s") or 0.0) for m, r in prev_rows.items()
            if isinstance(r, Mapping) and m not in modules), 1)
    if identity is not None:
        summary["identity"] = dict(identity)
    changed: dict[str, Any] = {}
    prev = rec.get("kernels") or {}
    if summary["digest"] and (prev.get("digest") != summary["digest"] or not prev.get("installed")):
        try:
            changed = carrier.install(kernel_dir, rec)
            summary["installed"] = True
        except (OSError, subprocess.SubprocessError) as exc:
            summary["installed"] = False
            summary["install_error"] = str(exc)[:300]
            report(str(rec.get("cell_id")), f"kernels: not installed: {exc}")
    else:
        summary["installed"] = bool(prev.get("installed")) if summary["digest"] else False
    new = {**rec, **changed, "kernels": summary}
    if folder.is_dir():
        atomic.write_json(folder / backend.RECORD_NAMES[str(rec.get("backend") or backend.DOCKER)], new, indent=1)
    return new


# --- the long modules after `provision build` returns (common.kernelstage): ``python -m provision.kernels JOB``
# ``JOB.json`` (written by provision.buildsession): the cells, their backend and target lists, the parallel
# builds, the modules, the envs folder. Each cell's record is read again (the quick stage just rewrote it), the
# modules are built and installed as `provision build --wait-kernels` builds them in its own run, and the lines
# it says go to the log the state file names, one event a line.
def start(job: dict[str, Any], folder: Path | None = None) -> kernelstage.Stage:
    """Take the folder's stage lock (kernelstage.StageBusy when another process holds it), write the job, start
    the stage's process (its own session: Ctrl-C in the terminal that started `provision build` does not reach
    it, and nothing waits on it; it inherits the lock and holds it until it ends) and record it in the state
    file (``folder``: common.kernelstage's, unless given). Nothing is written through a link: the job and the
    state are replaced by renames, the log opened with O_NOFOLLOW."""
    folder = (folder or kernelstage.FOLDER).absolute()
    lock = kernelstage.take_lock(folder)
    try:
        job_path = kernelstage.job_path(folder)
        atomic.write_text(job_path, json.dumps(job, indent=1))
        log_path = folder / kernelstage.LOG
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            proc = subprocess.Popen([sys.executable, "-m", kernelstage.MARKER, str(job_path)], cwd=CODE_ROOT,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, pass_fds=(lock,))
        finally:
            os.close(log)
        stage = kernelstage.Stage(proc.pid, time.time(), log_path, int(job.get("builds", 0)))
        kernelstage.write_state(stage, folder)
    finally:
        os.close(lock)  # the stage's own copy holds the lock from here
    return stage


# The containers the stage's Docker builds run in (their cidfiles): a stopped stage kills them, since a
# container goes on when the `docker run` that started it is killed.
BUILDING: dict[Path, Docker] = {}


def stop_builds(signum: int, folder: Path) -> None:
    """End every build the stage started and the stage itself: the containers of its Docker builds, then every
    process under it or in its process group (compilers included), stopped first so none forks away; its state
    file is removed and the stage exits with 128 + the signal's number. For SIGTERM and SIGINT."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    killed = 0
    for cidfile, docker in list(BUILDING.items()):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            cid = cidfile.read_text().strip()
            if cid and docker.run("kill", cid, timeout=60).returncode == 0:
                killed += 1
    group = os.getpgrp() if os.getpgrp() == os.getpid() else None  # its own session's group: none of the caller's
    killed += lifetime.end_below(os.getpid(), group)
    with contextlib.suppress(OSError, ValueError, RuntimeError):  # RuntimeError: a write of the stage's own cut
        sys.stdout.write(f"{time.strftime('%H:%M:%S')} kernels: the stage was stopped ({signal.Signals(signum).name}):"
                         f" {killed} build process(es) and container(s) ended with it\n")
        sys.stdout.flush()
    kernelstage.clear(os.getpid(), folder)
    os._exit(128 + signum)


def run(job: dict[str, Any], log: Any) -> int:
    lock = threading.Lock()

    def report(cid: str, msg: str) -> None:
        with lock:
            log.write(f"{time.strftime('%H:%M:%S')} {cid + ' ' if cid else ''}{msg}\n")
            log.flush()

    envs = Path(job["envs"])
    records = []
    for cid in job["cells"]:
        loaded = buildrecord.read(envs / cid, job["backend"])
        if loaded.record is not None:
            records.append(dict(loaded.record.data))
    archs = {cid: tuple(a) for cid, a in job["archs"].items()}
    t0 = time.monotonic()
    where = {k: Path(job[k]) for k in ("kernels_root", "cache") if job.get(k)}  # tests keep them in their folder
    done = carry(records, archs, int(job["jobs"]), envs, report, modules=tuple(job["modules"]), **where)
    carried = sum(1 for r in done for row in ((r.get("kernels") or {}).get("modules") or {}).values()
                  if isinstance(row, dict) and row.get("carried"))
    report("", f"kernels: the stage ended after {round(time.monotonic() - t0)} s; {carried} module(s) carried "
               "in its cells")
    return 0


def _main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m provision.kernels JOB.json\n")
        return 2
    folder = Path(argv[0]).parent
    for sig in (signal.SIGTERM, signal.SIGINT):  # stopping the stage stops what it started
        signal.signal(sig, lambda signum, frame: stop_builds(signum, folder))
    try:
        with contextlib.suppress(OSError):
            os.nice(10)  # the quick pass `checks run` answers with meanwhile comes first; its builds inherit this
        job = json.loads(Path(argv[0]).read_text())
        return run(job, sys.stdout)
    finally:
        kernelstage.clear(os.getpid(), folder)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
