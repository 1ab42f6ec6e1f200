"""One `checks run`, whatever the backend (host side): a chain of small steps, each returning a value.

    backend -> probes -> targets -> prepare -> plan -> store -> reuse -> (run lock) manifest -> execute
            -> summary -> table

With no ``--level`` the chain runs twice: at the quick level over every selected cell (its table is the first
answer), then at the full level, which reuses every result the quick pass made at full fidelity (what a quick
run does not shorten: every variant of a probe without a GPU) and runs the rest. Each pass is a run of its own
(its store, manifest and run lock); Ctrl-C in the full pass leaves the quick pass's table as it was.

The backend (checks.run.backend) answers where cells come from and where their variants run; every other step
is the same for Docker images, venv cells, a local interpreter and Slurm jobs, so each gets resuming, reuse
of unchanged results, the run lock, the summary, the regenerated table and ``--json`` from here.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from checks.report import summary
from checks.report.report import generate
from checks.results import hostfacts, ids, provenance
from checks.results.provenance import Checkout
from checks.results.result import ProbeResult
from checks.results.store import RunLock, RunStore, latest_run, next_run_id, read_manifest, regular_run, unwritable
from checks.run import incremental, manifest, placement, runconsole, runprogress
from checks.run.backend import Backend, Targets
from checks.run.backends import BACKENDS, resolve
from checks.run.cost import budget
from checks.run.cost import model as costmodel
from checks.run.executor import EnvPrint
from checks.run.options import REPO, SLURM, RunOptions, UsageError
from checks.run.plan import (
    REUSED,
    STAGE_WAIT,
    WorkItem,
    awaiting_stage,
    compiles_here,
    deferred,
    deferred_shallow,
    deferred_sizes,
    plan_work,
    summary_counts,
)
from checks.run.runner import RunReport, Work, now_iso
from common import escape, reasons
from common.build import buildrecord, kernelstage
from common.build.backend import RECORD_NAMES
from common.caches import compile_cache_dir
from common.progress import duration
from inenv import kit, registry
from inenv.probe import FULL, QUICK, declared


@dataclass(frozen=True)
class Planned:
    """The run's work before it starts: every item, the probe hashes and code they run with, and what each
    fresh result records so a later run can reuse it."""

    items: list[WorkItem]
    hashes: dict[str, str]
    code: Checkout
    inputs: dict[tuple[str, str, str], incremental.Inputs | None]
    fingerprints: dict[str, EnvPrint | None]
    build_costs: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)  # probe -> build -> s


@dataclass(frozen=True)
class Pass:
    """What one pass of the chain ended with: its exit code, its results, and how long it took."""

    code: int
    results: list[ProbeResult]
    seconds: float
    recorded: bool = False  # the pass recorded a run of its own (not everything was carried or decided)
    skipped: bool = False  # a resumed full run made the quick pass needless
    waiting: int = 0  # a full pass run while the kernel stage builds: the variants it left for after the stage


def run(opts: RunOptions, con: Any) -> int:
    """`checks run`: the chain once at the level given, or with none given at the quick level and then at the
    full level; the exit code (0 done, 130 interrupted, 2 results not stored)."""
    if why := unwritable(opts.results):
        print(f"checks run: results folder: {why}; nothing was run (give --results DIR on a writable disk)",
              file=sys.stderr)
        return 2
    # --budget: the whole command ends by then; each pass fits what is left of it (checks.run.cost.budget)
    deadline = None if opts.budget_s is None else time.monotonic() + opts.budget_s
    passes = levels(opts)
    compiling = kernelstage.running() is not None  # the full level's plan changes when the stage ends
    ready = prepared(passes[-1]) if len(passes) > 1 and not (opts.resume or opts.fresh or compiling) else None
    if ready is not None and (again := unchanged(passes[-1], ready)) is not None:
        reread = f" ({again} variant(s) read this host's state again)" if again else ""
        con.print(f"level: full only: every variant is unchanged since its last run{reread}, so one pass answers",
                  markup=False, highlight=False)
        passes = passes[-1:]
    staged = len(passes) > 1
    if staged and ready is not None:
        con.print(full_level_line(passes[-1], ready), markup=False, highlight=False)
    done: list[Pass] = []
    for i, level_opts in enumerate(passes):
        first = done[-1] if i and not done[-1].skipped else None
        if level_opts.level != QUICK and not opts.resume and (building := kernelstage.building()):
            # the kernel stage `provision build` left running builds for minutes: the full level runs now what
            # needs none of it, and after the stage only what does (the same run's results carried over)
            interim = one_pass(level_opts, con, staged, first, None, deadline, building)
            done.append(interim)
            if interim.code or not interim.waiting:
                break
            first = interim
        if level_opts.level != QUICK and wait_for_kernels(con):
            ready = None  # the cells now carry what the stage built: the full level is planned again
        mine = ready if i == len(passes) - 1 or ready is None else replanned(ready, level_opts)
        outcome = one_pass(level_opts, con, staged, first, mine, deadline)
        done.append(outcome)
        if outcome.code:
            break
    if opts.as_json:
        print(json.dumps([r.to_json() for r in answer(done)], indent=2, sort_keys=True))
    return done[-1].code


# A GPU variant of a full pass run beside the kernel stage names it among what ran beside it (its timings were taken
# while the stage's niced compilers held the CPU cores)
STAGE_BESIDE = "the kernel stage of `provision build` (flashinfer module builds, niced)"


def wait_for_kernels(con: Any) -> bool:
    """Before a full-level pass: wait for the kernel stage `provision build` left running (its lines shown as
    they come), so the pass loads the modules it carries instead of compiling them again; True when it waited."""
    try:
        return kernelstage.wait(lambda line: con.print(line, markup=False, highlight=False))
    except KeyboardInterrupt:
        con.print("stopped waiting: the kernel stage goes on by itself (`checks run` again waits for it); the "
                  "table written so far stands", markup=False, highlight=False)
        raise


def answer(passes: list[Pass]) -> list[ProbeResult]:
    """Every variant once: its result from the last pass that recorded it (the quick pass's where the full
    pass was stopped before it), in the order the passes made them."""
    out: dict[tuple[str, str, str], ProbeResult] = {}
    for p in passes:
        for r in p.results:
            out.pop(r.key, None)
            out[r.key] = r
    return list(out.values())


def levels(opts: RunOptions) -> tuple[RunOptions, ...]:
    """One options value per pass: the level given alone, or (no --level) quick and then full."""
    if opts.level is not None:
        return (opts,)
    return (dataclasses.replace(opts, level=QUICK), dataclasses.replace(opts, level=FULL))


@dataclass(frozen=True)
class Prepared:
    """The chain's steps up to the plan, done once: the backend (with the line saying why ``auto`` chose
    it), the probes, the targets and the plan."""

    backend: Backend
    chosen: str
    probes: dict[str, ModuleType]
    targets: Targets
    planned: Planned


def unchanged(opts: RunOptions, ready: Prepared) -> int | None:
    """Whether the full level, prepared as ``ready``, would learn nothing new: every variant reused or decided
    without running, or only reading this host's state again (incremental.rechecked). Then the quick pass
    before it would only write a table the full pass writes again. The number of variants that read the host
    again, or None when the full level has something to run. The full pass takes ``ready`` either way instead
    of preparing it again. Never asked for a resumed or --fresh run."""
    host_id = str(ready.targets.facts["host_id"])
    store = RunStore(opts.results, host_id, next_run_id(opts.results / host_id))  # no file until news
    latest = incremental.latest(store.folder)
    runs = [it for it in reuse(opts, ready.planned, store).items if it.runs]
    if all(incremental.rechecked(it, latest, ready.planned.hashes) for it in runs):
        return len(runs)
    return None


def replanned(ready: Prepared, opts: RunOptions) -> Prepared:
    """The steps up to the plan done for one pass, planned again at another pass's level: the backend, its
    executors, the host facts and the environments' fingerprints are the same for both passes, so the quick
    pass does not start the environments again to read what the full pass's preparation read."""
    return dataclasses.replace(ready, planned=plan(opts, ready.probes, ready.targets, ready.planned.fingerprints))


