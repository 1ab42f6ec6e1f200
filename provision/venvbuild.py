"""The venv builder of `provision build` (provision.buildsession.Builder): each cell as a virtual environment
made from the cell's lock.

A full cell installs its whole lock with hashes (uv links the files from its cache, so cells share bytes) and,
for CUDA versions whose registry toolkit wheels hold nvcc, a CUDA_HOME of those wheels in ``<venv>/cuda``; for
the others that folder stays empty and is still the cell's CUDA_HOME, as the image's /usr/local/cuda without a
toolkit, so no host nvcc stands in for the one the cell lacks. An overlay cell (``--base-python``) is a venv
that sees an existing environment's packages after its own (a ``.pth`` file adding the base's site
directories), with only the cell's other packages installed into it, without dependencies
(provision/overlay.py decides which; an NCCL release the cell names is one, and a second ``.pth`` file loads
that NCCL before torch is imported); it compiles with the toolkit the host has, as the base's CUDA libraries
are the host's. ``--wheels DIR`` installs from that folder alone (hosts without an index). Then the same
self-check as in an image, and a record of the same shape in envs/<cell>/build-venv.json (the image's is
build.json, so a cell built both ways keeps both), with ``backend: venv``, the venv, and
where each package came from.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import canonical
from common.build import buildrecord, celltoolkit
from common.build.buildrecord import BuildStatus
from common.catalog import glibc_floor
from common.catalog import load as load_catalog
from common.errors import InputError
from common.progress import TICK_S, Ticker
from common.resolve import RESOLVED, Resolved
from provision import buildprogress, cudahome, doctor, installer, interp, overlay, wheeldir
from provision.buildprogress import VenvStep
from provision.cellrecord import (
    SELFCHECK,
    SELFCHECK_ROOT,
    previous,
    record,
    selfcheck_files,
    selfcheck_texts,
    versions,
)
from provision.lock import LockError, lock_cell, requirements_in, uv_version
from provision.options import BuildOptions
from provision.render import load_cell
from provision.verify import mismatches

# The interpreters both image bases have (Debian 12: 3.11, Ubuntu 24.04: 3.12); every lock is valid for them.
PYTHON_REQUEST = ">=3.11,<3.13"
PTH = "_stackprobe_base.pth"
BACKEND = "venv"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def pth_text(site_dirs: Sequence[str]) -> str:
    """Lines that add the base's site directories after the overlay's own (their .pth files processed too)."""
    head = "# provision build: this overlay sees its base environment's packages after its own\n"
    return head + "".join(f"import site; site.addsitedir({d!r})\n" for d in site_dirs)


def lock_for_venv(cells: Sequence[Resolved], envs: Path) -> tuple[list[Path], list[dict[str, Any]]]:
    """Lock each cell with uv; where there is no uv (a lent GPU machine), use the lock already in envs/
    when it was made from the same requirements."""
    has_uv = installer.uv() is not None
    uv = uv_version() if has_uv else ""
    folders, failed = [], []
    host_glibc = glibc_here()
    for r in cells:
        if r.status != RESOLVED:
            continue
        if (why := below_floor(r, host_glibc)) is not None:
            failed.append({"cell_id": r.cell_id, "status": "unavailable", "reason": why})
            continue
        folder = envs / r.cell_id
        try:
            if _same_inputs(folder, r) and (not has_uv or _offline()):
                pass  # the committed lock of these requirements: a uv of another version must not relock offline
            elif has_uv:
                lock_cell(r, envs, uv)
            elif not _same_inputs(folder, r):
                raise LockError("", f"no uv here to lock it, and {folder} holds no lock of these requirements: "
                                    "run `provision lock` where uv is and bring envs/ along")
            folders.append(folder)
        except LockError as e:
            failed.append({"cell_id": r.cell_id, "status": BuildStatus.FAILED, "reason": f"lock: {e.args[1]}"})
    return folders, failed


def glibc_here() -> tuple[int, int] | None:
    """This machine's glibc release, (2, 36); None when it has none (musl) or it cannot be read."""
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        return None
    _, _, version = text.partition(" ")
    major, _, minor = version.partition(".")
    return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None


