"""Write checks/run/cost/prior.json: the median seconds of each variant shape (probe, world size, placement,
build module) per class of host, from the committed results under results/ (or --results DIR), and the step's
GPU-per-rank figures benchmarks/bench_step_grid.py measured as one rank (its committed JSONs, or --step-grid FILES).

    uv run python tools/make_prior.py [--results results] [--step-grid F ...] [--out checks/run/cost/prior.json]

What counts as a record is checks.run.cost.prior's rule.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checks.run.cost import model, prior  # noqa: E402
from inenv import atomic, registry  # noqa: E402


def build_params() -> dict[str, str]:
    return {pid: mod.SPEC.build_param for pid, (_, mod) in registry.discover().items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    ap.add_argument("--step-grid", type=Path, nargs="*", default=prior.committed_step_grids(ROOT))
    ap.add_argument("--out", type=Path, default=model.PRIOR_PATH)
    args = ap.parse_args(argv)
    data = model.derive(prior.records(args.results, build_params()), prior.step_grids(args.step_grid))
    atomic.write_json(args.out, data)
    n = sum(len(v) for v in data["classes"].values())
    floors = data.get(model.ONE_RANK_KEY, {})
    print(f"{args.out}: {n} shape(s) in {len(data['classes'])} host class(es): {', '.join(data['classes'])}; "
          f"one rank's figures: {sum(len(v) for v in floors.values())} shape(s) of {', '.join(floors) or 'no GPU'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