def full_level_line(opts: RunOptions, ready: Prepared) -> str:
    """Said before the quick pass: what the full level after it should cost, from the durations this host (or
    its class, or the packaged prior) recorded. Variants the quick pass answers at full fidelity are counted
    too, so the figure leans long."""
    host_id = str(ready.targets.facts["host_id"])
    store = RunStore(opts.results, host_id, next_run_id(opts.results / host_id))  # no file until news
    todo = reuse(opts, ready.planned, store).items
    view = progress_view(opts, ready.backend.name, store, todo, ready.targets.facts,
                         cell_carries(opts, ready.backend.name, ready.targets))
    return (f"cost: the quick answer first, then the full level: {len(view.expected)} variant(s) to run, "
            f"{view.left().text()} ({view.basis()})")


def prepared(opts: RunOptions) -> Prepared:
    """The chain's steps from the backend to the plan: backend -> probes -> targets -> prepare -> plan."""
    name, chosen = resolve(opts.backend)
    backend = BACKENDS[name]()
    probes = select_probes(opts)
    targets = backend.targets(opts)
    return Prepared(backend, chosen, probes, targets, plan(opts, probes, targets, backend.prepare(opts, targets)))


def one_pass(opts: RunOptions, con: Any, staged: bool, first: Pass | None, ready: Prepared | None = None,
             deadline: float | None = None, building: Mapping[str, Iterable[str]] | None = None) -> Pass:
    """The chain at ``opts.level``. ``staged``: one of two passes; ``first``: the pass before this one (said in
    the line between them, and with --fresh the only results this pass may reuse); ``ready``: this pass's steps
    up to the plan, already done; ``deadline``: the monotonic time --budget ends the command at; ``building``:
    what the running kernel stage builds (common.build.kernelstage.building), whose variants this pass leaves
    for the pass after the stage (plan.awaiting_stage)."""
    started = time.monotonic()
    ready = ready or prepared(opts)
    if ready.chosen:
        print(f"checks: {ready.chosen}", file=sys.stderr, flush=True)
    backend, probes, targets, planned = ready.backend, ready.probes, ready.targets, ready.planned
    store = open_store(opts, str(targets.facts["host_id"]), staged)
    if store is None:
        con.print("quick level: not run; --resume continues the latest run, a full-level one", markup=False)
        return Pass(0, [], 0.0, skipped=True)
    planned = soaked(opts, reuse(opts, planned, store, first.results if first else None))
    carries = cell_carries(opts, backend.name, targets)
    if opts.level == QUICK:
        planned = defer(opts, planned, carries, targets)
    elif building:
        planned = dataclasses.replace(planned, items=awaiting_stage(planned.items, building))
    waiting = sum(1 for it in planned.items if it.decided is not None and it.decided.reason_code == STAGE_WAIT)
    if first is not None:
        con.print(between(first, planned, opts, backend.name, store, targets.facts, carries), markup=False,
                  highlight=False)
    view = progress_view(opts, backend.name, store, to_run(opts, planned, store), targets.facts, carries)
    planned, view, fitted = fit_budget(opts, planned, view, targets.gpus, deadline)
    show_plan(con, targets.facts, planned.items, probes)
    for line in budget.cost_lines(view.items, {k: e.seconds for k, e in view.expected.items()},
                                  {k: e.seconds is None for k, e in view.expected.items()}):
        con.print(f"  cost {line}", markup=False, highlight=False)
    for line in budget.left_out_lines(fitted) if fitted is not None else ():
        con.print(line, markup=False, highlight=False)
    if fitted is None and (hint := budget.budget_hint(
            view.items, {k: e.seconds for k, e in view.expected.items()}, opts.jobs, targets.gpus,
            view.shared_ranks, view.switched, view.islands)):
        con.print(hint, markup=False, highlight=False)
    if line := compile_line(targets, probes):
        con.print(line, markup=False, highlight=False)
    for line in kernel_lines(carries, targets.facts.get("compute_capability") if targets.gpus else None):
        con.print(line, markup=False, highlight=False)
    for line in compile_lines(view):
        con.print(line, markup=False, highlight=False)
    with RunLock(store.folder):
        written = write_manifest(opts, store, backend.name, targets, probes, planned)
        report = execute(con, opts, backend, store, targets, planned, written, carries, view, deadline,
                         (STAGE_BESIDE,) if building else ())
        if first is not None and first.recorded and not report.interrupted:
            store.keep()  # the quick pass's answers, now recorded at the full level: the table drops "quick"
    if not store.results_path.exists() and not store.unstored:  # the store makes a run's files with its first news
        con.print("results: nothing new, so no run recorded (each variant reused or decided as before)",
                  markup=False)
    code = finish(con, opts, report, targets.gpus, staged, waiting)
    return Pass(unstored(store) or code, report.results, time.monotonic() - started, store.results_path.exists(),
                waiting=waiting)


