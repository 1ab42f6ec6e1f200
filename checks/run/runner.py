"""Executes a planned run on this host's executors: up to ``jobs`` variants at once, each result appended to the
store as it arrives. :func:`begin` and :class:`Recorder` are shared with every backend (checks.run.slurm.backend too):
resumed and reused items are settled first, and every verdict is stamped, stored and reported one way.

Which variant may start is decided by :func:`pick` (pure): CPU-only variants side by side up to ``jobs``, the
longest expected first, a cell's builds of different things (fi-jit's modules) and its variant that builds
nothing (inventory) beside one another, each build's variants in plan order; two builds another cell may
share (``ProbeSpec.build_param``) not side by side while anything else can start; a variant that times
anything on the GPU alone, with nothing else running, so a latency is never measured beside a compile and no
CPU-only probe that touches the GPU (fi-jit's local build, inventory's peer-access reading) shares it, while
variants that time nothing run side by side with each other and with CPU-only work, within the rank cap; when
the executors take turns on the host's GPU lock (inenv.gpugate), the next GPU variants in plan order (up to
``GATE_DEPTH``) start beside the running one and wait at the gate, their ranks already started, so their
start-up costs no GPU time. Variants run in
worker threads (each blocks on its worker process or container); only the main thread records results and
calls back, so progress lines and the store see one event at a time. Ctrl-C reaches the main thread: it
interrupts every worker thread, whose executor then ends its process group or removes its container.
"""

from __future__ import annotations

import fcntl
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from checks.results import portable
from checks.results.provenance import Provenance
from checks.results.result import ProbeResult, Verdict
from checks.results.store import RunStore
from checks.run import classify, hostjudge, incremental, isolate, placement
from checks.run.executor import Executor, ExecutorError, hard_timeout
from checks.run.incremental import Inputs, Key
from checks.run.options import REPO, RunOptions
from checks.run.plan import WorkItem, jit_modules
from common.reasons import Catalogue
from inenv import gpugate
from inenv.gpugate import DEFAULT_QUEUE_S
from inenv.load_engine import SOAK_ENV
from inenv.probe import LEVEL_ENV, QUICK, Variant, untimed
from inenv.status import Status

# GPU variants started ahead, waiting at the gate while one runs: two, so a variant's rank start-up (the
# interpreter, ``import torch``, its preload: 2-6 s on 1x H200) overlaps two variants' GPU time (1.5-3 s each)
# and is never what the GPU waits for.
GATE_DEPTH = 2
# The rank processes of GPU variants in flight are kept within the host's cores (but at least this many): ranks
# that spin while they wait for their GPU's turn compete for cores, so more of them than cores slows every
# variant (on a 16-core 1x H100, three variants of 8 ranks sharing the GPU, 24 processes, took 35-40 s each).
# Variants that time nothing hold the GPU lock shared (inenv.gpugate), so as many of them run at once as the
# cap holds: their cost is mostly each rank's start (the interpreter, imports, a CUDA context), which overlaps.
MIN_RANK_CAP = 8
OVER_BUDGET = "over-budget"  # the reason code of a variant left out for --budget, at plan time or at run time
STOP_WAIT_S = 60.0  # how long Ctrl-C waits for the running variants' cleanup (containers removed, groups killed)


@dataclass
class RunReport:
    results: list[ProbeResult] = field(default_factory=list)
    resumed: int = 0  # variants skipped because --resume found them recorded
    interrupted: bool = False

    @property
    def reused(self) -> list[ProbeResult]:
        """The results carried from earlier runs (checks.run.incremental), not run again."""
        return [r for r in self.results if incremental.REUSED_FROM in r.verdict.evidence]