def below_floor(r: Resolved, host_glibc: tuple[int, int] | None) -> str | None:
    """Why a preset cell cannot be a venv on this host: its engine's wheels need a newer glibc than it has."""
    preset = load_catalog().presets.get(r.cell.preset or "")
    floor = glibc_floor(preset.platform) if preset is not None else None
    if preset is None or floor is None or host_glibc is None or host_glibc >= floor:
        return None
    return (f"{preset.engine} {preset.version} ships only {preset.platform} wheels (glibc {floor[0]}.{floor[1]} or "
            f"newer) and this host has glibc {host_glibc[0]}.{host_glibc[1]}: build it as a Docker cell "
            "(`--backend docker`, whose base is newer) or on a newer host")


def _offline() -> bool:
    """No index to lock against (``provision build --offline`` sets UV_OFFLINE)."""
    return os.environ.get("UV_OFFLINE", "") not in ("", "0")


def _same_inputs(folder: Path, r: Resolved) -> bool:
    try:
        # compared layout-free (common.canonical): the header names the catalog's path
        same = canonical.layout_free((folder / "requirements.in").read_text()) == canonical.layout_free(
            requirements_in(r))
        return same and (
            folder / "requirements.lock").exists() and (folder / "cell.json").exists()
    except OSError:
        return False


def build_inputs(folder: Path, base: interp.Interpreter | None, wheels: wheeldir.WheelDir | None,
                 tool: str) -> dict[str, str]:
    """Everything a venv cell is made from, each by name with a digest of it: locks, base environment, wheel
    bytes, installer, the code that lays it out, self-check."""
    parts = {"installer": f"{BACKEND} {tool} {PYTHON_REQUEST}", "self-check": "\0".join(selfcheck_texts()),
             # what decides a venv's contents, spelled layout-free as all project text that is hashed
             "venv layout code": "\0".join(canonical.layout_free_source(Path(m.__file__).read_text())
                                           for m in (overlay, cudahome)),
             "base environment": json.dumps([base.to_json(), base.dists], sort_keys=True) if base else "no base",
             "wheels": "\0".join(sorted(f"{w.name} {w.version} {w.sha256}" for w in wheels.wheels))
             if wheels is not None else "index"}
    for name in ("toolkit.lock", "torch.lock", "requirements.lock"):
        p = folder / name
        parts[name] = p.read_text() if p.exists() else ""
    return buildprogress.digests(parts)



