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

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from common import backend, buildrecord
from common.buildrecord import BuildStatus
from common.caches import CODE_ROOT, compile_cache_dir
from common.celltoolkit import base_env, cell_env
from inenv import atomic
from inenv.kit import _carried
from inenv.kit._compile_cache import CELL_ENV
from inenv.kit._compile_cache import ENV as COMPILE_CACHE_ENV
from inenv.kit._fi_carry import RESULT_PREFIX
from inenv.kit._flashinfer import COMM_MODULES
from inenv.probes.fi_jit import BUILD_COST
from provision.dockercli import Docker

KERNELS = CODE_ROOT / ".cache" / "kernels"  # one kernel set per cell: <cell id>/<name>/<name>.so + record
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


def current(kernel_dir: Path, job: Job, torch: str | None) -> _carried.Carried | None:
    """The module of ``job`` in the kernel set when it was built for the same list, flashinfer and torch."""
    found = _carried.kernel_set(kernel_dir).get(job.module)
    if found is None:
        return None
    rec = found.record
    same = (rec.get("arch_list") == " ".join(job.archs) and rec.get("flashinfer") == job.flashinfer
            and _base(rec.get("torch")) == _base(torch))
    return found if same else None


def known_failure(rec: Mapping[str, Any], job: Job) -> dict[str, Any] | None:
    """The answer the cell's last kernel stage gave for ``job`` when the module was not carried for a reason
    of the cell's own (no nvcc, a module this flashinfer lacks, an architecture gate) and nothing it was
    decided from has changed: the cell is unchanged since (its build was skipped) and the list is the same.
    None otherwise: a failure of the builder itself (``harness-error``, a time-out) is always tried again."""
    kernels = rec.get("kernels")
    if BuildStatus.of(rec) is not BuildStatus.UNCHANGED or not isinstance(kernels, Mapping):
        return None
    row = (kernels.get("modules") or {}).get(job.module) if isinstance(kernels.get("modules"), Mapping) else None
    if (kernels.get("arch_list") != " ".join(job.archs) or not isinstance(row, Mapping)
            or row.get("carried") is not False):
        return None
    code = str(row.get("reason_code") or "")
    if not code or code == "harness-error" or "timeout" in code or "unknown" in code:
        return None
    return {"ok": False, "reason_code": code, "line": row.get("line"), "from": "the cell's last kernel stage"}