def between(first: Pass, planned: Planned, opts: RunOptions, backend: str, store: RunStore,
            facts: dict[str, Any], carries: Mapping[str, Mapping[str, tuple[str, ...]]]) -> str:
    """The line between the passes: what the first answer covered, what the full level adds and how long
    that should take by the durations this host recorded (and for what it never timed, hosts of its class)."""
    todo = to_run(opts, planned, store)
    view = progress_view(opts, backend, store, todo, facts, carries)
    answer = "table written" if opts.report is not None else "done"
    if first.waiting:  # the full level's pass while the kernel stage built
        head = (f"the kernel stage has ended (the full level's pass beside it took {duration(first.seconds)}); "
                f"now the {first.waiting} variant(s) that needed what it built")
        return f"{head}: nothing more to run" if not view.expected else \
            f"{head}: {len(view.expected)} variant(s) to run, {view.left().text()} ({view.basis()})"
    head = f"first answer: {answer} (quick level, {len(first.results)} variant(s) in {duration(first.seconds)})"
    if not view.expected:
        return f"{head}; now the full level: nothing more to run"
    return f"{head}; now the full level: {len(view.expected)} variant(s) to run, {view.left().text()} ({view.basis()})"


def unstored(store: RunStore) -> int:
    """What a failed write (a full disk) kept from the results files, said at the end; 2 when anything."""
    if not store.unstored:
        return 0
    print(f"checks: {len(store.unstored)} result(s) were measured but not stored ({store.write_error}); "
          "free space and rerun them:", file=sys.stderr)
    for r in store.unstored:
        print(f"  not stored: {r.result_id} {r.verdict.status.value}", file=sys.stderr)
    return 2


