"""`checks report`: the compatibility table (Markdown and a self-contained HTML page) from recorded results:
the answer (checks/report/answer.py) first, a page per host, and an archive page for the cells no matrix
declares.

Building the model is a pure function of the results and manifests; rendering is Jinja2. Same
results, same bytes: nothing depends on the clock, the order of files on disk or the machine.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
import urllib.parse
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import markupsafe

from checks.report import abigrid, here, plots, stamp
from checks.report import answer as answer_mod
from checks.report.estimate import default_shape
from checks.report.footnotes import Footnote, Occurrence, footnotes
from checks.report.headline import headline
from checks.report.summary import proven_statically
from checks.results import hostresults, hwclass, ids, portable, remedies
from checks.results.freshness import Refresh, judged_by, refresh_list, staleness
from checks.results.provenance import VERDICT_CODE_ROLE, current_probe_hashes, verdict_code_versions
from checks.results.reader import HOST_PAGES, ORIGIN_SUFFIX
from checks.results.result import ProbeResult, table_view
from checks.results.store import REUSED_FROM, contributed, level_of, read_file, read_manifest, read_origin, scan
from common import catalog, escape, home, memlock, reasons
from inenv import atomic, registry
from inenv.probe import QUICK, Declared, Params, Role
from inenv.status import ORDER, Status

TEMPLATES = Path(__file__).with_name("templates")
MARK = {"pass": "✅", "partial": "🟡", "fail": "❌", "crash": "💥", "hang": "⏳", "skip": "➖", "not-run": "⏸️",
        "unavailable": "🚫"}
VERSION_COLUMNS = (("cuda", "CUDA"), ("torch", "torch"), ("sgl_kernel", "sgl-kernel"), ("flashinfer", "flashinfer"))
STATUS_LABEL = {"pass": "pass", "partial": "partial", "fail": "FAIL", "crash": "CRASH", "hang": "HANG",
                "skip": "skip", "not-run": "not run", "unavailable": "n/a"}  # the page's words: no emoji font needed
FILTERS = (("any", "every row", ()), ("pass", "a pass", ("pass",)), ("partial", "a partial", ("partial",)),
           ("bad", "a fail, crash or hang", ("fail", "crash", "hang")), ("skip", "a skip", ("skip",)),
           ("none", "not run or n/a", ("not-run", "unavailable")))  # the page's status filter: id, words, statuses
STALE_MARK = "↻"  # the verdict was made by other probe code than this checkout's


@dataclass
class TableCell:
    counts: list[tuple[str, int]]  # (status, n), best first
    worst: str
    notes: list[int]
    headline: str
    title: str  # a plain-text summary for HTML tooltips
    stale: bool = False  # a verdict here was made by other probe code than this checkout's (STALE_MARK)
    cached: str = ""  # e.g. "cached" or "1 of 2 cached": results reused a compile instead of compiling
    reused: str = ""  # e.g. "reused" or "3 of 4 reused": carried from an earlier run, not rerun
    quick: bool = False  # a result here was made by a quick run or is shortened by the quick level
    static: bool = False  # its pass or partial was proven on a host without a GPU (summary.proven_statically)


@dataclass
class HostSection:
    host_id: str
    facts: dict[str, Any]
    runs: list[dict[str, str]]  # run_id, date, path (relative to the output)
    probes: list[dict[str, str]]  # id, title, feature
    rows: list[dict[str, Any]]  # cell_id, versions, cells (probe id -> TableCell or None)
    footnotes: list[Footnote]
    warnings: list[str]
    refresh: list[Refresh] = field(default_factory=list)  # how to rerun the stale verdicts
    decisions: list[Any] = field(default_factory=list)  # decision notes (attach_decisions): text blocks
    memlock: str = ""  # containers ran without memlock unlimited: why, and for how many variants
    plots: list[Any] = field(default_factory=list)  # checks.report.plots.LatencyPlot per cell and rank count
    estimates: list[Any] = field(default_factory=list)  # estimate.Estimate of the advice (attach_decisions)
    judged: list[str] = field(default_factory=list)  # host-side code that judged verdicts, with its version
    # the newest run's host only, said first: here.rows as (text, True where stackprobe composed the whole line)
    standing: list[tuple[str, bool]] = field(default_factory=list)
    raw_facts: dict[str, Any] = field(default_factory=dict)  # the newest manifest's facts (hwclass.of reads them)
    latest: list[ProbeResult] = field(default_factory=list)  # the newest result per variant of the rows' cells
    decided: Any = None  # decisions.HostDecision for the rows' cells (attach_decisions)


def judged_lines(results: list[ProbeResult]) -> list[str]:
    """Which host-side code judged which probe's verdicts after the probe ran, by the version each verdict
    recorded: one line per probe, file and version (judged_by)."""
    count: Counter[tuple[str, str, str]] = Counter()
    for r in results:
        shaped = judged_by(r)
        for name, version in (shaped or {"": ""}).items() if shaped is not None else ():
            count[(r.probe_id, name, version)] += 1
    out = []
    for (probe, name, version), n in sorted(count.items()):
        what = f"{n} variant{'s' if n > 1 else ''}"
        if not name:
            out.append(f"{probe} ({what}): by the requirement judge hostjudge.py, in a version these results did "
                       "not record")
        else:
            out.append(f"{probe} ({what}): by the {VERDICT_CODE_ROLE.get(name, 'host-side code')} {name} {version}")
    return out


MAX_HEADLINES = 5


def _variant_label(parts: Params, drop: set[str]) -> str:
    """``ranks=2,backend=nccl`` -> ``nccl`` (a lone parameter loses its key); ``drop`` keys are omitted."""
    kept = [(k, v) for k, v in parts if k not in drop]
    if len(kept) == 1:
        return kept[0][1]
    return ",".join(f"{k}={v}" for k, v in kept)


def labelled_headlines(heads: list[tuple[str, Params, str]]) -> str:
    """Passing variants' headlines (variant key, its parts, headline) in variant order, each named by what tells
    it apart (one alone needs no name); ranks are left out when every variant has the same count."""
    if not heads:
        return ""
    if len(heads) == 1:
        return heads[0][2]
    ordered = sorted(heads)
    ranks = {v for _, parts, _ in ordered for k, v in parts if k == "ranks"}
    drop = {"ranks"} if len(ranks) <= 1 else set()
    shown = [f"{_variant_label(parts, drop) or key}: {h}" for key, parts, h in ordered[:MAX_HEADLINES]]
    more = len(ordered) - MAX_HEADLINES
    return "; ".join(shown) + (f"; +{more} more" if more > 0 else "")


def header(facts: dict[str, Any]) -> dict[str, Any]:
    """The host facts a section header shows, every key present (missing facts read '-')."""
    peer = facts.get("peer_access") or []
    mc = [m for m in facts.get("multicast") or [] if m is not None]
    return {
        "gpu_name": facts.get("gpu_name"),
        "gpu_count": int(facts.get("gpu_count") or 0),
        "compute_capability": facts.get("compute_capability"),
        "driver": facts.get("driver"),
        "driver_cuda": facts.get("driver_cuda"),
        "interconnect": facts.get("interconnect"),
        "nccl": facts.get("nccl"),
        "peer_access": ("all pairs" if all(all(r) for r in peer) else "not all pairs") if len(peer) > 1 else
                       ("single GPU" if peer else None),
        "multicast": ("yes" if all(mc) else "no") if mc else None,
    }


def latest_results(results: list[ProbeResult]) -> list[ProbeResult]:
    """For each (cell, probe, variant), the result the table shows (checks.results.result.table_view)."""
    best = table_view(results)
    return [best[k] for k in sorted(best)]


def _versions(cell_id: str, manifests: list[dict[str, Any]], results: list[ProbeResult]) -> dict[str, str]:
    for m in reversed(manifests):  # newest manifest that knows the cell
        cell = (m.get("cells") or {}).get(cell_id)
        if cell and cell.get("versions"):
            v = {k: str(x) for k, x in cell["versions"].items()}
            if "cuda" not in v and v.get("torch_cuda"):
                v["cuda"] = v["torch_cuda"]
            return v
    env = next((r.verdict.evidence.get("env") for r in results
                if r.cell_id == cell_id and r.verdict.evidence.get("env")), None) or {}
    return {"cuda": str(env.get("torch_cuda", "")), "torch": str(env.get("torch", "")),
            "sgl_kernel": str(env.get("sgl_kernel", "")), "flashinfer": str(env.get("flashinfer", ""))}


def cached_label(results: list[ProbeResult], fields: Declared) -> str:
    """Whether the probe reused built objects instead of building them (its metric of role CACHED)."""
    key = fields.metric(Role.CACHED)
    n = sum(1 for r in results if key is not None and r.verdict.metrics.get(key) is True)
    return "" if not n else "cached" if n == len(results) else f"{n} of {len(results)} cached"


def reused_label(results: list[ProbeResult]) -> str:
    """Whether the latest results were carried from an earlier run (checks.run.incremental) instead of run."""
    n = sum(1 for r in results if REUSED_FROM in r.verdict.evidence)
    return "" if not n else "reused" if n == len(results) else f"{n} of {len(results)} reused"


def _read_runs(runs: list[tuple[str, Path]], out_dir: Path) -> tuple[list[ProbeResult], list[str],
                                                                    list[dict[str, Any]], list[dict[str, Any]]]:
    """A host's runs read: every result, the warnings, the manifests of runs with a readable result, and a
    row per such run for the section's list of runs."""
    all_results: list[ProbeResult] = []
    warnings: list[str] = []
    manifests: list[dict[str, Any]] = []
    run_rows = []
    for run_id, path in runs:
        res, warn = read_file(path)
        warnings.extend(warn)
        if not res:
            continue  # a run with nothing readable describes nothing: its manifest is not read
        all_results.extend(portable.result(r) for r in res)
        m, why = read_manifest(path.with_name(f"{run_id}.manifest.json"))
        if m is not None:
            manifests.append(m)
        elif why:
            warnings.append(why)
        origin, why = read_origin(path.with_name(f"{run_id}{ORIGIN_SUFFIX}"))
        if why:
            warnings.append(why)
        run_rows.append({"run_id": run_id, "date": min(r.started_at for r in res)[:10],
                         "path": link(os.path.relpath(path, out_dir)),
                         "quick": m is not None and m.get("level") == QUICK, "contributed": contributed(origin)})
    return all_results, warnings, manifests, run_rows