def iso(stamp: float) -> str:
    """A POSIX time as the results record it: UTC, to the second."""
    return datetime.fromtimestamp(stamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_iso() -> str:
    return iso(datetime.now(UTC).timestamp())


def assemble(item: WorkItem, verdict: Verdict, run_id: str, host_id: str, started_at: str,
             code: Provenance | None) -> ProbeResult:
    """The result as recorded: its words name no folder of this machine (checks.results.portable)."""
    return portable.result(ProbeResult(run_id, host_id, item.cell.cell_id, item.spec.id, item.variant.key, verdict,
                                       started_at, code), str(REPO))


def decided_verdict(item: WorkItem, catalogue: Catalogue) -> Verdict:
    assert item.decided is not None
    p = item.decided
    return classify.decided(p.status, p.reason_code, p.note, catalogue)


def uses_gpu(item: WorkItem) -> bool:
    return item.runs and item.spec.needs_gpu


def compiles(item: WorkItem) -> bool:
    """A variant that builds something (its probe declares a ``build_param``: fi-jit's modules)."""
    return bool(item.spec.build_param)


def loads_no_jit(item: WorkItem) -> bool:
    """A GPU variant that loads no flashinfer JIT module (NCCL, torch symmetric memory...): no compile
    running beside it can be one it waits for."""
    return not jit_modules(item)


def rank_cap(cores: int | None = None) -> int:
    """How many rank processes of GPU variants may be in flight at once on a host of ``cores`` (default: this
    one's): its cores, at least MIN_RANK_CAP."""
    return max(MIN_RANK_CAP, cores if cores is not None else os.cpu_count() or 1)


def shares_gpu(item: WorkItem) -> bool:
    """A GPU variant that times nothing (inenv.probe.untimed): it holds the GPU lock shared, beside others."""
    return uses_gpu(item) and untimed(item.spec, item.variant)


def goes_beside(item: WorkItem, running: list[WorkItem], share: bool = True) -> bool:
    """Whether GPU variant ``item`` may start beside the CPU-only variants ``running``: beside compiles when it
    loads no JIT module (nothing it needs is among them), or, when it times nothing (inenv.probe.untimed: its
    numbers are exact checks a busy CPU cannot change), beside anything that does not build a module it loads
    (``share`` False, --gpu-alone: never)."""
    if loads_no_jit(item) and all(compiles(r) for r in running):
        return True
    if not share:
        return False
    built = {r.variant.param(r.spec.build_param) for r in running if compiles(r)}
    return untimed(item.spec, item.variant) and not (set(jit_modules(item)) & built)


def shared_build(item: WorkItem) -> tuple[str, ...] | None:
    """The build ``item`` shares with other cells, if any: the same probe and value of its ``build_param``,
    with the same CUDA and the same versions of the libraries the probe requires (the sources it builds).
    Cells with other versions build other sources, so their builds may run side by side."""
    name = item.spec.build_param
    value = item.variant.param(name) if name and item.runs else None
    if not value:
        return None
    versions = item.cell.versions
    return (item.spec.id, value, versions.get("torch_cuda", ""), *(versions.get(lib, "") for lib in item.spec.requires))


def pick(pending: list[WorkItem], running: list[WorkItem], jobs: int, ahead: int = 0,
         cost: Callable[[WorkItem], float] = lambda _: 0.0, share: bool = True,
         rank_cap: int | None = None, lanes: placement.Free | None = None) -> WorkItem | None:
    """The pending item that may start beside ``running``, or None. A GPU variant starts alone, the first in
    plan order, when nothing runs, or, when it loads no JIT module, beside running compiles (nothing it
    needs is among them, and waiting for them would hold every JIT-free answer behind the longest build;
    its result names what ran beside it). CPU-only variants start up to ``jobs`` at once, also beside others of
    their own cell: builds of different things (``ProbeSpec.build_param``: fi-jit's modules) and a variant
    that builds nothing (inventory) run side by side, while the variants of one build, and the variants
    that build nothing, keep their plan order within the cell. Of those that may start, the one of the
    highest ``cost`` (its expected seconds; ties in plan order) goes first, so the longest compiles start
    first and overlap instead of one running alone at the end. An item that would build what a running
    item of another cell is building goes after any other that can start: the two would share one build,
    and the second would only hold a job slot waiting for it. ``ahead``: the GPU variants take turns on the
    GPU lock, so while one runs, the items that would start next once it ended start now, up to ``ahead``
    of them, when they are GPU variants too: they wait at the gate with their ranks started, as long as the
    GPU variants' rank processes stay within ``rank_cap`` (None: no cap).

    GPU variants that time nothing (:func:`shares_gpu`, unless ``share`` is False: --gpu-alone) hold the lock
    shared and run side by side: while every GPU variant in flight is one of them, more of them start past
    ``ahead`` within ``rank_cap``, the costliest first, and none past it while it waits for room (so the longest
    do not run alone at the end), and so do CPU-only variants (nothing beside them is timed).

    ``lanes``: the host's GPUs are every pair joined by NVLink or grouped behind PCIe switches
    (checks.run.placement) and these of them are free: timed variants run side by side on disjoint GPU sets, the
    costliest that fits the free GPUs first (nothing starts ahead at the gate: ``ahead`` is not used for them),
    never beside a variant that times nothing; None: one at a time."""
    on_gpu = [r for r in running if uses_gpu(r)]
    if not on_gpu:
        first = _first(pending, running, jobs, cost, share, None)  # alone on the GPUs, any size starts
        if lanes is not None and first is not None and uses_gpu(first) and not (share and shares_gpu(first)):
            return _placed(pending, running, cost, share, lanes, None) or first
        return first
    side_by_side = share and all(shares_gpu(r) for r in on_gpu)
    room = None if rank_cap is None else rank_cap - sum(r.variant.ranks for r in on_gpu)
    beside = [r for r in running if not uses_gpu(r)]
    if lanes is not None and share and not any(shares_gpu(r) for r in on_gpu):
        return _placed(pending, beside, cost, share, lanes, room)
    if side_by_side:
        return _first(pending, beside, jobs, cost, share, room, timed_gpu=len(on_gpu) <= ahead)
    if len(on_gpu) > ahead:
        return None
    after = _first(pending, beside, jobs, cost, share, room)  # the next to start once the GPU is free
    return after if after is not None and uses_gpu(after) else None


def _first(pending: list[WorkItem], running: list[WorkItem], jobs: int, cost: Callable[[WorkItem], float],
           share: bool, room: int | None, timed_gpu: bool = True) -> WorkItem | None:
    """:func:`pick`'s choice beside ``running`` (no GPU variant among them): ``room``, the rank processes GPU
    variants may still start (None: any); ``timed_gpu`` False: no GPU variant that times something."""
    if len(running) >= jobs and not any(uses_gpu(it) for it in pending):
        return None
    cpu = len(running) < jobs
    claimed = {(r.cell.cell_id, shared_build(r)) for r in running}
    building = {shared_build(r) for r in running} - {None}
    busy: set[str] = set()  # cells whose later items wait behind a GPU variant that could start
    later: WorkItem | None = None
    ready: list[WorkItem] = []
    side: list[WorkItem] = []  # GPU variants that time nothing and may start: the costliest goes first
    for it in pending:
        cid = it.cell.cell_id
        if cid in busy:
            continue
        if uses_gpu(it):
            if running and not goes_beside(it, running, share):
                continue  # it waits for the host to be idle; its cell's CPU-only variants may go meanwhile
            fits = room is None or it.variant.ranks <= room  # else its rank processes would pass the cores
            if share and shares_gpu(it):
                side.append(it)
                continue
            if not timed_gpu:
                continue
            if not fits:
                timed_gpu = False  # the next timed variant in plan order waits; none passes it
                continue
            if not ready and not side:
                return it
            busy.add(cid)
            continue
        if not cpu or (cid, shared_build(it)) in claimed:
            continue
        claimed.add((cid, shared_build(it)))  # this build's (or the cell's non-building) later items wait
        if shared_build(it) in building:
            later = later or it
            continue
        ready.append(it)
    if ready:
        return max(ready, key=cost)
    if side:
        # the costliest first, and nothing smaller past it while it waits for room: started last, the long ones
        # would run alone at the end
        best = max(side, key=cost)
        return best if room is None or best.variant.ranks <= room else later
    return later


def _placed(pending: list[WorkItem], running: list[WorkItem], cost: Callable[[WorkItem], float], share: bool,
            lanes: placement.Free, room: int | None) -> WorkItem | None:
    """:func:`pick`'s timed GPU variant for the free GPUs ``lanes`` beside the CPU-only variants ``running``: of
    those that fit, the costliest (ties in plan order), so the long ones start first and none runs alone at
    the end."""
    fit = [it for it in pending if uses_gpu(it) and not (share and shares_gpu(it)) and lanes.fits(it.variant)
           and (room is None or it.variant.ranks <= room) and (not running or goes_beside(it, running, share))]
    return max(fit, key=cost) if fit else None


def level_variant(item: WorkItem, level: str, soak_s: float | None = None) -> Variant:
    """The variant as the worker gets it: a quick run's GPU variant tells its ranks the level through an
    ``env.`` param, and so does its compile variant (fi-jit then builds only its own module: the same
    result at either level); with --soak (``soak_s``) a variant of a probe that replays under load
    (``ProbeSpec.sustained``) tells its ranks how long to replay the same way. The recorded key stays the
    planned one (results say their level, and how long they replayed, in evidence)."""
    v = item.variant
    extra: tuple[tuple[str, str], ...] = ()
    if incremental.shortened(item, level) or (level == QUICK and item.runs and compiles(item)):
        extra += ((f"env.{LEVEL_ENV}", QUICK),)
    if soak_s and item.spec.sustained:
        extra += ((f"env.{SOAK_ENV}", f"{soak_s:g}"),)
    return Variant(v.probe_id, v.ranks, (*v.params, *extra), v.share_gpu, v.skip, v.gpus) if extra else v


@dataclass(frozen=True)
class Work:
    """What one run executes: the planned items, where each cell runs (an executor per cell, none for a
    backend that starts its variants itself), the store the results go to, and what recording needs."""

    items: list[WorkItem]
    store: RunStore
    catalogue: Catalogue
    gpus: int  # the GPU count every worker is told
    codes: Mapping[str, Provenance] = field(default_factory=dict)  # the code each probe id runs with
    inputs: Mapping[Key, Inputs | None] = field(default_factory=dict)  # what a fresh result records for reuse
    executors: Mapping[str, Executor] = field(default_factory=dict)
    manifest: Mapping[str, Any] = field(default_factory=dict)  # the run's manifest, as the store records it
    costs: Mapping[Key, float] = field(default_factory=dict)  # expected seconds: the longest starts first
    deadline: float | None = None  # time.monotonic() after which nothing starts (--budget)
    # what runs on this host beside every variant of the run, outside it (the kernel stage's builds): named in
    # each GPU variant's ``ran_beside`` with the compiles the run itself started
    alongside: tuple[str, ...] = ()


@dataclass(frozen=True)
class Hooks:
    """Calls the run makes as it goes (on the main thread): a variant starts, a result is recorded."""

    on_start: Callable[[WorkItem], None] | None = None
    on_result: Callable[[WorkItem, ProbeResult], None] | None = None
    say: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))


