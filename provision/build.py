"""`provision build`: lock, render, build with the docker CLI (BuildKit when it can), self-check, record.

Side effects live here: docker subprocesses and the files under envs/ and dockerfiles/.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from checks import atomic
from checks.progress import TICK_S, Ticker
from provision import backend, buildlog
from provision.buildprogress import BuildProgress, Step
from provision.errors import InputError
from provision.lock import ENVS, LockError, lock_cell, uv_version
from provision.render import DOCKERFILES, Base, load_cell, render
from provision.resolve import RESOLVED, Resolved
from provision.selfcheck import SHARED as SELFCHECK_SHARED
from provision.verify import mismatches

SELFCHECK = Path(__file__).with_name("selfcheck.py")
SELFCHECK_ROOT = "/opt/stackprobe-code"  # in the image: the self-check beside the checks/ modules it imports
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
LOGS = Path(__file__).resolve().parent.parent / ".cache" / "build-logs"
VENVS = Path(__file__).resolve().parent.parent / ".cache" / "venvs"  # venv cells (provision/venvbuild.py)
NO_CLI = "docker CLI not found"


def docker_cli() -> str:
    """Debian's CLI speaks BuildKit with DOCKER_BUILDKIT=1; a newer CLI without buildx does not."""
    return "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else (shutil.which("docker") or "docker")


@dataclass
class Docker:
    """The docker CLI; counts build invocations so callers can prove a no-op."""

    cli: str = field(default_factory=docker_cli)
    builds: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.cli, *args], capture_output=True, text=True, **kw)

    def check_daemon(self) -> None:
        """InputError saying why Docker cannot build here and how to make it, for `--backend docker`."""
        problem = self.unreachable()
        if problem is None:
            return
        if problem == NO_CLI:
            what, hint = problem, "install Docker (Debian: apt-get install docker.io)"
        else:
            what = f"cannot talk to the Docker daemon ({problem})"
            hint = "run as a member of the docker group" if "permission denied" in problem else "start dockerd"
        raise InputError(f"{what}: {hint}, or leave out --backend docker to build venv cells instead")

    def unreachable(self) -> str | None:
        """Why this CLI cannot build (no CLI, or the daemon's refusal as the CLI prints it), or None when it
        can: the reason alone, no fix."""
        if shutil.which(self.cli) is None and not os.path.exists(self.cli):
            return NO_CLI
        proc = self.run("info", "--format", "{{.ServerVersion}}")
        if proc.returncode != 0:
            return (proc.stderr.strip().splitlines() or ["no answer"])[-1]
        return None

    def buildkit(self) -> bool:
        """BuildKit is reachable through this CLI (DOCKER_BUILDKIT=1 build with --secret)."""
        proc = self.run("build", "--help", env=dict(os.environ, DOCKER_BUILDKIT="1"))
        return "--secret" in proc.stdout

    def image_id(self, ref: str) -> str | None:
        proc = self.run("image", "inspect", "--format", "{{.Id}}", ref)
        return proc.stdout.strip() if proc.returncode == 0 else None

    def build(self, dockerfile: Path, context: Path, tag: str, buildkit: bool, log: Path,
              on_line: Callable[[str], None]) -> int:
        with self._lock:
            self.builds += 1
        cmd = [self.cli, "build", "-f", str(dockerfile), "-t", tag]
        env = dict(os.environ, DOCKER_BUILDKIT="1" if buildkit else "0")
        if buildkit:
            cmd += ["--progress=plain"]
            if CA_BUNDLE.exists():
                cmd += ["--secret", f"id=cacert,src={CA_BUNDLE}"]
        cmd.append(str(context))
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                if line.strip():
                    on_line(line.strip())
            return proc.wait()