def select_probes(opts: RunOptions) -> dict[str, ModuleType]:
    probes = {pid: mod for pid, (_, mod) in registry.discover().items()}
    if opts.all_probes:
        if not probes:
            raise UsageError("checks run: no probes found in inenv/probes")
        return probes
    for pid in opts.probes:
        if pid not in probes:
            close = difflib.get_close_matches(pid, list(probes), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "; see `checks list`"
            raise UsageError(f"checks run: unknown probe {pid!r}{hint}")
    return {pid: probes[pid] for pid in opts.probes}


def plan(opts: RunOptions, probes: dict[str, ModuleType], targets: Targets,
         fingerprints: dict[str, EnvPrint | None]) -> Planned:
    """Cells x probes x variants on the targets' host, with the inputs each fresh result will record."""
    host = dataclasses.replace(hostfacts.host_view(targets.facts, targets.compile.archs), gpu_count=targets.gpus,
                               level=opts.level)
    items = plan_work(targets.cells, probes, host, opts.timeout_scale)
    inputs = {it.key: incremental.inputs_for(it, fingerprints.get(it.cell.cell_id), targets.facts,
                                             targets.compile.archs) for it in items if it.runs}
    costs = {pid: dict(declared(mod).build_cost) for pid, mod in probes.items()}
    return Planned(items, provenance.probe_hashes(probes), provenance.checkout(), inputs, fingerprints, costs)


def open_store(opts: RunOptions, host_id: str, staged: bool = False) -> RunStore | None:
    """The store of a new run, or with --resume of the host's latest run. In a staged run (quick, then
    full) --resume continues the latest run in the pass of its level, and the other pass starts a run of its
    own; None for the quick pass when that run is a full one (the full level answers every quick question)."""
    folder = opts.results / host_id
    latest = latest_run(folder) if opts.resume else None
    if latest and (why := regular_run(folder, latest)):
        print(f"checks run: --resume: {ids.shown(str(folder / f'{latest}.jsonl'))} {why}; a new run starts instead",
              file=sys.stderr, flush=True)
        latest = None
    if latest and staged:
        made = read_manifest(folder / f"{latest}.manifest.json")[0]
        level = made.get("level") if isinstance(made, dict) else None
        if level == FULL and opts.level == QUICK:
            return None
        if level != opts.level:
            latest = None
    return RunStore(opts.results, host_id, latest or next_run_id(folder), exact=opts.fresh)


def reuse(opts: RunOptions, planned: Planned, store: RunStore,
          first: list[ProbeResult] | None = None) -> Planned:
    """Items whose inputs match the result this host recorded last carry it. With --fresh none do, except
    in the full pass of a staged run the results its quick pass just made (``first``)."""
    if opts.fresh and first is None:
        return planned
    earlier = {r.key: r for r in first} if opts.fresh and first is not None else incremental.latest(store.folder)
    ours = frozenset(r.run_id for r in first or [])
    items = incremental.decide(planned.items, earlier, planned.inputs, planned.hashes, opts.level, ours)
    return dataclasses.replace(planned, items=items)


def soaked(opts: RunOptions, planned: Planned) -> Planned:
    """With --soak, a probe's variants that replay under load (``ProbeSpec.sustained``) run again whatever this host
    recorded (a soak asks more of them than the short check a result holds) and may take the soak longer."""
    if not opts.soak_s:
        return planned
    items = [dataclasses.replace(it, reused=None, timeout_s=it.timeout_s + opts.soak_s)
             if it.spec.sustained and it.decided is None else it for it in planned.items]
    return dataclasses.replace(planned, items=items)


def cell_carries(opts: RunOptions, backend: str, targets: Targets) -> dict[str, dict[str, tuple[str, ...]]]:
    """What each cell carries (common.build.buildrecord.BuildRecord.carried), from its build record for this
    backend, and what a user's environment already holds for this GPU (``targets.holds``, read from it);
    nothing for a cell of neither (Slurm)."""
    out: dict[str, dict[str, tuple[str, ...]]] = {cid: dict(have) for cid, have in targets.holds.items()}
    for cell in targets.cells if backend in RECORD_NAMES else ():
        record = buildrecord.read(opts.envs / cell.cell_id, backend).record
        if record is not None:
            out[cell.cell_id] = {**out.get(cell.cell_id, {}), **dict(record.carried)}
    return out


def kernel_lines(carries: dict[str, dict[str, tuple[str, ...]]], capability: str | None) -> list[str]:
    """On a GPU host, per cell with carried kernels: which of them run on this GPU, and that the rest is
    compiled here."""
    if not capability:
        return []
    out = []
    for cid, have in sorted(carries.items()):
        if not have:
            continue
        fit = sorted(m for m, sass in have.items() if kit.runs_on(sass, capability))
        rest = sorted(set(have) - set(fit))
        out.append(f"  {cid}: carries {len(fit)} of its {len(have)} comm module(s) for compute capability "
                   f"{capability}" + (f"; compiles {', '.join(rest)} here (carried for other GPUs)" if rest else ""))
    return out


def needed_distributions(module: ModuleType) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """A probe module's ``DISTRIBUTIONS`` (param, value, distribution names): what a variant with that param
    value needs installed; entries of another shape are left out (a probe on STACKPROBE_PROBE_PATH is anyone's)."""
    raw = getattr(module, "DISTRIBUTIONS", ())
    out = []
    for entry in raw if isinstance(raw, tuple | list) else ():
        if (isinstance(entry, tuple | list) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[1], str) and isinstance(entry[2], tuple | list)
                and all(isinstance(d, str) for d in entry[2])):
            out.append((entry[0], entry[1], tuple(entry[2])))
    return tuple(out)


