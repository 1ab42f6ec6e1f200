"""What a variant costs one-shot (fresh rank processes) and on warm ranks (inenv.warm), through the local
executor as `checks run` uses it.

    python benchmarks/bench_warm_ranks.py [--python PATH] [--variants N] [--ranks R] [--gpus G]
                                          [--probe ID[:PARAM=VALUE,...]] ... [--json OUT]
    python benchmarks/bench_warm_ranks.py --why RESULTS_DIR


Default: N (8) variants of the stand-in ``t-warm-pid`` (two ranks that import torch, form a gloo group and
all-reduce: tests/probes_fixtures_warm), one after another, first one-shot (``checks run --cold-ranks``), then
warm. ``--probe`` names the variants instead (each run N times, in the order given; ``ranks=R`` and other
params after the colon, e.g. ``--probe ar-latency:ranks=2,mode=eager``); ``--gpus`` is what the worker is told
(default 0: CPU). Prints each way's seconds per variant (first variant, the rest's mean), the ratio and
whether every verdict matched; ``--json`` writes the numbers.

``--why`` reads the results a `checks run` stored (every run in the folder) and prints per probe how many of its
variants ran on reused ranks, kept their ranks for the next one, or ended them, and why (``evidence.warm``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checks.results.store import read_file  # noqa: E402
from checks.run.executor import LocalExecutor, gpu_lock_path, run_env  # noqa: E402
from common import reasons  # noqa: E402
from inenv.probe import Variant  # noqa: E402
from inenv.registry import PROBE_PATH_ENV, find  # noqa: E402

STAND_IN = "t-warm-pid"
STAND_INS = ROOT / "tests" / "probes_fixtures_warm"


def parse_variant(text: str, ranks: int) -> Variant:
    """``ID[:KEY]`` as a variant, KEY as a result records it (``ranks=2,placement=shared,gpus=1,op=all-reduce``;
    ``ranks`` when it names none)."""
    probe, _, rest = text.partition(":")
    params = [tuple(p.split("=", 1)) for p in rest.split(",") if p]
    if any(len(p) != 2 for p in params):
        raise SystemExit(f"bench_warm_ranks: --probe {text}: give ID or ID:NAME=VALUE,...")
    named = dict(params)
    shared = named.get("placement") == "shared"
    return Variant(probe, int(named.get("ranks", ranks)),
                   tuple((k, v) for k, v in params if k not in ("ranks", "placement", "gpus")),
                   share_gpu=shared, gpus=int(named.get("gpus", 0)) if shared else 0)


def measure(ex: LocalExecutor, variants: list[Variant], gpus: int) -> tuple[list[float], list[str]]:
    catalogue = reasons.default()
    times, verdicts = [], []
    for v in variants:
        timeout = find(v.probe_id)[1].SPEC.timeout_s
        started = time.monotonic()
        got = ex.run(v, gpus, timeout, catalogue, queue_s=60.0 if ex.gated else 0.0)
        times.append(time.monotonic() - started)
        verdicts.append(f"{v.probe_id} {v.key}: {got.status.value} {got.reason_code}".rstrip())
    return times, verdicts


def summary(times: list[float]) -> dict[str, float]:
    rest = times[1:] or times
    return {"first_s": round(times[0], 3), "rest_mean_s": round(statistics.mean(rest), 3),
            "mean_s": round(statistics.mean(times), 3), "total_s": round(sum(times), 3)}


def why(results: Path) -> int:
    """Per probe: variants one-shot, on reused ranks, kept after, and the reasons their groups ended."""
    rows: dict[str, dict[str, int]] = {}
    for path in sorted(results.glob("*/*.jsonl")):
        stored, _ = read_file(path)
        for r in stored:
            warm = r.verdict.evidence.get("warm")
            row = rows.setdefault(r.probe_id, {})
            if not isinstance(warm, dict):
                row["one-shot"] = row.get("one-shot", 0) + 1
                continue
            row["warm"] = row.get("warm", 0) + 1
            row["reused"] = row.get("reused", 0) + bool(warm.get("reused"))
            ended = str(warm.get("ended") or "")[:100]
            key = f"ended: {ended}" if ended else "kept"
            row[key] = row.get(key, 0) + 1
    if not rows:
        print(f"bench_warm_ranks: no results under {results}", file=sys.stderr)
        return 2
    for probe, row in sorted(rows.items()):
        print(f"{probe}: " + "; ".join(f"{k} {v}" for k, v in sorted(row.items(), key=lambda kv: -kv[1])))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--python", default=sys.executable, help="the environment's interpreter (default: this one)")
    p.add_argument("--variants", type=int, default=8, help="how many times each variant runs (default 8)")
    p.add_argument("--ranks", type=int, default=2, help="world size of a variant that names none (default 2)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs the worker is told (default 0)")
    p.add_argument("--probe", action="append", default=[], help="ID[:NAME=VALUE,...]; default the stand-in")
    p.add_argument("--json", type=Path, help="write the numbers here")
    p.add_argument("--why", type=Path, metavar="RESULTS", help="only summarise the warm ranks of stored results")
    args = p.parse_args(argv)
    if args.why:
        return why(args.why)
    if args.variants < 1 or args.ranks < 1 or args.gpus < 0:
        print("bench_warm_ranks: --variants and --ranks must be 1 or more, --gpus 0 or more", file=sys.stderr)
        return 2
    path = [d for d in os.environ.get(PROBE_PATH_ENV, "").split(os.pathsep) if d]
    os.environ[PROBE_PATH_ENV] = os.pathsep.join([*path, str(STAND_INS)])
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    named = [parse_variant(t, args.ranks) for t in args.probe] or [Variant(STAND_IN, args.ranks)]
    variants = [v for v in named for _ in range(args.variants)]
    lock = gpu_lock_path() if args.gpus else None
    env = run_env("bench", (), None, gpu_lock=lock)
    out: dict[str, Any] = {"variants": [f"{v.probe_id} {v.key}" for v in named], "runs_each": args.variants}
    verdicts: dict[str, list[str]] = {}
    for way, warm in (("one-shot", False), ("warm", True)):
        ex = LocalExecutor(args.python).with_run_env(env, warm=warm)
        try:
            times, verdicts[way] = measure(ex, variants, args.gpus)
        finally:
            ex.close()
        out[way] = summary(times)
        s = out[way]
        print(f"{way:9} first {s['first_s']:7.3f} s   then {s['rest_mean_s']:7.3f} s/variant   "
              f"mean {s['mean_s']:7.3f} s   total {s['total_s']:8.3f} s   ({len(times)} variants)")
    ratio = out["one-shot"]["mean_s"] / out["warm"]["mean_s"]
    steady = out["one-shot"]["rest_mean_s"] / out["warm"]["rest_mean_s"]
    out["ratio_mean"], out["ratio_steady"] = round(ratio, 2), round(steady, 2)
    out["same_verdicts"] = verdicts["one-shot"] == verdicts["warm"]
    print(f"one-shot / warm: {ratio:.2f}x per variant on average, {steady:.2f}x after the first; "
          f"verdicts {'identical' if out['same_verdicts'] else 'DIFFER'}")
    if not out["same_verdicts"]:
        for a, b in zip(verdicts["one-shot"], verdicts["warm"], strict=True):
            if a != b:
                print(f"  one-shot {a}  |  warm {b}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if out["same_verdicts"] else 1


if __name__ == "__main__":
    sys.exit(main())
