"""Plots of the HTML page, written as inline SVG by hand (pure: same results, same bytes).

- :func:`latency_plots` / :func:`latency_svg`: per cell and rank count, the allreduce latency of every backend
  ar-latency measured (and the tuned all-reduce of the pcie-ipc probe) against the message size, both axes
  logarithmic, NCCL drawn as the thick black reference line;
- :func:`estimate_svg`: the decode and verify estimate of ``checks advise`` (checks.report.estimate) as bars, one pair
  per backend, NCCL's first.

Every series has its own colour and dash pattern and is named in a legend and at its last point, so it reads
in grey too; every value is printed beside its bar. Every text and attribute is escaped here (values come
from results files).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from checks.report.advise import declared_metric
from checks.results.result import ProbeResult, is_number
from common.escape import html as escape
from inenv.probe import Role
from inenv.status import Status

LATENCY_PROBE = "ar-latency"
IPC_PROBE = "pcie-ipc"
REFERENCE = "nccl"
COLOURS = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#8C6D31", "#7F7F7F")
DASHES = ("", "6 3", "2 3", "8 3 2 3", "4 4", "1 2", "10 2", "3 2 1 2")
W, H = 640, 300  # latency plot size, px
LEFT, RIGHT, TOP, BOTTOM = 56, 190, 14, 40
MIN_LABEL_GAP = 36  # px between size labels on the x axis
GOOD = (Status.PASS, Status.PARTIAL)
FONT = "system-ui, sans-serif"


@dataclass(frozen=True)
class Series:
    label: str
    points: tuple[tuple[int, float], ...]  # (bytes, µs), bytes ascending
    reference: bool = False


@dataclass(frozen=True)
class LatencyPlot:
    cell_id: str
    ranks: str
    series: tuple[Series, ...]

    @property
    def key(self) -> str:
        return f"{self.cell_id}, {self.ranks} ranks"


def _points(metric: Any) -> tuple[tuple[int, float], ...]:
    if not isinstance(metric, Mapping):
        return ()
    pts = [(int(k), float(v)) for k, v in metric.items()
           if isinstance(k, str) and k.isdigit() and is_number(v) and math.isfinite(v) and v > 0 and int(k) > 0]
    return tuple(sorted(pts))


def latency_plots(results: Iterable[ProbeResult]) -> list[LatencyPlot]:
    """One plot per (cell, ranks) with a measured latency curve, series NCCL first then by name."""
    groups: dict[tuple[str, str], dict[str, Series]] = defaultdict(dict)
    for r in results:
        if r.verdict.status not in GOOD:
            continue
        p = r.params
        if r.shared_gpu:  # several ranks on one GPU: not a latency anyone would deploy
            continue
        pts = _points(declared_metric(r, Role.LATENCY))
        if not pts:
            continue
        if r.probe_id == LATENCY_PROBE and p.get("backend"):
            label = p["backend"]
        elif r.probe_id == IPC_PROBE and p.get("op") == "all-reduce":
            label = "pcie-ipc probe (all-reduce)"
        else:
            continue
        ranks = str(r.ranks) if r.ranks is not None else "?"
        groups[(r.cell_id, ranks)][label] = Series(label, pts, label == REFERENCE)
    out = []
    for (cell, ranks), by_label in sorted(groups.items()):
        series = sorted(by_label.values(), key=lambda s: (not s.reference, s.label))
        out.append(LatencyPlot(cell, ranks, tuple(series)))
    return out


def _size(n: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v >= 10 or v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def _us(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _f(x: float) -> str:
    return f"{x:.1f}"


def _y_ticks(lo: float, hi: float) -> list[float]:
    ticks = []
    e = math.floor(math.log10(lo))
    while 10**e <= hi * 1.0001:
        ticks += [m * 10**e for m in (1, 2, 5) if lo * 0.9999 <= m * 10**e <= hi * 1.0001]
        e += 1
    return ticks


def latency_svg(plot: LatencyPlot) -> str:
    """The plot as one <svg> element."""
    xs = sorted({x for s in plot.series for x, _ in s.points})
    ys = [y for s in plot.series for _, y in s.points]
    x0, x1 = math.log2(xs[0]), math.log2(xs[-1])
    y_lo = min(ys) / 1.15
    y_hi = max(ys) * 1.15
    y0, y1 = math.log10(y_lo), math.log10(y_hi)
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (0.5 if x1 == x0 else (math.log2(x) - x0) / (x1 - x0)) * pw

    def py(y: float) -> float:
        return TOP + ph - (math.log10(y) - y0) / (y1 - y0) * ph

    title = f"Allreduce latency against message size: {plot.key}"
    parts = [f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
             f'viewBox="0 0 {W} {H}" role="img" aria-label="{escape(title)}" font-family="{FONT}">',
             f"<title>{escape(title)}</title>",
             f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="#fff" stroke="#999"/>']
    labelled = -1e9
    for x in xs:
        parts.append(f'<line x1="{_f(px(x))}" y1="{TOP}" x2="{_f(px(x))}" y2="{TOP + ph}" stroke="#eee"/>')
        if px(x) - labelled >= MIN_LABEL_GAP:  # a size too close to the last labelled one keeps its grid line only
            labelled = px(x)
            parts.append(f'<text x="{_f(px(x))}" y="{TOP + ph + 14}" font-size="10" text-anchor="middle">'
                         f"{escape(_size(x))}</text>")
    for y in _y_ticks(y_lo, y_hi):
        parts.append(f'<line x1="{LEFT}" y1="{_f(py(y))}" x2="{LEFT + pw}" y2="{_f(py(y))}" stroke="#eee"/>')
        parts.append(f'<text x="{LEFT - 4}" y="{_f(py(y) + 3)}" font-size="10" text-anchor="end">{y:g}</text>')
    parts.append(f'<text x="{LEFT + pw / 2:.1f}" y="{H - 6}" font-size="11" text-anchor="middle">'
                 "message size (bytes per rank, log scale)</text>")
    parts.append(f'<text x="12" y="{TOP + ph / 2:.1f}" font-size="11" text-anchor="middle" '
                 f'transform="rotate(-90 12 {TOP + ph / 2:.1f})">µs per call (log)</text>')
    others = 0
    for i, s in enumerate(plot.series):
        if s.reference:
            colour, dash, width = "#000", "", 3
        else:
            colour, dash, width = COLOURS[others % len(COLOURS)], DASHES[others % len(DASHES)], 1.6
            others += 1
        pts = " ".join(f"{_f(px(x))},{_f(py(y))}" for x, y in s.points)
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(f'<g class="series"><title>{escape(s.label)}: '
                     + escape("; ".join(f"{_size(x)} {_us(y)} µs" for x, y in s.points))
                     + f'</title><polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="{width}"'
                     f'{dash_attr}/>'
                     + "".join(f'<circle cx="{_f(px(x))}" cy="{_f(py(y))}" r="2.2" fill="{colour}"/>'
                               for x, y in s.points) + "</g>")
        ly = TOP + 10 + i * 16
        lx = LEFT + pw + 10
        parts.append(f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 24}" y2="{ly - 4}" stroke="{colour}" '
                     f'stroke-width="{width}"{dash_attr}/>')
        ref = " (reference)" if s.reference else ""
        parts.append(f'<text x="{lx + 28}" y="{ly}" font-size="10">{escape(s.label + ref)}</text>')
    parts.append("</svg>")
    return "".join(parts)


@dataclass(frozen=True)
class Bar:
    label: str
    decode_us: float | None
    verify_us: float | None
    reference: bool = False


def estimate_bars(estimate: Any) -> list[Bar]:
    """The backends of a checks.report.estimate.Estimate, NCCL first, as bars."""
    bars = [Bar(r.backend, r.decode.total_us, r.verify.total_us, r.backend == estimate.baseline)
            for r in estimate.rows]
    return sorted(bars, key=lambda b: (not b.reference, b.label))


def estimate_svg(title: str, bars: Sequence[Bar]) -> str:
    """Horizontal bars: per backend its decode and its verify step's allreduce time, values printed."""
    left, right, row, gap = 170, 90, 13, 8
    width = 640
    height = 34 + len(bars) * (2 * row + gap) + 18
    values = [v for b in bars for v in (b.decode_us, b.verify_us) if v is not None]
    top = max(values) if values else 1.0
    scale = (width - left - right) / top
    parts = [f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}" font-family="{FONT}">',
             f"<title>{escape(title)}</title>",
             f'<rect x="{left}" y="20" width="10" height="9" fill="#4a7bb7"/><text x="{left + 14}" y="28" '
             'font-size="10">decode step</text>',
             f'<rect x="{left + 100}" y="20" width="10" height="9" fill="#e8a33d" stroke="#000" stroke-width="0.5"/>'
             f'<text x="{left + 114}" y="28" font-size="10">verify step</text>']
    y = 34
    for b in bars:
        weight = ' font-weight="bold"' if b.reference else ""
        parts.append(f'<text x="{left - 6}" y="{y + row + 3}" font-size="11" text-anchor="end"{weight}>'
                     f"{escape(b.label + (' (reference)' if b.reference else ''))}</text>")
        for v, colour, extra, dy in ((b.decode_us, "#4a7bb7", "", 0),
                                     (b.verify_us, "#e8a33d", ' stroke="#000" stroke-width="0.5"', row)):
            if v is None:
                parts.append(f'<text x="{left + 2}" y="{y + dy + row - 3}" font-size="10">beyond the measured '
                             "sizes: no estimate</text>")
                continue
            w = max(v * scale, 1.0)
            parts.append(f'<rect x="{left}" y="{y + dy}" width="{_f(w)}" height="{row - 2}" fill="{colour}"{extra}/>'
                         f'<text x="{_f(left + w + 4)}" y="{y + dy + row - 3}" font-size="10">{_us(v)} µs</text>')
        y += 2 * row + gap
    parts.append(f'<text x="{left}" y="{height - 4}" font-size="10">allreduce time per step (µs), '
                 "lower is better</text></svg>")
    return "".join(parts)