def _table_cell(rs: list[ProbeResult], declared: Declared, notes: list[int], stale: bool, quick: bool,
                static: bool) -> TableCell:
    """One probe's cell of a table row from its results there, with the marks that qualify it."""
    counts = Counter(r.verdict.status for r in rs)
    ordered = sorted(counts.items(), key=lambda kv: kv[0].severity)
    heads = [(r.variant, r.parts, h) for r in rs
             if r.verdict.status is Status.PASS and (h := headline(r.verdict.metrics, declared))]
    title = ", ".join(f"{n} {s}" for s, n in ordered)
    if stale:
        title += "; made by other probe code than this checkout's, or by code no clean commit names"
    if quick:
        title += "; made by a quick run"
    if static:
        title += "; proven without a GPU (static)"
    return TableCell(ordered, ordered[-1][0], sorted(notes), labelled_headlines(heads), title, stale,
                     cached_label(rs, declared), reused_label(rs), quick, static)


def build_host(host_id: str, runs: list[tuple[str, Path]], out_dir: Path, probe_info: dict[str, dict[str, str]],
               catalogue_messages: dict[str, str], current: Mapping[str, str],
               catalogue_remediations: Mapping[str, str] | None = None, read: Any = None,
               keep: Callable[[str], bool] | None = None) -> HostSection:
    """One host's section. ``current``: probe id -> hash of that probe's source in this checkout;
    ``catalogue_*``: the reason catalogue's text by code (it wins over the text a result recorded); ``read``:
    what :func:`_read_runs` read of ``runs`` (read here when None); ``keep``: the cells the section shows (by
    cell id; every cell when None)."""
    all_results, warnings, manifests, run_rows = read if read is not None else _read_runs(runs, out_dir)
    results = [r for r in latest_results(all_results) if keep is None or keep(r.cell_id)]
    quick_runs = {row["run_id"] for row in run_rows if row["quick"]}  # a cell they answer is marked quick
    judges = verdict_code_versions()
    imported = {row["run_id"] for row in run_rows if row["contributed"]}  # their code is the bundle's claim
    stale = {r.key: why for r in results if (why := staleness(r, current, judges, r.run_id in imported))}
    executors = {str(m.get("run_id")): str(m.get("executor") or "docker") for m in manifests}
    probe_info = dict(probe_info)
    for m in manifests:  # what each run recorded about its probes; newer runs win
        for pid, info in (m.get("probes") or {}).items() if isinstance(m.get("probes"), dict) else []:
            probe_info[pid] = {"title": str(info.get("title", pid)), "feature": str(info.get("feature", ""))}
    raw_facts = dict(manifests[-1].get("facts") or {}) if manifests and isinstance(manifests[-1].get("facts"),
                                                                                  dict) else {}
    facts = header(raw_facts)
    probe_ids = sorted({r.probe_id for r in results})
    cell_ids = sorted({r.cell_id for r in results})
    fields = defaultdict(Declared, registry.declarations())  # a probe this checkout lacks declares nothing
    by_pair: dict[tuple[str, str], list[ProbeResult]] = defaultdict(list)
    for r in results:
        by_pair[(r.cell_id, r.probe_id)].append(r)

    chosen = _remedies(results) if catalogue_remediations is not None else {}
    occurrences = [Occurrence(cell_id, pid, r.variant, r.verdict.status, r.verdict.reason_code, r.verdict.note,
                              r.verdict.remediation, chosen.get(r.key))
                   for cell_id in cell_ids for pid in probe_ids for r in by_pair.get((cell_id, pid), [])
                   if r.verdict.status is not Status.PASS]
    notes_list, numbers = footnotes(occurrences, catalogue_messages, catalogue_remediations or {})
    note_of: dict[tuple[str, str], list[int]] = defaultdict(list)
    for o, n in zip(occurrences, numbers, strict=True):
        if n not in note_of[(o.cell, o.probe)]:
            note_of[(o.cell, o.probe)].append(n)
    rows = []
    for cell_id in cell_ids:
        cells: dict[str, TableCell | None] = {}
        for pid in probe_ids:
            rs = by_pair.get((cell_id, pid))
            if not rs:
                cells[pid] = None
                continue
            cells[pid] = _table_cell(rs, fields[pid], note_of.get((cell_id, pid), []),
                                     any(r.key in stale for r in rs),
                                     any(level_of(r) == QUICK or r.run_id in quick_runs for r in rs),
                                     proven_statically(rs, facts["gpu_count"]))
        rows.append({"cell_id": cell_id, "versions": _versions(cell_id, manifests, results), "cells": cells,
                     "statuses": sorted({str(st) for c in cells.values() if c for st, _ in c.counts})})
    probes = [{"id": p, **probe_info.get(p, {"title": p, "feature": ""})} for p in probe_ids]
    refresh = refresh_list([(r, stale[r.key]) for r in results if r.key in stale], executors)
    ml = memlock.summary(((r.run_id, r.verdict.evidence.get("memlock")) for r in results),
                         run_rows[-1]["run_id"] if run_rows else None)
    return HostSection(host_id, facts, run_rows, probes, rows, notes_list, warnings, refresh, memlock=ml,
                       plots=plots.latency_plots(results), judged=judged_lines(results), raw_facts=raw_facts,
                       latest=results)


