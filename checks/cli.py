"""`checks list | run | report | advise | diff | share | import | validate`: the host-side command line. Exit codes:
0 done, 2 bad input, 130 interrupted; share, import and validate also 1 (checks.share.exchange says when)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.table import Table

from checks.report import here
from checks.report.estimate import DEFAULT_BATCH, DEFAULT_DRAFT, ModelError, model_shapes, parse_model
from checks.report.report import generate
from checks.results import changes, hostfacts, hostresults, hwclass, ids, reader
from checks.results.store import StoreBusy
from checks.run import session
from checks.run.executor import ExecutorError
from checks.run.options import (
    AUTO,
    BACKEND_CHOICES,
    MAX_DEFAULT_JOBS,
    SLURM,
    RunOptions,
    SlurmOptions,
    UsageError,
    backend_from_flags,
    default_jobs,
)
from common import catalog, home, outputs, progress, reasons
from inenv import gpuarch, registry
from inenv.probe import LEVELS

REPO = home.WORK_ROOT  # results, docs, envs: the checkout's, or the current folder's for an installed wheel


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see --help)")


def run_parser(sub: Any) -> None:
    """`checks run` and its options."""
    p = sub.add_parser("run", help="run the probes in each cell: Docker images, venv cells, one local Python or "
                       "Slurm jobs (--backend)")
    p.add_argument("--all", action="store_true", help="every probe")
    p.add_argument("--probe", action="append", default=[], metavar="ID", help="a probe id (repeatable)")
    p.add_argument("--cuda", help="cells of this CUDA version (13 = every 13.x)")
    p.add_argument("--only", action="append", default=[], metavar="GLOB", help="cells whose id matches (repeatable)")
    p.add_argument("--backend", choices=BACKEND_CHOICES, default=AUTO,
                   help="where cells come from and where their variants run: docker (cell images), venv (venv "
                        "cells of `provision build --backend venv`), local (one interpreter, --python), slurm "
                        "(jobs from this host); auto (default): Docker when its daemon answers, else venv cells")
    p.add_argument("--python", help="the interpreter of --backend local (default: this one); with --backend slurm, "
                   "the interpreter on the nodes instead of the venv cells")
    p.add_argument("--image", action="append", default=[], metavar="IMAGE[,IMAGE...]",
                   help="probe existing images (the one you serve), each a cell named by what is inside it: "
                        "torch, CUDA, sgl-kernel, flashinfer, serving engine (Docker; with slurm, its container "
                        "image); the probe code is mounted read-only and nothing is written into the image")
    p.add_argument("--local", action="store_true", help=argparse.SUPPRESS)  # deprecated: --backend local
    p.add_argument("--executor", choices=("local", "docker", "slurm"), help=argparse.SUPPRESS)  # deprecated
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
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="CPU-only variants of different cells run up to N at once; GPU variants run alone "
                        f"(default: the CPU cores, at most {MAX_DEFAULT_JOBS}: {default_jobs()} here)")
    p.add_argument("--level", choices=LEVELS, help="quick: fi-jit's smallest module only and the GPU probes at one "
                   "message size, marked as such in the table; full: everything; not given: quick first (its table "
                   "is the first answer), then what full adds, and the table again")
    p.add_argument("--budget", type=float, metavar="MIN", help="fit the run into MIN minutes: the plan says its "
                   "cost first, the least informative variants are left out as not-run over-budget (larger world "
                   "sizes, ranks sharing GPUs, sustained load go first) and nothing starts after the time is up")
    p.add_argument("--soak", type=float, metavar="MIN", help="the load probe's variants replay their backend MIN "
                   "minutes each, a soak, instead of seconds (each runs again, whatever this host recorded; the plan "
                   "counts the minutes)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("--timeout-scale", type=float, default=1.0, metavar="X", help="multiply every probe timeout")
    p.add_argument("--cold-ranks", action="store_true", help="start fresh rank processes for every variant (default "
                   "on local, venv and Docker cells: a cell's variants of one world size share rank processes that "
                   "imported their libraries once; a variant that fails, hangs or leaves state behind ends them)")
    p.add_argument("--gpu-alone", action="store_true", help="every GPU variant has the GPUs alone (default: "
                   "variants that time nothing, ranks sharing a GPU or set-up checks, run side by side; timed ones "
                   "always run alone)")
    p.add_argument("--target-arch", metavar="LIST", help="cross-compile targets for the compile probes beside the "
                   "local GPU, e.g. 12.0a,12.0f, or none (default: none on a host with a GPU, which compiles for "
                   "its own GPU only; 12.0a,12.0f on a host without one)")
    p.add_argument("--compile-cache", type=Path, metavar="DIR", help="compiled JIT modules shared by every cell "
                   "and run (default: $STACKPROBE_COMPILE_CACHE, else .cache/compile of the checkout, or of the "
                   "current folder when installed)")
    p.add_argument("--no-compile-cache", action="store_true", help="compile everything again, share nothing")
    p.add_argument("--results", type=Path, default=REPO / "results", help="results directory")
    p.add_argument("--matrix", type=Path, default=home.DATA_ROOT / "matrix.yaml",
                   help="matrix file naming the cells (every backend but local)")
    p.add_argument("--envs", type=Path, default=REPO / "envs",
                   help="where `provision build` wrote each cell's build record")
    p.add_argument("--report", type=Path, metavar="MD", help="the table regenerated at the end, with its .html "
                   "(default: docs/compatibility.md for the default --results, else <results>/compatibility.md)")
    p.add_argument("--no-report", action="store_true", help="do not regenerate the table at the end")


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="checks", description="Run the probe suite against cells and report the results.")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    p = sub.add_parser("list", help="the probes: id, feature, ranks, packages needed")
    p.add_argument("--json", action="store_true")
    run_parser(sub)
    p = sub.add_parser("report", help="generate docs/compatibility.md (and .html) from the results")
    p.add_argument("--results", type=Path, default=REPO / "results")
    p.add_argument("--out", type=Path, help="the Markdown table (default: docs/compatibility.md for the default "
                   "--results, else <results>/compatibility.md, as `checks run` writes it)")
    p.add_argument("--html", type=Path, help="HTML page path (default: --out with .html)")
    p.add_argument("--check", action="store_true", help="exit 1 if the files on disk are not what would be written")
    p.add_argument("--json", action="store_true", help="print the answer (feature x declared stack x hardware class, "
                   "and what to launch with per class and rank count) as JSON instead of writing the pages")
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
    t = Table("id", "title", "ranks", "gpu", "needs", title=f"{len(rows)} probes")
    for r in rows:
        t.add_row(r["id"], r["title"], ",".join(map(str, r["ranks"])) + ("" if r["distinct_gpus"] else " (may share)"),
                  "yes" if r["needs_gpu"] else "no", ", ".join(r["requires"]) or "-")
    Console(highlight=False).print(t)
    return 0


# --- run ---------------------------------------------------------------------------------------------------
def report_path(args: argparse.Namespace) -> Path | None:
    """Where `checks run` regenerates the table, or None with --no-report."""
    if args.no_report:
        return None
    if args.report:
        return Path(args.report)
    return table_for(args.results)


def table_for(results: Path) -> Path:
    """The table a results folder gets by default: docs/compatibility.md for a checkout's results, else its own
    compatibility.md (another folder's table never overwrites the committed one; an installed wheel writes no
    docs/ into the folder it runs in)."""
    if home.CHECKOUT and results.resolve() == (REPO / "results").resolve():
        return REPO / "docs" / "compatibility.md"
    return results / "compatibility.md"


def target_archs(given: str | None) -> tuple[str, ...] | None:
    """``--target-arch`` as targets: None when not given (the host decides: options.compile_targets), () for
    ``none``."""
    if given is None:
        return None
    if given.strip().lower() == "none":
        return ()
    try:
        archs = gpuarch.parse_targets(given)
    except gpuarch.TargetError as exc:
        raise UsageError(f"checks run: --target-arch: {exc}") from None
    if not archs:
        raise UsageError("checks run: --target-arch: give targets such as 12.0a,12.0f, or none")
    return archs


def run_options(args: argparse.Namespace, argv: list[str]) -> RunOptions:
    """The command line of `checks run` as options, validated; nothing past this function sees ``args``."""
    archs = target_archs(args.target_arch)
    images = tuple(dict.fromkeys(i.strip() for given in args.image for i in given.split(",")))
    backend = backend_from_flags(args.backend, args.executor, args.local, bool(images))
    container = args.container_image or (images[0] if backend == SLURM and len(images) == 1 else None)
    slurm = SlurmOptions(args.partition, args.gpus_per_job, args.time, container, tuple(args.sbatch_arg))
    return RunOptions(
        probes=tuple(args.probe), all_probes=args.all, cuda=args.cuda, only=tuple(args.only),
        backend=backend, python=args.python, images=images, slurm=slurm,
        resume=args.resume, fresh=args.fresh, jobs=default_jobs() if args.jobs is None else args.jobs,
        level=args.level, as_json=args.json, cold_ranks=args.cold_ranks, gpu_alone=args.gpu_alone,
        budget_s=None if args.budget is None else args.budget * 60.0,
        soak_s=None if args.soak is None else args.soak * 60.0,
        timeout_scale=args.timeout_scale, target_archs=archs, compile_cache=args.compile_cache,
        no_compile_cache=args.no_compile_cache, results=args.results, matrix=args.matrix, envs=args.envs,
        report=report_path(args), argv=tuple(argv)).check()


def cmd_run(args: argparse.Namespace, argv: list[str]) -> int:
    return session.run(run_options(args, argv), _console())


# --- report ------------------------------------------------------------------------------------------------
def cmd_report(args: argparse.Namespace) -> int:
    out = args.out or table_for(args.results)
    _writable((out, "checks report: --out"), ((args.html or out.with_suffix(".html")), "checks report: --html"))
    return generate(args.results, out, args.html, args.check, repo=REPO, as_json=args.json, reuse=True)


def _writable(*paths: tuple[Path, str]) -> None:
    """Refuse, in one line, an output path that is not a new name or a regular file (common.outputs)."""
    if (why := outputs.first_problem(paths)) is not None:
        raise UsageError(why)


# --- advise, diff: decisions from recorded results only --------------------------------------------------------
def decision_parsers(sub: Any) -> None:
    p = sub.add_parser("advise", help="per host and cell, the allreduce path to use per decode size, from results")
    p.add_argument("--results", type=Path, default=REPO / "results", help="results directory")
    p.add_argument("--host", help="one host id (default: every host, this one first)")
    p.add_argument("--here", metavar="HOST_ID", help="the host to start with (default: this machine's host id)")
    p.add_argument("--cell", help="one cell id (default: every cell the host recorded)")
    p.add_argument("--model", metavar="SHAPE|hidden=N,layers=N[,dtype=bf16]",
                   help=f"estimate the allreduce time per decode and verify step ({', '.join(model_shapes())})")
    p.add_argument("--tp", type=int, metavar="N", help="tensor-parallel size: the rank count to advise on")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, metavar="N", help="decode tokens per step (--model)")
    p.add_argument("--draft", type=int, default=DEFAULT_DRAFT, metavar="N",
                   help="tokens each sequence verifies per speculative step (--model)")
    p.add_argument("--accept", type=float, metavar="L",
                   help="mean acceptance length: tokens each sequence keeps per verify step, the verified one included "
                   "(--model); verify steps are also counted in tokens per second at it (default: a published figure "
                   "for the model and --draft, where one exists)")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("diff", help="every verdict and headline that differs between two runs, hosts or cells")
    p.add_argument("a", nargs="?", help="a run id, host id, cell id or HOST/CELL")
    p.add_argument("b", nargs="?", help="the same kind as A")
    p.add_argument("--results", type=Path, default=REPO / "results", help="results directory")
    p.add_argument("--base", metavar="REV", help="instead of A and B: what the results directory changes against "
                   "itself at git revision REV (new and removed hosts, cells and results, verdict flips, changed "
                   "figures, probe-code changes); exit 1 when a pass turned into a fail that this checkout cannot "
                   "show to come from other probe code, or a result was removed, and results/expected-changes.yaml "
                   "does not list it")
    p.add_argument("--json", action="store_true")


def _hosts(results: Path, cmd: str) -> dict[str, Any]:
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
    return advise_here(args, brief=False)[0]


def _standing(h: Any, title: str) -> list[str]:
    return here.lines(here.standing(h, {r.code: r.message for r in reasons.default().reasons}), title)


def advise_here(args: argparse.Namespace, brief: bool = True) -> tuple[list[Any], list[str]]:
    """One HostDecision per selected host, this host's first, and the lines that start the advice: this
    host's standing (checks.report.here). ``brief`` (the text output): a host without a GPU is said in its
    standing alone, not in a decision per cell that has no latency to decide from."""
    # lazy: checks.report.decisions (with launch, diff, nearest) adds 15 ms to every `checks` start
    from checks.report import decisions, launch

    if args.tp is not None and args.tp < 2:
        raise UsageError(f"checks advise: --tp {args.tp}: an allreduce needs 2 or more ranks; give --tp 2, 4 or 8")
    for opt, n in (("--batch", args.batch), ("--draft", args.draft)):
        if n < 1:
            raise UsageError(f"checks advise: {opt} {n}: give a positive number of tokens")
    if args.accept is not None and not args.model:
        raise UsageError("checks advise: --accept counts a model's verify steps in tokens: give --model too")
    if args.accept is not None and not 1 <= args.accept <= args.draft:
        raise UsageError(f"checks advise: --accept {args.accept:g}: a sequence keeps 1 to --draft ({args.draft}) "
                         "tokens per verify step; give a length in that range")
    try:
        model = parse_model(args.model) if args.model else None
    except ModelError as exc:
        raise UsageError(f"checks advise: --model: {exc}") from None
    hosts = _hosts(args.results, "advise")
    pins = catalog.load().sglang_pins
    engines = launch.load()

    def decide(h: Any) -> Any:
        return decisions.decide(h, engines, pins, cell=args.cell, tp=args.tp, model=model, batch=args.batch,
                                draft=args.draft, accept=args.accept)

    def gpu_less(h: Any, title: str) -> list[str]:
        """A host without a GPU: its standing, then the engine gates its cells recorded (read without a GPU)."""
        d = decide(h)
        return _standing(h, title) + [x for g in d.engines
                                      for x in ("", *decisions.block_lines(decisions.gates_block(g, d.gate_reader)))]

    line, first = "", []
    mine = args.here or hostfacts.own_host_id()
    if args.host:
        _one(args.host, sorted(hosts), "--host")
        if brief and not hosts[args.host].gpu_count:
            return [], gpu_less(hosts[args.host], "host")
    else:
        if mine in hosts:
            first = _standing(hosts[mine], "this host")
            if brief and not hosts[mine].gpu_count and not args.cell:
                gated = sorted({g.cell_id for g in decide(hosts[mine]).engines})
                if gated:
                    first.append(f"engine gates recorded in {len(gated)} cell(s) here: `checks advise --host {mine}` "
                                 "shows them")
                others = sorted(n for n, h in hosts.items() if h.gpu_count and n != mine)
                if others:
                    first.append(f"other hosts with GPU results: {', '.join(others)}; `checks advise --host ID` "
                                 "advises on one")
                return [], first
        elif brief:
            first = [f"this host: {mine} has no results in {args.results}; `uv run checks run --all` records them"]
        hosts, line = gpu_hosts(hosts)
        # this host's advice first, then by hardware class (the table's columns), hosts of one class together
        hosts = dict(sorted(hosts.items(), key=lambda kv: (kv[0] != mine, hwclass.of(kv[1].facts).sort_key, kv[0])))
    selected = [h for name, h in hosts.items() if not args.host or name == args.host]
    if args.cell:
        _one(args.cell, sorted({r.cell_id for h in selected for r in h.results}), "--cell")
        selected = [h for h in selected if any(r.cell_id == args.cell for r in h.results)]
    if line:
        print(f"checks advise: {line}", file=sys.stderr)
    return [decide(h) for h in selected], first


def cmd_advise(args: argparse.Namespace) -> int:
    # lazy: checks.report.decisions (with launch, diff, nearest) adds 15 ms to every `checks` start
    from checks.report import decisions

    if args.json:
        print(json.dumps([decisions.to_json(d) for d in advise(args)], indent=2, sort_keys=True))
        return 0
    found, first = advise_here(args)
    if first:
        print("\n".join(first) + ("\n\n" if found else "\n"), end="")
    groups = decisions.by_class(found)
    for i, (label, ds) in enumerate(groups):
        if len(groups) > 1 or len(ds) > 1:  # a heading where the hosts are of several classes, or several hosts
            names = ", ".join(d.host_id for d in ds)
            print(("\n" if i else "") + ids.one_line(f"== hardware class {label or 'unknown'}: {names} =="))
        print("\n".join(decisions.render(d) for d in ds), end="")
    return 0


def diff(args: argparse.Namespace) -> Any:
    # lazy: checks.report.diff (with nearest) adds 3 ms to every `checks` start; only `checks diff` needs it
    from checks.report import diff as diffmod

    hosts = _hosts(args.results, "diff")
    try:
        sides = diffmod.select(hosts, args.a), diffmod.select(hosts, args.b)
        for side in sides:
            if side.kind == "run" and not side.results:  # its file was refused: not a run that recorded nothing
                why = next((w for w in hosts[side.host_id].warnings if side.name in w), "no result could be read")
                raise UsageError(f"checks diff: run {ids.one_line(side.name)} cannot be compared: {why}; "
                                 "nothing of it was read (restore its results file)")
        return diffmod.diff(*sides)
    except diffmod.SelectError as exc:
        raise UsageError(f"checks diff: {exc}") from None


def diff_base(args: argparse.Namespace) -> int:
    """`checks diff --base REV`: the results directory against itself at a git revision, and the regression gate."""
    if args.a or args.b:
        raise UsageError("checks diff: give either A and B, or --base REV")
    try:
        expected = changes.read_expected(args.results / changes.EXPECTED_FILE)
        base = changes.read_at(args.base, args.results)
    except changes.ChangesError as exc:
        raise UsageError(f"checks diff: {exc}") from None
    after, problems = reader.read_results(args.results)
    if any(p.fatal for p in problems):
        raise UsageError(f"checks diff: {problems[0]}")
    found = changes.compare(base.hosts, after)
    probes, now = changes.code_now()
    versions: changes.Versions = {pid: frozenset({h}) for pid, h in now.items()}
    if any(f.pass_to_fail and not f.same_code for f in found.flips):  # the base's probe code, read only if asked
        try:
            versions, code_problems = changes.code_versions(base, probes, now)
        except changes.ChangesError as exc:
            raise UsageError(f"checks diff: {exc}") from None
        problems += code_problems
    bad = changes.unexpected(found, expected, versions)
    out = sys.stderr if args.json else sys.stdout
    if args.json:
        print(json.dumps({"base": args.base, "commit": base.commit, "new_hosts": found.new_hosts,
                          "new_cells": found.new_cells, "added": found.added,
                          "flips": [dataclasses.asdict(f) for f in found.flips], "code_changes": found.code_changes,
                          "removed": found.removed, "figures": [dataclasses.asdict(f) for f in found.figures],
                          "problems": [str(p) for p in (*base.problems, *problems)],
                          "gated": [{"key": list(g.key), "why": g.why} for g in bad]}, indent=2, sort_keys=True))
    print(f"{ids.shown(str(args.results))} against {ids.one_line(args.base)}:", file=out)
    for line in found.lines() or ["no change"]:
        print(f"  {line}", file=out)
    for p in base.problems:
        print(f"warning: base {ids.one_line(args.base)}: {p}", file=sys.stderr)
    for p in problems:
        print(f"warning: {p}", file=sys.stderr)
    if bad:
        print(f"checks diff: {len(bad)} gated change(s) not listed in "
              f"{ids.shown(str(args.results / changes.EXPECTED_FILE))}:", file=sys.stderr)
        for g in bad:
            print(f"  {g.line()}", file=sys.stderr)
        print("  if a change is real, add its entry there for review (why: a sentence saying why it is expected; "
              "see docs/contributing-results.md):", file=sys.stderr)
        for g in bad:
            print(f"  {ids.one_line(g.entry())}", file=sys.stderr)
        return 1
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    # lazy: checks.report.decisions (with launch, diff, nearest) adds 15 ms to every `checks` start
    from checks.report import decisions

    if args.base is not None:
        return diff_base(args)
    if not (args.a and args.b):
        raise UsageError("checks diff: give A and B (two runs, hosts or cells), or --base REV")
    d = diff(args)
    if args.json:
        print(json.dumps(decisions.plain(d), indent=2, sort_keys=True))
    else:
        print("\n".join(decisions.block_lines(decisions.diff_block(d))))
    return 0


# --- share, import, validate: results between machines (checks.share.exchange) ----------------------------------------
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
    p.add_argument("--accept-flips", action="store_true",
                   help="write a bundle that changes verdicts or advice of a host the results already hold (each "
                        "change is printed first; without this flag such a bundle is not imported)")
    p = sub.add_parser("validate", help="check a results directory or a bundle as untrusted input")
    p.add_argument("path", nargs="?", type=Path, default=REPO / "results", metavar="PATH",
                   help="a results directory, one host's folder or a bundle file (default: results/)")
    p.add_argument("--json", action="store_true", help="what was read and every problem, as JSON on stdout")


def cmd_share(args: argparse.Namespace) -> int:
    # lazy: checks.share (its scrub rules compile on import) costs 15 ms at every `checks` start
    from checks.share import bundle, exchange

    if args.out is not None:
        _writable((args.out, "checks share: --out"))
    try:
        return exchange.share(exchange.ShareOptions(args.results, args.host, args.out, args.show))
    except bundle.BundleError as exc:
        raise UsageError(str(exc)) from None


def cmd_import(args: argparse.Namespace) -> int:
    # lazy: checks.report.decisions (with launch, diff, nearest) adds 15 ms to every `checks` start
    from checks.report import decisions, launch

    # lazy: checks.share (its scrub rules compile on import) costs 15 ms at every `checks` start
    from checks.share import exchange

    pins, engines = catalog.load().sglang_pins, launch.load()

    def advice_of(h: Any) -> list[str]:  # the advice only: what the newest run changed is history, not advice
        d = dataclasses.replace(decisions.decide(h, engines, pins), changes=None)
        return decisions.render(d).splitlines()

    return exchange.import_bundles(exchange.ImportOptions(tuple(args.bundles), args.results, args.accept_flips),
                                   advice_of)


def cmd_validate(args: argparse.Namespace) -> int:
    # lazy: checks.share (its scrub rules compile on import) costs 15 ms at every `checks` start
    from checks.share import exchange

    return exchange.validate(args.path, args.json)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM/SIGHUP clean up like Ctrl-C: workers and containers are ended, what was recorded is said. Once:
    a repeat is ignored until ``main`` returns, since a signal sent to the process group under `uv run`
    arrives twice (uv forwards the one it got too), and the second would cut the clean-up and its summary short."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code. SIGTERM and SIGHUP act as Ctrl-C while it runs; the handlers
    it replaced are restored on return, so it can be called in-process, except after one of them interrupted
    it: then both stay ignored (see ``_interrupt``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        args = parser().parse_args(argv)
        if args.cmd == "run":
            return cmd_run(args, argv)
        return {"list": cmd_list, "report": cmd_report, "advise": cmd_advise, "diff": cmd_diff, "share": cmd_share,
                "import": cmd_import, "validate": cmd_validate}[args.cmd](args)
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
            # after an interrupt the repeat stays ignored: the process is about to end, and restoring the
            # default action here would let a forwarded copy that arrives late kill it before it exits
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
