"""`checks list | run | report | advise | diff | share | import | validate`: the host-side command line. Exit codes:
0 done, 2 bad input, 130 interrupted; share, import and validate also 1 (checks.exchange says when)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from checks import (
    gpuarch,
    hostfacts,
    ids,
    incremental,
    manifest,
    memlock,
    progress,
    provenance,
    reasons,
    registry,
    runprogress,
    shellwords,
    summary,
)
from checks.executor import Executor, ExecutorError, LocalExecutor, compile_cache_dir, for_run, gpu_lock_path
from checks.plan import (
    REUSED,
    CellState,
    CellTarget,
    ImageState,
    WorkItem,
    image_state,
    local_cell_id,
    matches_cuda,
    plan_work,
    select_cells,
    summary_counts,
)
from checks.probe import FULL, LEVELS
from checks.progress import TICK_S
from checks.provenance import Provenance
from checks.result import ProbeResult
from checks.runner import RunReport, execute, now_iso
from checks.status import Status
from checks.store import RunLock, RunStore, StoreBusy, latest_run, new_run_id, read_manifest

REPO = Path(__file__).resolve().parent.parent
STATUS_STYLE = {Status.PASS: "green", Status.PARTIAL: "yellow", Status.SKIP: "dim", Status.FAIL: "red",
                Status.CRASH: "bold red", Status.HANG: "magenta", Status.NOT_RUN: "cyan", Status.UNAVAILABLE: "blue"}


MAX_DEFAULT_JOBS = 4


def default_jobs() -> int:
    """The CPU cores this process may use, at most MAX_DEFAULT_JOBS (each compile job is itself parallel)."""
    return max(1, min(MAX_DEFAULT_JOBS, len(os.sched_getaffinity(0))))


class UsageError(Exception):
    """Bad input: printed as one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see --help)")


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="checks", description="Run the probe suite against cells and report the results.")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    p = sub.add_parser("list", help="the probes: id, feature, ranks, packages needed")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("run", help="run probes in cell images (docker) or in a local Python environment")
    p.add_argument("--all", action="store_true", help="every probe")
    p.add_argument("--probe", action="append", default=[], metavar="ID", help="a probe id (repeatable)")
    p.add_argument("--cuda", help="cells of this CUDA version (13 = every 13.x)")
    p.add_argument("--only", action="append", default=[], metavar="GLOB", help="cells whose id matches (repeatable)")
    p.add_argument("--local", action="store_true", help="run in a local Python environment instead of images")
    p.add_argument("--backend", choices=("auto", "docker", "venv"), default="auto",
                   help="cells as Docker images or as venv cells (`provision build --backend venv`); auto: "
                        "Docker when its daemon answers, else venv cells")
    p.add_argument("--python", help="the local environment's interpreter (with --local; default: this one); with "
                   "--executor slurm, the interpreter on the nodes instead of the venv cells")
    p.add_argument("--executor", choices=("local", "docker", "slurm"),
                   help="where variants run: docker (default), local (= --local) or slurm (jobs from this host)")
    p.add_argument("--partition", help="Slurm partition (default: the site's default partition)")
    p.add_argument("--gpus-per-job", type=int, metavar="N", help="most GPUs one Slurm job asks for (default: "
                   "the partition's GPUs per node); variants needing more are skipped")
    p.add_argument("--time", type=int, metavar="MIN", help="time limit of every Slurm job, minutes (default: "
                   "its variants' timeouts added up)")
    p.add_argument("--container-image", metavar="IMAGE", help="with slurm: run in this image through the site's "
                   "pyxis plugin, where it has one (default: the --python interpreter on the nodes)")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="passed to sbatch for every job (repeatable), e.g. --sbatch-arg=--account=X")
    p.add_argument("--resume", action="store_true", help="continue the latest run, skipping recorded variants")
    p.add_argument("--fresh", action="store_true", help="run every variant, even those whose inputs (environment, "
                   "probe source, host facts) match a result this host recorded (by default reused)")
    p.add_argument("--jobs", type=int, default=default_jobs(), metavar="N",
                   help="CPU-only variants of different cells run up to N at once; GPU variants run alone "
                        f"(default: the CPU cores, at most {MAX_DEFAULT_JOBS}: {default_jobs()} here)")
    p.add_argument("--level", choices=LEVELS, default=FULL, help="quick: fi-jit's smallest module only and the GPU "
                   "probes at one message size, marked as such in the table; full (default): everything")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("--timeout-scale", type=float, default=1.0, metavar="X", help="multiply every probe timeout")
    p.add_argument("--target-arch", default="12.0a,12.0f", help="cross-compile targets for compile probes")
    p.add_argument("--compile-cache", type=Path, metavar="DIR", help="compiled JIT modules shared by every cell "
                   "and run (default: $STACKPROBE_COMPILE_CACHE, else .cache/compile in the repository)")
    p.add_argument("--no-compile-cache", action="store_true", help="compile everything again, share nothing")
    p.add_argument("--results", type=Path, default=REPO / "results", help="results directory")
    p.add_argument("--matrix", type=Path, default=REPO / "matrix.yaml", help="matrix file (docker mode)")
    p.add_argument("--envs", type=Path, default=REPO / "envs", help="where `provision build` wrote build.json")
    p.add_argument("--report", type=Path, metavar="MD", help="the table regenerated at the end, with its .html "
                   "(default: docs/compatibility.md for the default --results, else <results>/compatibility.md)")
    p.add_argument("--no-report", action="store_true", help="do not regenerate the table at the end")
    p = sub.add_parser("report", help="generate docs/compatibility.md (and .html) from the results")
    p.add_argument("--results", type=Path, default=REPO / "results")
    p.add_argument("--out", type=Path, help="the Markdown table (default: docs/compatibility.md for the default "
                   "--results, else <results>/compatibility.md, as `checks run` writes it)")
    p.add_argument("--html", type=Path, help="HTML page path (default: --out with .html)")
    p.add_argument("--check", action="store_true", help="exit 1 if the files on disk are not what would be written")
    decision_parsers(sub)
    exchange_parsers(sub)
    return ap


