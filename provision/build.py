"""The Docker builder of `provision build` (provision.buildsession.Builder): lock, render, build with the docker
CLI (BuildKit when it can), self-check, record.

Side effects live here: docker subprocesses and the files under envs/ and dockerfiles/.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import reasons
from common.build import buildrecord
from common.build.buildrecord import BuildStatus
from common.errors import InputError
from common.home import CACHE_ROOT
from common.progress import TICK_S, Ticker
from common.resolve import RESOLVED, Resolved
from inenv import atomic
from provision import buildprogress, doctor
from provision.baseimage import DEFAULT_TAG, DEV_TAG, ensure_base, ensure_dev
from provision.buildprogress import Step
from provision.cellrecord import SELFCHECK_ROOT, previous, record, selfcheck_files, selfcheck_texts, versions
from provision.dockercli import Docker
from provision.lock import LockError, lock_cell, uv_version
from provision.options import BuildOptions
from provision.render import Base, image_tag, load_cell, render
from provision.verify import mismatches

LOGS = CACHE_ROOT / "build-logs"


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
    if opts.toolkit and cell.get("wheel_nvcc", True):
        return Base("registry-free", DEV_TAG)
    return Base("registry-free-notoolkit", DEFAULT_TAG)


def build_inputs(dockerfile: str, folder: Path, base_id: str, build_args: dict[str, str]) -> dict[str, str]:
    """Everything an image is built from, each by name with a digest of it: what its tag hashes, and what
    its build record keeps so that a rebuild can name the input that changed."""
    parts = {"Dockerfile": dockerfile, "base image": base_id, "build args": json.dumps(build_args, sort_keys=True),
             "self-check": "\0".join(selfcheck_texts())}
    for name in ("toolkit.lock", "torch.lock", "kernel.lock", "requirements.lock"):
        p = folder / name
        parts[name] = p.read_text() if p.exists() else ""
    return buildprogress.digests(parts)


def build_hash(dockerfile: str, folder: Path, base_id: str, build_args: dict[str, str]) -> str:
    return buildprogress.inputs_hash(build_inputs(dockerfile, folder, base_id, build_args))


def selfcheck(docker: Docker, tag: str, compile_test: bool) -> dict[str, Any]:
    mounts = [arg for host, inside in selfcheck_files() for arg in ("-v", f"{host}:{inside}:ro")]
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


def no_nvcc_note(cell: dict[str, Any]) -> str:
    """Why a registry-free CUDA 12 image has no nvcc and what to do, in the reason catalogue's words: the
    same message and next step the table gives for the JIT probes that then skip (fi-no-nvcc)."""
    reason = reasons.default().get("fi-no-nvcc")
    assert reason is not None, "common/reasons.yaml lost fi-no-nvcc"
    return f"{reason.message}; next step: {reason.remediation} (for this cell: {nvidia_image(cell)})"


def _note(cell: dict[str, Any], base: Base, opts: BuildOptions) -> str:
    return no_nvcc_note(cell) if base.kind == "registry-free-notoolkit" and opts.toolkit else ""


def build_locked(folders: Sequence[Path], opts: BuildOptions, docker: Docker,
                 report: Callable[[str, str], None] = lambda cid, msg: None,
                 tick_s: float = TICK_S,
                 on_built: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Build every locked cell folder; one failure never stops the others. First every cell's Dockerfile
    and tag (so the unchanged cells are known and the rest can be counted and timed from their last
    builds), then the builds, each saying which of how many it is, its steps, and every ``tick_s`` how long
    it has been building. ``on_built`` is given each cell's record as soon as its build ends (built or not)."""
    run = _LockedBuild(opts, docker, report, docker.buildkit(), on_built=on_built)
    prepared = {folder: run.prepare(folder) for folder in folders}
    values = list(prepared.values())
    order = spread if opts.jobs > 1 else grouped
    ordered = [*(v for v in values if not isinstance(v, Step)),
               *order([v for v in values if isinstance(v, Step)],
                      lambda s: str(s.cell.get("torch_lock") or s.cell_id))]
    steps, run.progress = buildprogress.begin(ordered, Step, report)
    # an image's self-check (a container of it) runs beside the next image's build: the builders never wait
    # for a check, and a cell is done (its record written, its line said) when its check is
    with Ticker(lambda line: report("", line), tick_s) as ticker, \
            ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool, \
            ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as run.checks:
        pending = list(pool.map(lambda s: run.one(s, ticker), steps))
        built = dict(zip((s.folder for s in steps), (f.result() for f in pending), strict=True))
    return [built[f] if isinstance(p, Step) else p for f, p in prepared.items()]


