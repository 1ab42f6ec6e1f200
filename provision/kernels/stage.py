"""The kernel stage in this process: plan the jobs of the built cells, read each cell's identity, drop from its
kernel set what is not the cell's, answer what needs no build, build the rest ``jobs`` at a time (the groups of
one build one after another, so the second finds the first's library in the compile cache), say where it is,
and record and install each cell's set."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common.build import backend, buildrecord
from common.build.buildrecord import BuildStatus
from common.caches import compile_cache_dir
from common.progress import Ticker
from inenv import kit
from inenv.kit import COMM_MODULES
from provision.dockercli import Docker
from provision.kernels import jobs as job_plan
from provision.kernels.carriers import CARRIERS, Carrier
from provision.kernels.estimate import StageProgress
from provision.kernels.jobs import Job, current, plan, ready_answer, set_digest
from provision.kernels.records import finish, learned_costs

STAGE_TICK_S = 30.0  # the kernel stage says where it is at least this often: no silence of a minute
Report = Callable[[str, str], None]
Key = tuple[str, str]  # (cell id, module)


def cell_identity(rec: Mapping[str, Any], carrier: Carrier, kernel_dir: Path) -> dict[str, Any] | None:
    """The cell's identity facts: those its last kernel stage read when neither the cell (its build was
    skipped) nor its kernel set has changed since, else read again inside the cell."""
    prev = rec.get("kernels") if isinstance(rec.get("kernels"), Mapping) else {}
    stored = prev.get("identity")
    if (BuildStatus.of(rec) is BuildStatus.UNCHANGED and isinstance(stored, Mapping)
            and prev.get("digest") == set_digest(kernel_dir)):
        return dict(stored)
    return carrier.identity(kernel_dir)


def _built(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {str(r["cell_id"]): r for r in records if buildrecord.runnable(r)}


def family(rec: Mapping[str, Any]) -> tuple[Any, Any]:
    """What a module build shares between cells as far as a record tells: its flashinfer and the CUDA torch was
    built for, as the record's ``versions`` spell them (None where it names none)."""
    v = rec.get("versions") if isinstance(rec.get("versions"), Mapping) else {}
    return v.get("flashinfer"), v.get("torch_cuda")


def _groups(built: Mapping[str, Mapping[str, Any]], archs_of: Mapping[str, tuple[str, ...]],
            modules: Sequence[str]) -> list[list[Job]]:
    rows = [{"cell_id": cid, "flashinfer": fi, "torch_cuda": cuda, "archs": archs_of.get(cid, ())}
            for cid, r in built.items() for fi, cuda in (family(r),)]
    return plan(rows, modules)


def _carriers(built: Mapping[str, Mapping[str, Any]], cells: Sequence[str], cache: Path | None,
              docker: Docker | None, given: Mapping[str, Carrier] | None) -> dict[str, Carrier]:
    """One carrier per cell: ``given`` (tests), else its backend's."""
    if given is not None:
        return dict(given)
    return {cid: CARRIERS[str(built[cid].get("backend") or backend.DOCKER)](built[cid], cache, docker or Docker())
            for cid in cells}


def pending(records: Sequence[dict[str, Any]], archs_of: Mapping[str, tuple[str, ...]], docker: Docker | None = None,
            kernels_root: Path | None = None, cache: Path | None = None, modules: Sequence[str] = COMM_MODULES,
            carriers: Mapping[str, Carrier] | None = None) -> list[Job]:
    """The jobs :func:`carry` would build (no current module in the kernel set, no kept failure of the cell's
    own), compiling nothing: what decides whether the long modules need a stage at all."""
    kernels_root = kernels_root or job_plan.KERNELS
    built = _built(records)
    jobs = [j for g in _groups(built, archs_of, modules) for j in g]
    cells = sorted({j.cell_id for j in jobs})
    by_cell = _carriers(built, cells, cache, docker, carriers)
    identities = {cid: cell_identity(built[cid], by_cell[cid], kernels_root / cid) for cid in cells}
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


def _answered(groups: list[list[Job]], kernels_root: Path, built: Mapping[str, Mapping[str, Any]],
              identities: Mapping[str, Any], report: Report) -> dict[Key, dict[str, Any]]:
    """The jobs answered without a build; each one that is built again though its set holds the module says
    why."""
    answered: dict[Key, dict[str, Any]] = {}
    for job in (j for g in groups for j in g):
        answer, why = ready_answer(kernels_root / job.cell_id, job, built[job.cell_id], identities[job.cell_id])
        if answer is not None:
            answered[(job.cell_id, job.module)] = answer
        elif why != "not in the kernel set":
            report(job.cell_id, f"kernels: {job.module} is built again: {why}")
    return answered


