"""One `provision build`, whatever the builder: a chain of small steps, each returning a value.

    plan -> builder -> (dry run: lock -> Dockerfiles -> summary) prepare -> lock -> disk gate -> build -> summary

A :class:`Builder` makes cells in one way; :data:`BUILDERS` holds every one by the name ``--backend`` takes
(Docker images: provision.build; venv cells: provision.venvbuild). The session never asks which it drives.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from common.api import plan
from common.build import backend, kernelstage
from common.build.buildrecord import BuildStatus
from common.errors import InputError
from common.progress import console as progress_console
from common.resolve import RESOLVED, Resolved
from inenv import kit
from provision import doctor, kernels
from provision.build import DockerBuilder, render_dockerfiles
from provision.dockercli import Docker
from provision.lock import torch_key
from provision.options import BuildOptions
from provision.planview import plan_lines
from provision.venvbuild import VenvBuilder

Records = list[dict[str, Any]]


class Builder(Protocol):
    name: str

    def prepare(self, opts: BuildOptions) -> None:
        """Check that it can build here (InputError with one line and the fix when not); not for a dry run."""
        ...

    def lock(self, cells: Sequence[Resolved], opts: BuildOptions) -> tuple[list[Path], Records]:
        """The locked cell folders, and a failed record for each cell that could not be locked."""
        ...

    def built(self, folder: Path, opts: BuildOptions) -> bool:
        """The cell's current build (of its current locks) is here already."""
        ...

    def layers_here(self, folder: Path, opts: BuildOptions) -> bool:
        """The cell's previous build is still here although not current (its tag moved with the build's
        inputs): a rebuild reuses what it holds, so it takes next to no disk."""
        ...

    def disk_root(self, opts: BuildOptions) -> str | None:
        """Where its builds take disk (None: unknown)."""
        ...

    def need_bytes(self, torch_stacks: int, cells: int) -> int:
        """The disk that many new torch builds and cells take (doctor's rule for this builder)."""
        ...

    def dry_run(self, folders: Sequence[Path], opts: BuildOptions) -> Records:
        """What a build would do, per cell, building nothing."""
        ...

    def build(self, folders: Sequence[Path], opts: BuildOptions, report: Callable[[str, str], None],
              on_built: Callable[[dict[str, Any]], None] | None = None) -> Records:
        """Build every locked cell; one failure never stops the others. ``on_built`` is given each cell's record
        as soon as its build ends (built or not), while the others build."""
        ...


BUILDERS: dict[str, Callable[[Docker], Builder]] = {
    backend.DOCKER: lambda docker: DockerBuilder(docker),
    backend.VENV: lambda docker: VenvBuilder(),
}


def build_cells(opts: BuildOptions, docker: Docker | None = None) -> int:
    """`provision build`: the whole chain; 0 when every cell built (or with --dry-run), 1 when one failed."""
    cells = plan(opts.matrix, opts.cuda, opts.torch, list(opts.only) or None, offline=opts.offline)
    if not opts.json:
        print("\n".join(plan_lines(cells)), flush=True)
    builder = choose(opts, docker or Docker())
    if opts.dry_run:
        return dry_run(cells, opts, builder)
    builder.prepare(opts)
    folders, records = builder.lock(cells, opts)
    disk_gate(cells, opts, builder)  # after locking: a cell counts as built only when its current build is here
    built, carried_early = build_carrying_early(builder, folders, cells, opts, docker)
    records = carry_kernels(cells, records + built, opts, docker, carried_early)
    summary(cells, records, opts.json)
    return 1 if any(r["status"] == BuildStatus.FAILED for r in records) else 0


def build_carrying_early(builder: Builder, folders: Sequence[Path], cells: Sequence[Resolved], opts: BuildOptions,
                         docker: Docker | None) -> tuple[Records, frozenset[str]]:
    """The builder's records, each built cell's quick module carried while the next cells build
    (provision.kernels.early), and the cells carried so."""
    early = kernels.EarlyQuick(kernel_archs(cells, opts), opts.envs, reporter(opts), docker)
    try:
        built = builder.build(folders, opts, reporter(opts), early.add)
    except BaseException:
        early.abandon()
        raise
    return early.finish(built), early.carried