@dataclass
class Recorder:
    """Turns verdicts into results of this run: stamped with their inputs and level, stored, reported."""

    work: Work
    level: str
    hooks: Hooks
    report: RunReport = field(default_factory=RunReport)

    def record(self, item: WorkItem, verdict: Verdict, started: str, store: RunStore | None = None) -> ProbeResult:
        """``store``: where the result goes when not the run's own (a Slurm node of another kind)."""
        store = store or self.work.store
        verdict = hostjudge.judge(item.spec.id, verdict, item.cell.cell_id)
        if item.runs:
            verdict = incremental.stamped(verdict, self.work.inputs.get(item.key),
                                         incremental.shortened(item, self.level))
        result = assemble(item, verdict, store.run_id, store.host_id, started, self.work.codes.get(item.spec.id))
        store.append(result)
        self.report.results.append(result)
        if self.hooks.on_result:
            self.hooks.on_result(item, result)
        return result

    def decided(self, items: list[WorkItem]) -> None:
        """Variants decided at plan time, recorded without running, in one write (a plan of thousands of
        cells that cannot be provisioned records its lines in seconds)."""
        store, started, results = self.work.store, now_iso(), []
        for item in items:
            if self.hooks.on_start:
                self.hooks.on_start(item)
            results.append(assemble(item, decided_verdict(item, self.work.catalogue), store.run_id, store.host_id,
                                    started, self.work.codes.get(item.spec.id)))
        store.append_all(results)
        for item, result in zip(items, results, strict=True):
            self.report.results.append(result)
            if self.hooks.on_result:
                self.hooks.on_result(item, result)


