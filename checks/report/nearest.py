"""Nearest green: for each feature (probe variant) that fails in a cell, the nearest cell of the same host where
it passes, from results only (pure).

Nearest means fewest changed axes of the cell id (CUDA, torch, sgl-kernel, flashinfer, jit-cache, and for a
local environment its nvcc), then the newest versions, then the cell id. A cell id that provision did not make
cannot be compared axis by axis and counts as changing every axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from checks.results.result import ProbeResult
from common import cellid
from inenv.status import Status

FAILING = frozenset({Status.FAIL, Status.CRASH, Status.HANG, Status.PARTIAL})
AXES = (("cuda", "CUDA"), ("torch", "torch"), ("sgl_kernel", "sgl-kernel"), ("flashinfer", "flashinfer"),
        ("jit_cache", "jit-cache"), ("local", "environment"), ("nvcc", "nvcc"))


@dataclass(frozen=True)
class Green:
    cell_id: str
    probe_id: str
    variant: str
    status: str
    reason_code: str
    failing_id: str
    nearest: str = ""  # the passing cell; "" when no cell of the host passes it
    changes: tuple[str, ...] = ()  # "flashinfer 0.6.16 → 0.6.17"
    passing_id: str = ""


def _axes(cell: str) -> dict[str, str] | None:
    c = cellid.parse(cell)
    if c is None:
        return None
    return {"cuda": c.cuda, "torch": c.torch, "sgl_kernel": c.sgl_kernel, "flashinfer": c.flashinfer,
            "jit_cache": "yes" if c.jit_cache else "no", "local": "local" if c.local else "image",
            "nvcc": c.nvcc or ""}


def changes(a: str, b: str) -> tuple[str, ...]:
    """The axes that differ from cell ``a`` to cell ``b``, spelled ``axis old → new``."""
    x, y = _axes(a), _axes(b)
    if x is None or y is None:
        return tuple(label for _, label in AXES) if a != b else ()
    return tuple(f"{label} {x[k] or '-'} → {y[k] or '-'}" for k, label in AXES if x[k] != y[k])


def _version(text: str) -> tuple[int, Version | float]:
    """Sort key, newest largest: nightly above every release, none and unparseable below (the first part
    decides the type of the second, so keys always compare)."""
    if text == "nightly":
        return (2, 0.0)
    digits = text[2:] if text.startswith("cu") and text[2:].isdigit() else text
    try:
        return (1, Version(digits))
    except InvalidVersion:
        return (0, 0.0)


def newness(cell: str) -> tuple[tuple[int, Version | float], ...]:
    x = _axes(cell) or {}
    return tuple(_version(x.get(k, "")) for k in ("torch", "flashinfer", "sgl_kernel", "cuda"))


def nearest_green(results: Sequence[ProbeResult], host_bound: frozenset[str] = frozenset()) -> list[Green]:
    """``results``: one host's latest result per (cell, probe, variant); ``host_bound``: reason codes of partials
    that say how far the host could check (the catalogue's ``host_bound_codes``), which no other cell of the host
    does better, so they are not looked up."""
    passing: dict[tuple[str, str], list[ProbeResult]] = {}
    for r in results:
        if r.verdict.status is Status.PASS:
            passing.setdefault((r.probe_id, r.variant), []).append(r)
    out = []
    for r in sorted(results, key=lambda r: r.key):
        if r.verdict.status not in FAILING or (r.verdict.status is Status.PARTIAL
                                                and r.verdict.reason_code in host_bound):
            continue
        cands = [p for p in passing.get((r.probe_id, r.variant), []) if p.cell_id != r.cell_id]
        base = Green(r.cell_id, r.probe_id, r.variant, r.verdict.status.value, r.verdict.reason_code, r.result_id)
        if not cands:
            out.append(base)
            continue
        # Stable sorts, last key first: fewest changes, then the newest versions, then the cell id.
        cands.sort(key=lambda p: p.cell_id)
        cands.sort(key=lambda p: newness(p.cell_id), reverse=True)
        best = min(cands, key=lambda p: len(changes(r.cell_id, p.cell_id)))
        out.append(Green(base.cell_id, base.probe_id, base.variant, base.status, base.reason_code, base.failing_id,
                         best.cell_id, changes(r.cell_id, best.cell_id), best.result_id))
    return out