def skipping_at_once(opts: RunOptions, backend: str, todo: list[WorkItem]) -> dict[tuple[str, str, str], str]:
    """The variants of ``todo`` that will skip at once (missing-package) -> the distribution their cell lacks
    (:func:`lacking_distributions`), by the serving engines and sgl-kernel each cell's build self-check found
    (common.build.buildrecord.BuildRecord.holds). They still run and find it themselves; this only costs them
    as the skip they will be. Cells without a build record (the local environment, an image): none."""
    if backend not in RECORD_NAMES:
        return {}
    held: dict[str, Mapping[str, str] | None] = {}

    def holds(cell_id: str) -> Mapping[str, str] | None:
        if cell_id not in held:
            record = buildrecord.read(opts.envs / cell_id, backend).record
            held[cell_id] = record.holds if record is not None else None
        return held[cell_id]

    return lacking_distributions(todo, holds)


def lacking_distributions(todo: Iterable[WorkItem], holds: Callable[[str], Mapping[str, str] | None]
                          ) -> dict[tuple[str, str, str], str]:
    """The variants of ``todo`` that need a distribution their probe declares (:func:`needed_distributions`)
    among those a build self-check reports (common.build.buildrecord.CHECKED) that ``holds(cell id)`` (what a
    cell holds of those; None: unknown) lacks -> the first such distribution."""
    looked_for = frozenset(buildrecord.CHECKED)
    needs: dict[str, tuple[tuple[str, str, tuple[str, ...]], ...]] = {}
    out: dict[tuple[str, str, str], str] = {}
    for it in todo:
        if not it.runs:
            continue
        if it.spec.id not in needs:
            try:
                needs[it.spec.id] = needed_distributions(registry.find(it.spec.id)[1])
            except Exception:  # a probe that cannot be found here is costed as any other
                needs[it.spec.id] = ()
        wanted = [d for name, value, dists in needs[it.spec.id] if it.variant.param(name) == value
                  for d in dists if d in looked_for]
        found = holds(it.cell.cell_id) if wanted else None
        lacking = [d for d in wanted if found is not None and d not in found]
        if lacking:
            out[it.key] = lacking[0]
    return out


def without_nvcc(opts: RunOptions, backend: str, todo: list[WorkItem]) -> dict[str, str]:
    """The cells of ``todo``'s compile-probe variants whose build record says the build found no nvcc in the cell
    (common.build.buildrecord.BuildRecord.no_nvcc) -> what it found instead: nothing compiles there, so their
    variants are not costed as compiles; they still run and find it themselves."""
    cells = {it.cell.cell_id for it in todo if it.spec.build_param and it.runs}
    out: dict[str, str] = {}
    for cid in sorted(cells) if backend in RECORD_NAMES else ():
        record = buildrecord.read(opts.envs / cid, backend).record
        if record is not None and record.no_nvcc:
            out[cid] = record.no_nvcc
    return out


