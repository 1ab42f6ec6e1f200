"""The overview at the top of the HTML page: per probe, on which classes of host it passes and on which newest
stack (pure, from the report's host sections).

A host class is what a reader shops for: GPU model, GPU count and interconnect ("no GPU" for a host without
one); hosts of one class are merged. A probe passes on a stack (a row of a host's table) when a variant
passed and none failed, crashed or hung; the newest passing stack is the one with the highest versions
(CUDA, then torch, flashinfer, sgl-kernel). Where it passes nowhere, the overview shows the worst verdict
met (a failure is news) or, with only skips and cells that never ran, the best.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from inenv.status import Status

BAD = frozenset({Status.FAIL, Status.CRASH, Status.HANG})
OK = frozenset({Status.PASS, Status.PARTIAL})


@dataclass(frozen=True)
class HostClass:
    label: str
    gpu: bool
    host_ids: tuple[str, ...]


@dataclass(frozen=True)
class Verdict:
    status: str  # a Status value
    passing: int  # stacks it passes on
    ran: int  # stacks it has verdicts on
    newest: str  # the newest passing stack, in words ("" when none)
    newest_cell: str
    static: bool = False  # the verdict shown was proven without a GPU (read from binaries or compiled), not run


@dataclass(frozen=True)
class Row:
    probe: str
    title: str
    verdicts: tuple[Verdict | None, ...]  # one per class; None where no host of the class ran the probe


@dataclass(frozen=True)
class Overview:
    classes: tuple[HostClass, ...]
    rows: tuple[Row, ...]


def class_label(facts: Mapping[str, Any]) -> tuple[str, bool]:
    name, count = facts.get("gpu_name"), facts.get("gpu_count")
    if not name or not count:
        return "no GPU (compile checks)", False
    short = re.sub(r"^NVIDIA\s+", "", str(name))
    inter = facts.get("interconnect")
    return f"{short} ×{count}" + (f", {inter}" if inter and count and int(count) > 1 else ""), True


def _vkey(version: str) -> tuple[Any, ...]:
    """A sort key for a version as printed in the table ("0.6.8.post1", "2.11.0", "nightly", "none", "-")."""
    if version in ("", "-", "none"):
        return ((-1, ""),)
    if version == "nightly":
        return ((2, ""),)
    public = version.split("+", 1)[0]  # 2.11.0+cu130 is torch 2.11.0 built for CUDA 13.0
    return tuple((1, int(p)) if p.isdigit() else (0, p) for p in re.split(r"[.-]", public))


def _stack_key(versions: Mapping[str, str]) -> tuple[Any, ...]:
    return tuple(_vkey(str(versions.get(k) or "")) for k in ("cuda", "torch", "flashinfer", "sgl_kernel"))


def stack_words(versions: Mapping[str, str]) -> str:
    names = (("cuda", "CUDA"), ("torch", "torch"), ("flashinfer", "flashinfer"), ("sgl_kernel", "sgl-kernel"))
    return " · ".join(f"{label} {versions.get(k) or '-'}" for k, label in names)


def _verdict(cells: Sequence[tuple[Any, Mapping[str, str], str]]) -> Verdict:
    """``cells``: (TableCell, versions, cell id) of one probe on every stack of one host class."""
    passing = [(v, cid) for c, v, cid in cells if {s for s, _ in c.counts} & OK and not {s for s, _ in c.counts} & BAD]
    if passing:
        versions, cell_id = max(passing, key=lambda p: (_stack_key(p[0]), p[1]))
        newest = [c for c, _, cid in cells if cid == cell_id]
        status = Status.PASS if any(c.worst != Status.PARTIAL and Status.PASS in {s for s, _ in c.counts}
                                    for c in newest) else Status.PARTIAL
        return Verdict(status, len(passing), len(cells), stack_words(versions), cell_id,
                       all(getattr(c, "static", False) for c in newest))
    seen = [Status(s) for c, _, _ in cells for s, _ in c.counts]
    bad = [s for s in seen if s in BAD]
    status = max(bad, key=lambda s: s.severity) if bad else min(seen, key=lambda s: s.severity)
    return Verdict(status, 0, len(cells), "", "")


def build(sections: Sequence[Any]) -> Overview:
    """From report.HostSection objects (host_id, facts, probes, rows)."""
    classes: dict[str, tuple[bool, list[Any]]] = {}
    for s in sections:
        label, gpu = class_label(s.facts)
        classes.setdefault(label, (gpu, []))[1].append(s)
    order = sorted(classes, key=lambda k: (not classes[k][0], -int(classes[k][1][0].facts.get("gpu_count") or 0), k))
    titles = {p["id"]: p.get("title") or p["id"] for s in sections for p in s.probes}
    rows = []
    for pid in sorted(titles):
        verdicts: list[Verdict | None] = []
        for label in order:
            cells = [(row["cells"][pid], row["versions"], row["cell_id"]) for s in classes[label][1]
                     for row in s.rows if row["cells"].get(pid)]
            verdicts.append(_verdict(cells) if cells else None)
        rows.append(Row(pid, str(titles[pid]), tuple(verdicts)))
    host_classes = tuple(HostClass(k, classes[k][0], tuple(s.host_id for s in classes[k][1])) for k in order)
    return Overview(host_classes, tuple(rows))
