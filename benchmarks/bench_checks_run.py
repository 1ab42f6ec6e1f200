"""Wall time of `checks run --all` for one local cell, cold and with a warm JIT cache.

    python benchmarks/bench_checks_run.py [--python PATH] [--cache DIR] [--runs N] [--timeout-scale X]

Runs the real CLI (`python -m checks.cli run --all --local`) N times against the same JIT cache
directory (STACKPROBE_JIT_CACHE and FLASHINFER_WORKSPACE_BASE), each into a scratch results directory,
and prints each wall time and its ratio to the 90 s target for a warm cache. The first run of a fresh
cache directory includes flashinfer's JIT compiles; the later runs are the warm numbers that the target
is about. Extra environment (e.g. STACKPROBE_FI_JIT_ONLY to keep fi-jit to the local GPU) passes through.
Meant for a GPU host; on a host without a GPU it measures the skip path only and says so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_WARM_S = 90.0


def run_once(python: str, cache: Path, scale: float) -> tuple[float, int]:
    env = dict(os.environ)
    env["STACKPROBE_JIT_CACHE"] = str(cache)
    env["FLASHINFER_WORKSPACE_BASE"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    results = Path(tempfile.mkdtemp(prefix="stackprobe-bench-"))
    cmd = [sys.executable, "-m", "checks.cli", "run", "--all", "--local", "--python", python,
           "--timeout-scale", str(scale), "--results", str(results)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    shutil.rmtree(results, ignore_errors=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"checks run exited {proc.returncode}: {tail}")
    return wall, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="the environment's interpreter")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "stackprobe-jit-cache")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--timeout-scale", type=float, default=1.0)
    args = ap.parse_args()
    has_gpu = shutil.which("nvidia-smi") is not None
    if not has_gpu:
        print("note: no nvidia-smi on this host: GPU probes skip, so this times the skip path only")
    args.cache.mkdir(parents=True, exist_ok=True)
    for i in range(args.runs):
        wall, _ = run_once(args.python, args.cache, args.timeout_scale)
        label = "first (cache as found)" if i == 0 else "warm cache"
        ratio = wall / TARGET_WARM_S
        print(f"checks run --all, {label}: {wall:.1f} s = {ratio:.2f}x of the {TARGET_WARM_S:.0f} s target")


if __name__ == "__main__":
    main()