def _remedies(results: list[ProbeResult]) -> dict[tuple[str, str, str], str]:
    """The next step of each result whose reason has remedies per NCCL release, chosen from what this host's
    results show passing on its release (checks.results.remedies)."""
    catalogue = reasons.default()
    seen = remedies.shown(results)
    return {r.key: text for r in results if r.verdict.status is not Status.PASS
            and (reason := catalogue.get(r.verdict.reason_code)) is not None and reason.remedies
            and (text := remedies.offered(r, catalogue, seen)) is not None}


def build_model(results_dir: Path, out_dir: Path, probe_info: dict[str, dict[str, str]] | None = None,
                catalogue_messages: dict[str, str] | None = None,
                current: Mapping[str, str] | None = None,
                catalogue_remediations: Mapping[str, str] | None = None) -> tuple[list[HostSection], list[str]]:
    """Every host's section. ``current``: probe id -> source hash now (default: this checkout's probes);
    verdicts made by other hashes, or recording none, are marked stale."""
    (sections,), warnings = build_split(results_dir, out_dir, (None,), probe_info, catalogue_messages, current,
                                        catalogue_remediations)
    return sections, warnings


def build_split(results_dir: Path, out_dir: Path, keeps: Sequence[Callable[[str], bool] | None],
                probe_info: dict[str, dict[str, str]] | None = None,
                catalogue_messages: dict[str, str] | None = None, current: Mapping[str, str] | None = None,
                catalogue_remediations: Mapping[str, str] | None = None,
                hosts: Mapping[str, hostresults.HostResults] | None = None) -> tuple[list[list[HostSection]],
                                                                                     list[str]]:
    """Every host's section once per ``keeps`` entry (the cells it shows; every cell for None), the results read
    once; a host with no row in one of them is left out of that one. ``current`` as in :func:`build_model`."""
    if current is None:
        current = current_probe_hashes()
    per_host: dict[str, list[tuple[str, Path]]] = defaultdict(list)
    found, skipped = scan(results_dir)
    for host, run_id, path in found:
        per_host[host].append((run_id, path))
    reads = {h: _read_runs(runs, out_dir) for h, runs in sorted(per_host.items())}
    warnings = skipped + [w for read in reads.values() for w in read[1]]
    if hosts is None:
        hosts = hostresults.load(results_dir)
    out = []
    for keep in keeps:
        sections = [build_host(h, per_host[h], out_dir, probe_info or {}, catalogue_messages or {}, current,
                               catalogue_remediations, read=read, keep=keep)
                    for h, read in reads.items()]
        sections = [s for s in sections if s.rows]
        attach_decisions(sections, hosts)
        out.append(sections)
    return out, warnings