@dataclass(frozen=True)
class BuildOptions:
    matrix: Path
    cuda: str | None = None
    torch: str | None = None
    only: tuple[str, ...] = ()
    offline: bool = False
    dry_run: bool = False
    jobs: int = 1
    base: str = "auto"
    base_image: str | None = None
    envs: Path = ENVS
    dockerfiles: Path = DOCKERFILES
    json: bool = False
    toolkit: bool = True  # registry-free base: add the CUDA toolkit from wheels (nvcc for JIT)
    backend: str = "auto"  # auto | docker | venv (provision/backend.py)
    base_python: str | None = None  # venv overlay cells: the environment whose torch stack they use
    wheels: Path | None = None  # venv cells: install from this folder of wheels instead of an index
    venvs: Path = VENVS
    ignore_disk: bool = False  # build even when the free space looks too small

    @property
    def overlay(self) -> bool:
        return self.base_python is not None or self.wheels is not None

    @classmethod
    def from_args(cls, a: argparse.Namespace, matrix: Path) -> BuildOptions:
        if a.jobs < 1:
            raise InputError("--jobs must be 1 or more")
        if a.base_image and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$", a.base_image):
            raise InputError(f"--base-image '{a.base_image}' is not an image reference")
        return cls(matrix, a.cuda, a.torch, tuple(a.only or ()), a.offline, a.dry_run, a.jobs, a.base, a.base_image,
                   Path(a.envs) if a.envs else ENVS, Path(a.dockerfiles) if a.dockerfiles else DOCKERFILES, a.json,
                   backend=a.backend, base_python=a.base_python, wheels=Path(a.wheels) if a.wheels else None,
                   venvs=Path(a.venvs) if a.venvs else VENVS, ignore_disk=getattr(a, "ignore_disk", False))


def nvidia_image(cell: dict[str, Any]) -> str:
    toolkit = cell["toolkit"].split("==")[-1]
    return f"nvidia/cuda:{toolkit}-devel-ubuntu24.04"


def choose_base(cell: dict[str, Any], opts: BuildOptions, docker: Docker | None) -> Base:
    """--base-image wins; auto takes nvidia/cuda when that image is present locally, else the registry-free base."""
    if opts.base_image:
        return Base("nvidia", opts.base_image)
    nv = nvidia_image(cell)
    if opts.base == "nvidia" or (opts.base == "auto" and docker is not None and docker.image_id(nv)):
        return Base("nvidia", nv)
    from provision.baseimage import DEFAULT_TAG, DEV_TAG

    if opts.toolkit and cell.get("wheel_nvcc", True):
        return Base("registry-free", DEV_TAG)
    return Base("registry-free-notoolkit", DEFAULT_TAG)


def image_tag(cell_id: str, digest: str) -> str:
    repo = re.sub(r"[^a-z0-9._-]+", "-", cell_id.lower()).strip("-._")
    return f"stackprobe/{repo}:{digest}"


def build_hash(dockerfile: str, folder: Path, base_id: str, build_args: dict[str, str]) -> str:
    h = hashlib.sha256()
    for part in (dockerfile, base_id, json.dumps(build_args, sort_keys=True), *_selfcheck_texts()):
        h.update(part.encode() + b"\0")
    for name in ("toolkit.lock", "torch.lock", "kernel.lock", "requirements.lock"):
        p = folder / name
        h.update(name.encode() + b"\0" + (p.read_bytes() if p.exists() else b"") + b"\0")
    return h.hexdigest()[:12]


def _selfcheck_files() -> list[tuple[Path, str]]:
    """(host path, image path) of the self-check and each module it shares with the probes."""
    root = SELFCHECK.parent.parent
    return [(SELFCHECK, f"{SELFCHECK_ROOT}/selfcheck.py"),
            *((root / rel, f"{SELFCHECK_ROOT}/{rel}") for rel in SELFCHECK_SHARED)]


def _selfcheck_texts() -> list[str]:
    return [host.read_text() for host, _ in _selfcheck_files()]


def selfcheck(docker: Docker, tag: str, compile_test: bool) -> dict[str, Any]:
    mounts = [arg for host, inside in _selfcheck_files() for arg in ("-v", f"{host}:{inside}:ro")]
    args = ["run", "--rm", "--network", "none", *mounts,
            "--entrypoint", "/opt/venv/bin/python", tag, f"{SELFCHECK_ROOT}/selfcheck.py"]
    proc = docker.run(*args, *(["--compile"] if compile_test else []))
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"self-check exited {proc.returncode}: {tail}"}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"self-check printed no JSON: {proc.stdout[-200:]!r}"}


def _versions(facts: dict[str, Any]) -> dict[str, str | None]:
    t = facts.get("torch") or {}
    return {"torch": t.get("version"), "torch_cuda": t.get("cuda"),
            "sgl_kernel": (facts.get("sgl_kernel") or {}).get("version"),
            "flashinfer": (facts.get("flashinfer") or {}).get("version"),
            "nccl": t.get("nccl"), "python": facts.get("python")}