def kernel_archs(cells: Sequence[Resolved], opts: BuildOptions) -> dict[str, tuple[str, ...]]:
    """Each resolved cell's carried-kernel archs: ``--kernel-archs``, else its matrix entry's."""
    return {r.cell_id: (opts.kernel_archs if opts.kernel_archs is not None else r.cell.kernel_archs)
            for r in cells if r.status == RESOLVED}


def memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 8 << 30


def carry_kernels(cells: Sequence[Resolved], records: Records, opts: BuildOptions, docker: Docker | None,
                  carried_early: frozenset[str] = frozenset()) -> Records:
    """The kernel stage (provision.kernels) over every built cell: the quick module here (what `checks run`'s
    quick pass loads) of the cells it was not carried for while the images built (``carried_early``), then the
    long ones in a process of their own that this command does not wait for
    (``python -m provision.kernels``; with --wait-kernels, here too), so the first table comes before the long compiles.
    A stage an earlier build started is waited for first: one build of each module at a time."""
    jobs = opts.kernel_parallel(os.cpu_count() or 1, memory_bytes())
    report = reporter(opts)
    archs = kernel_archs(cells, opts)
    kernelstage.wait(lambda line: report("", line))
    records = kernels.carry(records, kernels.left_over(archs, records, carried_early), jobs, opts.envs, report,
                            docker, modules=kernels.QUICK_MODULES)
    if opts.wait_kernels:
        return kernels.carry(records, archs, jobs, opts.envs, report, docker, modules=kernels.LONG_MODULES)
    backend_of = {str(r.get("cell_id")): str(r.get("backend") or backend.DOCKER) for r in records}
    todo = kernels.pending(records, archs, docker, modules=kernels.LONG_MODULES)
    cells_of = sorted({j.cell_id for j in todo})
    rows = {str(r.get("cell_id")): kernels.module_rows(r) for r in records}
    answered = {c: a for c, a in archs.items()
                if a and c not in cells_of and not set(kernels.LONG_MODULES) <= set(rows.get(c, ()))}
    if answered:  # every long module of these cells is answered by the set they hold, but their record does not
        # say so yet (a set copied in from the machine that built it): recorded here, compiling nothing
        records = kernels.carry(records, answered, jobs, opts.envs, report, docker, modules=kernels.LONG_MODULES)
    if not todo:
        report("", f"kernels: the long modules ({', '.join(kernels.LONG_MODULES)}) are current in every cell "
                   "(or not carried for a reason of the cell's own): nothing more to build")
        return records
    kinds = sorted({backend_of[c] for c in cells_of})
    for kind in kinds:
        mine = [c for c in cells_of if backend_of[c] == kind]
        job = {"cells": mine, "backend": kind, "jobs": jobs, "envs": str(opts.envs),
               "kernels_root": str(kernels.jobs.KERNELS), "archs": {c: list(archs[c]) for c in mine},
               "modules": list(kernels.LONG_MODULES), "builds": sum(1 for j in todo if j.cell_id in mine)}
        try:
            stage = start_stage(job, lambda line: report("", line))
        except OSError as exc:
            report("", f"kernels: the long modules' stage could not be started ({exc}); they are built here")
            return kernels.carry(records, archs, jobs, opts.envs, report, docker, modules=kernels.LONG_MODULES)
        report("", f"kernels: {stage.builds} build(s) of the long modules ({', '.join(kernels.LONG_MODULES)}) "
                   f"go on after this command (pid {stage.pid}, log {shown_path(stage.log)}); `checks run` "
                   "answers at the quick level meanwhile and waits for them before its full level")
        if kind != kinds[-1]:
            kernelstage.wait(lambda line: report("", line))  # one stage at a time
    return records


