"""`checks list | run | report`: the host-side command line. Exit codes: 0 done, 2 bad input, 130 interrupted."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any, NoReturn

from checks import hostfacts, provenance, reasons, registry
from checks.executor import Executor, ExecutorError, LocalExecutor
from checks.plan import (
    CellTarget,
    WorkItem,
    image_state,
    local_cell_id,
    matches_cuda,
    plan_work,
    select_cells,
    summary_counts,
)
from checks.provenance import Provenance
from checks.result import ProbeResult
from checks.status import ORDER, Status
from checks.store import RunLock, RunStore, StoreBusy, latest_run, new_run_id

REPO = Path(__file__).resolve().parent.parent
MANIFEST_SCHEMA = "stackprobe.manifest/2"  # 2: `code`, the checkout and probe hashes the run used
STATUS_STYLE = {Status.PASS: "green", Status.PARTIAL: "yellow", Status.SKIP: "dim", Status.FAIL: "red",
                Status.CRASH: "bold red", Status.HANG: "magenta", Status.NOT_RUN: "cyan", Status.UNAVAILABLE: "blue"}


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
    p.add_argument("--python", default=sys.executable, help="the local environment's interpreter (with --local)")
    p.add_argument("--resume", action="store_true", help="continue the latest run, skipping recorded variants")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("--timeout-scale", type=float, default=1.0, metavar="X", help="multiply every probe timeout")
    p.add_argument("--target-arch", default="12.0a,12.0f", help="cross-compile targets for compile probes")
    p.add_argument("--results", type=Path, default=REPO / "results", help="results directory")
    p.add_argument("--matrix", type=Path, default=REPO / "matrix.yaml", help="matrix file (docker mode)")
    p.add_argument("--envs", type=Path, default=REPO / "envs", help="where `provision build` wrote build.json")
    p = sub.add_parser("report", help="generate docs/compatibility.md (and .html) from the results")
    p.add_argument("--results", type=Path, default=REPO / "results")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "compatibility.md")
    p.add_argument("--html", type=Path, help="HTML page path (default: --out with .html)")
    p.add_argument("--check", action="store_true", help="exit 1 if the files on disk are not what would be written")
    return ap


def _console() -> Any:
    from rich.console import Console

    return Console(stderr=True, highlight=False)


# --- list --------------------------------------------------------------------------------------------------
def cmd_list(args: argparse.Namespace) -> int:
    probes = registry.discover()
    rows = []
    for pid, (loc, mod) in sorted(probes.items()):
        s = mod.SPEC
        rows.append({"id": pid, "title": s.title, "feature": s.feature, "ranks": list(s.ranks),
                     "share_gpu": s.share_gpu, "requires": list(s.requires), "needs_gpu": s.needs_gpu,
                     "timeout_s": s.timeout_s, "source": loc.module or loc.file})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table("id", "title", "ranks", "gpu", "needs", title=f"{len(rows)} probes")
    for r in rows:
        t.add_row(r["id"], r["title"], ",".join(map(str, r["ranks"])) + (" (may share)" if r["share_gpu"] else ""),
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


def _local_cells(args: argparse.Namespace) -> tuple[list[CellTarget], dict[str, Executor], dict[str, Any]]:
    ex = LocalExecutor(args.python)
    inspect = ex.inspect()
    versions = {k: str(v) for k, v in (inspect.get("versions") or {}).items() if isinstance(v, str | int | float)}
    cell = CellTarget(local_cell_id(versions), "local", versions=versions, image_status="local")
    cells = [cell]
    if args.cuda and not matches_cuda(versions.get("torch_cuda", ""), args.cuda):
        cells = []
    cells = select_cells(cells, args.only)
    if not cells:
        raise UsageError(f"checks run: the local environment ({cell.cell_id}) does not match --cuda/--only")
    return cells, {cell.cell_id: ex}, inspect


def _docker_cells(args: argparse.Namespace, gpus: int) -> tuple[list[CellTarget], dict[str, Executor], dict | None]:
    from provision.api import plan_cells
    from provision.errors import InputError

    try:
        planned = plan_cells(args.matrix, cuda=args.cuda, only=args.only or None)
    except InputError as exc:
        raise UsageError(exc.one_line()) from None
    if not planned:
        raise UsageError(f"checks run: the selection matches no cell of {args.matrix}")
    cells: list[CellTarget] = []
    for pc in planned:
        if pc.status != "resolved":
            cells.append(CellTarget(pc.cell_id, pc.status, pc.reason, dict(pc.versions)))
            continue
        state, tag, why = image_state(args.envs, pc.cell_id)
        cells.append(CellTarget(pc.cell_id, pc.status, pc.reason, dict(pc.versions), tag, state, why))
    executors: dict[str, Executor] = {}
    runnable = [c for c in cells if c.image_status == "built" and c.image]
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
    return cells, executors, inspect


def _print_plan(con: Any, facts: dict[str, Any], items: list[WorkItem], probes: dict[str, Any]) -> None:
    gpu = f"{facts['gpu_count']}x {facts['gpu_name']} (CC {facts['compute_capability']})" if facts["gpu_count"] \
        else f"no GPU ({facts['no_gpu_reason']})"
    con.print(f"[bold]host[/] {facts['host_id']}: {gpu}")
    counts = summary_counts(items)
    con.print(f"[bold]plan[/] {len(counts)} cell(s) x {len(probes)} probe(s) = {len(items)} variant(s)")
    for cell_id, c in counts.items():
        run = c.pop("run", 0)
        con.print(f"  {cell_id}: {run} to run")
        for why, n in sorted(c.items()):
            con.print(f"    {n} decided without running, {why}")


def _summary(con: Any, results: list[ProbeResult]) -> None:
    from rich.table import Table

    t = Table("cell", "probe", "verdicts", title="summary")
    per: dict[tuple[str, str], Counter[Status]] = {}
    for r in results:
        per.setdefault((r.cell_id, r.probe_id), Counter())[r.verdict.status] += 1
    for (cell, probe), c in sorted(per.items()):
        t.add_row(cell, probe, ", ".join(f"[{STATUS_STYLE[s]}]{c[s]} {s}[/]" for s in ORDER if c[s]))
    con.print(t)


def cmd_run(args: argparse.Namespace) -> int:
    if args.timeout_scale <= 0:
        raise UsageError("checks run: --timeout-scale must be > 0")
    archs = tuple(a.strip() for a in args.target_arch.split(",") if a.strip())
    con = _console()
    probes = _select_probes(args)
    catalogue = reasons.default()
    smi_facts = hostfacts.collect()
    gpus = int(smi_facts["gpu_count"])
    if args.local:
        cells, executors, inspect = _local_cells(args)
    else:
        cells, executors, inspect = _docker_cells(args, gpus)
    facts = hostfacts.collect(inspect) if inspect else smi_facts
    items = plan_work(cells, probes, hostfacts.host_view(facts, archs), args.timeout_scale)
    _print_plan(con, facts, items, probes)

    host_id = facts["host_id"]
    folder = args.results / host_id
    run_id = (latest_run(folder) if args.resume else None) or new_run_id()
    store = RunStore(args.results, host_id, run_id)
    code = provenance.checkout()
    hashes = provenance.probe_hashes(probes)
    with RunLock(folder):
        from checks.runner import now_iso

        manifest = {"schema": MANIFEST_SCHEMA, "run_id": run_id, "host_id": host_id, "written_at": now_iso(),
                    "executor": "local" if args.local else "docker", "facts": facts,
                    "cells": {c.cell_id: {"status": c.status, "reason": c.reason, "versions": c.versions,
                                          "image": c.image, "image_status": c.image_status} for c in cells},
                    "probes": {pid: {"title": m.SPEC.title, "feature": m.SPEC.feature} for pid, m in probes.items()},
                    "code": code.to_json(hashes), "argv": sys.argv[1:]}
        if args.resume and store.manifest_path.exists():
            old = json.loads(store.manifest_path.read_text())
            manifest["cells"] = {**old.get("cells", {}), **manifest["cells"]}
            old_probes = old.get("probes") if isinstance(old.get("probes"), dict) else {}
            manifest["probes"] = {**old_probes, **manifest["probes"]}
        store.write_manifest(manifest)
        con.print(f"[bold]results[/] {store.results_path}")
        codes = {pid: code.for_probe(h) for pid, h in hashes.items()}
        report = _execute_with_progress(con, items, executors, store, catalogue, gpus, codes, args.resume)
    if report.resumed:
        con.print(f"resumed: {report.resumed} variant(s) already recorded were not run again")
    _summary(con, report.results)
    if args.json:
        print(json.dumps([r.to_json() for r in report.results], indent=2, sort_keys=True))
    return 130 if report.interrupted else 0


def _execute_with_progress(con: Any, items: list[WorkItem], executors: dict[str, Executor], store: RunStore,
                           catalogue: reasons.Catalogue, gpus: int, codes: dict[str, Provenance], resume: bool) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from checks.runner import execute

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=con, transient=False) as progress:
        task = progress.add_task("running", total=len(items))

        def started(item: WorkItem) -> None:
            progress.update(task, description=f"{item.cell.cell_id} {item.spec.id} {item.variant.key}")

        def finished(item: WorkItem, result: ProbeResult) -> None:
            v = result.verdict
            progress.console.print(f"[{STATUS_STYLE[v.status]}]{v.status:>11}[/] {item.cell.cell_id} {item.spec.id} "
                                   f"{item.variant.key} ({v.duration_s:.1f}s) {v.reason_code}")
            progress.advance(task)

        report = execute(items, executors, store, catalogue, gpus, codes, resume, on_result=finished,
                         on_start=started)
        progress.update(task, completed=len(items))
    return report


# --- report ------------------------------------------------------------------------------------------------
def cmd_report(args: argparse.Namespace) -> int:
    from checks.report import generate

    return generate(args.results, args.out, args.html, args.check, repo=REPO)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM/SIGHUP clean up like Ctrl-C: workers and containers are ended


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    try:
        args = parser().parse_args(argv)
        return {"list": cmd_list, "run": cmd_run, "report": cmd_report}[args.cmd](args)
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


if __name__ == "__main__":
    sys.exit(main())