def _record(folder: Path, **kw: Any) -> dict[str, Any]:
    rec = {"cell_id": folder.name, "status": kw.pop("status"), "tag": kw.pop("tag", None),
           "image_id": kw.pop("image_id", None), "reason": kw.pop("reason", ""),
           "selfcheck": kw.pop("selfcheck", {}), "versions": kw.pop("versions", {}),
           "built_at": datetime.now(UTC).isoformat(timespec="seconds"), **kw}
    atomic.write_json(folder / "build.json", rec, indent=1)
    return rec


def no_nvcc_note(cell: dict[str, Any]) -> str:
    """Why a registry-free CUDA 12 image has no nvcc and what to do, in the reason catalogue's words: the
    same message and next step the table gives for the JIT probes that then skip (fi-no-nvcc)."""
    from checks.reasons import default

    reason = default().get("fi-no-nvcc")
    assert reason is not None, "checks/reasons.yaml lost fi-no-nvcc"
    return f"{reason.message}; next step: {reason.remediation} (for this cell: {nvidia_image(cell)})"


def _note(cell: dict[str, Any], base: Base, opts: BuildOptions) -> str:
    return no_nvcc_note(cell) if base.kind == "registry-free-notoolkit" and opts.toolkit else ""


def build_locked(folders: Sequence[Path], opts: BuildOptions, docker: Docker,
                 report: Callable[[str, str], None] = lambda cid, msg: None,
                 tick_s: float = TICK_S) -> list[dict[str, Any]]:
    """Build every locked cell folder; one failure never stops the others. First every cell's Dockerfile
    and tag (so the unchanged cells are known and the rest can be counted and timed from their last
    builds), then the builds, each saying which of how many it is, its steps, and every ``tick_s`` how long
    it has been building."""
    buildkit = docker.buildkit()
    base_ids: dict[str, str] = {}

    def base_id(base: Base) -> str:
        if base.image not in base_ids:
            if base.kind.startswith("registry-free") and docker.image_id(base.image) is None:
                from provision.baseimage import ensure_base, ensure_dev

                report("base", f"making {base.image} (debootstrap, once)")
                (ensure_dev if base.kind == "registry-free" else ensure_base)(docker=docker.cli)
            bid = docker.image_id(base.image)
            if bid is None:
                raise InputError(f"base image {base.image} is not present locally and no registry is used: "
                                 "docker load it, or pass --base registry-free")
            base_ids[base.image] = bid
        return base_ids[base.image]

    def adopt(folder: Path, cell: dict[str, Any], base: Base, tag: str, image_id: str) -> dict[str, Any] | None:
        """The record of an image already under ``tag`` that this checkout has no record of (another checkout
        built it, or envs/ was cleaned). The tag is a digest of everything the build reads, and a build whose
        self-check failed never keeps its tag, so the image is this build: its self-check runs again for the
        record. None (build it) if that self-check now fails."""
        facts = selfcheck(docker, tag, compile_test=base.kind == "registry-free")
        if "error" in facts or mismatches(cell["expected"], facts, compiled_toolkit=base.kind == "registry-free"):
            return None
        return _record(folder, status="skipped-unchanged", tag=tag, image_id=image_id, selfcheck=facts,
                       versions=_versions(facts), build_s=None, base=base.image, adopted=True,
                       note=_note(cell, base, opts))

    def prepare(folder: Path) -> Step | dict[str, Any]:
        """The cell's step, or its record when nothing is to be built (unchanged, or failed already)."""
        cell = load_cell(folder)
        cid = cell["cell_id"]
        try:
            base = choose_base(cell, opts, docker)
            text = render(cell, base, buildkit=buildkit)
            dockerfile = opts.dockerfiles / f"{cid}.Dockerfile"
            atomic.write_text(dockerfile, text)
            tag = image_tag(cid, build_hash(text, folder, base_id(base), {}))
            prev = _previous(folder)
            image_id = docker.image_id(tag)
            if prev.get("tag") == tag and prev.get("status") in ("built", "skipped-unchanged") and image_id:
                report(cid, "unchanged, not rebuilt")
                keep = {k: prev.get(k) for k in ("selfcheck", "versions", "image_id", "build_s", "base")}
                return _record(folder, status="skipped-unchanged", tag=tag, note=_note(cell, base, opts), **keep)
            if image_id and (adopted := adopt(folder, cell, base, tag, image_id)) is not None:
                report(cid, "unchanged, not rebuilt (its image was already here; self-checked again)")
                return adopted
            return Step(folder, cell, base, dockerfile, tag, prev)
        except InputError:
            raise
        except Exception as e:  # one broken cell must not stop the others
            return _record(folder, status="failed", reason=f"{type(e).__name__}: {e}")

    prepared = {folder: prepare(folder) for folder in folders}
    steps = [p for p in prepared.values() if isinstance(p, Step)]
    progress = BuildProgress(steps)
    if folders:
        records = [p for p in prepared.values() if not isinstance(p, Step)]
        report("", progress.opening(sum(1 for r in records if r["status"] == "skipped-unchanged"),
                                    sum(1 for r in records if r["status"] == "failed")))
    lock = threading.Lock()

    def build(step: Step, ticker: Ticker) -> dict[str, Any]:
        cid, folder, tag = step.cell_id, step.folder, step.tag
        current = {"step": ""}
        seen: set[str] = set()  # BuildKit repeats a step's header when its output resumes

        def on_line(line: str) -> None:
            found = buildlog.step(line)
            if found and found[0] not in seen:
                seen.add(found[0])
                current["step"] = found[1]
                report(cid, found[1])
            elif (err := buildlog.error(line)) is not None:
                report(cid, err)

        log = LOGS / f"{cid}.log"
        t0 = time.monotonic()
        ticker.start(cid, lambda elapsed: progress.tick_line(step, elapsed, current["step"]))
        try:
            rc = docker.build(step.dockerfile, folder, tag, buildkit, log, on_line)
        finally:
            ticker.stop(cid)
        if rc != 0:
            tail = _log_tail(log)
            reason = f"docker build exited {rc}: {tail} (log: {log})"
            return _record(folder, status="failed", tag=tag, reason=reason)
        build_s = round(time.monotonic() - t0, 1)
        report(cid, "self-check")
        facts = selfcheck(docker, tag, compile_test=step.base.kind == "registry-free")
        problems = [facts["error"]] if "error" in facts else mismatches(
            step.cell["expected"], facts, compiled_toolkit=step.base.kind == "registry-free")
        if problems:
            docker.run("image", "rm", "--no-prune", tag)  # never leave a wrong image under a valid tag
            return _record(folder, status="failed", tag=tag, reason="self-check: " + "; ".join(problems),
                           selfcheck=facts, versions=_versions(facts))
        return _record(folder, status="built", tag=tag, image_id=docker.image_id(tag), selfcheck=facts,
                       versions=_versions(facts), build_s=build_s, base=step.base.image,
                       note=_note(step.cell, step.base, opts))

    def one(step: Step, ticker: Ticker) -> dict[str, Any]:
        report(step.cell_id, progress.start_line(step))
        t0 = time.monotonic()
        try:
            rec = build(step, ticker)
        except InputError:
            raise
        except Exception as e:  # one broken cell must not stop the others
            rec = _record(step.folder, status="failed", tag=step.tag, reason=f"{type(e).__name__}: {e}")
        with lock:
            progress.done.add(step.cell_id)
            report(step.cell_id, progress.end_line(step, str(rec["status"]), time.monotonic() - t0))
        return rec

    with Ticker(lambda line: report("", line), tick_s) as ticker, \
            ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
        built = dict(zip((s.folder for s in steps), pool.map(lambda s: one(s, ticker), steps), strict=True))
    return [built[f] if isinstance(p, Step) else p for f, p in prepared.items()]