def compile_lines(view: runprogress.RunView) -> list[str]:
    """Per cell, the modules the compile probe builds here (nothing carries or holds them for their target,
    nothing published them) and what that should cost, so the plan says it before anything starts; a cell whose
    build found no nvcc in it says that instead."""
    per: dict[str, dict[str, float | None]] = {}
    for it in view.items:
        if it.key in view.compiling:
            exp = view.expected.get(it.key)
            per.setdefault(it.cell.cell_id, {})[f"{it.variant.param(it.spec.build_param)}@"
                                                f"{it.variant.param('arch') or 'local'}"] = exp.seconds if exp else None
    out = []
    for cid, mods in sorted(per.items()):
        known = [v for v in mods.values() if v is not None]
        cost = f", about {duration(sum(known))} of compiling" if known else ""
        guessed = f" ({len(mods) - len(known)} never timed)" if len(known) < len(mods) else ""
        out.append(f"  {cid}: compiles {', '.join(sorted(mods))} here{cost}{guessed}")
    for cid, found in sorted(view.no_nvcc.items()):
        out.append(f"  {cid}: compiles nothing: its build found no nvcc in the cell ({escape.terminal(found)}); "
                   "the compile probe's variants check that themselves")
    return out


def defer(opts: RunOptions, planned: Planned, carries: dict[str, dict[str, tuple[str, ...]]],
          targets: Targets) -> Planned:
    """A quick pass leaves to the full pass the GPU variants that would compile in their turn (plan.deferred):
    what each cell carries from its build record, what fi-jit built here from the compile cache; and the
    multi-rank ones beyond their smallest world size (plan.deferred_sizes); the checked-not-timed variants of a
    probe whose answer is its timings (plan.deferred_shallow)."""
    unpublished = unpublished_here(opts)
    capability = targets.facts.get("compute_capability") if targets.gpus else None
    items = deferred_shallow(deferred_sizes(deferred(planned.items, carries, capability, unpublished)))
    return dataclasses.replace(planned, items=items)


def compile_line(targets: Targets, probes: dict[str, ModuleType]) -> str:
    """The plan's line naming what the compile probes (those that build: ``ProbeSpec.build_param``) build for
    and why; "" when none is selected."""
    return f"  {targets.compile.why}" if any(mod.SPEC.build_param for mod in probes.values()) else ""


def show_plan(con: Any, facts: dict[str, Any], items: list[WorkItem], probes: dict[str, Any]) -> None:
    gpu = f"{facts['gpu_count']}x {facts['gpu_name']} (CC {facts['compute_capability']})" if facts.get("gpu_count") \
        else f"no GPU ({facts.get('no_gpu_reason')})"
    con.print(f"[bold]host[/] {facts['host_id']}: {gpu}", highlight=False)
    counts = summary_counts(items)
    con.print(f"[bold]plan[/] {len(counts)} cell(s) x {len(probes)} probe(s) = {len(items)} variant(s)")
    for cell_id, c in counts.items():
        run, reused = c.pop("run", 0), c.pop(REUSED, 0)
        con.print(f"  {cell_id}: {run} to run" + (f", {reused} unchanged" if reused else ""), markup=False)
        for why, n in sorted(c.items()):
            con.print(f"    {n} decided without running, {why}", markup=False)
    if line := incremental.reused_line(items):
        con.print(f"[bold]reused[/] {line}", highlight=False)


def write_manifest(opts: RunOptions, store: RunStore, executor: str, targets: Targets,
                   probes: dict[str, ModuleType], planned: Planned) -> dict[str, Any]:
    new = manifest.build(store.run_id, store.host_id, now_iso(), executor, targets.facts, targets.cells, probes,
                         planned.code, planned.hashes, list(opts.argv), opts.level, planned.fingerprints)
    old = read_manifest(store.manifest_path)[0] if opts.resume else None
    merged = manifest.merge(old, new)
    store.write_manifest(merged)
    return merged