def begin(resume: bool, level: str, work: Work, hooks: Hooks) -> tuple[Recorder, list[WorkItem]]:
    """The first steps every backend shares: items a resumed run recorded are counted and left out; those
    with ``reused`` are carried into this run as copies, and those decided at plan time are recorded (one
    write for each kind). Returns the recorder and the items still to start, in plan order."""
    rec = Recorder(work, level, hooks)
    done = work.store.recorded() if resume else set()
    pending: list[WorkItem] = []
    for it in work.items:
        if it.key in done:
            rec.report.resumed += 1
        else:
            pending.append(it)
    carried = [(it, incremental.carried(it.reused, work.store.run_id)) for it in pending if it.reused is not None]
    work.store.append_all([r for _, r in carried])
    for it, r in carried:
        rec.report.results.append(r)
        if hooks.on_result:
            hooks.on_result(it, r)
    rec.decided([it for it in pending if it.reused is None and it.decided is not None])
    return rec, [it for it in pending if it.reused is None and it.decided is None]


def execute(opts: RunOptions, work: Work, hooks: Hooks | None = None) -> RunReport:
    """Run every item of ``work`` not yet recorded on its cell's executor, up to ``opts.jobs`` at once.
    Ctrl-C stops after cleanup; what finished stays in the store."""
    rec, pending = begin(opts.resume, opts.level, work, hooks or Hooks())
    executors, catalogue, gpus = work.executors, work.catalogue, work.gpus
    broken: dict[str, tuple[str, str]] = {}  # cell -> the reason code and why its executor cannot start
    # Only when every cell's workers take turns on the lock: a variant started ahead on an ungated executor
    # would not wait at any gate and would share the GPUs with the running one.
    lanes = side_by_side_lanes(opts, work)
    facts = work.manifest.get("facts")
    within = placement.islands(facts if isinstance(facts, Mapping) else None) if lanes else ()
    ahead = GATE_DEPTH if gpus and executors and all(ex.gated for ex in executors.values()) and not lanes else 0
    cap = rank_cap()
    queue_for: dict[Key, float] = {}  # how long a GPU variant may wait at the gate
    beside: dict[Key, list[str]] = {}  # a GPU variant started beside compiles: which
    placed: dict[Key, tuple[int, ...]] = {}  # a timed variant running on some of the GPUs (lanes): which
    lane_of: dict[Key, dict[str, Any]] = {}  # its evidence: its GPUs and every timed variant that overlapped it
    hold = _HostHold(lock_path(executors))  # held while variants placed on GPU sets run

    def run_one(item: WorkItem) -> Verdict:
        cell = item.cell.cell_id
        if cell in broken:
            return classify.decided(Status.NOT_RUN, *broken[cell], catalogue)
        executor = executors[cell]
        try:
            if item.key in placed:  # on its own GPUs beside other timed variants, the runner holding the lock
                devices = placed[item.key]
                return executor.run(level_variant(item, opts.level, opts.soak_s), len(devices), item.timeout_s,
                                    catalogue, env=placement.lane_env(devices))
            if executor.gated and uses_gpu(item):
                return executor.run(level_variant(item, opts.level, opts.soak_s), gpus, item.timeout_s, catalogue,
                                    queue_s=queue_for.get(item.key, DEFAULT_QUEUE_S))
            return executor.run(level_variant(item, opts.level, opts.soak_s), gpus, item.timeout_s, catalogue)
        except ExecutorError as exc:
            broken[cell] = (exc.code, str(exc))
            return classify.decided(Status.NOT_RUN, exc.code, str(exc), catalogue)
        except Exception as exc:  # the harness failed this variant (a bug, the daemon): its result, not the run's end
            return harness_failure(exc, catalogue)

    pool = _Pool(run_one)
    isolate.STOP.clear()  # a run in this process after an interrupted one starts afresh
    try:
        while pending or pool.running:
            if work.deadline is not None and pending and time.monotonic() >= work.deadline:
                for item in list(pending):  # the budget is spent: what has not started is left, said as such
                    pending.remove(item)
                    if rec.hooks.on_start:
                        rec.hooks.on_start(item)
                    rec.record(item, over_budget(catalogue), now_iso())
            while (item := pick(pending, list(pool.running.values()), opts.jobs, ahead,
                                lambda it: work.costs.get(it.key, 0.0), share=not opts.gpu_alone,
                                rank_cap=cap, lanes=(room := placement.free(placed.values(), gpus, within))
                                if lanes else None)) is not None:
                pending.remove(item)
                if lanes and uses_gpu(item) and not shares_gpu(item):
                    got = room.place(item.variant)
                    assert got is not None  # pick chose it because it fits
                    hold.take()
                    mine = lane_of[item.key] = {"gpus": list(got), "gpu_count": gpus, "beside": []}
                    label = f"{item.cell.cell_id} {item.spec.id} {item.variant.key}"
                    for other, theirs in lane_of.items():
                        if other in placed:
                            theirs["beside"].append({"variant": label, "gpus": list(got)})
                            mine["beside"].append({"variant": f"{other[0]} {other[1]} {other[2]}",
                                                   "gpus": list(placed[other])})
                    placed[item.key] = got
                before = [r for r in pool.running.values() if uses_gpu(r)]
                # behind the running GPU variants (the gate picks no order among waiters): all of their time
                queue_for[item.key] = max(DEFAULT_QUEUE_S, sum(hard_timeout(r.timeout_s) for r in before))
                if uses_gpu(item):
                    others = [f"{r.cell.cell_id} {r.spec.id} {r.variant.key}" for r in pool.running.values()
                              if not uses_gpu(r)] + list(work.alongside)
                    if others:
                        beside[item.key] = others
                if rec.hooks.on_start:
                    rec.hooks.on_start(item)
                pool.start(item, now_iso())
            if pool.running:
                item, started, outcome = pool.next_done()
                if isinstance(outcome, BaseException):
                    raise outcome  # a bug in the runner or executor, not a verdict: as without threads
                if item.key in beside:  # measured while these compiled: a reader weighs its timings by it
                    outcome = outcome.with_evidence(ran_beside=beside.pop(item.key))
                if placed.pop(item.key, None) is not None:  # measured on its GPUs beside these timed variants
                    outcome = outcome.with_evidence(**{placement.LANE: lane_of.pop(item.key)})
                    if not placed:
                        hold.release()
                rec.record(item, outcome, started)
    except KeyboardInterrupt:
        rec.report.interrupted = True
        pool.stop(executors)
        print("interrupted: results finished so far are kept in " + str(work.store.results_path), file=sys.stderr)
    finally:
        hold.release()
    return rec.report


