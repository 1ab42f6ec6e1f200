"""Wall time of a fresh `checks run --all` per cell, probe by probe, against the 90 s target of a GPU host.

    python benchmarks/bench_checks_run.py [--python PATH] [--cache DIR] [--runs N] [--timeout-scale X]
        [--out DIR] [--compare RESULTS.jsonl] [CHECKS-RUN ARGS ...]
    python benchmarks/bench_checks_run.py --summarize RESULTS.jsonl   # the same lines for a recorded run

Runs the real CLI N times, each a fresh run (``--fresh``, a scratch results directory) against the same JIT
cache directory (STACKPROBE_JIT_CACHE and FLASHINFER_WORKSPACE_BASE). The cells are ``--backend local --python PATH``
unless other `checks run` arguments choose them (``--backend venv --matrix M --only CELL``: they pass
through). After each run it prints, per cell, the suite's time (the sum of its variants' seconds, what one
cell costs when the runner runs one variant at a time) and its ratio to the 90 s target, each probe's
seconds and count of variants run, and the verdicts that differ from the run before (``--compare``: from a
recorded run; same cell, probe and variant key, compared on status and reason code). ``--out`` keeps each
run's results file and this output. The first run of a fresh cache includes flashinfer's JIT compiles.
Extra environment (e.g. STACKPROBE_FI_JIT_ONLY to keep fi-jit to the local GPU) passes through. Meant for a
GPU host; on a host without a GPU it measures the skip path only and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 90.0

Key = tuple[str, str, str]  # cell, probe, variant key


def read_results(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def verdicts(rows: Iterable[dict[str, Any]]) -> dict[Key, tuple[str, str]]:
    return {(r["cell_id"], r["probe_id"], r["variant"]): (r["status"], r.get("reason_code") or "") for r in rows}


def differences(before: dict[Key, tuple[str, str]], after: dict[Key, tuple[str, str]]) -> list[str]:
    """One line per variant whose status or reason differs, or that only one side has."""
    out = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if a != b:
            show = lambda v: "absent" if v is None else f"{v[0]} {v[1]}".strip()  # noqa: E731
            out.append(f"{key[0]} {key[1]} {key[2]}: {show(a)} -> {show(b)}")
    return out


def wall_span(rows: list[dict[str, Any]]) -> float | None:
    """Seconds from the first variant's start to the last one's end. A variant's end is its start, its wait at
    the GPU gate (evidence.phases.queued, not part of its duration) and its duration."""
    spans = []
    for r in rows:
        try:
            start = datetime.fromisoformat(str(r["started_at"]).replace("Z", "+00:00")).timestamp()
        except (KeyError, ValueError):
            continue
        phases = (r.get("evidence") or {}).get("phases") or {}
        queued = phases.get("queued") if isinstance(phases, dict) else 0
        spans.append((start, start + float(queued or 0) + float(r.get("duration_s") or 0)))
    return max(e for _, e in spans) - min(s for s, _ in spans) if spans else None


def suite_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per cell: its suite's seconds and ratio to the target; per probe: seconds and variants run."""
    by_cell: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_cell[r["cell_id"]].append(r)
    lines = []
    for cell, cell_rows in sorted(by_cell.items()):
        total = sum(float(r.get("duration_s") or 0) for r in cell_rows)
        ran = [r for r in cell_rows if float(r.get("duration_s") or 0) > 0]
        lines.append(f"cell {cell}: suite {total:.1f} s = {total / TARGET_S:.2f}x of the {TARGET_S:.0f} s target "
                     f"({len(cell_rows)} variants, {len(ran)} launched)")
        span = wall_span(cell_rows)
        if span is not None:
            lines.append(f"  wall {span:.1f} s = {span / TARGET_S:.2f}x of the target, first start to last end "
                         "(variants started ahead overlap their start-up with the one before)")
        per_probe: dict[str, list[float]] = defaultdict(list)
        for r in cell_rows:
            per_probe[r["probe_id"]].append(float(r.get("duration_s") or 0))
        for probe, secs in sorted(per_probe.items(), key=lambda kv: -sum(kv[1])):
            launched = [s for s in secs if s > 0]
            spread = f", {min(launched):.1f}-{max(launched):.1f} s each" if launched else ""
            lines.append(f"  {probe:<12} {sum(secs):6.1f} s  {len(launched):2d} of {len(secs):2d} run{spread}")
    return lines


def newest_results(folder: Path) -> Path:
    found = sorted(folder.glob("*/*.jsonl"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"checks run wrote no results under {folder}")
    return found[-1]


def run_once(cell_args: list[str], cache: Path, scale: float) -> tuple[float, Path, Path]:
    env = dict(os.environ)
    env["STACKPROBE_JIT_CACHE"] = str(cache)
    env["FLASHINFER_WORKSPACE_BASE"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    results = Path(tempfile.mkdtemp(prefix="stackprobe-bench-"))
    cmd = [sys.executable, "-m", "checks.cli", "run", "--all", "--fresh", "--no-report", *cell_args,
           "--timeout-scale", str(scale), "--results", str(results)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"checks run exited {proc.returncode}: {tail}")
    return wall, newest_results(results), results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="the environment's interpreter (when no cell "
                    "arguments pass through)")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "stackprobe-jit-cache")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--timeout-scale", type=float, default=1.0)
    ap.add_argument("--out", type=Path, help="keep each run's results file and this output here")
    ap.add_argument("--compare", type=Path, help="a recorded results file whose verdicts each run should match")
    ap.add_argument("--summarize", type=Path, metavar="RESULTS.jsonl", help="only print a recorded run's suite "
                    "time per cell and probe (run nothing)")
    args, cell_args = ap.parse_known_args()
    if args.summarize:
        for line in suite_lines(read_results(args.summarize)):
            print(line)
        return
    if not cell_args:
        cell_args = ["--backend", "local", "--python", args.python]
    printed: list[str] = []

    def say(line: str) -> None:
        printed.append(line)
        print(line, flush=True)

    if shutil.which("nvidia-smi") is None:
        say("note: no nvidia-smi on this host: GPU probes skip, so this times the skip path only")
    args.cache.mkdir(parents=True, exist_ok=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    before = verdicts(read_results(args.compare)) if args.compare else None
    for i in range(args.runs):
        wall, path, scratch = run_once(cell_args, args.cache, args.timeout_scale)
        rows = read_results(path)
        label = "first (cache as found)" if i == 0 else "warm cache"
        say(f"run {i + 1}, {label}: checks run --all --fresh {wall:.1f} s wall = {wall / TARGET_S:.2f}x of the "
            f"{TARGET_S:.0f} s target")
        for line in suite_lines(rows):
            say(line)
        now = verdicts(rows)
        if before is not None:
            diff = differences(before, now)
            say(f"  verdicts vs {'the run before' if i else args.compare}: "
                f"{'identical' if not diff else f'{len(diff)} differ'} ({len(now)} variants)")
            for line in diff:
                say(f"    {line}")
        before = now
        if args.out:
            shutil.copy(path, args.out / f"run{i + 1}-{path.name}")
        shutil.rmtree(scratch, ignore_errors=True)
    if args.out:
        (args.out / "bench_checks_run.txt").write_text("\n".join(printed) + "\n")


if __name__ == "__main__":
    main()
