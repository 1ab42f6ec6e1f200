"""What the step probe's full grid costs with a GPU per rank, measured on one GPU: the floor under the seconds a
step variant at a deep world size takes, which no host of ours has run. tools/make_prior.py puts the committed
JSONs (benchmarks/results/*/step-grid-*.json) into the packaged prior as one rank's figures
(checks.run.cost.model), which cost such variants where no host's records do.

    python3 benchmarks/bench_step_grid.py [--world 2] [--json OUT]      # on a GPU host, the machine's torch

One process, one rank: torch.distributed over NCCL with a world of one, and the step probe's own code
(inenv.probes.stepmodel, stepcomm's NCCL adapter, the agreement cases) run as a variant with a GPU per rank runs
it at ``--world`` ranks: every model shape at that world size's widths (inenv.probes.stepmodel.shapes), every
decode and verify case (cases of one token count once, as the probe measures them), each captured, checked on two
inputs and timed (stepmodel.REPLAYS replays of the step, the baseline and the allreduces alone, whose graph's
kernels are also read), then the agreement cases of every dtype. Everything a rank of a real variant does but
wait for its peers: a world of one's allreduce is a copy on the GPU, so what is left out is the links' time,
which the run adds as an estimate from the allreduce calls a rank makes
(``inenv.stepgrid.allreduces``, the agreement cases' few left out; ``--link-us`` per call, default 20 us: an NVLink
allreduce of decode sizes; PCIe is slower) and prints apart. The measuring runs in ``inenv.stepgrid``, the
in-environment side of this benchmark.

Prints per shape and case the seconds spent, where the grid's seconds went (``inenv.stepgrid.PHASES``), the
step's whole grid, the agreement cases, the count of allreduce calls and the estimate with the links' time;
``--json`` writes the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="the world size whose widths the shapes take (default 2)")
    ap.add_argument("--link-us", type=float, default=20.0, help="an allreduce's time across real links, per call")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from inenv import stepgrid

    out = stepgrid.measure(args.world, args.link_us)
    rows = out["rows"]
    wanted, grid_s, agree_s, calls = out["shapes"], out["grid_s"], out["agreement_s"], out["allreduces"]
    for row in rows:
        print(f"{row['shape']:>24} {row['case']:>14} {row['verdict']:>8} {row['s']:>7.2f} s "
              f"{row['allreduces']:>6} allreduces")
    bad = sorted({str(r["verdict"]) for r in rows if not str(r["verdict"]).startswith("same_graph_as")} - {"ok"})
    print(f"{out['gpu']}, torch {out['torch']}: the step's grid at {args.world} ranks' widths ({wanted} shapes x "
          f"{out['cases']} cases) took {grid_s:.1f} s on one rank, its agreement cases {agree_s:.1f} s, "
          f"{calls} allreduces; with {args.link_us:g} us of links per call: about {out['estimate_s']} s a variant "
          f"(process start and rendezvous apart){'; verdicts other than ok: ' + ', '.join(bad) if bad else ''}")
    print("where the grid's seconds went: " + ", ".join(f"{k} {v:.1f} s" for k, v in out["phases_s"].items())
          + f", the rest {grid_s - sum(out['phases_s'].values()):.1f} s")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