def _outcome(job: Job, got: Mapping[str, Any]) -> str:
    """The line a finished build says: carried for which targets (size, wall time) or why not, with the targets
    flashinfer's gate refused."""
    refused = got.get("refused") or {}
    gate = (f"; refused by flashinfer's gate: {', '.join(sorted(refused))} "
            f"({'; '.join(sorted({str(v.get('reason_code')) for v in refused.values()}))})"
            if isinstance(refused, Mapping) and refused else "")
    return f"kernels: {job.module} " + (
        f"carried for {got.get('arch_list')} ({got.get('library_bytes', 0) / 1e6:.1f} MB, "
        f"{got.get('wall_s')} s){gate}" if got.get("ok")
        else f"not carried: {got.get('reason_code')}: {got.get('line', '')}{gate}")


def _build(job: Job, kernel_dir: Path, carrier: Carrier, progress: StageProgress, report: Report) -> dict[str, Any]:
    """One job's build in its cell, told to the estimator as it begins and ends; a failed build leaves no
    module of that name in the set."""
    progress.begin(job)
    report(job.cell_id, f"kernels: {progress.position(job)} {job.module} for {' '.join(job.archs)}")
    t0 = time.monotonic()
    try:
        got = carrier.compile(job, kernel_dir)
    finally:
        progress.end(job)
    got.setdefault("wall_s", round(time.monotonic() - t0, 1))
    built = len(str(got.get("arch_list") or "").split()) if got.get("ok") else None
    progress.spent(float(got.get("compile_cpu_s") or 0.0) if not got.get("cached") else 0.0, job, built)
    if not got.get("ok"):
        _drop(kernel_dir, job.module)
    report(job.cell_id, _outcome(job, got))
    return got


def twins(groups: Sequence[Sequence[Job]], identities: Mapping[str, Any]) -> dict[Key, list[Job]]:
    """For each job, the other jobs of its group whose module is built from the same inputs as far as the cells'
    facts tell before a build (``kit.KERNEL_IDENTITY`` but the module's source hash, which a cell reads only for
    the modules its set holds: a copy is judged on it in its new cell, :func:`_copy`), so one build's library
    answers them all: cells that differ only in what no module is compiled from (an NCCL release) share one
    build (pure)."""
    out: dict[Key, list[Job]] = {}
    for group in groups:
        facts = []
        for j in group:
            mine = job_plan.facts_for(j, identities.get(j.cell_id))
            facts.append((j, None if mine is None else {k: v for k, v in mine.items() if k != "source_hash"}))
        for job, mine in facts:
            if mine is not None:
                same = [o for o, theirs in facts if o.cell_id != job.cell_id and theirs == mine]
                if same:
                    out[(job.cell_id, job.module)] = same
    return out


def _copy(job: Job, same: Sequence[Job], kernels_root: Path, built: Mapping[str, Mapping[str, Any]],
          carrier: Carrier, progress: StageProgress, report: Report) -> dict[str, Any] | None:
    """The module of ``job`` copied from the kernel set of a cell in ``same`` (built from the same inputs as far
    as they are known before any build: see :func:`twins`), then judged in this cell as any carried module is,
    by this cell's facts read again with the copy in its set (which gives the module's source hash here); None
    when no twin holds it or the copy is not this cell's (then it is built)."""
    for other in same:
        have = kit.kernel_set(kernels_root / other.cell_id).get(job.module)
        if have is None:
            continue
        progress.begin(job)
        try:
            dest = kernels_root / job.cell_id / have.library.parent.name
            part = dest.with_name(f".{dest.name}.part")
            shutil.rmtree(part, ignore_errors=True)
            shutil.copytree(have.library.parent, part)
            shutil.rmtree(dest, ignore_errors=True)
            part.rename(dest)
            facts = carrier.identity(kernels_root / job.cell_id)
        except OSError as exc:
            report(job.cell_id, f"kernels: {job.module} could not be copied from {other.cell_id} ({exc}): built")
            continue
        finally:
            progress.end(job)
        answer, why = ready_answer(kernels_root / job.cell_id, job, built[job.cell_id], facts)
        if answer is not None and answer.get("ok"):
            report(job.cell_id, f"kernels: {progress.position(job)} {job.module} for {' '.join(job.archs)} copied "
                                f"from {other.cell_id}'s build of the same inputs (flashinfer, torch, CUDA, nvcc, "
                                "apache-tvm-ffi, targets, sources): nothing compiled")
            return {**answer, "copied_from": other.cell_id}
        _drop(kernels_root / job.cell_id, job.module)
        report(job.cell_id, f"kernels: {job.module} copied from {other.cell_id} is not this cell's "
                            f"({why or 'its facts could not be read'}): built")
    return None