def spread(steps: Sequence[Step], layer_of: Callable[[Step], str]) -> list[Step]:
    """The builds in the order that keeps parallel builders apart: the first cell of each torch build, then the
    second of each, and so on (each group in its given order). Cells of one torch build share that layer, so
    two of them started together would both wait on the one build of it while another torch build waits in
    the queue; one builder gets the same order, its first image as soon as before."""
    groups: dict[str, list[Step]] = {}
    for s in steps:
        groups.setdefault(layer_of(s), []).append(s)
    rounds = max((len(g) for g in groups.values()), default=0)
    return [g[i] for i in range(rounds) for g in groups.values() if i < len(g)]


def grouped(steps: Sequence[Step], layer_of: Callable[[Step], str]) -> list[Step]:
    """The builds in the order one builder takes: the cells of one torch build one after another, the torch builds
    with the most cells first (each group in its given order). After a torch build's first image the others of
    its group take seconds, so the cells whose kernels can be compiled while the next images build
    (provision.kernels.early) come as early as they can, and the build that no cell shares comes last."""
    groups: dict[str, list[Step]] = {}
    for s in steps:
        groups.setdefault(layer_of(s), []).append(s)
    return [s for g in sorted(groups.values(), key=len, reverse=True) for s in g]


@dataclass
class _LockedBuild:
    """One `build_locked` call: the Docker builds of its cells, the base images they share, their progress."""

    opts: BuildOptions
    docker: Docker
    report: Callable[[str, str], None]
    buildkit: bool
    base_ids: dict[str, str] = field(default_factory=dict)
    progress: Any = None  # buildprogress.begin's, once every cell is prepared
    lock: threading.Lock = field(default_factory=threading.Lock)
    checks: ThreadPoolExecutor | None = None  # where built images are self-checked (build_locked's)
    on_built: Callable[[dict[str, Any]], None] | None = None  # given each cell's record as its build ends

    def base_id(self, base: Base) -> str:
        if base.image not in self.base_ids:
            if base.kind.startswith("registry-free") and self.docker.image_id(base.image) is None:
                self.report("base", f"making {base.image} (debootstrap, once)")
                (ensure_dev if base.kind == "registry-free" else ensure_base)(docker=self.docker.cli)
            bid = self.docker.image_id(base.image)
            if bid is None:
                raise InputError(f"base image {base.image} is not present locally and no registry is used: "
                                 "docker load it, or pass --base registry-free")
            self.base_ids[base.image] = bid
        return self.base_ids[base.image]

    def adopt(self, folder: Path, cell: dict[str, Any], base: Base, tag: str, image_id: str,
              inputs: dict[str, str]) -> dict[str, Any] | None:
        """The record of an image already under ``tag`` that this checkout has no record of (another checkout
        built it, or envs/ was cleaned), or whose recorded image is not the one the tag names today (another
        checkout built the tag again: its kernel stage then carries the cell's kernels anew). The tag is a digest
        of everything the build reads, and a build whose self-check failed never keeps its tag, so the image is
        this build: its self-check runs again for the record. None (build it) if that self-check now fails."""
        facts = selfcheck(self.docker, tag, compile_test=base.kind == "registry-free")
        if "error" in facts or mismatches(cell["expected"], facts, compiled_toolkit=base.kind == "registry-free"):
            return None
        return record(folder, status=BuildStatus.UNCHANGED, tag=tag, image_id=image_id, selfcheck=facts,
                      versions=versions(facts), build_s=None, base=base.image, adopted=True,
                      note=_note(cell, base, self.opts), inputs=inputs)

    def prepare(self, folder: Path) -> Step | dict[str, Any]:
        """The cell's step, or its record when nothing is to be built (unchanged, or failed already)."""
        cell = load_cell(folder)
        cid = cell["cell_id"]
        try:
            base = choose_base(cell, self.opts, self.docker)
            text = render(cell, base, buildkit=self.buildkit)
            dockerfile = self.opts.dockerfiles / f"{cid}.Dockerfile"
            atomic.write_text(dockerfile, text)
            inputs = build_inputs(text, folder, self.base_id(base), {})
            tag = image_tag(cid, buildprogress.inputs_hash(inputs))
            prev = previous(folder)
            image_id = self.docker.image_id(tag)
            # the record stands for the image only while the tag still names the image it recorded: another
            # checkout on this daemon may have built the same tag again since (then it is adopted below)
            if prev.get("tag") == tag and buildrecord.runnable(prev) and image_id and prev.get("image_id") == image_id:
                self.report(cid, "unchanged, not rebuilt")
                keep = {k: prev.get(k) for k in ("selfcheck", "versions", "image_id", "build_s", "base", "kernels",
                                                   "kernels_base")}
                return record(folder, status=BuildStatus.UNCHANGED, tag=tag, note=_note(cell, base, self.opts),
                              inputs=inputs, **keep)
            if image_id and (adopted := self.adopt(folder, cell, base, tag, image_id, inputs)) is not None:
                self.report(cid, "unchanged, not rebuilt (its image was already here; self-checked again)")
                return adopted
            return Step(folder=folder, cell=cell, previous=prev, base=base, dockerfile=dockerfile, tag=tag,
                        inputs=inputs)
        except InputError:
            raise
        except Exception as e:  # one broken cell must not stop the others
            return record(folder, status=BuildStatus.FAILED, reason=f"{type(e).__name__}: {e}")

    def build(self, step: Step, ticker: Ticker) -> dict[str, Any] | float:
        """The image built: its build's seconds (the self-check is the caller's), or the failed build's record."""
        cid, folder, tag = step.cell_id, step.folder, step.tag
        current = {"step": ""}
        seen: set[str] = set()  # BuildKit repeats a step's header when its output resumes

        def on_line(line: str) -> None:
            found = buildprogress.step(line)
            if found and found[0] not in seen:
                seen.add(found[0])
                current["step"] = found[1]
                self.report(cid, found[1])
            elif (err := buildprogress.error(line)) is not None:
                self.report(cid, err)

        log = LOGS / f"{cid}.log"
        t0 = time.monotonic()
        ticker.start(cid, lambda elapsed: self.progress.tick_line(step, elapsed, current["step"]))
        try:
            rc = self.docker.build(step.dockerfile, folder, tag, self.buildkit, log, on_line)
        finally:
            ticker.stop(cid)
        if rc != 0:
            reason = f"docker build exited {rc}: {_log_tail(log)} (log: {log})"
            return record(folder, status=BuildStatus.FAILED, tag=tag, reason=reason)
        return round(time.monotonic() - t0, 1)

    def checked(self, step: Step, build_s: float) -> dict[str, Any]:
        """The record of a built image after its self-check: built, or failed (the image removed) when the
        image is not what the cell asks."""
        self.report(step.cell_id, "self-check")
        compiled = step.base.kind == "registry-free"
        facts = selfcheck(self.docker, step.tag, compile_test=compiled)
        problems = [facts["error"]] if "error" in facts else mismatches(step.cell["expected"], facts,
                                                                         compiled_toolkit=compiled)
        if problems:
            self.docker.run("image", "rm", "--no-prune", step.tag)  # never leave a wrong image under a valid tag
            return record(step.folder, status=BuildStatus.FAILED, tag=step.tag,
                          reason="self-check: " + "; ".join(problems), selfcheck=facts, versions=versions(facts))
        return record(step.folder, status=BuildStatus.BUILT, tag=step.tag, image_id=self.docker.image_id(step.tag),
                      selfcheck=facts, versions=versions(facts), build_s=build_s, base=step.base.image,
                      note=_note(step.cell, step.base, self.opts), inputs=step.inputs)

    def one(self, step: Step, ticker: Ticker) -> Future[dict[str, Any]]:
        """Build the cell's image and hand it to its self-check (:attr:`checks`); the cell's record, once checked."""
        self.report(step.cell_id, self.progress.start_line(step))
        t0 = time.monotonic()
        try:
            built = self.build(step, ticker)
        except InputError:
            raise
        except Exception as e:  # one broken cell must not stop the others
            built = self.failed(step, e)
        assert self.checks is not None, "build_locked gives every run its self-check pool"
        if isinstance(built, dict):  # the build failed: nothing to check
            return self.checks.submit(self.ended, step, built, t0)
        return self.checks.submit(self.check, step, built, t0)

    def check(self, step: Step, build_s: float, t0: float) -> dict[str, Any]:
        try:
            rec = self.checked(step, build_s)
        except Exception as e:  # one broken cell must not stop the others
            rec = self.failed(step, e)
        return self.ended(step, rec, t0)

    def failed(self, step: Step, e: Exception) -> dict[str, Any]:
        return record(step.folder, status=BuildStatus.FAILED, tag=step.tag, reason=f"{type(e).__name__}: {e}")

    def ended(self, step: Step, rec: dict[str, Any], t0: float) -> dict[str, Any]:
        with self.lock:
            self.progress.done.add(step.cell_id)
            self.report(step.cell_id, self.progress.end_line(step, str(rec["status"]), time.monotonic() - t0))
        if self.on_built is not None:
            self.on_built(rec)
        return rec


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
            failed.append({"cell_id": r.cell_id, "status": BuildStatus.FAILED, "reason": f"lock: uv: {e.args[1]}"})
    return folders, failed


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