def start_stage(job: dict[str, Any], say: Callable[[str], None], folder: Path | None = None,
                attempts: int = 3) -> kernelstage.Stage:
    """Start the kernel stage; while another `provision build` holds the folder's stage lock (two started
    together), say so, wait for its stage (showing its lines) and try again: one stage at a time, each with its
    own log. kernelstage.StageBusy when it is still held after ``attempts`` waits."""
    tried = 0
    while True:
        try:
            return kernels.start(job, folder)
        except kernelstage.StageBusy:
            tried += 1
            if tried >= attempts:
                raise
            say("kernels: another `provision build` runs the kernel stage; waiting for it before starting this "
                "one's")
            kernelstage.wait(say, folder)


def shown_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def dry_run(cells: Sequence[Resolved], opts: BuildOptions, builder: Builder) -> int:
    """Lock the cells and print the plan; render every Dockerfile whether or not a daemon answers, unless
    venv cells were asked for by name (``--backend venv``, ``--base-python``, ``--wheels``). Builds nothing."""
    folders, records = builder.lock(cells, opts)
    rows = builder.dry_run(folders, opts)
    if opts.backend != backend.VENV and not opts.overlay:
        rendered = render_dockerfiles(folders, opts)
        for row in rows:
            row["reason"] = "; ".join(filter(None, [row["reason"], rendered[row["cell_id"]]]))
    summary(cells, records + rows, opts.json)
    return 0


def choose(opts: BuildOptions, docker: Docker) -> Builder:
    """``--backend``, or under auto Docker when its daemon answers, else venv cells (said in one line)."""
    chosen = backend.choose(opts.backend, docker.unreachable, opts.overlay)
    if chosen.line:
        print(f"provision: {chosen.line}", file=sys.stderr, flush=True)
    return BUILDERS[chosen.backend](docker)


def reporter(opts: BuildOptions) -> Callable[[str, str], None]:
    """One line per build event on stderr (never wrapped: a log gets one event per line); none with --json."""
    console = progress_console()
    lock = threading.Lock()

    def report(cid: str, msg: str) -> None:
        if opts.json:
            return
        who = f" [bold]{escape(cid)}[/]" if cid else ""
        with lock:
            console.print(f"[dim]{time.strftime('%H:%M:%S')}[/]{who} {escape(msg)}")

    return report