def _run_groups(groups: list[list[Job]], answered: Mapping[Key, dict[str, Any]], carriers: Mapping[str, Carrier],
                kernels_root: Path, progress: StageProgress, jobs: int, report: Report, tick_s: float,
                same: Mapping[Key, Sequence[Job]], built: Mapping[str, Mapping[str, Any]]) -> dict[Key, dict[str, Any]]:
    """Every job's answer: the ready one, else a copy of a twin cell's build (``same``), else its own build's;
    the groups ``jobs`` at a time, a group's jobs one after another (so a twin's build is there to copy), a
    line at least every ``tick_s`` seconds while any builds."""
    results: dict[Key, dict[str, Any]] = {}
    lock = threading.Lock()

    def one(job: Job) -> None:
        key = (job.cell_id, job.module)
        got = answered.get(key)
        if got is None and same.get(key):
            got = _copy(job, same[key], kernels_root, built, carriers[job.cell_id], progress, report)
        if got is None:
            got = _build(job, kernels_root / job.cell_id, carriers[job.cell_id], progress, report)
        with lock:
            results[(job.cell_id, job.module)] = got

    with Ticker(lambda line: report("", line), tick_s) as ticker, \
            ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        if progress.todo:
            ticker.start("kernels", lambda elapsed: progress.tick_line(elapsed))
        for f in [pool.submit(lambda g=g: [one(j) for j in g]) for g in groups]:
            f.result()
        ticker.stop("kernels")
    return results


def carry(records: Sequence[dict[str, Any]], archs_of: Mapping[str, tuple[str, ...]], jobs: int, envs: Path,
          report: Report, docker: Docker | None = None,
          kernels_root: Path | None = None, cache: Path | None = None,
          modules: Sequence[str] = COMM_MODULES, carriers: Mapping[str, Carrier] | None = None,
          tick_s: float = STAGE_TICK_S) -> list[dict[str, Any]]:
    """Compile and install every built cell's kernels; each record gains ``kernels`` (and is rewritten).
    ``carriers``: one per cell id, instead of the backend's (tests)."""
    kernels_root = kernels_root or job_plan.KERNELS
    cache = cache if cache is not None else compile_cache_dir(None, False)
    built = _built(records)
    groups = _groups(built, archs_of, modules)
    if not groups:
        return list(records)
    planned = sorted({j.cell_id for g in groups for j in g})
    by_cell = _carriers(built, planned, cache, docker, carriers)
    identities = {cid: cell_identity(built[cid], by_cell[cid], kernels_root / cid) for cid in planned}
    for cid in planned:  # a set copied in is installed only as far as it is this cell's
        for why in prune(kernels_root / cid, built[cid], archs_of.get(cid, ()), identities[cid]):
            report(cid, why)
    digests = {cid: set_digest(kernels_root / cid) for cid in planned}
    answered = _answered(groups, kernels_root, built, identities, report)
    todo = [j for g in groups for j in g if (j.cell_id, j.module) not in answered]

    def live() -> float | None:
        spent = [by_cell[c].running_cpu_s() for c in sorted({j.cell_id for j in todo})]
        return None if any(v is None for v in spent) else sum(v for v in spent if v is not None)

    same = twins(groups, identities)
    # a job whose twin is answered or comes before it in the group copies that build: it costs nothing
    copied = {(j.cell_id, j.module) for g in groups for i, j in enumerate(g)
              if (j.cell_id, j.module) in same and (j.cell_id, j.module) not in answered
              and any(o in g[:i] or (o.cell_id, o.module) in answered for o in same[(j.cell_id, j.module)])}
    progress = StageProgress(todo, jobs, learned_costs(envs), live, copied)
    builds = [j for j in todo if (j.cell_id, j.module) not in copied]
    shared = f" and {len(copied)} copied from a twin cell's build of the same inputs" if copied else ""
    report("", f"kernels: {len(builds)} module build(s) in {len({j.cell_id for j in builds})} cell(s){shared}, "
               f"{jobs} at a time, longest first; {progress.left_text()}")
    t0 = time.monotonic()
    results = _run_groups(groups, answered, by_cell, kernels_root, progress, jobs, report, tick_s, same, built)
    stage_s = round(time.monotonic() - t0, 1)
    for cid in planned:  # a set that changed is judged by the facts of what it now holds, next time
        if set_digest(kernels_root / cid) != digests[cid]:
            identities[cid] = by_cell[cid].identity(kernels_root / cid)
    return [finish(r, by_cell[cid], envs / cid, kernels_root / cid, archs_of[cid],
                   {m: v for (c, m), v in results.items() if c == cid}, report, stage_s, identities.get(cid))
            if cid in built and archs_of.get(cid) and any(k[0] == cid for k in results) else r
            for r, cid in ((r, str(r.get("cell_id"))) for r in records)]


def _drop(kernel_dir: Path, module: str) -> None:
    stale = kit.kernel_set(kernel_dir).get(module)
    if stale is not None:
        shutil.rmtree(stale.library.parent, ignore_errors=True)
