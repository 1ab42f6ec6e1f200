"""The answer the page opens on: a feature x stack table whose cells give the verdict per hardware class, then
what to launch with per class and rank count (pure, from the report's host sections and the declared matrix).

Rows are the features a reader asks about (``FEATURES``: a probe, narrowed to some of its params, split into one
row per value of a param where each value is its own question). Columns are the stacks the matrices in this
checkout declare (``declared``), so a cell removed from a matrix leaves the answer; results of other cells stay
on the archive page. In a cell, each hardware class (checks.results.hwclass) shows one verdict: per variant the
newest result of any host of the class, then the worst failure met, else a pass or partial where one passed, else
the best of the rest; with the reason code of the result shown, and the host and run it came from. Where hosts of
one class disagree on a variant (one passed, another failed), the cell says so.

A skip for want of a GPU (``no-gpu``) or of GPUs (``too-few-gpus``) is not shown per cell: one line under the
table counts them and says what a host with (more) GPUs would add.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checks.results.hwclass import HwClass, group, shorts
from checks.results.result import ProbeResult
from common import catalog as catalog_mod
from common import matrix as matrix_mod
from common import resolve
from inenv.status import Status

BAD = frozenset({Status.FAIL, Status.CRASH, Status.HANG})
OK = frozenset({Status.PASS, Status.PARTIAL})
DECISIVE = BAD | OK  # the verdicts hosts of one class can disagree on (a skip depends on what the host has)
UNSHOWN = frozenset({"no-gpu", "too-few-gpus"})  # a skip for want of GPUs: counted under the table, not per cell


@dataclass(frozen=True)
class Feature:
    key: str  # letters, digits and '-': the page's element classes use it
    label: str
    probe: str
    match: tuple[tuple[str, str], ...] = ()  # the probe params a variant must have
    split: str = ""  # a param whose every value is a row of its own ("backend")


FEATURES: tuple[Feature, ...] = (
    Feature("fusion-jit-local", "Allreduce fusion JIT, this GPU (compile)", "fi-jit",
            (("module", "trtllm_comm"), ("arch", "local"))),
    Feature("fusion-jit-sm120a", "Allreduce fusion JIT, SM120 12.0a (compile)", "fi-jit",
            (("module", "trtllm_comm"), ("arch", "12.0a"))),
    Feature("fusion-jit-sm120f", "Allreduce fusion JIT, SM120 12.0f (compile)", "fi-jit",
            (("module", "trtllm_comm"), ("arch", "12.0f"))),
    Feature("fusion", "Allreduce + RMSNorm fusion (run)", "fi-fusion"),
    Feature("custom-ar-flashinfer", "Custom allreduce, flashinfer", "custom-ar", (("impl", "flashinfer"),)),
    Feature("custom-ar-sgl", "Custom allreduce, sgl-kernel", "custom-ar", (("impl", "sgl_kernel"),)),
    Feature("pcie-ipc", "PCIe IPC collectives (flashinfer)", "pcie-ipc"),
    Feature("nccl-graphs", "NCCL algorithms under CUDA graphs", "nccl-graphs"),
    Feature("symm-mem", "Symmetric memory (torch)", "symm-mem"),
    Feature("ep-a2a", "EP all-to-all (flashinfer MoE)", "ep-a2a"),
    Feature("rank-agreement", "Rank agreement, decode step per backend", "step"),
    Feature("load", "Under load", "load", split="backend"),
)


@dataclass(frozen=True)
class Stack:
    cell_id: str
    matrix: str  # the matrix file that declares it, relative to the checkout ("matrix.yaml")


@dataclass(frozen=True)
class Evidence:
    """One class's verdict in one cell of the answer."""

    status: str  # a Status value
    reason: str  # the shown result's reason code; "" for none
    host: str
    run: str
    path: str  # the run's results file, as a link relative to the page
    variants: int  # variants of the feature the class has a verdict on
    disagree: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (status, hosts) where the class's hosts differ


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    probe: str
    cells: tuple[tuple[Evidence | None, ...], ...]  # per stack, per class