def free_bytes(path: Path) -> int | None:
    """Free space of the file system holding ``path`` (its nearest existing folder); None when unknown."""
    for p in (path, *path.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def disk_check(need: int, free: int | None, where: str, todo: int, torch_builds: int = 0,
               present: int = 0) -> tuple[str, str | None]:
    """(the line saying what the build needs, the refusal or None): pure, the free space is read elsewhere.
    ``torch_builds`` torch layers are still to make; ``present`` more are shared with builds already here."""
    gb = doctor.gb
    shared = f", {present} already here" if present else ""
    line = (f"{todo} cell(s) to build ({torch_builds} new torch build(s){shared}) need about {gb(need)}; "
            + (f"{gb(free)} free under {where}" if free is not None else f"free space under {where} unknown"))
    if free is None or free >= need:
        return line, None
    return line, (f"not enough disk under {where}: this build needs about {gb(need)} and "
                  f"{gb(free)} is free; run `provision prune` (or build fewer cells with --only), "
                  "or pass --ignore-disk")


def disk_gate(cells: Sequence[Resolved], opts: BuildOptions, builder: Builder) -> None:
    """Print the disk the cells still to build need (doctor's estimate rule for the builder, with each torch
    build counted once and not at all when a build here already holds it, and no cell whose previous image is
    still here) and refuse when it is not free."""
    todo = [c for c in cells if c.status == RESOLVED and not builder.built(opts.envs / c.cell_id, opts)]
    # a cell whose previous image is still here rebuilds from its cached layers: next to no disk
    reused = {c.cell_id for c in todo if builder.layers_here(opts.envs / c.cell_id, opts)}
    todo = [c for c in todo if c.cell_id not in reused]
    wanted = {torch_key(c) for c in todo}
    present = set()
    for meta in sorted(opts.envs.glob("*/cell.json")):  # any cell of this machine, of any matrix
        try:
            key = json.loads(meta.read_text()).get("torch_lock")
        except (OSError, ValueError):
            continue
        if key in wanted and key not in present and (builder.built(meta.parent, opts)
                                                     or builder.layers_here(meta.parent, opts)):
            present.add(key)
    if reused:
        print(f"provision: {len(reused)} cell(s) rebuild from the layers of their previous image, still here "
              "(next to no disk)", file=sys.stderr, flush=True)
    need = builder.need_bytes(len(wanted - present), len(todo))
    if not need:
        return
    where = builder.disk_root(opts)
    line, refusal = disk_check(need, free_bytes(Path(where)) if where else None, where or "the Docker root",
                               len(todo), len(wanted - present), len(present))
    print(f"provision: {line}", file=sys.stderr, flush=True)
    if refusal and not opts.ignore_disk:
        raise InputError(refusal)


def kernels_line(k: Any) -> str:
    """``4/5 for 9.0a 12.0f, 31.2 MB (trtllm_comm: fi-module-absent; trtllm_comm for 9.0a only, 12.0f refused:
    fi-arch-gate)``; "" when the cell carries nothing."""
    if not isinstance(k, dict) or not isinstance(k.get("modules"), dict):
        return ""
    mods = k["modules"]
    ok = [m for m, v in mods.items() if isinstance(v, dict) and v.get("carried")]
    why = [f"{m}: {v.get('reason_code')}" for m, v in mods.items() if isinstance(v, dict) and not v.get("carried")]
    for m, v in mods.items():
        refused = v.get("refused") if isinstance(v, dict) else None
        if v.get("carried") and isinstance(refused, dict) and refused:  # from a record that may come from elsewhere
            codes = sorted({kit.visible(str(r.get("reason_code")), 40) for r in refused.values()
                            if isinstance(r, dict)})
            targets = " ".join(sorted(kit.visible(str(a), 20) for a in refused))
            why.append(f"{m} for {kit.visible(str(v.get('arch_list')), 60)} only, {targets} refused: "
                       f"{', '.join(codes)}")
    text = f"{len(ok)}/{len(mods)} for {k.get('arch_list')}, {float(k.get('bytes') or 0) / 1e6:.1f} MB"
    if k.get("installed") is False and ok:
        text += f", not installed: {k.get('install_error') or '?'}"
    return text + (f" ({'; '.join(why)})" if why else "")


def summary(cells: Sequence[Resolved], results: Sequence[dict[str, Any]], json_out: bool) -> None:
    by_id = {r["cell_id"]: r for r in results}
    rows = []
    for c in cells:
        r = by_id.get(c.cell_id)
        if r is None:
            rows.append((c.cell_id, c.status, "", c.reason))
        else:
            rows.append((c.cell_id, r["status"], r.get("tag") or r.get("venv") or "",
                         r.get("reason") or r.get("note") or "", kernels_line(r.get("kernels"))))
    if json_out:
        keys = ("cell_id", "status", "tag", "reason", "kernels")
        print(json.dumps([dict(zip(keys, row, strict=False)) for row in rows], indent=1))
        return
    table = Table(title="provision build")
    for col in ("cell", "status", "image", "reason", "kernels"):
        table.add_column(col, overflow="fold")
    colour = {BuildStatus.BUILT: "green", BuildStatus.UNCHANGED: "green", BuildStatus.FAILED: "red",
              BuildStatus.WOULD_BUILD: "cyan"}
    for cid, status, tag, reason, *carried in rows:
        table.add_row(cid, f"[{colour.get(status, 'yellow')}]{status}[/]", tag, escape(reason),
                      escape(carried[0] if carried else ""))
    Console(width=200).print(table)