@dataclass
class DockerBuilder:
    """Cells as Docker images (provision.buildsession.Builder)."""

    docker: Docker = field(default_factory=Docker)
    name: str = "docker"
    _buildkit_seen: bool | None = None

    def prepare(self, opts: BuildOptions) -> None:
        self.docker.check_daemon()

    def lock(self, cells: Sequence[Resolved], opts: BuildOptions) -> tuple[list[Path], list[dict[str, Any]]]:
        return lock_for_build(cells, opts)

    def built(self, folder: Path, opts: BuildOptions) -> bool:
        return image_built(folder, opts, self.docker, self._buildkit())

    def layers_here(self, folder: Path, opts: BuildOptions) -> bool:
        """The image the cell's last build made is still in the daemon: Docker's build cache reuses its layers
        for every step whose inputs did not change."""
        image_id = previous(folder).get("image_id")
        return bool(image_id) and self.docker.image_id(str(image_id)) is not None

    def disk_root(self, opts: BuildOptions) -> str | None:
        """Where images take their disk: the Docker root."""
        proc = self.docker.run("info", "--format", "{{.DockerRootDir}}")
        return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None

    def need_bytes(self, torch_stacks: int, cells: int) -> int:
        """doctor's image rule: a base image when none is here, each torch build's layers, each cell."""
        base_present = any(self.docker.image_id(t) for t in (DEFAULT_TAG, DEV_TAG))
        return doctor.need_bytes(doctor.Facts(base_images=("present",) if base_present else (),
                                              torch_stacks=torch_stacks, cells_to_build=cells))

    def dry_run(self, folders: Sequence[Path], opts: BuildOptions) -> list[dict[str, Any]]:
        return [{"cell_id": f.name, "status": BuildStatus.WOULD_BUILD, "reason": ""} for f in folders]

    def build(self, folders: Sequence[Path], opts: BuildOptions, report: Callable[[str, str], None],
              on_built: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        return build_locked(folders, opts, self.docker, report, on_built=on_built)

    def _buildkit(self) -> bool:
        if self._buildkit_seen is None:
            self._buildkit_seen = self.docker.buildkit()
        return self._buildkit_seen