def ready_answer(kernel_dir: Path, job: Job, rec: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a job answers without compiling: the module its kernel set holds for the same inputs, or the
    cell's own known failure; None when it must be built."""
    have = current(kernel_dir, job, torch_of(rec))
    if have is not None:
        return {"ok": True, "name": have.name, "sass": have.sass, "from": "kernel set",
                "library_bytes": have.library.stat().st_size}
    return known_failure(rec, job)


def _base(version: Any) -> str:
    """A torch version without its local label (2.11.0+cu130 and 2.11.0 are one release)."""
    return str(version or "").split("+", 1)[0]


def set_digest(kernel_dir: Path) -> str:
    """A digest of a kernel set's records (each names its library's build); "" for an empty set."""
    carried = _carried.kernel_set(kernel_dir).values()
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


class Carrier(Protocol):
    """Runs the kernel builder inside one built cell and installs a kernel set into it."""

    def compile(self, job: Job, out_dir: Path) -> dict[str, Any]: ...

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
        cmd = [str(self.rec["python"]), "-m", "inenv.kit._fi_carry", job.module, "--archs", " ".join(job.archs),
               "--out", str(out_dir), "--timeout", str(JOB_LIMIT_S)]
        try:
            proc = subprocess.run(cmd, cwd=CODE_ROOT, env=self._python_env(), capture_output=True, text=True,
                                  timeout=JOB_LIMIT_S + 120)
        except (OSError, subprocess.SubprocessError) as exc:
            return {"ok": False, "reason_code": "harness-error", "line": f"{type(exc).__name__}: {exc}"[:300]}
        return parse_result(proc.stdout, proc.returncode, proc.stderr)

    def install(self, kernel_dir: Path, rec: Mapping[str, Any]) -> dict[str, Any]:
        code = "from inenv.kit._carried import aot_dir; print(aot_dir() or '')"
        proc = subprocess.run([str(self.rec["python"]), "-c", code], cwd=CODE_ROOT, env=self._python_env(),
                              capture_output=True, text=True, timeout=300)
        target = proc.stdout.strip()
        if proc.returncode != 0 or not target:
            raise OSError("the cell has no flashinfer AOT folder of its own (flashinfer-jit-cache installed, or "
                          "flashinfer not importable)")
        install_tree(kernel_dir, Path(target))
        return {}


def install_tree(kernel_dir: Path, target: Path) -> None:
    """Make ``target``'s carried modules exactly ``kernel_dir``'s: each library and record copied (atomically),
    a carried module missing from the set removed; modules without a record (not ours) stay."""
    wanted = _carried.kernel_set(kernel_dir)
    for old in _carried.kernel_set(target).values():
        if old.module not in wanted or wanted[old.module].name != old.name:
            shutil.rmtree(old.library.parent, ignore_errors=True)
    for c in wanted.values():
        dest = target / c.name
        atomic.write_bytes(dest / f"{c.name}.so", c.library.read_bytes())
        atomic.write_json(dest / _carried.RECORD, dict(c.record))


@dataclass(frozen=True)
class DockerCarrier:
    rec: Mapping[str, Any]
    cache: Path | None
    docker: Docker

    def compile(self, job: Job, out_dir: Path) -> dict[str, Any]:
        out_dir.mkdir(parents=True, exist_ok=True)
        args = ["run", "--rm", "--network", "none", "-w", "/tmp",
                "-v", f"{CODE_ROOT / 'inenv'}:{CODE_MOUNT}/inenv:ro", "-v", f"{out_dir.resolve()}:{OUT_MOUNT}",
                "-e", f"PYTHONPATH={CODE_MOUNT}", "-e", "PYTHONDONTWRITEBYTECODE=1"]
        for name, value in _env(self.rec, None, str(self.rec.get("cell_id"))).items():
            args += ["-e", f"{name}={value}"]
        if self.cache is not None:
            self.cache.mkdir(parents=True, exist_ok=True)
            args += ["-v", f"{self.cache}:{CACHE_MOUNT}", "-e", f"{COMPILE_CACHE_ENV}={CACHE_MOUNT}"]
        image = str(self.rec.get("kernels_base") or self.rec.get("image_id") or self.rec["tag"])
        args += [image, "python", "-m", "inenv.kit._fi_carry", job.module, "--archs", " ".join(job.archs),
                 "--out", OUT_MOUNT, "--timeout", str(JOB_LIMIT_S)]
        try:
            proc = self.docker.run(*args, timeout=JOB_LIMIT_S + 300)
        except (OSError, subprocess.SubprocessError) as exc:
            return {"ok": False, "reason_code": "harness-error", "line": f"{type(exc).__name__}: {exc}"[:300]}
        return parse_result(proc.stdout, proc.returncode, proc.stderr)

    def install(self, kernel_dir: Path, rec: Mapping[str, Any]) -> dict[str, Any]:
        """An image of the builder's image plus one layer holding the set, under the cell's tag."""
        base = str(rec.get("kernels_base") or rec.get("image_id") or "")
        tag = str(rec["tag"])
        if not base:
            raise OSError(f"no image id recorded for {tag}")
        code = "from inenv.kit._carried import aot_dir; print(aot_dir() or '')"
        probe = self.docker.run("run", "--rm", "--network", "none",
                                "-v", f"{CODE_ROOT / 'inenv'}:{CODE_MOUNT}/inenv:ro", "-e", f"PYTHONPATH={CODE_MOUNT}",
                                base, "python", "-c", code, timeout=300)
        target = probe.stdout.strip()
        if probe.returncode != 0 or not target.startswith("/"):
            raise OSError("the image has no flashinfer AOT folder of its own (flashinfer-jit-cache installed, or "
                          "flashinfer not importable)")
        digest = set_digest(kernel_dir)
        with tempfile.TemporaryDirectory(prefix="stackprobe-kernel-layer-") as ctx:
            shutil.copytree(kernel_dir, Path(ctx) / "kernels", ignore=shutil.ignore_patterns(".*"))
            (Path(ctx) / "Dockerfile").write_text(
                f"FROM {base}\nCOPY kernels/ {target}/\nLABEL {KERNELS_LABEL}=\"{digest}\"\n")
            proc = self.docker.run("build", "-q", "-t", tag, ctx, env=dict(os.environ, DOCKER_BUILDKIT="0"),
                                   timeout=1800)
        if proc.returncode != 0:
            raise OSError(f"docker build of the kernel layer exited {proc.returncode}: "
                          f"{(proc.stderr.strip().splitlines() or [''])[-1][:300]}")
        return {"kernels_base": base, "image_id": self.docker.image_id(tag)}


CARRIERS: dict[str, Callable[[Mapping[str, Any], Path | None, Docker], Carrier]] = {
    backend.VENV: lambda rec, cache, docker: VenvCarrier(rec, cache),
    backend.DOCKER: lambda rec, cache, docker: DockerCarrier(rec, cache, docker),
}


def torch_of(rec: Mapping[str, Any]) -> str | None:
    return (rec.get("versions") or {}).get("torch")


def carry(records: Sequence[dict[str, Any]], archs_of: Mapping[str, tuple[str, ...]], jobs: int, envs: Path,
          report: Callable[[str, str], None], docker: Docker | None = None,
          kernels_root: Path = KERNELS, cache: Path | None = None,
          modules: Sequence[str] = COMM_MODULES) -> list[dict[str, Any]]:
    """Compile and install every built cell's kernels; each record gains ``kernels`` (and is rewritten)."""
    cache = cache if cache is not None else compile_cache_dir(None, False)
    built = {str(r["cell_id"]): r for r in records if buildrecord.runnable(r)}
    rows = [{"cell_id": cid, "flashinfer": (r.get("versions") or {}).get("flashinfer"),
             "torch_cuda": (r.get("versions") or {}).get("torch_cuda"), "archs": archs_of.get(cid, ())}
            for cid, r in built.items()]
    groups = plan(rows, modules)
    if not groups:
        return list(records)
    answered = {(j.cell_id, j.module): answer for g in groups for j in g
                if (answer := ready_answer(kernels_root / j.cell_id, j, built[j.cell_id])) is not None}
    todo = sum(len(g) for g in groups) - len(answered)
    report("", f"kernels: {todo} module build(s) in {len({j.cell_id for g in groups for j in g})} cell(s), "
               f"{jobs} at a time, longest first")
    carriers = {cid: CARRIERS[str(r.get("backend") or backend.DOCKER)](r, cache, docker or Docker())
                for cid, r in built.items()}
    results: dict[tuple[str, str], dict[str, Any]] = {}
    lock = threading.Lock()

    def one(job: Job) -> None:
        kernel_dir = kernels_root / job.cell_id
        got = answered.get((job.cell_id, job.module))
        if got is None:
            report(job.cell_id, f"kernels: {job.module} for {' '.join(job.archs)}")
            t0 = time.monotonic()
            got = carriers[job.cell_id].compile(job, kernel_dir)
            got.setdefault("wall_s", round(time.monotonic() - t0, 1))
            if not got.get("ok"):
                _drop(kernel_dir, job.module)
            report(job.cell_id, f"kernels: {job.module} " + (
                f"carried ({got.get('library_bytes', 0) / 1e6:.1f} MB, {got.get('wall_s')} s)" if got.get("ok")
                else f"not carried: {got.get('reason_code')}: {got.get('line', '')}"))
        with lock:
            results[(job.cell_id, job.module)] = got

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for f in [pool.submit(lambda g=g: [one(j) for j in g]) for g in groups]:
            f.result()
    stage_s = round(time.monotonic() - t0, 1)
    out = []
    for r in records:
        cid = str(r.get("cell_id"))
        if cid not in built or not archs_of.get(cid) or not any(k[0] == cid for k in results):
            out.append(r)
            continue
        out.append(finish(r, carriers[cid], envs / cid, kernels_root / cid, archs_of[cid],
                          {m: v for (c, m), v in results.items() if c == cid}, report, stage_s))
    return out


def _drop(kernel_dir: Path, module: str) -> None:
    stale = _carried.kernel_set(kernel_dir).get(module)
    if stale is not None:
        shutil.rmtree(stale.library.parent, ignore_errors=True)


def finish(rec: dict[str, Any], carrier: Carrier, folder: Path, kernel_dir: Path, archs: tuple[str, ...],
           modules: Mapping[str, Mapping[str, Any]], report: Callable[[str, str], None],
           stage_s: float = 0.0) -> dict[str, Any]:
    """Install the cell's set and rewrite its record with ``kernels``: per module whether it is carried, and
    the compilers' CPU seconds this build spent on it (0 for a set reused or a cached build); ``stage_s``
    the kernel stage's wall time (every cell's stage)."""
    summary: dict[str, Any] = {
        "arch_list": " ".join(archs), "folder": str(kernel_dir), "digest": set_digest(kernel_dir),
        "stage_s": stage_s,
        "compile_cpu_s": round(sum(float(v.get("compile_cpu_s") or 0.0) for v in modules.values()
                                   if not v.get("cached") and v.get("from") != "kernel set"), 1),
        "bytes": sum(c.library.stat().st_size for c in _carried.kernel_set(kernel_dir).values()),
        "modules": {m: ({"carried": True, "sass": v.get("sass"), "bytes": v.get("library_bytes")} if v.get("ok")
                        else {"carried": False, "reason_code": v.get("reason_code"), "line": v.get("line")})
                    for m, v in sorted(modules.items())}}
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
