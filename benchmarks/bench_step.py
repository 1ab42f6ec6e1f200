"""What the step probe costs: one model's decode and verify sweep for every backend of one cell, against the 60 s
target of a 2-GPU host, read from recorded results.

    uv run python benchmarks/bench_step.py results/<host>/<run>.jsonl [...]

The step probe sweeps every model shape in one variant per backend, so one model's share of a variant is its
seconds over the models it swept (``evidence.per_case``); a cell's sweep for one model is that share summed over
its backends at one world size and placement. Printed per run, cell, world size and placement: the backends,
their seconds, the seconds one model costs and the ratio to the target (under 1.00 meets it). A shared-GPU
sweep (ranks time-slicing one GPU, checked but not timed, fewer cases) is printed as such: it is not the
2-GPU figure the target is set for, and says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from inenv.probe import SHARED, key_parts

TARGET_S = 60.0  # one model's decode + verify sweep for every backend of one cell, on a 2-GPU host


def rows(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("probe_id") == "step" and row.get("status") in ("pass", "partial"):
            out.append(row)
    return out


def summarize(found: list[dict[str, Any]]) -> list[str]:
    groups: dict[tuple[str, str, str, str], list[tuple[str, float, int]]] = defaultdict(list)
    for r in found:
        parts = dict(key_parts(str(r.get("variant", ""))))
        models = r.get("evidence", {}).get("per_case") or {}  # the models this variant swept
        place = "shared GPU" if parts.get("gpus") == SHARED else "a GPU per rank"
        key = (str(r.get("run_id")), str(r.get("cell_id")), parts.get("ranks", "?"), place)
        groups[key].append((parts.get("backend", "?"), float(r.get("duration_s") or 0.0), max(len(models), 1)))
    out = []
    for (run, cell, ranks, place), items in sorted(groups.items()):
        per_model = sum(s / n for _, s, n in items)
        out.append(f"{run} {cell} ranks={ranks} ({place}): {len(items)} backend(s), "
                   + ", ".join(f"{b} {s:.0f} s/{n} models" for b, s, n in sorted(items)))
        note = "" if place == "a GPU per rank" else " (shared GPU: not the 2-GPU figure the target is for)"
        out.append(f"  one model, every backend: {per_model:.1f} s = {per_model / TARGET_S:.2f}x of the "
                   f"{TARGET_S:.0f} s target{note}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path, help="results files (.jsonl)")
    args = p.parse_args(argv)
    found = [r for f in args.results for r in rows(f)]
    if not found:
        print("bench_step: no passing or partial step results in these files", file=sys.stderr)
        return 2
    print("\n".join(summarize(found)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