def _catalogue() -> tuple[dict[str, str], dict[str, str]]:
    """The reason catalogue's messages and next steps by code."""
    known = reasons.default().reasons
    return {r.code: r.message for r in known}, {r.code: r.remediation for r in known}


def link(relpath: str) -> str:
    """A relative path as a link target: every segment percent-encoded (a ``:`` included), so no folder
    name can make a link with a scheme such as ``javascript:``."""
    return "/".join(urllib.parse.quote(part, safe="") for part in relpath.split(os.sep))


def md_line(text: Any) -> str:
    """Composed prose for one Markdown line or table cell: no raw HTML, no ``|`` that splits a cell, no
    link of its own; backticks stay (the text's code spans hold only checked ids and quoted commands)."""
    return escape.markdown_prose(text)


def md_text(text: Any) -> str:
    """A string from a results file for a Markdown line or table cell: as :func:`md_line`, and a backtick
    is shown, not taken as a code span."""
    return escape.markdown(text)


def visible(value: Any) -> Any:
    """Every value a template prints, last: control and bidirectional characters shown as escapes
    (common.escape), whatever filter the template applied or forgot; markup the code made itself (the SVG
    plots) is passed as it is."""
    if isinstance(value, markupsafe.Markup):
        return value
    return escape.visible(value, keep="\t\n") if isinstance(value, str) else value