def side_by_side_lanes(opts: RunOptions, work: Work) -> bool:
    """Whether this run's timed variants go side by side on disjoint GPU sets (checks.run.placement): two GPUs
    or more, every pair joined by NVLink or GPUs grouped behind PCIe switches (placement.side_by_side) by the host
    facts of the run's manifest, no --gpu-alone, and every cell's executor able to give a variant its own GPUs
    (``places``)."""
    facts = work.manifest.get("facts")
    return (work.gpus > 1 and not opts.gpu_alone and bool(work.executors)
            and all(getattr(ex, "places", False) for ex in work.executors.values())
            and placement.side_by_side(facts if isinstance(facts, Mapping) else None))


def lock_path(executors: Mapping[str, Executor]) -> str | None:
    """The host's GPU lock file the cells' workers take turns on (inenv.gpugate), if any."""
    for ex in executors.values():
        for name, value in getattr(ex, "run_env", ()):
            if name == gpugate.ENV and value:
                return str(value)
    return None


class _HostHold:
    """The runner's exclusive hold on the host's GPU lock while variants it placed on GPU sets run (their
    workers take no lock): another run on the host, and this run's own gated workers, wait for it."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.fd: int | None = None

    def take(self) -> None:
        if self.path is None or self.fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)  # closing the last descriptor lets the flock go


def over_budget(catalogue: Catalogue) -> Verdict:
    """The verdict of a variant that had not started when the run's --budget ran out."""
    return classify.decided(Status.NOT_RUN, OVER_BUDGET, "not started: the run's --budget was spent before its "
                            "turn; a later run with a larger --budget, or without one, runs it", catalogue)


