"""The step probe's deep path (a GPU per rank: each shape and case captured, checked, kernels read and timed, then the
agreement cases) run as a rank of a real variant runs it, with a world of one on this machine's GPU 0:
``inenv.probes.step.run`` itself, which ``benchmarks/bench_step_grid.py`` (the probe's parts, timed apart) does not
call. Prints the verdict, its reason, the seconds and the cases' verdicts; writes the whole result as JSON.

    python3 tools/device_step_run.py [--backend nccl] [--json OUT]     # on a GPU host, the machine's torch
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from inenv.probe import RankContext, Variant
    from inenv.probes import step
    from inenv.worker import reserved_port

    variant = Variant("step", 1, (("backend", args.backend),))
    with tempfile.TemporaryDirectory() as work, reserved_port() as port:
        ctx = RankContext(0, 1, 0, 0, variant, Path(work), "127.0.0.1", port)
        t0 = time.monotonic()
        result = step.run(ctx)
        took = time.monotonic() - t0
    cases = result.get("evidence", {}).get("per_case", {})
    verdicts = {f"{m} {k}": r.get("verdict") if "same_graph_as" not in r else f"= {r['same_graph_as']}"
                for m, per in cases.items() for k, r in per.items()}
    print(f"step.run {args.backend}, a world of one: {result.get('status')} in {took:.1f} s "
          f"{result.get('note', '')} {result.get('reason_code', '')}".rstrip())
    print(f"headline: {result.get('metrics', {}).get('headline', '')}")
    for key, verdict in verdicts.items():
        print(f"  {key}: {verdict}")
    if args.json:
        args.json.write_text(json.dumps({"took_s": round(took, 2), "result": result}, indent=1, default=str) + "\n")
    return 0 if result.get("status") == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
