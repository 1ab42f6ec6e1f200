"""How a plan is shown: aligned text for people, JSON for scripts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from common.matrix import DEFAULT_KERNEL_ARCHS
from common.resolve import Resolved


def plan_json(cells: Sequence[Resolved]) -> list[dict[str, Any]]:
    return [
        {
            "cell_id": r.cell_id,
            "status": r.status,
            "reason": r.reason,
            "cuda": r.cell.cuda,
            "versions": r.versions,
            "sources": {s.package: s.where for s in r.sources},
            "requirements": [s.requirement for s in r.sources],
            "notes": list(r.notes),
            "expect": list(r.expect),
            "kernel_archs": list(r.cell.kernel_archs),
            "engine": r.cell.engine,
            "overrides": list(r.overrides),
        }
        for r in cells
    ]


def _expect(r: Resolved) -> str:
    return "".join(f"; note: {e}" for e in r.expect)


def _own(r: Resolved) -> str:
    """What the cell sets beyond its versions: its engine's pins that replace the declared ones when locking, and
    carried-kernel archs other than the matrix default (said once under the plan)."""
    out = ""
    if r.overrides:
        out += f"; pins overridden: {', '.join(r.overrides)}"
    if tuple(r.cell.kernel_archs) != DEFAULT_KERNEL_ARCHS:
        out += f"; kernel archs: {','.join(r.cell.kernel_archs) or 'none'}"
    return out


def _preset(r: Resolved) -> str:
    return f"[{r.cell.preset}] " if r.cell.preset else ""


def plan_lines(cells: Sequence[Resolved]) -> list[str]:
    width = max(len(r.cell_id) for r in cells)
    lines = []
    for r in cells:
        if r.status == "resolved":
            where = ", ".join(f"{s.requirement.split(' @ ')[0]} ({'registry' if s.where == 'registry' else s.where})"
                              for s in r.sources)
            lines.append(f"{r.cell_id:<{width}}  resolved     {_preset(r)}{where}{_own(r)}{_expect(r)}")
        else:
            lines.append(f"{r.cell_id:<{width}}  {r.status:<11}  {_preset(r)}{r.reason}{_expect(r)}")
    counts = Counter(r.status for r in cells)
    lines.append(f"{len(cells)} cells: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    default = sum(1 for r in cells if tuple(r.cell.kernel_archs) == DEFAULT_KERNEL_ARCHS)
    if default:
        lines.append(f"carried kernels built for {','.join(DEFAULT_KERNEL_ARCHS)} (kernel_archs) in {default} cell(s); "
                     "the others say theirs")
    return lines