@dataclass(frozen=True)
class ClassInfo:
    hw: HwClass
    short: str
    hosts: tuple[str, ...]
    newest_run: str
    paged: tuple[str, ...] = ()  # the hosts with results on a declared stack (a page of their own)


@dataclass(frozen=True)
class LaunchLine:
    hw: HwClass
    ranks: int
    cell_id: str
    ranges: tuple[tuple[str, str], ...]  # (sizes in words, backend) in size order
    host: str
    run: str
    path: str
    others: tuple[str, ...] = ()  # other hosts of the class that advise otherwise for this cell and rank count


@dataclass(frozen=True)
class Answer:
    classes: tuple[ClassInfo, ...]
    stacks: tuple[Stack, ...]
    rows: tuple[Row, ...]
    launch: tuple[LaunchLine, ...]
    reasons: tuple[tuple[str, str], ...]  # (code, what it means) for every code a cell shows
    unshown: tuple[tuple[str, str, int, tuple[str, ...]], ...]  # (class label, reason code, variants, probes)
    archived: tuple[str, ...]  # cells with results that no matrix declares


def declared(root: Path, cat: catalog_mod.Catalog | None = None) -> list[Stack]:
    """The stacks the matrices of a checkout declare: ``matrix.yaml``, then ``matrices/*.yaml`` by name; a cell
    declared twice keeps its first matrix. Reads files (the report's edge); a broken matrix raises InputError."""
    cat = cat or catalog_mod.load()
    out: dict[str, Stack] = {}
    for f in [root / "matrix.yaml", *sorted((root / "matrices").glob("*.yaml"))]:
        if not f.is_file():
            continue
        for cell in matrix_mod.expand(matrix_mod.load(f, cat)).cells:
            cid = resolve.cell_id(cell, cat)
            out.setdefault(cid, Stack(cid, f.relative_to(root).as_posix()))
    return list(out.values())


def _matches(r: ProbeResult, f: Feature) -> bool:
    return r.probe_id == f.probe and all(r.params.get(k) == v for k, v in f.match)


def _pick(newest: Sequence[tuple[ProbeResult, str]]) -> tuple[Status, ProbeResult, str]:
    """The verdict one class shows from its newest result per variant (result, host): the worst failure, else a
    pass (a partial where one is partial), else the best of the rest; with the result that shows it."""
    statuses = {r.verdict.status for r, _ in newest}
    if statuses & BAD:
        st = max(statuses & BAD, key=lambda s: s.severity)
    elif statuses & OK:
        st = Status.PARTIAL if Status.PARTIAL in statuses else Status.PASS
    else:
        st = min(statuses, key=lambda s: s.severity)
    r, host = max(((r, h) for r, h in newest if r.verdict.status is st), key=lambda p: (p[0].run_id, p[0].key))
    return st, r, host


def _cell(rs: Sequence[tuple[ProbeResult, str]], paths: Mapping[tuple[str, str], str]) -> Evidence | None:
    """One class's verdict on one feature and stack from every host's latest results there (result, host)."""
    per_variant: dict[str, list[tuple[ProbeResult, str]]] = defaultdict(list)
    for r, h in rs:
        per_variant[r.variant].append((r, h))
    newest = [max(v, key=lambda p: (p[0].run_id, p[0].started_at, p[1])) for v in per_variant.values()]
    shown = [(r, h) for r, h in newest
             if not (r.verdict.status is Status.SKIP and r.verdict.reason_code in UNSHOWN)]
    if not shown:
        return None
    st, r, host = _pick(shown)
    split: dict[str, set[str]] = defaultdict(set)
    for v in per_variant.values():
        said = {p[0].verdict.status for p in v if p[0].verdict.status in DECISIVE}
        if len(said) > 1:
            for p in v:
                if p[0].verdict.status in DECISIVE:
                    split[p[0].verdict.status.value].add(p[1])
    disagree = tuple((s, tuple(sorted(split[s]))) for s in sorted(split, key=lambda s: Status(s).severity))
    return Evidence(st.value, "" if st is Status.PASS else r.verdict.reason_code, host, r.run_id,
                    paths.get((host, r.run_id), ""), len(shown), disagree)