def _console() -> Any:
    return progress.console()  # never wraps: a log gets one event per line


# --- list --------------------------------------------------------------------------------------------------
def cmd_list(args: argparse.Namespace) -> int:
    probes = registry.discover()
    rows = []
    for pid, (loc, mod) in sorted(probes.items()):
        s = mod.SPEC
        rows.append({"id": pid, "title": s.title, "feature": s.feature, "ranks": list(s.ranks),
                     "min_ranks": s.min_ranks, "distinct_gpus": s.distinct_gpus,
                     "requires": list(s.requires), "needs_gpu": s.needs_gpu,
                     "timeout_s": s.timeout_s, "source": loc.module or loc.file})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table("id", "title", "ranks", "gpu", "needs", title=f"{len(rows)} probes")
    for r in rows:
        t.add_row(r["id"], r["title"], ",".join(map(str, r["ranks"])) + ("" if r["distinct_gpus"] else " (may share)"),
                  "yes" if r["needs_gpu"] else "no", ", ".join(r["requires"]) or "-")
    Console(highlight=False).print(t)
    return 0


# --- run ---------------------------------------------------------------------------------------------------
def _select_probes(args: argparse.Namespace) -> dict[str, Any]:
    probes = {pid: mod for pid, (_, mod) in registry.discover().items()}
    if args.all and args.probe:
        raise UsageError("checks run: give --all or --probe, not both")
    if not args.all and not args.probe:
        raise UsageError("checks run: choose probes with --all or --probe ID (see `checks list`)")
    if args.all:
        if not probes:
            raise UsageError("checks run: no probes found in checks/probes")
        return probes
    out = {}
    for pid in args.probe:
        if pid not in probes:
            import difflib

            close = difflib.get_close_matches(pid, list(probes), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "; see `checks list`"
            raise UsageError(f"checks run: unknown probe {pid!r}{hint}")
        out[pid] = probes[pid]
    return out


@dataclass(frozen=True)
class Targets:
    """Where the selected cells run: the cells, an executor for each runnable one, and what one environment
    reported about the GPUs (peer access, multicast), when one could be asked."""

    cells: list[CellTarget]
    executors: dict[str, Executor]
    inspect: dict[str, Any] | None
    kind: str = "docker"  # the manifest's executor: docker | venv | local


def local_targets(args: argparse.Namespace) -> Targets:
    ex = LocalExecutor(args.python)
    inspect = ex.inspect()
    versions = {k: str(v) for k, v in (inspect.get("versions") or {}).items() if isinstance(v, str | int | float)}
    cell = CellTarget(local_cell_id(versions), CellState.LOCAL, versions=versions, image_status=ImageState.LOCAL)
    cells = [cell]
    if args.cuda and not matches_cuda(versions.get("torch_cuda", ""), args.cuda):
        cells = []
    cells = select_cells(cells, args.only)
    if not cells:
        raise UsageError(f"checks run: the local environment ({cell.cell_id}) does not match --cuda/--only")
    return Targets(cells, {cell.cell_id: ex}, inspect, "local")


def planned_cells(args: argparse.Namespace) -> list[Any]:
    """The selected cells of the matrix (provision.api.PlannedCell), as `provision build` planned them."""
    from provision.api import plan_cells
    from provision.errors import InputError

    try:
        planned = plan_cells(args.matrix, cuda=args.cuda, only=args.only or None)
    except InputError as exc:
        raise UsageError(exc.one_line()) from None
    if not planned:
        raise UsageError(f"checks run: the selection matches no cell of {args.matrix}")
    return planned


def venv_targets(args: argparse.Namespace, gpus: int) -> Targets:
    """Each selected cell's venv (envs/<cell>/build.json), run by the local executor with its interpreter."""
    from checks import venvcell

    cells: list[CellTarget] = []
    executors: dict[str, Executor] = {}
    for pc in planned_cells(args):
        if pc.status != CellState.RESOLVED:
            cells.append(CellTarget(pc.cell_id, pc.status, pc.reason, dict(pc.versions)))
            continue
        vc = venvcell.read(args.envs, pc.cell_id)
        versions = {**pc.versions, **({"from_base": vc.from_base} if vc.from_base else {})}
        cells.append(CellTarget(pc.cell_id, pc.status, pc.reason, versions, vc.python, vc.state, vc.reason))
        if vc.state is ImageState.BUILT and vc.python:
            executors[pc.cell_id] = LocalExecutor(vc.python, venvcell.BACKEND, vc.env)
    inspect = None
    if executors and gpus:
        try:
            inspect = next(iter(executors.values())).inspect()
        except ExecutorError as exc:  # one broken venv must not stop the run; its variants say why
            print(f"warning: peer access and multicast unknown: {exc}", file=sys.stderr)
    return Targets(cells, executors, inspect, venvcell.BACKEND)


def chosen_backend(args: argparse.Namespace) -> str:
    """docker or venv: ``--backend``, or under auto Docker when its daemon answers (said in one line if not)."""
    from checks.container import client, unreachable
    from provision import backend
    from provision.errors import InputError

    try:
        chosen = backend.choose(args.backend, unreachable, doing=backend.RUN_VENVS)
    except InputError as exc:
        raise UsageError(f"checks run: {exc.one_line()}") from None
    if args.backend == backend.DOCKER:
        client()  # insisted on: fails now (ExecutorError with the fix), even when no image would run
    if chosen.line:
        print(f"checks: {chosen.line}", file=sys.stderr, flush=True)
    return chosen.backend


def docker_targets(args: argparse.Namespace, gpus: int) -> Targets:
    planned = planned_cells(args)
    cells: list[CellTarget] = []
    for pc in planned:
        if pc.status != CellState.RESOLVED:
            cells.append(CellTarget(pc.cell_id, pc.status, pc.reason, dict(pc.versions)))
            continue
        state, tag, why = image_state(args.envs, pc.cell_id)
        cells.append(CellTarget(pc.cell_id, pc.status, pc.reason, dict(pc.versions), tag, state, why))
    executors: dict[str, Executor] = {}
    runnable = [c for c in cells if c.image_status is ImageState.BUILT and c.image]
    inspect = None
    if runnable:
        from checks.container import DockerExecutor, client

        docker = client()  # no Docker: one line, exit 2
        for c in runnable:
            executors[c.cell_id] = DockerExecutor(image=str(c.image), gpus_on_host=gpus, _client=docker)
        if gpus:
            try:
                inspect = executors[runnable[0].cell_id].inspect()
            except ExecutorError as exc:  # one broken image must not stop the run; its variants say why
                print(f"warning: peer access and multicast unknown: {exc}", file=sys.stderr)
    return Targets(cells, executors, inspect)


def host_and_targets(args: argparse.Namespace) -> tuple[dict[str, Any], Targets, int]:
    """The host facts, the targets, and the GPU count nvidia-smi reports (what the workers are told)."""
    smi_facts = hostfacts.collect()
    gpus = int(smi_facts["gpu_count"])
    if args.local and args.backend != "auto":
        raise UsageError("checks run: --local runs the interpreter of --python; leave out --backend")
    if args.local:
        targets = local_targets(args)
    else:
        targets = venv_targets(args, gpus) if chosen_backend(args) == "venv" else docker_targets(args, gpus)
    facts = hostfacts.collect(targets.inspect) if targets.inspect else smi_facts
    return facts, targets, gpus


def open_run(args: argparse.Namespace, host_id: str) -> RunStore:
    """The store of a new run, or with --resume of the host's latest run."""
    folder = args.results / host_id
    return RunStore(args.results, host_id, (latest_run(folder) if args.resume else None) or new_run_id())


def _print_plan(con: Any, facts: dict[str, Any], items: list[WorkItem], probes: dict[str, Any]) -> None:
    gpu = f"{facts['gpu_count']}x {facts['gpu_name']} (CC {facts['compute_capability']})" if facts["gpu_count"] \
        else f"no GPU ({facts['no_gpu_reason']})"
    con.print(f"[bold]host[/] {facts['host_id']}: {gpu}")
    counts = summary_counts(items)
    con.print(f"[bold]plan[/] {len(counts)} cell(s) x {len(probes)} probe(s) = {len(items)} variant(s)")
    for cell_id, c in counts.items():
        run, reused = c.pop("run", 0), c.pop(REUSED, 0)
        con.print(f"  {cell_id}: {run} to run" + (f", {reused} unchanged" if reused else ""))
        for why, n in sorted(c.items()):
            con.print(f"    {n} decided without running, {why}")
    if line := incremental.reused_line(items):
        con.print(f"[bold]reused[/] {line}", highlight=False)


def report_path(args: argparse.Namespace) -> Path | None:
    """Where `checks run` regenerates the table, or None with --no-report."""
    if args.no_report:
        return None
    if args.report:
        return Path(args.report)
    return table_for(args.results)


def table_for(results: Path) -> Path:
    """The table a results folder gets by default: docs/compatibility.md for the repository's results, else
    its own compatibility.md (another folder's table never overwrites the committed one)."""
    if results.resolve() == (REPO / "results").resolve():
        return REPO / "docs" / "compatibility.md"
    return results / "compatibility.md"


def cmd_run(args: argparse.Namespace) -> int:
    if args.timeout_scale <= 0:
        raise UsageError("checks run: --timeout-scale must be > 0")
    if args.jobs < 1:
        raise UsageError(f"checks run: --jobs {args.jobs}: give 1 or more")
    try:
        archs = gpuarch.parse_targets(args.target_arch)
    except gpuarch.TargetError as exc:
        raise UsageError(f"checks run: --target-arch: {exc}") from None
    con = _console()
    probes = _select_probes(args)
    catalogue = reasons.default()
    if args.executor == "slurm":
        if args.local:
            raise UsageError("checks run: --local and --executor slurm exclude each other")
        if args.level != FULL:  # its jobs would run every size and record nothing that marks them quick
            raise UsageError("checks run: --level quick is not available with --executor slurm")
        from checks import slurm_run

        return slurm_run.run(args, con, probes, catalogue, archs)
    args.local = args.local or args.executor == "local"
    args.python = args.python or sys.executable
    facts, targets, gpus = host_and_targets(args)
    host = dataclasses.replace(hostfacts.host_view(facts, archs), level=args.level)
    items = plan_work(targets.cells, probes, host, args.timeout_scale)
    cache_dir = compile_cache_dir(args.compile_cache, args.no_compile_cache)
    executors = for_run(targets.executors, archs, cache_dir, facts["host_id"], gpu_lock_path() if gpus else None)
    hashes = provenance.probe_hashes(probes)
    store = open_run(args, facts["host_id"])
    earlier = incremental.latest(store.folder)  # before this run adds to it
    prints = incremental.fingerprints(executors, sorted({it.cell.cell_id for it in items if it.runs}))
    stamps = {it.key: incremental.inputs_for(it, prints.get(it.cell.cell_id), facts, archs)
              for it in items if it.runs}
    if not args.fresh:
        items = incremental.decide(items, earlier, stamps, hashes, args.level)
    _print_plan(con, facts, items, probes)
    code = provenance.checkout()
    recorded = runprogress.learned(store.folder)  # before this run adds to it
    with RunLock(store.folder):
        new = manifest.build(store.run_id, store.host_id, now_iso(), targets.kind, facts,
                             targets.cells, probes, code, hashes, args.argv, args.level, prints)
        old = read_manifest(store.manifest_path)[0] if args.resume else None
        store.write_manifest(manifest.merge(old, new))
        con.print(f"[bold]results[/] {store.results_path}")
        codes = {pid: code.for_probe(h) for pid, h in hashes.items()}
        done = store.recorded() if args.resume else set()
        todo = [it for it in items if it.key not in done]
        view = runprogress.RunView(todo, runprogress.expected_durations(todo, recorded, targets.kind),
                                    jobs=args.jobs, compile_note=runprogress.compile_note(cache_dir))
        report = _execute_with_progress(con, items, executors, store, catalogue, gpus, codes, args.resume,
                                        view, jobs=args.jobs, level=args.level, inputs=stamps)
    if not store.results_path.exists() and not store.unstored:  # the store makes a run's files with its first news
        con.print("results: nothing new, so no run recorded (each variant reused or decided as before)",
                  markup=False)
    code = _finish_run(con, report, args.json, args.results, report_path(args), gpus)
    return _unstored(store) or code


def _unstored(store: RunStore) -> int:
    """What a failed write (a full disk) kept from the results files, said at the end; 2 when anything."""
    if not store.unstored:
        return 0
    print(f"checks: {len(store.unstored)} result(s) were measured but not stored ({store.write_error}); "
          "free space and rerun them:", file=sys.stderr)
    for r in store.unstored:
        print(f"  not stored: {r.result_id} {r.verdict.status.value}", file=sys.stderr)
    return 2


def _finish_run(con: Any, report: RunReport, as_json: bool, results_dir: Path, table: Path | None,
                gpus: int | None = None) -> int:
    """The summary, the regenerated table, and last the verdict count and where the table is."""
    if report.resumed:
        con.print(f"resumed: {report.resumed} variant(s) already recorded were not run again", markup=False)
    if reused := report.reused:
        runs = sorted({incremental.origin(r) for r in reused})
        con.print(f"reused: {len(reused)} variant(s) unchanged since run{'s' if len(runs) > 1 else ''} "
                  f"{', '.join(runs)} were not run again (--fresh reruns them)", markup=False)
    for line in summary.lines(report.results, gpus):
        con.print(line, markup=False)
    if as_json:
        print(json.dumps([r.to_json() for r in report.results], indent=2, sort_keys=True))
    where = _regenerate(table, results_dir, report.interrupted)
    con.print(f"verdicts: {summary.totals_line(report.results)}", markup=False)
    con.print(where, markup=False)
    return 130 if report.interrupted else 0


def _regenerate(table: Path | None, results_dir: Path, interrupted: bool) -> str:
    """Regenerate the table from every run under ``results_dir``; the line that says where it is (or why
    it was not written)."""
    words = ["checks", "report", "--results", str(results_dir), *(["--out", str(table)] if table else [])]
    rerun = f"`{shellwords.command(words)}`"
    if table is None:
        return f"table: not regenerated (--no-report); {rerun} writes it"
    if interrupted:
        return f"table: not regenerated (interrupted); {rerun} writes it from what finished"
    from checks.report import generate

    if generate(results_dir, table, None, False, repo=REPO, quiet=True) != 0:
        return f"table: not written (see above); {rerun} retries"
    return f"table: {_shown(table)} and {_shown(table.with_suffix('.html'))}, from every run in {_shown(results_dir)}"


def _shown(path: Path) -> str:
    """A path relative to the working directory when it is under it, as a user would type it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _execute_with_progress(con: Any, items: list[WorkItem], executors: dict[str, Executor], store: RunStore,
                           catalogue: reasons.Catalogue, gpus: int, codes: dict[str, Provenance],
                           resume: bool, view: runprogress.RunView, *, jobs: int = 1, level: str = FULL,
                           inputs: dict[tuple[str, str, str], incremental.Inputs | None] | None = None) -> RunReport:
    """Run the items, saying what happens: a line when a cell comes up and one per variant that ran (with
    done/total and the time left). A terminal also gets a live bar with the running variant and its time;
    anything else gets a line when a variant starts and again every TICK_S while it runs."""
    live = con.is_terminal
    said_memlock: list[str] = []

    def say(text: str) -> None:
        con.print(text, markup=False)

    say(view.opening())
    with contextlib.ExitStack() as stack:
        ticker = stack.enter_context(progress.Ticker(say, TICK_S))
        bar = stack.enter_context(_live_bar(con, view.total)) if live else None

        def started(item: WorkItem) -> None:
            header = view.cell_header(item)
            if header:
                say(header)
            if not item.runs:
                return
            if bar is not None:
                bar.start(item, view)
            else:
                say(view.start_line(item))
                ticker.start(view.label(item), lambda elapsed: view.tick_line(item, elapsed))

        def finished(item: WorkItem, result: ProbeResult) -> None:
            view.finish(item)
            ticker.stop(view.label(item))
            if bar is not None:
                bar.advance(view)
            if item.runs:
                con.print(view.result_line(item, result), markup=False, style=STATUS_STYLE[result.verdict.status])
            note = result.verdict.evidence.get("memlock")
            if note and note != memlock.UNLIMITED and not said_memlock:
                said_memlock.append(str(note))
                say(memlock.console_line(str(note)))

        return execute(items, executors, store, catalogue, gpus, codes, resume, on_result=finished,
                       on_start=started, jobs=jobs, level=level, inputs=inputs)


class _Bar:
    """The live bar of a terminal: the running variant, how long it has run, done/total, time left."""

    def __init__(self, progress: Any, total: int) -> None:
        self.progress = progress
        self.task = progress.add_task("starting", total=total, since=None, left="")

    def start(self, item: WorkItem, view: runprogress.RunView) -> None:
        cell = view.cells.index(item.cell.cell_id) + 1
        self.progress.update(self.task, description=f"cell {cell}/{len(view.cells)} {item.spec.id} "
                             f"{item.variant.key}", since=time.monotonic())

    def advance(self, view: runprogress.RunView) -> None:
        est = view.left()
        self.progress.update(self.task, advance=1, since=None, left=f"{est.text()} left" if est.steps else "")


@contextlib.contextmanager
def _live_bar(con: Any, total: int) -> Iterator[_Bar]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
    from rich.text import Text

    class Running(ProgressColumn):
        def render(self, task: Any) -> Text:
            since = task.fields.get("since")
            return Text(progress.duration(time.monotonic() - since) if since else "")

    # transient: the bar goes when the run ends, so the summary is not printed under a half-drawn bar
    with Progress(TextColumn("{task.description}"), Running(), BarColumn(bar_width=20), MofNCompleteColumn(),
                  TextColumn("{task.fields[left]}"), console=con, transient=True) as p:
        yield _Bar(p, total)


# --- report ------------------------------------------------------------------------------------------------
def cmd_report(args: argparse.Namespace) -> int:
    from checks.report import generate

    return generate(args.results, args.out or table_for(args.results), args.html, args.check, repo=REPO)


# --- advise, diff: decisions from recorded results only --------------------------------------------------------
def decision_parsers(sub: Any) -> None:
    from checks.estimate import DEFAULT_BATCH, DEFAULT_DRAFT, model_shapes

    p = sub.add_parser("advise", help="per host and cell, the allreduce path to use per decode size, from results")
    p.add_argument("--results", type=Path, default=REPO / "results", help="results directory")
    p.add_argument("--host", help="one host id (default: every host)")
    p.add_argument("--cell", help="one cell id (default: every cell the host recorded)")
    p.add_argument("--model", metavar="SHAPE|hidden=N,layers=N[,dtype=bf16]",
                   help=f"estimate the allreduce time per decode and verify step ({', '.join(model_shapes())})")
    p.add_argument("--tp", type=int, metavar="N", help="tensor-parallel size: the rank count to advise on")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, metavar="N", help="decode tokens per step (--model)")
    p.add_argument("--draft", type=int, default=DEFAULT_DRAFT, metavar="N",
                   help="tokens each sequence verifies per speculative step (--model)")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("diff", help="every verdict and headline that differs between two runs, hosts or cells")
    p.add_argument("a", help="a run id, host id, cell id or HOST/CELL")
    p.add_argument("b", help="the same kind as A")
    p.add_argument("--results", type=Path, default=REPO / "results", help="results directory")
    p.add_argument("--json", action="store_true")


def _hosts(results: Path, cmd: str) -> dict[str, Any]:
    from checks import hostresults

    if not results.is_dir():
        raise UsageError(f"checks {cmd}: no results directory {results} (give --results DIR)")
    hosts, skipped = hostresults.load_all(results)
    warnings = [*skipped, *(w for h in hosts.values() for w in h.warnings)]
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    if warnings:
        print(f"checks {cmd}: {len(warnings)} unreadable item(s) in {results} skipped (warnings above)",
              file=sys.stderr)
    return hosts


def _one(name: str, known: list[str], option: str) -> None:
    if name not in known:
        import difflib

        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known) or 'none'}"
        raise UsageError(f"checks advise: {option} {name!r} has no results; {hint}")


def gpu_hosts(hosts: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The hosts whose results were measured on GPUs (advice rests on latencies only a GPU gives), and one
    line naming the GPU-less ones left out and how to pick a host; "" when none was left out."""
    without = sorted(n for n, h in hosts.items() if h.gpu_count == 0)
    if not without:
        return hosts, ""
    kept = {n: h for n, h in hosts.items() if n not in without}
    left = f"left out {', '.join(without)} (recorded without a GPU: no latency to advise from)"
    if kept:
        return kept, f"{left}; advising on {', '.join(sorted(kept))}; `--host ID` picks one"
    return kept, f"{left}; no host has GPU results: run `checks run` on a GPU host, or `--host ID` to see one"


def advise(args: argparse.Namespace) -> list[Any]:
    """One HostDecision per selected host."""
    from checks import decisions, launch
    from checks.estimate import ModelError, parse_model
    from provision import catalog

    if args.tp is not None and args.tp < 2:
        raise UsageError(f"checks advise: --tp {args.tp}: an allreduce needs 2 or more ranks; give --tp 2, 4 or 8")
    for opt, n in (("--batch", args.batch), ("--draft", args.draft)):
        if n < 1:
            raise UsageError(f"checks advise: {opt} {n}: give a positive number of tokens")
    try:
        model = parse_model(args.model) if args.model else None
    except ModelError as exc:
        raise UsageError(f"checks advise: --model: {exc}") from None
    hosts = _hosts(args.results, "advise")
    line = ""
    if args.host:
        _one(args.host, sorted(hosts), "--host")
    else:
        hosts, line = gpu_hosts(hosts)
    selected = [h for name, h in hosts.items() if not args.host or name == args.host]
    if args.cell:
        _one(args.cell, sorted({r.cell_id for h in selected for r in h.results}), "--cell")
        selected = [h for h in selected if any(r.cell_id == args.cell for r in h.results)]
    if line:
        print(f"checks advise: {line}", file=sys.stderr)
    pins = {p.version: p.sgl_kernel for p in catalog.load().presets.values()}
    engines = launch.load()
    return [decisions.decide(h, engines, pins, cell=args.cell, tp=args.tp, model=model, batch=args.batch,
                             draft=args.draft) for h in selected]


def cmd_advise(args: argparse.Namespace) -> int:
    from checks import decisions

    found = advise(args)
    if args.json:
        print(json.dumps([decisions.to_json(d) for d in found], indent=2, sort_keys=True))
    else:
        print("\n".join(decisions.render(d) for d in found), end="")
    return 0


def diff(args: argparse.Namespace) -> Any:
    from checks import diff as diffmod

    hosts = _hosts(args.results, "diff")
    try:
        return diffmod.diff(diffmod.select(hosts, args.a), diffmod.select(hosts, args.b))
    except diffmod.SelectError as exc:
        raise UsageError(f"checks diff: {exc}") from None


def cmd_diff(args: argparse.Namespace) -> int:
    from checks import decisions

    d = diff(args)
    if args.json:
        print(json.dumps(decisions.plain(d), indent=2, sort_keys=True))
    else:
        b = decisions.diff_block(d)
        print("\n".join([b.title, *b.lines, *(["ids:"] if b.ids else []),
                         *(f"  [{n}] {i}" for n, i in enumerate(b.ids, 1))]))
    return 0


# --- share, import, validate: results between machines (checks.exchange) ----------------------------------------
def exchange_parsers(sub: Any) -> None:
    p = sub.add_parser("share", help="one bundle file of a host's runs to send, scrubbed of names and secrets")
    p.add_argument("--host", help="the host id to share (default: this machine's, else the only host)")
    p.add_argument("--results", type=Path, default=REPO / "results", help="results directory")
    p.add_argument("--out", type=Path, metavar="FILE", help="the bundle (default: stackprobe-<host>.bundle.json)")
    p.add_argument("--show", action="store_true", help="print exactly what would leave this machine (no file "
                   "unless --out is given too)")
    p = sub.add_parser("import", help="add bundles' runs to a results directory, read as untrusted input")
    p.add_argument("bundles", nargs="+", type=Path, metavar="BUNDLE")
    p.add_argument("--results", type=Path, default=REPO / "results", help="results directory")
    p = sub.add_parser("validate", help="check a results directory or a bundle as untrusted input")
    p.add_argument("path", nargs="?", type=Path, default=REPO / "results", metavar="PATH",
                   help="a results directory, one host's folder or a bundle file (default: results/)")
    p.add_argument("--json", action="store_true", help="what was read and every problem, as JSON on stdout")


def cmd_share(args: argparse.Namespace) -> int:
    from checks import bundle, exchange

    try:
        return exchange.share(exchange.ShareOptions(args.results, args.host, args.out, args.show))
    except bundle.BundleError as exc:
        raise UsageError(str(exc)) from None


def cmd_import(args: argparse.Namespace) -> int:
    from checks import exchange

    return exchange.import_bundles(exchange.ImportOptions(tuple(args.bundles), args.results))


def cmd_validate(args: argparse.Namespace) -> int:
    from checks import exchange

    return exchange.validate(args.path, args.json)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM/SIGHUP clean up like Ctrl-C: workers and containers are ended


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code. SIGTERM and SIGHUP act as Ctrl-C while it runs; the handlers
    it replaced are restored on return, so it can be called in-process."""
    argv = sys.argv[1:] if argv is None else list(argv)
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        args = parser().parse_args(argv)
        args.argv = argv
        return {"list": cmd_list, "run": cmd_run, "report": cmd_report, "advise": cmd_advise,
                "diff": cmd_diff, "share": cmd_share, "import": cmd_import, "validate": cmd_validate}[args.cmd](args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (UsageError, registry.ProbeNotFound, reasons.CatalogueError, ExecutorError, StoreBusy) as exc:
        msg = str(exc)
        print(msg if msg.startswith(("checks", "/")) else f"checks: {msg}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # a results folder that is a file or read-only, a full disk, --out under a file
        where = f"{ids.shown(str(exc.filename))}: " if exc.filename else ""
        print(f"checks: {where}{exc.strerror or exc}; check the path and its permissions and free space",
              file=sys.stderr)
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
