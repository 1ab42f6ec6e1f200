"""The page's ABI section: which extension release loads beside which torch build, from the grid
`provision abi` keeps (docs/abi-grid.json), and each built cell's inventory verdict set beside the grid's
prediction for the same pair (a disagreement is shown as a finding). Pure but for reading the results."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from checks.results.reader import read_results
from common import abi
from common.cellid import parse as parse_cell

GRID_FILE = abi.GRID_DATA.name  # the grid is read from beside the page it is shown on
_ENGINE = re.compile(r"(vllm|sglang)(\d[0-9A-Za-z._+]*)")


def observations(results: Iterable[tuple[str, Mapping[str, Any]]]) -> list[abi.Observed]:
    """(host, result) pairs -> what each inventory result observed, the latest result per host and cell."""
    latest: dict[tuple[str, str], Mapping[str, Any]] = {}
    for host, r in results:
        if r.get("probe_id") != "inventory" or not isinstance(r.get("evidence"), dict):
            continue
        key = (host, str(r.get("cell_id")))
        if key not in latest or str(r.get("started_at", "")) >= str(latest[key].get("started_at", "")):
            latest[key] = r
    out: list[abi.Observed] = []
    for (host, cell), r in sorted(latest.items()):
        parsed = parse_cell(cell)
        m = _ENGINE.fullmatch(parsed.engine) if parsed is not None and parsed.engine else None
        out += abi.observed(f"{host}/{cell}", r["evidence"], {m.group(1): m.group(2)} if m else {})
    return out


def model(data: Mapping[str, Any] | None, seen: list[abi.Observed]) -> dict[str, Any] | None:
    """What the templates show; None without a grid."""
    if not data:
        return None
    torches = [t for t in data.get("torch") or [] if isinstance(t, dict)]
    exts = [e for e in data.get("extensions") or [] if isinstance(e, dict)]
    cells = {(c.get("extension"), c.get("torch")): c for c in data.get("cells") or [] if isinstance(c, dict)}
    rows = [{"label": str(e.get("label")), "pin": abi.spec_text(e.get("torch_pin")).strip(),
             "cells": [(abi.short(c), str(c.get("says", ""))) if (c := cells.get((e.get("label"), t.get("label"))))
                       else ("-", "") for t in torches]} for e in exts]
    findings = abi.finding_lines(cells.values())
    compared = abi.compare(dict(data), seen)
    return {"columns": [(str(t.get("version")), str(t.get("variant"))) for t in torches], "rows": rows,
            "legend": abi.LEGEND, "findings": findings,
            "agree": sum(c.agrees is True for c in compared),
            "disagree": [f"{c.seen.where}: {c.seen.module} {c.seen.version} beside torch {c.seen.torch}: the "
                         f"inventory found {c.seen.said}, the grid says {c.predicted.get('says')}"
                         for c in compared if c.agrees is False and c.predicted is not None],
            "unpredicted": sorted({f"{c.seen.module} {c.seen.version} beside torch {c.seen.torch}"
                                   for c in compared if c.agrees is None})}


def section(results_dir: Path, grid_data: Path) -> dict[str, Any] | None:
    """The section's model from the kept grid and every inventory result under ``results_dir``; None
    when no grid is kept there."""
    data = abi.load_grid_data(grid_data)
    if data is None:
        return None
    hosts, _problems = read_results(results_dir)  # the host sections report unreadable items already
    pairs = [(host, r) for host, runs in hosts.items() for run in runs.values() for r in run.results]
    return model(data, observations(pairs))