def execute(con: Any, opts: RunOptions, backend: Backend, store: RunStore, targets: Targets, planned: Planned,
            written: dict[str, Any], carries: Mapping[str, Mapping[str, tuple[str, ...]]] | None = None,
            view: runprogress.RunView | None = None, deadline: float | None = None,
            alongside: tuple[str, ...] = ()) -> RunReport:
    """The backend runs the work; progress is shown as it goes (``carries``: the kernels each cell carries,
    so a variant that loads them is not said to compile; ``view``: the progress view the plan was costed
    with; ``alongside``: what runs on the host beside the whole run, for each GPU variant's evidence). Nothing
    starts after ``deadline`` (--budget). Ctrl-C outside the backend's own handling still ends what it
    started."""
    todo = to_run(opts, planned, store)
    if any(it.runs and it.reused is None for it in todo):  # where they go; a run with nothing to run may write
        con.print(f"[bold]results[/] {store.results_path}", highlight=False)  # no file, and says so at its end
    codes = {pid: planned.code.for_probe(h) for pid, h in planned.hashes.items()}
    view = view or progress_view(opts, backend.name, store, todo, targets.facts, carries)
    costs = runprogress.start_costs(view.items, view.expected, planned.build_costs)
    # what this run measures re-estimates what is left (RunView.finish), and the longest of it still starts first
    view.on_estimates = lambda: costs.update(runprogress.start_costs(view.items, view.expected, planned.build_costs))
    work = Work(planned.items, store, reasons.default(), targets.gpus, codes, planned.inputs, manifest=written,
                costs=costs, deadline=deadline, alongside=alongside)
    try:
        return runconsole.with_progress(con, view, lambda hooks: backend.run(opts, work, hooks))
    except KeyboardInterrupt:
        backend.cancel()
        raise


def to_run(opts: RunOptions, planned: Planned, store: RunStore) -> list[WorkItem]:
    """The items this invocation goes through: all but those a resumed run recorded."""
    done = store.recorded() if opts.resume else set()
    return [it for it in planned.items if it.key not in done]


def progress_view(opts: RunOptions, backend: str, store: RunStore, todo: list[WorkItem],
                  facts: dict[str, Any],
                  carries: Mapping[str, Mapping[str, tuple[str, ...]]] | None) -> runprogress.RunView:
    """Counts and time estimates of ``todo``, from the durations this host recorded before this run, and
    for what it never timed from those the hosts of its class (``facts``: this host's) recorded under the
    same results root. ``carries`` (every caller's to give: cell_carries): what each cell carries, so fi-jit's
    variants that load a carried module are not costed as compiles."""
    recorded = runprogress.learned(store.folder)
    compiles = {it.spec.id for it in todo if it.spec.build_param}
    lent = runprogress.lent(store.folder.parent, store.folder.name, facts, compiles)
    gpus = facts.get("gpu_count") if isinstance(facts.get("gpu_count"), int) else 0
    prior = costmodel.at_level(costmodel.tables_for(costmodel.load_prior(), str(facts.get("gpu_name") or ""), gpus),
                               opts.level == QUICK)
    no_nvcc = without_nvcc(opts, backend, todo)
    compiling = compiling_here(opts, todo, carries or {}, facts.get("compute_capability") if gpus else None, no_nvcc)
    lacking = skipping_at_once(opts, backend, todo)
    lanes = side_by_side(opts, backend, facts)
    expected = runprogress.expected_durations(todo, recorded, backend, lent, prior, compiling, lacking)
    if opts.soak_s:  # a soak replays each load variant that long beyond its set-up
        expected.update({it.key: dataclasses.replace(expected[it.key], seconds=opts.soak_s + (
            expected[it.key].seconds or budget.UNTIMED_S)) for it in todo if it.spec.sustained and it.key in expected})
    return runprogress.RunView(todo, expected,
                               jobs=opts.jobs, prior=prior, compiling=compiling, lacking=lacking, no_nvcc=no_nvcc,
                               shared_ranks=0 if opts.gpu_alone else None, gpus=gpus,
                               switched=lanes, islands=placement.islands(facts) if lanes else (),
                               compile_note=runprogress.compile_note(
                                   compile_cache_dir(opts.compile_cache, opts.no_compile_cache), carries,
                                   facts.get("compute_capability") if facts.get("gpu_count") else None),
                               history=recorded, lent=lent, backend=backend)


def side_by_side(opts: RunOptions, backend: str, facts: Mapping[str, Any]) -> bool:
    """Whether this host's timed variants will run side by side on disjoint GPU sets, as the runner places them
    (checks.run.runner.side_by_side_lanes): every pair of its GPUs joined by NVLink or its GPUs grouped behind PCIe
    switches, no --gpu-alone, and a backend that runs its variants on this host (Slurm's jobs are placed by
    Slurm)."""
    return backend != SLURM and not opts.gpu_alone and placement.side_by_side(facts)