def harness_failure(exc: Exception, catalogue: Catalogue) -> Verdict:
    """The verdict of a variant the harness itself failed (an executor raised): not-run harness-error, with the
    traceback, so the run goes on and a later run reruns it (harness codes are never reused)."""
    tb = "".join(traceback.format_exception(exc))[-3000:]
    print(f"warning: stackprobe failed a variant: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
    v = classify.decided(Status.NOT_RUN, "harness-error", f"{type(exc).__name__}: {str(exc)[:300]}", catalogue)
    return v.with_evidence(traceback=tb)


Outcome = tuple[WorkItem, str, Verdict | BaseException]


class _Pool:
    """One thread per running variant; finished ones are collected by the main thread only."""

    def __init__(self, run_one: Callable[[WorkItem], Verdict]) -> None:
        self.run_one = run_one
        self.running: dict[threading.Thread, WorkItem] = {}
        self.done: queue.Queue[Outcome] = queue.Queue()

    def start(self, item: WorkItem, started: str) -> None:
        th = threading.Thread(target=self._body, args=(item, started), name=f"variant {item.spec.id}", daemon=True)
        self.running[th] = item
        th.start()

    def _body(self, item: WorkItem, started: str) -> None:
        outcome: Verdict | BaseException
        try:
            outcome = self.run_one(item)
        except BaseException as exc:  # KeyboardInterrupt once stop() set isolate.STOP, or a bug: main decides
            outcome = exc
        self.done.put((item, started, outcome))

    def next_done(self) -> Outcome:
        """The next finished variant; waits in short slices so Ctrl-C reaches the main thread at once."""
        while True:
            try:
                got = self.done.get(timeout=0.5)
            except queue.Empty:
                continue
            self.running = {th: it for th, it in self.running.items() if it is not got[0]}
            return got

    def stop(self, executors: Mapping[str, Executor]) -> None:
        """Ctrl-C: tell every running variant to end (isolate.STOP, which their waits check) and wait (bounded)
        for the cleanup."""
        isolate.STOP.set()
        for item in self.running.values():
            executors[item.cell.cell_id].sweep()  # a thread waiting on a container's daemon returns once it is gone
        deadline = time.monotonic() + STOP_WAIT_S
        for th in list(self.running):
            th.join(timeout=max(0.0, deadline - time.monotonic()))