def _rows(features: Sequence[Feature], results: Sequence[tuple[ProbeResult, str]]) -> list[tuple[str, str, Feature,
                                                                                                   str]]:
    """(row key, label, feature, split value) per row: a split feature has a row per value seen (one row saying
    so where none was seen)."""
    out = []
    for f in features:
        if not f.split:
            out.append((f.key, f.label, f, ""))
            continue
        values = sorted({r.params.get(f.split, "") for r, _ in results if _matches(r, f)} - {""})
        out += [(f"{f.key}-{i}", f"{f.label}: {v}", f, v) for i, v in enumerate(values)] or \
            [(f.key, f"{f.label} (not measured yet)", f, "")]
    return out


def build(sections: Sequence[Any], stacks: Sequence[Stack], messages: Mapping[str, str],
          features: Sequence[Feature] = FEATURES, others: Sequence[Any] = ()) -> Answer:
    """From report.HostSection objects (host_id, raw_facts, latest, runs, decided) of the declared stacks and the
    declared stacks; ``others``: the sections of hosts with results on other stacks only (members of their class,
    nothing to show in it)."""
    paged = {s.host_id for s in sections}
    archived = {r.cell_id for s in [*sections, *others] for r in s.latest} - {st.cell_id for st in stacks}
    sections = [*sections, *(s for s in others if s.host_id not in paged)]
    by_class = group({s.host_id: s.raw_facts for s in sections})
    names = shorts(by_class)
    section = {s.host_id: s for s in sections}
    paths = {(s.host_id, run["run_id"]): run["path"] for s in sections for run in s.runs}
    classes = tuple(ClassInfo(c, names[c], hosts, max((r["run_id"] for h in hosts for r in section[h].runs),
                                                      default=""), tuple(h for h in hosts if h in paged))
                    for c, hosts in by_class.items())
    declared_ids = {st.cell_id for st in stacks}
    every = [(r, s.host_id) for s in sections for r in s.latest]
    by_place: list[dict[tuple[str, str], list[tuple[ProbeResult, str]]]] = []  # per class: (cell, probe) -> results
    for c in classes:
        place: dict[tuple[str, str], list[tuple[ProbeResult, str]]] = defaultdict(list)
        for h in c.hosts:
            for r in section[h].latest:
                place[(r.cell_id, r.probe_id)].append((r, h))
        by_place.append(place)
    rows = []
    for key, label, f, value in _rows(features, [p for p in every if p[0].cell_id in declared_ids]):
        cells = []
        for st in stacks:
            per_class: list[Evidence | None] = []
            for place in by_place:
                rs = [(r, h) for r, h in place.get((st.cell_id, f.probe), ())
                      if _matches(r, f) and (not value or r.params.get(f.split) == value)]
                per_class.append(_cell(rs, paths) if rs else None)
            cells.append(tuple(per_class))
        rows.append(Row(key, label, f.probe, tuple(cells)))
    codes = sorted({e.reason for row in rows for cell in row.cells for e in cell if e and e.reason})
    unshown: dict[tuple[str, str], tuple[int, set[str]]] = {}
    for c in classes:
        for h in c.hosts:
            for r in section[h].latest:
                if r.cell_id in declared_ids and r.verdict.status is Status.SKIP and r.verdict.reason_code in UNSHOWN:
                    n, probes = unshown.get((c.hw.label, r.verdict.reason_code), (0, set()))
                    unshown[(c.hw.label, r.verdict.reason_code)] = (n + 1, probes | {r.probe_id})
    return Answer(classes, tuple(stacks), tuple(rows), tuple(launch_lines(classes, section, declared_ids)),
                  tuple((c, messages.get(c, "")) for c in codes),
                  tuple((label, code, n, tuple(sorted(p))) for (label, code), (n, p) in sorted(unshown.items())),
                  tuple(sorted(archived)))


