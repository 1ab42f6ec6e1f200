"""The closing summary of a `checks run` (pure): totals by verdict, then only the rows worth reading, with
full ids, and everything else counted on one line by reason.

A full matrix run is mostly variants decided without running (a host with too few GPUs, a cell that
cannot be provisioned): listing them row by row buries the few verdicts someone came to read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from checks.results.result import ProbeResult
from inenv.status import ORDER, Status

WORTH_READING = frozenset({Status.PASS, Status.PARTIAL, Status.FAIL, Status.CRASH, Status.HANG})
PROVEN = frozenset({Status.PASS, Status.PARTIAL})
STATIC_LINE = ("static: proven without a GPU (read from the binaries, or compiled), nothing ran on one; a run on a "
               "GPU host proves it at run time")


def proven_statically(results: Iterable[ProbeResult], gpu_count: int) -> bool:
    """Whether a pass or partial among ``results`` was proven on a host with no GPU: from the binaries (the
    inventory's architectures) or by compiling (fi-jit's cross-compiles), never by running on a GPU."""
    return gpu_count == 0 and any(r.verdict.status in PROVEN for r in results)


def counts_text(counts: Counter[Status]) -> str:
    """``2 pass, 1 fail``: best first, zeros left out."""
    return ", ".join(f"{counts[s]} {s}" for s in ORDER if counts[s])


def totals_line(results: Iterable[ProbeResult]) -> str:
    """The one-line verdict count: ``29 variants: 2 pass, 1 fail, 26 skip``."""
    counts = Counter(r.verdict.status for r in results)
    n = sum(counts.values())
    return f"{n} variant{'' if n == 1 else 's'}: {counts_text(counts) or 'none'}"


def _reasons(results: list[ProbeResult]) -> str:
    codes = Counter(r.verdict.reason_code or "no reason" for r in results)
    if len(codes) == 1:
        return next(iter(codes))
    return ", ".join(f"{code} {n}" for code, n in sorted(codes.items(), key=lambda kv: (-kv[1], kv[0])))


def rows(results: Iterable[ProbeResult], gpu_count: int | None = None) -> list[str]:
    """One line per (cell, probe) with a verdict worth reading: its full cell id, the probe, the counts of
    those verdicts and the reason codes of the ones that are not a pass, and ``[static]`` where a pass or
    partial was proven without a GPU (``gpu_count`` 0). Columns are padded, never cut."""
    per: dict[tuple[str, str], list[ProbeResult]] = {}
    for r in results:
        if r.verdict.status in WORTH_READING:
            per.setdefault((r.cell_id, r.probe_id), []).append(r)
    if not per:
        return []
    cell_w = max(len(c) for c, _ in per)
    probe_w = max(len(p) for _, p in per)
    out = []
    for (cell, probe), rs in sorted(per.items()):
        text = counts_text(Counter(r.verdict.status for r in rs))
        bad = [r for r in rs if r.verdict.status is not Status.PASS]
        why = f" ({_reasons(bad)})" if bad else ""
        static = " [static]" if gpu_count is not None and proven_statically(rs, gpu_count) else ""
        out.append(f"{cell:<{cell_w}}  {probe:<{probe_w}}  {text}{why}{static}")
    return out


def rest_line(results: Iterable[ProbeResult]) -> str:
    """Every variant whose verdict is not worth a row, counted by verdict and reason; '' when there is none:
    ``not listed: 120 skip (no-gpu 100, too-few-gpus 20); 18 unavailable (cell-unavailable 18)``."""
    by: dict[Status, list[ProbeResult]] = {}
    for r in results:
        if r.verdict.status not in WORTH_READING:
            by.setdefault(r.verdict.status, []).append(r)
    parts = [f"{len(by[s])} {s} ({_reasons(by[s])})" for s in ORDER if s in by]
    return "not listed: " + "; ".join(parts) if parts else ""


def lines(results: list[ProbeResult], gpu_count: int | None = None) -> list[str]:
    """The summary before the totals: the rows worth reading, then the one line for the rest, then what
    [static] means when a row has it. ``gpu_count``: the host's GPUs (None: not known, nothing marked)."""
    body = rows(results, gpu_count)
    rest = rest_line(results)
    out = ["summary (pass, partial, fail, crash, hang by cell and probe):"]
    out += [f"  {line}" for line in body] or ["  none"]
    if rest:
        out.append(f"  {rest}")
    if any(line.endswith(" [static]") for line in body):
        out.append(f"  {STATIC_LINE}")
    return out