@functools.cache
def environment(html: bool = False) -> jinja2.Environment:
    """This process's Jinja2 environment for Markdown, or (``html``) for the HTML page, which escapes every value
    for HTML: each template is compiled once per process, whatever renders it."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=html,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                             undefined=jinja2.StrictUndefined, finalize=visible)
    env.filters["md"] = md_text
    env.filters["mdline"] = md_line
    env.filters["anchor"] = anchor
    env.globals["MARK"] = MARK
    env.globals["VERSION_COLUMNS"] = VERSION_COLUMNS
    env.globals["STALE_MARK"] = STALE_MARK
    return env


def plot_figures(s: HostSection) -> list[dict[str, Any]]:
    """Per cell and rank count of a host, its latency plot and the estimate's bars (either may be missing), as
    SVG text with a caption."""
    latency = {(p.cell_id, p.ranks): p for p in s.plots}
    estimate = {(e.cell_id, str(e.ranks)): e for e in s.estimates}
    out = []
    for key in sorted(latency.keys() | estimate.keys()):
        p, e = latency.get(key), estimate.get(key)
        out.append({
            "title": f"{key[0]}, {key[1]} ranks",
            "latency": markupsafe.Markup(plots.latency_svg(p)) if p else None,
            "estimate": markupsafe.Markup(plots.estimate_svg(f"Estimated allreduce time per step, {key[0]}",
                                                             plots.estimate_bars(e))) if e else None,
            "model": f"{e.model.label}, batch {e.batch}, draft {e.draft}" if e else "",
        })
    return out


def page_extras(sections: list[HostSection]) -> dict[str, Any]:
    """What only the HTML page shows: the sections in page order (hosts with GPUs first, most GPUs first), each
    host's hardware class (its slug: the class filter), and the plots as SVG text."""
    order = sorted(sections, key=lambda s: (not s.facts.get("gpu_count"), -int(s.facts.get("gpu_count") or 0),
                                            s.host_id))
    svgs = {s.host_id: plot_figures(s) for s in sections}
    return {"page_sections": order, "svgs": svgs, "STATUS_LABEL": STATUS_LABEL, "FILTERS": FILTERS,
            "host_class": {s.host_id: hwclass.of(s.raw_facts).slug for s in sections}}