def ranges(sizes: Iterable[Any]) -> tuple[tuple[str, str], ...]:
    """advise.SizeAdvice per size, in size order -> (sizes in words, backend) per run of one backend:
    ``(("1-8 tokens", "flashinfer-pcie-ipc"), ("16 tokens", "flashinfer-custom-ar"))``; sizes in bytes where no
    token count is known."""
    runs: list[tuple[list[Any], str]] = []
    for s in sizes:
        if runs and runs[-1][1] == s.use:
            runs[-1][0].append(s)
        else:
            runs.append(([s], s.use))
    out = []
    for group_, use in runs:
        unit = "tokens" if all(s.tokens is not None for s in group_) else "bytes"
        lo, hi = ((group_[0].tokens, group_[-1].tokens) if unit == "tokens" else (group_[0].nbytes, group_[-1].nbytes))
        out.append((f"{lo} {unit}" if lo == hi else f"{lo}-{hi} {unit}", use))
    return tuple(out)


def launch_lines(classes: Sequence[ClassInfo], section: Mapping[str, Any], declared_ids: set[str]) -> list[LaunchLine]:
    """Per class, rank count and declared stack with advice: the advice of the class's host whose newest
    ar-latency result there is newest; other hosts of the class that advise otherwise are named."""
    out = []
    for c in classes:
        found: dict[tuple[int, str], list[tuple[str, str, tuple[tuple[str, str], ...]]]] = defaultdict(list)
        for h in c.hosts:
            decided = section[h].decided
            for cd in decided.cells if decided is not None else ():
                a = cd.advice
                if a.cell_id not in declared_ids or not a.sizes:
                    continue
                run = max((i.split("/", 1)[0] for s in a.sizes for i in s.ids), default="")
                found[(a.ranks, a.cell_id)].append((run, h, ranges(a.sizes)))
        for (ranks, cell_id), advised in sorted(found.items()):
            run, host, said = max(advised)
            others = tuple(sorted(h for _, h, r in advised if r != said))
            paths = {r["run_id"]: r["path"] for r in section[host].runs}
            out.append(LaunchLine(c.hw, ranks, cell_id, said, host, run, paths.get(run, ""), others))
    return out


def references(a: Answer) -> dict[str, str]:
    """Each evidence link of the answer -> a short reference label (``r1``, ``r2``... in order of first use), so
    a Markdown table cell names its run in a few characters and the link stands once under the table."""
    out: dict[str, str] = {}
    paths = [e.path for row in a.rows for cell in row.cells for e in cell if e and e.path]
    for path in [*paths, *(ln.path for ln in a.launch if ln.path)]:
        out.setdefault(path, f"r{len(out) + 1}")
    return out


def to_json(a: Answer) -> dict[str, Any]:
    """The answer as plain data (`checks report --json`)."""
    def ev(e: Evidence | None) -> dict[str, Any] | None:
        if e is None:
            return None
        return {"status": e.status, "reason": e.reason, "host": e.host, "run": e.run, "variants": e.variants,
                "disagree": {s: list(h) for s, h in e.disagree}}

    return {
        "classes": [{"class": c.hw.label, "slug": c.hw.slug, "gpu": c.hw.gpu, "gpu_count": c.hw.count,
                     "interconnect": c.hw.interconnect, "driver_major": c.hw.driver_major, "hosts": list(c.hosts),
                     "newest_run": c.newest_run} for c in a.classes],
        "stacks": [{"cell_id": s.cell_id, "matrix": s.matrix} for s in a.stacks],
        "features": [{"feature": row.key, "label": row.label, "probe": row.probe,
                      "cells": {st.cell_id: {c.hw.label: ev(e) for c, e in zip(a.classes, cell, strict=True)}
                                for st, cell in zip(a.stacks, row.cells, strict=True)}} for row in a.rows],
        "launch": [{"class": ln.hw.label, "ranks": ln.ranks, "cell_id": ln.cell_id,
                    "use": [{"sizes": s, "backend": b} for s, b in ln.ranges], "host": ln.host, "run": ln.run,
                    "hosts_advising_otherwise": list(ln.others)} for ln in a.launch],
        "reasons": dict(a.reasons),
        "unshown": [{"class": c, "reason": code, "variants": n, "probes": list(p)} for c, code, n, p in a.unshown],
        "archived": list(a.archived),
    }
