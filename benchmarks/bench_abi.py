"""Speed of `provision abi`: a warm run (every index already in .cache/abi) against its 5 s target, and, with
--cold, a run from an empty cache folder (every index read from uv's cache or streamed from the registry).

Prints each time with its ratio to the target (ratio < 1 meets it); the cold run has no target, it prints
what it streamed. The cold run uses a temporary cache folder and leaves .cache/abi as it was.

    uv run python benchmarks/bench_abi.py [--cold]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.catalog import load as load_catalog  # noqa: E402
from provision.abi import command  # noqa: E402

WARM_TARGET_S = 5.0


def warm(runs: int = 5) -> float:
    """Median wall time of the whole command, interpreter start included."""
    times = []
    for _ in range(runs):
        start = time.monotonic()
        subprocess.run(["uv", "run", "provision", "abi", "--cached"], cwd=ROOT, check=True, capture_output=True)
        times.append(time.monotonic() - start)
    return statistics.median(times)


def cold() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-abi-") as tmp:
        start = time.monotonic()
        command.run(command.AbiOptions(load_catalog(), root=Path(tmp), page_data=None))
        print(f"cold: {time.monotonic() - start:.0f} s (no target)")


if __name__ == "__main__":
    if "--cold" in sys.argv[1:]:
        cold()
    seconds = warm()
    ratio = seconds / WARM_TARGET_S
    print(f"warm provision abi: {seconds:.2f} s, ratio {ratio:.2f} to the {WARM_TARGET_S:.0f} s target")