def anchor(host_id: str) -> str:
    """A host id as the page's element ids, links and CSS selectors use it: the id itself when it is of the
    host id grammar (letters, digits, '-'), else a hash of it, so no other text reaches a selector or a link."""
    if ids.valid("host id", host_id):
        return host_id
    return "x" + hashlib.sha256(host_id.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def render(sections: list[HostSection], kind: str, results_rel: str, skipped: int = 0,
           abi: dict[str, Any] | None = None, answer: answer_mod.Answer | None = None, archive: str = "") -> str:
    """One document; ``skipped``: how many unreadable items the results held (said at the top when any);
    ``abi``: the extension x torch grid's section (checks/report/abigrid.py), None for none; ``answer``: the
    feature x stack table (default: every cell of the sections taken as declared); ``archive``: the archive
    page's link, "" for none."""
    env = environment(html=kind == "html")
    extras: dict[str, Any] = {}
    if kind == "html":
        extras = page_extras(sections)
    if answer is None:
        every = sorted({row["cell_id"] for s in sections for row in s.rows})
        answer = answer_mod.build(sections, [answer_mod.Stack(c, "") for c in every], _catalogue()[0])
    sm12 = any(str(s.facts.get("compute_capability") or "").startswith("12.") for s in sections)
    cells = [c for s in sections for row in s.rows for c in row["cells"].values() if c]
    return env.get_template(f"compatibility.{kind}.j2").render(
        sections=sections, statuses=list(ORDER), measured_sm12=sm12, results_rel=results_rel,
        newest=next((s for s in sections if s.standing), None),
        any_stale=any(s.refresh for s in sections), any_cached=any(c.cached for c in cells),
        any_reused=any(c.reused for c in cells), any_quick=any(c.quick for c in cells),
        any_static=any(c.static for c in cells), answer=answer, refs=answer_mod.references(answer),
        archive=archive, hosts_dir=HOSTS_DIR,
        skipped=skipped, abi=abi, **extras)


HOSTS_DIR = HOST_PAGES  # the per-host pages, beside the main page (the results reader skips the folder)
ARCHIVE_SUFFIX = "-archive"  # compatibility.md -> compatibility-archive.md: the cells no matrix declares


@dataclass
class Pages:
    """Every file one report writes: path -> text."""

    files: dict[Path, str]
    answer: answer_mod.Answer
    hosts: int


def host_page(s: HostSection, main_name: str, results_rel: str) -> str:
    """One host's page: its facts, runs, every declared cell's verdicts, notes and decisions."""
    return environment().get_template("host.md.j2").render(
        s=s, up="../", main_name=main_name, results_rel=results_rel, statuses=list(ORDER), **_flags([s]))


def archive_page(sections: list[HostSection], main_name: str, results_rel: str) -> str:
    """The cells with results that no matrix of this checkout declares, per host."""
    return environment().get_template("archive.md.j2").render(
        sections=sections, up="", main_name=main_name, results_rel=results_rel, statuses=list(ORDER),
        **_flags(sections))


def _flags(sections: list[HostSection]) -> dict[str, bool]:
    """Which qualifiers the legend explains: those some cell of ``sections`` carries."""
    cells = [c for s in sections for row in s.rows for c in row["cells"].values() if c]
    return {"any_stale": any(s.refresh for s in sections), "any_cached": any(c.cached for c in cells),
            "any_reused": any(c.reused for c in cells), "any_quick": any(c.quick for c in cells),
            "any_static": any(c.static for c in cells)}


def pages(results_dir: Path, out: Path, html: Path, current: Mapping[str, str] | None = None,
          stacks: Sequence[answer_mod.Stack] | None = None) -> tuple[Pages | None, list[str]]:
    """What a report writes (None when no result is readable) and the warnings of what was skipped. ``stacks``:
    the declared stacks (default: the matrices of this checkout, home.DATA_ROOT)."""
    messages, remediations = _catalogue()
    if stacks is None:
        stacks = answer_mod.declared(home.DATA_ROOT)
    ids_declared = {st.cell_id for st in stacks}
    hosts = hostresults.load(results_dir)
    (main, archived), warnings = build_split(results_dir, out.parent, (ids_declared.__contains__,
                                                                       lambda c: c not in ids_declared),
                                             {}, messages, current, remediations, hosts)
    if not main and not archived:
        return None, warnings
    attach_standing(main or archived, hosts, messages)
    model = answer_mod.build(main, stacks, messages, others=archived)
    rel = os.path.relpath(results_dir, out.parent)
    grid = abigrid.section(results_dir, out.parent / abigrid.GRID_FILE)  # kept beside the page by provision abi
    archive = out.with_name(f"{out.stem}{ARCHIVE_SUFFIX}{out.suffix}")
    files = {out: render(main, "md", rel, len(warnings), grid, model, archive.name if archived else ""),
             html: render(main, "html", os.path.relpath(results_dir, html.parent), len(warnings), grid, model,
                          os.path.relpath(archive, html.parent) if archived else "")}
    for s in main:
        files[out.parent / HOSTS_DIR / f"{anchor(s.host_id)}.md"] = host_page(s, out.name, rel)
    if archived:
        files[archive] = archive_page(archived, out.name, rel)
    return Pages(files, model, len(main)), warnings


def generate(results_dir: Path, out: Path, html: Path | None, check: bool, repo: Path | None = None,
             current: Mapping[str, str] | None = None, quiet: bool = False, as_json: bool = False,
             stacks: Sequence[answer_mod.Stack] | None = None, reuse: bool = False) -> int:
    """Write (or with ``check``, compare) the Markdown and HTML table, a page per host and the archive.
    ``current``: probe id -> source hash that verdicts must have been made by (default: this checkout's
    probes). ``quiet``: no line saying what was written (the caller says it). ``as_json``: print the answer
    (feature x stack x hardware class, and what to launch with) as JSON on stdout instead of writing.
    ``reuse``: when the stamp (checks/report/stamp.py) says nothing the pages are made from changed since they
    were written and no page was touched since, write nothing (the pages are already these bytes)."""
    if not results_dir.is_dir():
        print(f"checks report: no results directory {results_dir} (run `checks run` first)", file=sys.stderr)
        return 2
    html = html or out.with_suffix(".html")
    hosts_dir = out.parent / HOSTS_DIR
    mark = fp = None
    if reuse and not check and not as_json and current is None and stacks is None:
        archive = out.with_name(f"{out.stem}{ARCHIVE_SUFFIX}{out.suffix}")
        mark = stamp.where(out)
        fp = stamp.fingerprint(results_dir, out, html, out.parent / abigrid.GRID_FILE, (out, html, archive, hosts_dir))
        if stamp.current(mark, fp, hosts_dir):
            if not quiet:
                print(f"up to date: {out}, {html} and the rest (nothing they are made from changed since they "
                      "were written)", file=sys.stderr)
            return 0
        stamp.forget(mark)
    made, warnings = pages(results_dir, out, html, current, stacks)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    if warnings:
        print(f"checks report: {len(warnings)} unreadable item(s) in {ids.shown(str(results_dir))} skipped "
              "(warnings above); the table says how many", file=sys.stderr)
    if made is None:
        print(f"checks report: no valid results under {results_dir}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(answer_mod.to_json(made.answer), indent=2, sort_keys=True))
        return 0
    old = {p for p in hosts_dir.glob("*.md")} if hosts_dir.is_dir() else set()
    gone = sorted(old - set(made.files))  # pages of hosts the results do not hold now
    if check:
        stale = [str(p) for p, text in made.files.items() if not p.exists() or p.read_text() != text]
        stale += [f"{p} (no such host now)" for p in gone]
        if stale:
            print(f"checks report: stale: {', '.join(stale)}; run `checks report` and commit", file=sys.stderr)
            return 1
        print(f"up to date: {out}, {html} and {len(made.files) - 2} more", file=sys.stderr)
        return 0
    for p, text in made.files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(p, text)
    for p in gone:
        p.unlink()
    if mark is not None and fp is not None and not warnings:
        stamp.record(mark, fp, made.files)
    if not quiet:
        print(f"wrote {out}, {html} and {len(made.files) - 2} more ({made.hosts} host(s), "
              f"{len(made.answer.classes)} hardware class(es))", file=sys.stderr)
    return 0


# --- decision notes: advice, launch settings, an estimate, nearest green, changes (checks advise) ------------------
def attach_decisions(sections: list[HostSection], hosts: Mapping[str, hostresults.HostResults]) -> None:
    """Each host section gets the text blocks `checks advise` prints for it, for the cells of its rows, with the
    estimate for the default model shape at every rank count advised on (checks.report.decisions; the same
    results, so the same bytes); a cell whose advice says nothing but what is missing gets no block."""
    # lazy: checks.report.decisions (with launch, diff, nearest) adds 15 ms to every `checks` start (via session)
    from checks.report import decisions, launch

    pins = catalog.load().sglang_pins
    engines, model = launch.load(), default_shape()
    for s in sections:
        if s.host_id in hosts:
            decided = decisions.narrowed(decisions.decide(hosts[s.host_id], engines, pins, model=model),
                                         {row["cell_id"] for row in s.rows})
            s.decided = decided
            s.decisions = decisions.blocks(decided)
            s.estimates = [c.estimate for c in decided.cells if c.estimate is not None]



def attach_standing(sections: list[HostSection], hosts: Mapping[str, hostresults.HostResults],
                    messages: Mapping[str, str]) -> None:
    """The section of the newest run's host gets that run's standing (here.rows): what this run measured, not
    what other runs recorded under the same host id (another machine of the same kind gets the same id); a
    last line names those other runs, whose verdicts are on the host's page."""
    newest = here.newest_host({s.host_id: [r["run_id"] for r in s.runs] for s in sections if s.rows})
    for s in sections:
        if s.host_id != newest or newest not in hosts:
            continue
        h = hosts[newest]
        run = h.runs[-1]
        shown = {row["cell_id"] for row in s.rows}
        own = dataclasses.replace(h, runs=(run,), results=tuple(r for r in h.results
                                                                if r.run_id == run and r.cell_id in shown))
        stand = here.standing(own, messages)
        added = here.gpu_adds(stand)
        s.standing = [(row, row == added) for row in here.rows(stand)]  # (text, composed here with its own code)
        others = [r for r in h.runs if r != run]
        if others:
            which = f"{others[0]} to {others[-1]}" if len(others) > 1 else others[0]
            s.standing.append((f"{len(others)} other run{'s' if len(others) > 1 else ''} recorded under this host "
                               f"id ({which}), on this machine or another of the same kind: their verdicts are in "
                               "the host's table, not in these lines", True))