def selfcheck(python: Path, cuda_home: Path, compile_test: bool) -> dict[str, Any]:
    """inenv/selfcheck.py run by the cell's interpreter, with the cell's CUDA_HOME and no host nvcc on PATH
    (common.build.celltoolkit, as the ranks of a venv cell get it); the same facts an image's self-check reports.
    It runs from a folder holding only it and the checks/ modules it shares, as in an image: run from
    provision/, that folder would come first on its path and common/select.py would hide the standard
    library's select."""
    env = installer.env()
    env["CUDA_HOME"] = str(cuda_home)
    env["PATH"] = celltoolkit.without_nvcc(env.get("PATH", os.defpath), keep=[str(cuda_home / "bin")])
    with tempfile.TemporaryDirectory(prefix="stackprobe-selfcheck-") as d:
        for host, inside in selfcheck_files():
            staged = Path(d) / Path(inside).relative_to(SELFCHECK_ROOT)
            staged.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(host, staged)
        cmd = [str(python), str(Path(d) / SELFCHECK.name), *(["--compile"] if compile_test else [])]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=d)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {"error": f"self-check did not run: {exc}"}
    if proc.returncode != 0:
        return {"error": f"self-check exited {proc.returncode}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"self-check printed no JSON: {proc.stdout[-200:]!r}"}


class CellFailed(Exception):
    """One step of one cell failed; the message is the record's reason."""


def _install(tool: installer.Installer, python: Path, entries: Sequence[overlay.Entry], cell: dict[str, Any],
             wheels: wheeldir.WheelDir | None, target: Path | None = None, indexes: bool = True) -> None:
    if not entries:
        return
    with tempfile.TemporaryDirectory(prefix="stackprobe-venv-") as d:
        req = Path(d) / "requirements.txt"
        # from a folder: exact pins (its wheels may be local builds, recorded, not hash-checked);
        # from the index: the lock's entries with their hashes
        req.write_text("".join(f"{e.pin()}\n" if wheels else e.text for e in entries))
        cmd = tool.install_cmd(str(python), req, wheels=wheels.path if wheels else None,
                               indexes=cell.get("indexes", []) if indexes else (),
                               prerelease=bool(cell.get("prerelease")) and indexes, hashes=wheels is None,
                               target=target)
        rc, last = installer.run(cmd)
    if rc != 0:
        raise CellFailed(f"{tool.kind} install exited {rc}: {last}")


def _toolkit(tool: installer.Installer, python: Path, markers: dict[str, str], folder: Path, venv: Path,
             cell: dict[str, Any], wheels: wheeldir.WheelDir | None) -> tuple[Path | None, str]:
    """(CUDA_HOME made from the registry's toolkit wheels, or None; a note)."""
    if not cell.get("wheel_nvcc", True):
        (venv / "cuda").mkdir(exist_ok=True)
        return None, (f"no nvcc in this venv: the registry's CUDA {cell['expected']['cuda']} nvcc wheel has only "
                      f"ptxas; CUDA_HOME is the empty {venv / 'cuda'}, as in the cell's image, so JIT compiles "
                      "fail (fi-no-nvcc) rather than use the host's toolkit")
    wanted = [e for e in overlay.entries((folder / "toolkit.lock").read_text()) if e.applies(markers)]
    if wheels is not None and not all(wheels.has(e.name, e.version) for e in wanted):
        return None, f"no nvcc in this venv: the toolkit wheels of toolkit.lock are not all in {wheels.path}"
    target = venv / "cuda-wheels"
    _install(tool, python, wanted, cell, wheels, target=target, indexes=False)
    home = venv / "cuda"
    try:
        note = cudahome.assemble(target, home)
    except OSError as exc:
        raise CellFailed(f"CUDA_HOME from the toolkit wheels: {exc}") from None
    return home, note


def _sources(plan: overlay.OverlayPlan, wheels: wheeldir.WheelDir | None) -> dict[str, dict[str, Any]]:
    """Where each installed package came from; a wheel from a folder says whether it is the lock's bytes."""
    out: dict[str, dict[str, Any]] = {}
    for e in plan.install:
        row: dict[str, Any] = {"version": e.version, "from": "wheels" if wheels else "index"}
        if wheels is not None:
            row["lock_hash"] = wheels.locked_bytes(e.name, e.version, e.hashes)
        out[e.name] = row
    return out


def prepare(folder: Path, opts: BuildOptions, tool: installer.Installer, base: interp.Interpreter | None,
            wheels: wheeldir.WheelDir | None, report: Callable[[str, str], None]) -> VenvStep | dict[str, Any]:
    """The cell's step, or its record when its venv is already made from the same inputs."""
    cell = load_cell(folder)
    cid = cell["cell_id"]
    venv = (opts.venvs / cid).absolute()
    inputs = build_inputs(folder, base, wheels, tool.kind)
    digest = buildprogress.inputs_hash(inputs)
    prev = previous(folder, BACKEND)
    if (prev.get("backend") == BACKEND and prev.get("hash") == digest and prev.get("venv") == str(venv)
            and buildrecord.runnable(prev) and venv_python(venv).exists()):
        report(cid, "unchanged, not rebuilt")
        keep = {k: v for k, v in prev.items() if k not in ("cell_id", "status", "built_at", "inputs")}
        return record(folder, status=BuildStatus.UNCHANGED, inputs=inputs, **keep)
    return VenvStep(folder=folder, cell=cell, previous=prev, venv=venv, inputs=inputs)


def build_cell(step: VenvStep, opts: BuildOptions, tool: installer.Installer, base: interp.Interpreter | None,
               wheels: wheeldir.WheelDir | None, report: Callable[[str, str], None]) -> dict[str, Any]:
    folder, cell, cid, venv = step.folder, step.cell, step.cell_id, step.venv
    python = venv_python(venv)
    nccl = overlay.nccl_release(cell)
    common: dict[str, Any] = {"backend": BACKEND, "venv": str(venv), "python": str(python),
                              "hash": buildprogress.inputs_hash(step.inputs), "inputs": step.inputs,
                              "installer": tool.kind, "base_python": base.python if base else None,
                              "wheels": str(wheels.path) if wheels else None}
    t0 = time.monotonic()
    report(cid, f"making {venv}" + (f" over {base.python}" if base else ""))
    if venv.exists():
        shutil.rmtree(venv)
    rc, last = installer.run(tool.venv_cmd(venv, base.python if base else PYTHON_REQUEST))
    if rc != 0:
        return record(folder, status=BuildStatus.FAILED, reason=f"{tool.kind} venv exited {rc}: {last}", **common)
    preload: Path | None = None  # the overlay's NCCL library its .pth loads, for a cell naming an NCCL release
    try:
        target = interp.read(str(python))
        if base is not None:
            (Path(target.site_dirs[0]) / PTH).write_text(pth_text(base.site_dirs))
        lock = overlay.entries((folder / "requirements.lock").read_text())
        stack = overlay.names((folder / "torch.lock").read_text()) if base else frozenset()
        own = overlay.own(cell.get("sources", {}))
        plan = overlay.plan(lock, target.markers, base.dists if base else None, stack, own,
                            (lambda e: wheels.has(e.name, e.version)) if wheels else (lambda e: True))
        report(cid, f"installing {len(plan.install)} package(s)" + (f", {len(plan.from_base)} from the base"
                                                                     if base else ""))
        _install(tool, python, plan.install, cell, wheels)
        if base is not None and nccl:
            preload = Path(target.site_dirs[0], *overlay.NCCL_LIB)
            (Path(target.site_dirs[0]) / overlay.NCCL_PTH).write_text(overlay.nccl_pth_text(str(preload)))
        if base is None and cell.get("wheel_nvcc", True):
            report(cid, "CUDA_HOME from the toolkit wheels")
        cuda_home, note = (None, "") if base else _toolkit(tool, python, target.markers, folder, venv, cell, wheels)
    except (CellFailed, InputError, OSError) as exc:
        return record(folder, status=BuildStatus.FAILED, reason=str(exc), **common)
    origin = {"installed": _sources(plan, wheels), "from_base": plan.base_json(),
              "from_base_summary": overlay.summary(p.name for p in plan.from_base) if base else "",
              "base_differs": plan.differs_json(), "absent": {p.name: p.version for p in plan.absent},
              **({"nccl_preload": str(preload) if preload.exists() else None} if preload is not None else {}),
              "cuda_home": str(cuda_home) if cuda_home else None, "path": [str(venv / "bin")] + (
                  [base.scripts] if base else [])}
    report(cid, "self-check")
    facts = selfcheck(python, cuda_home or Path(celltoolkit.toolkit_home(origin | common)),
                      compile_test=cuda_home is not None)
    problems = [facts["error"]] if "error" in facts else mismatches(
        cell["expected"], facts, compiled_toolkit=cuda_home is not None, nccl=nccl)
    if plan.absent:
        names = [f"{p.name}=={p.version}" for p in plan.absent]
        more = f" +{len(names) - 4} more" if len(names) > 4 else ""
        note = "; ".join(filter(None, [note, f"{len(names)} locked package(s) neither installed nor in the base "
                                             f"(build-venv.json: absent): {', '.join(names[:4])}{more}"]))
    status = BuildStatus.FAILED if problems else BuildStatus.BUILT
    return record(folder, status=status, reason="self-check: " + "; ".join(problems) if problems else "",
                   selfcheck=facts, versions=versions(facts), build_s=round(time.monotonic() - t0, 1), note=note,
                   **common, **origin)


def build_venv_cells(folders: Sequence[Path], opts: BuildOptions,
                     report: Callable[[str, str], None] = lambda cid, msg: None,
                     tick_s: float = TICK_S,
                     on_built: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Build every locked cell folder as a venv; one failure never stops the others. As for images: first
    which cells are unchanged, then each build saying which of how many it is, its steps, every ``tick_s``
    how long it has been building, and the time left from the cells' last builds. ``on_built`` is given each
    cell's record as soon as its build ends (built or not)."""
    base = interp.read(opts.base_python) if opts.base_python else None
    tool = installer.find(base.python if base else None)
    if opts.wheels is not None and not opts.wheels.is_dir():
        raise InputError(f"--wheels {opts.wheels}: no such folder")
    wheels = wheeldir.scan(opts.wheels) if opts.wheels is not None else None

    def ready(folder: Path) -> VenvStep | dict[str, Any]:
        try:
            return prepare(folder, opts, tool, base, wheels, report)
        except InputError:
            raise
        except Exception as e:  # one broken cell must not stop the others
            return record(folder, status=BuildStatus.FAILED, reason=f"{type(e).__name__}: {e}", backend=BACKEND)

    prepared = {folder: ready(folder) for folder in folders}
    steps, progress = buildprogress.begin(list(prepared.values()), VenvStep, report, noun="venv cells")
    lock = threading.Lock()

    def one(step: VenvStep, ticker: Ticker) -> dict[str, Any]:
        cid = step.cell_id
        current = {"step": ""}

        def say(who: str, msg: str) -> None:
            current["step"] = msg
            report(who, msg)

        report(cid, progress.start_line(step))
        t0 = time.monotonic()
        ticker.start(cid, lambda elapsed: progress.tick_line(step, elapsed, current["step"]))
        try:
            rec = build_cell(step, opts, tool, base, wheels, say)
        except InputError:
            raise
        except Exception as e:  # one broken cell must not stop the others
            rec = record(step.folder, status=BuildStatus.FAILED, reason=f"{type(e).__name__}: {e}", backend=BACKEND)
        finally:
            ticker.stop(cid)
        with lock:
            progress.done.add(cid)
            report(cid, progress.end_line(step, str(rec["status"]), time.monotonic() - t0))
        if on_built is not None:
            on_built(rec)
        return rec

    with Ticker(lambda line: report("", line), tick_s) as ticker, \
            ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
        built = dict(zip((s.folder for s in steps), pool.map(lambda s: one(s, ticker), steps), strict=True))
    return [built[f] if isinstance(p, VenvStep) else p for f, p in prepared.items()]


def dry_run(folders: Sequence[Path], opts: BuildOptions) -> list[dict[str, Any]]:
    over = f" over {opts.base_python}" if opts.base_python else ""
    return [{"cell_id": f.name, "status": BuildStatus.WOULD_BUILD, "reason": f"venv {opts.venvs / f.name}{over}"}
            for f in folders]


@dataclass(frozen=True)
class VenvBuilder:
    """Cells as virtual environments (provision.buildsession.Builder)."""

    name: str = BACKEND

    def prepare(self, opts: BuildOptions) -> None:
        """Nothing to reach: uv (or the base's pip) is found per build."""

    def lock(self, cells: Sequence[Resolved], opts: BuildOptions) -> tuple[list[Path], list[dict[str, Any]]]:
        return lock_for_venv(cells, opts.envs)

    def built(self, folder: Path, opts: BuildOptions) -> bool:
        """A record of a built venv whose folder is still there (its files are linked from uv's cache, so a
        second venv of a torch build is nearly free)."""
        rec = previous(folder, BACKEND)
        return buildrecord.runnable(rec) and bool(rec.get("venv")) and Path(str(rec["venv"])).is_dir()

    def layers_here(self, folder: Path, opts: BuildOptions) -> bool:
        """A venv is made anew, from uv's cache: nothing of a previous one is reused in place."""
        return False

    def disk_root(self, opts: BuildOptions) -> str | None:
        return str(opts.venvs)

    def need_bytes(self, torch_stacks: int, cells: int) -> int:
        """doctor's venv rule: each torch build in uv's cache, each cell; no base image."""
        return doctor.need_bytes(doctor.Facts(venv_torch_stacks=torch_stacks, venv_cells_to_build=cells), doctor.VENV)

    def dry_run(self, folders: Sequence[Path], opts: BuildOptions) -> list[dict[str, Any]]:
        return dry_run(folders, opts)

    def build(self, folders: Sequence[Path], opts: BuildOptions, report: Callable[[str, str], None],
              on_built: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        return build_venv_cells(folders, opts, report, on_built=on_built)