def unpublished_here(opts: RunOptions) -> Callable[[WorkItem, list[str]], list[str]]:
    """Which of the flashinfer modules a work item names no fi-jit build has published for its cell in this run's
    compile cache (all of them when nothing is known; none for a cell without flashinfer)."""
    env_of = runprogress.compile_env(compile_cache_dir(opts.compile_cache, opts.no_compile_cache))

    def unpublished(item: WorkItem, modules: list[str]) -> list[str]:
        release = item.cell.versions.get("flashinfer") or ""
        return kit.unpublished(modules, release, env_of(item)) if release and release != "none" else []

    return unpublished


def compiling_here(opts: RunOptions, todo: list[WorkItem], carries: Mapping[str, Mapping[str, tuple[str, ...]]],
                   capability: str | None, no_nvcc: Collection[str] = ()) -> frozenset[tuple[str, str, str]]:
    """The compile probe's variants that will compile their module here (plan.compiles_here): what nothing
    carries for their target and no fi-jit build has published for the cell in the compile cache, in a cell whose
    build found an nvcc (``no_nvcc``: the cells of :func:`without_nvcc`)."""
    unpublished = unpublished_here(opts)
    return frozenset(it.key for it in todo
                     if it.cell.cell_id not in no_nvcc and compiles_here(it, carries, capability, unpublished))


def fit_budget(opts: RunOptions, planned: Planned, view: runprogress.RunView, gpus: int,
               deadline: float | None) -> tuple[Planned, runprogress.RunView, budget.Fitted | None]:
    """With --budget, the plan fitted into what is left of it (checks.run.cost.budget.fit): the variants left out
    become not-run over-budget and the view counts only what runs; the fit itself (None without a budget)."""
    if deadline is None:
        return planned, view, None
    seconds = {k: e.seconds for k, e in view.expected.items()}
    fitted = budget.fit(planned.items, seconds, max(0.0, deadline - time.monotonic()), opts.jobs, gpus,
                        view.shared_ranks, view.switched, view.islands)
    if not fitted.left_out:
        return planned, view, fitted
    gone = {it.key for it in fitted.left_out}
    now = {it.key: it for it in fitted.items}
    todo = [now.get(it.key, it) for it in view.items]
    kept = dataclasses.replace(view, items=todo, expected={k: e for k, e in view.expected.items() if k not in gone})
    return dataclasses.replace(planned, items=fitted.items), kept, fitted


def finish(con: Any, opts: RunOptions, report: RunReport, gpus: int | None = None, staged: bool = False,
           waiting: int = 0) -> int:
    """The summary, the regenerated table, and last the verdict count and where the table is (``--json`` is
    printed once after every pass); ``waiting``: the variants a pass run beside the kernel stage left for
    after it."""
    if report.resumed:
        con.print(f"resumed: {report.resumed} variant(s) already recorded were not run again", markup=False)
    if reused := report.reused:
        runs = sorted({incremental.origin(r) for r in reused})
        con.print(f"reused: {len(reused)} variant(s) unchanged since run{'s' if len(runs) > 1 else ''} "
                  f"{', '.join(runs)} were not run again (--fresh reruns them)", markup=False)
    if waiting:
        con.print(f"level: {opts.level}, beside the kernel stage (every variant but the {waiting} that need what it "
                  "builds; they follow when it ends)", markup=False)
    elif staged:
        con.print(f"level: {opts.level}" + (" (the first answer; the full level follows)" if opts.level == QUICK
                                           else " (every variant; the quick answer is replaced)"), markup=False)
    for line in summary.lines(report.results, gpus):
        con.print(line, markup=False)
    where = regenerate(opts.report, opts.results, report.interrupted)
    con.print(f"verdicts: {summary.totals_line(report.results)}" + (" (quick level)" if opts.level == QUICK
                                                                    else ""), markup=False)
    con.print(where, markup=False)
    return 130 if report.interrupted else 0


def regenerate(table: Path | None, results_dir: Path, interrupted: bool) -> str:
    """Regenerate the table from every run under ``results_dir``; the line that says where it is (or why
    it was not written)."""
    words = ["checks", "report", "--results", str(results_dir), *(["--out", str(table)] if table else [])]
    rerun = f"`{escape.command(words)}`"
    if table is None:
        return f"table: not regenerated (--no-report); {rerun} writes it"
    if interrupted:
        return f"table: not regenerated after the stop; {rerun} writes it from what finished"
    if generate(results_dir, table, None, False, repo=REPO, quiet=True, reuse=True) != 0:
        return f"table: not written (see above); {rerun} retries"
    return f"table: {shown(table)} and {shown(table.with_suffix('.html'))}, from every run in {shown(results_dir)}"


def shown(path: Path) -> str:
    """A path relative to the working directory when it is under it, as a user would type it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
