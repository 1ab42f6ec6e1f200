"""How a plan is shown: aligned text for people, JSON for scripts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

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
        }
        for r in cells
    ]


def _expect(r: Resolved) -> str:
    return "".join(f"; note: {e}" for e in r.expect)


def _preset(r: Resolved) -> str:
    return f"[{r.cell.preset}] " if r.cell.preset else ""


def plan_lines(cells: Sequence[Resolved]) -> list[str]:
    width = max(len(r.cell_id) for r in cells)
    lines = []
    for r in cells:
        if r.status == "resolved":
            where = ", ".join(f"{s.requirement.split(' @ ')[0]} ({'registry' if s.where == 'registry' else s.where})"
                              for s in r.sources)
            lines.append(f"{r.cell_id:<{width}}  resolved     {_preset(r)}{where}{_expect(r)}")
        else:
            lines.append(f"{r.cell_id:<{width}}  {r.status:<11}  {_preset(r)}{r.reason}{_expect(r)}")
    counts = Counter(r.status for r in cells)
    lines.append(f"{len(cells)} cells: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return lines