def _previous(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "build.json").read_text())
    except (OSError, ValueError):
        return {}


def _log_tail(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    # BuildKit: "#8 ERROR: executor failed ..." follows the step's own last output line, the useful one
    for i in range(len(lines) - 1, 0, -1):
        if re.match(r"^#\d+ ERROR", lines[i]):
            return re.sub(r"^#\d+ [\d.]+ ", "", lines[i - 1])[:300]
    errs = [ln for ln in lines if "error" in ln.lower()]
    return (errs or lines or [""])[-1][:300]


def lock_for_build(cells: Sequence[Resolved], opts: BuildOptions) -> tuple[list[Path], list[dict[str, Any]]]:
    uv = uv_version()
    folders, failed = [], []
    for r in cells:
        if r.status != RESOLVED:
            continue
        try:
            lock_cell(r, opts.envs, uv)
            folders.append(opts.envs / r.cell_id)
        except LockError as e:
            failed.append({"cell_id": r.cell_id, "status": "failed", "reason": f"lock: uv: {e.args[1]}"})
    return folders, failed


def summary(cells: Sequence[Resolved], results: Sequence[dict[str, Any]], json_out: bool) -> None:
    by_id = {r["cell_id"]: r for r in results}
    rows = []
    for c in cells:
        r = by_id.get(c.cell_id)
        if r is None:
            rows.append((c.cell_id, c.status, "", c.reason))
        else:
            rows.append((c.cell_id, r["status"], r.get("tag") or r.get("venv") or "",
                         r.get("reason") or r.get("note") or ""))
    if json_out:
        keys = ("cell_id", "status", "tag", "reason")
        print(json.dumps([dict(zip(keys, row, strict=True)) for row in rows], indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="provision build")
    for col in ("cell", "status", "image", "reason"):
        table.add_column(col, overflow="fold")
    colour = {"built": "green", "skipped-unchanged": "green", "failed": "red", "would-build": "cyan"}
    for cid, status, tag, reason in rows:
        table.add_row(cid, f"[{colour.get(status, 'yellow')}]{status}[/]", tag, reason)
    Console(width=200).print(table)


def reporter(opts: BuildOptions) -> Callable[[str, str], None]:
    """One timestamped line per build event, the cell's id first (nothing with --json)."""
    from rich.markup import escape

    from checks.progress import console as progress_console

    console = progress_console()  # never wraps: a log gets one event per line
    lock = threading.Lock()

    def report(cid: str, msg: str) -> None:
        if opts.json:
            return
        who = f" [bold]{escape(cid)}[/]" if cid else ""
        with lock:
            console.print(f"[dim]{time.strftime('%H:%M:%S')}[/]{who} {escape(msg)}")

    return report


def build_venvs(cells: Sequence[Resolved], opts: BuildOptions) -> int:
    """The venv backend: the same plan, locks, self-check, record and summary as images."""
    from provision import venvbuild

    folders, results = venvbuild.lock_for_venv(cells, opts.envs)
    results += venvbuild.build_venv_cells(folders, opts, reporter(opts))
    summary(cells, results, opts.json)
    return 1 if any(r["status"] == "failed" for r in results) else 0


def free_bytes(path: Path) -> int | None:
    """Free space of the file system holding ``path`` (its nearest existing folder); None when unknown."""
    for p in (path, *path.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def _venv_built(rec: dict[str, Any]) -> bool:
    if rec.get("status") not in ("built", "skipped-unchanged"):
        return False
    return bool(rec.get("venv")) and Path(str(rec["venv"])).is_dir()


def disk_check(need: int, free: int | None, where: str, todo: int, torch_builds: int = 0,
               present: int = 0) -> tuple[str, str | None]:
    """(the line saying what the build needs, the refusal or None): pure, the free space is read elsewhere.
    ``torch_builds`` torch layers are still to make; ``present`` more are shared with images already here."""
    from provision.doctor import gb

    shared = f", {present} already here" if present else ""
    line = (f"{todo} cell(s) to build ({torch_builds} new torch build(s){shared}) need about {gb(need)}; "
            + (f"{gb(free)} free under {where}" if free is not None else f"free space under {where} unknown"))
    if free is None or free >= need:
        return line, None
    return line, (f"not enough disk under {where}: this build needs about {gb(need)} and "
                  f"{gb(free)} is free; run `provision prune` (or build fewer cells with --only), "
                  "or pass --ignore-disk")


def image_built(folder: Path, opts: BuildOptions, docker: Docker, buildkit: bool) -> bool:
    """The image the cell's current locks, template and base make is here already (its tag names an image):
    an image of an older lock or template does not count, it would be built again."""
    try:
        cell = load_cell(folder)
        base = choose_base(cell, opts, docker)
        base_id = docker.image_id(base.image)
        if base_id is None:
            return False
        tag = image_tag(cell["cell_id"], build_hash(render(cell, base, buildkit=buildkit), folder, base_id, {}))
    except (OSError, ValueError, KeyError):
        return False
    return docker.image_id(tag) is not None


def disk_gate(cells: Sequence[Resolved], opts: BuildOptions, docker: Docker | None) -> None:
    """Print the disk the cells still to build need (doctor's estimate rule, with each torch build counted
    once and not at all when an image here already holds its layer) and refuse when it is not free."""
    from provision import doctor
    from provision.lock import torch_key

    venv = docker is None
    buildkit = docker.buildkit() if docker is not None else False

    def built(folder: Path) -> bool:
        if docker is None:  # a venv's files are linked from uv's cache, so a second venv of a torch build is ~free
            return _venv_built(_previous(folder))
        return image_built(folder, opts, docker, buildkit)

    todo = [c for c in cells if c.status == RESOLVED and not built(opts.envs / c.cell_id)]
    wanted = {torch_key(c) for c in todo}
    present = set()
    for meta in sorted(opts.envs.glob("*/cell.json")):  # any cell of this machine, of any matrix
        try:
            key = json.loads(meta.read_text()).get("torch_lock")
        except (OSError, ValueError):
            continue
        if key in wanted and key not in present and built(meta.parent):
            present.add(key)
    if venv:
        where: str | None = str(opts.venvs)
        base_present = True  # venv cells need no base image
    else:
        assert docker is not None
        from provision.baseimage import DEFAULT_TAG, DEV_TAG

        proc = docker.run("info", "--format", "{{.DockerRootDir}}")
        where = proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None
        base_present = any(docker.image_id(t) for t in (DEFAULT_TAG, DEV_TAG))
    stacks = len(wanted - present)
    need = doctor.need_bytes(doctor.Facts(venv_torch_stacks=stacks, venv_cells_to_build=len(todo)), doctor.VENV) \
        if venv else doctor.need_bytes(doctor.Facts(base_images=("present",) if base_present else (),
                                                    torch_stacks=stacks, cells_to_build=len(todo)))
    if not need:
        return
    line, refusal = disk_check(need, free_bytes(Path(where)) if where else None, where or "the Docker root",
                               len(todo), len(wanted - present), len(present))
    print(f"provision: {line}", file=sys.stderr, flush=True)
    if refusal and not opts.ignore_disk and not opts.dry_run:
        raise InputError(refusal)


def shown(path: Path) -> str:
    """``path`` relative to the working directory when it is under it, as a user would type it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def render_dockerfiles(folders: Sequence[Path], opts: BuildOptions) -> dict[str, str]:
    """Write each locked cell's Dockerfile (pure rendering, no daemon asked: the base is the one ``--base``
    names, or the registry-free one under auto); cell id -> what the dry run says about it."""
    out = {}
    for f in folders:
        cell = load_cell(f)
        base = choose_base(cell, opts, None)
        atomic.write_text(opts.dockerfiles / f"{f.name}.Dockerfile", render(cell, base, buildkit=True))
        out[f.name] = f"FROM {base.image}; {shown(opts.dockerfiles / f'{f.name}.Dockerfile')}"
    return out


def dry_run(cells: Sequence[Resolved], opts: BuildOptions, chosen: str) -> int:
    """Lock the cells and print the plan; render every Dockerfile whether or not a daemon answers, unless
    venv cells were asked for by name (``--backend venv``, ``--base-python``, ``--wheels``). Builds nothing."""
    if chosen == backend.VENV:
        from provision import venvbuild

        disk_gate(cells, opts, None)
        folders, results = venvbuild.lock_for_venv(cells, opts.envs)
        rows = venvbuild.dry_run(folders, opts)
    else:
        folders, results = lock_for_build(cells, opts)
        rows = [{"cell_id": f.name, "status": "would-build", "reason": ""} for f in folders]
    if opts.backend != backend.VENV and not opts.overlay:
        rendered = render_dockerfiles(folders, opts)
        for row in rows:
            row["reason"] = "; ".join(filter(None, [row["reason"], rendered[row["cell_id"]]]))
    summary(cells, results + rows, opts.json)
    return 0


def build_cells(opts: BuildOptions, docker: Docker | None = None) -> int:
    from provision.api import plan
    from provision.planview import plan_lines

    cells = plan(opts.matrix, opts.cuda, opts.torch, opts.only or None, offline=opts.offline)
    if not opts.json:
        print("\n".join(plan_lines(cells)), flush=True)
    docker = docker or Docker()
    chosen = backend.choose(opts.backend, docker.unreachable, opts.overlay)
    if chosen.line:
        print(f"provision: {chosen.line}", file=sys.stderr, flush=True)
    if opts.dry_run:
        return dry_run(cells, opts, chosen.backend)
    if chosen.backend == backend.VENV:
        disk_gate(cells, opts, None)
        return build_venvs(cells, opts)
    docker.check_daemon()
    folders, results = lock_for_build(cells, opts)
    disk_gate(cells, opts, docker)  # after locking: a cell counts as built only when its current image is here
    results += build_locked(folders, opts, docker, reporter(opts))
    summary(cells, results, opts.json)
    return 1 if any(r["status"] == "failed" for r in results) else 0
