"""What the results store costs as a run grows: appends must cost the same at the 10,000th result as at the
first, and a plan of 9,700 cells must record its decided-without-running lines in seconds.

    python benchmarks/bench_store.py [--appends N] [--cells N] [--probe ID ...] [--dir DIR]

Part 1 appends N results (default 10,000) one at a time to one run file through ``RunStore.append``, as
the runner does, and prints the time of the first 1,000 and of the last 1,000 and their ratio (about 1 when
an append costs O(1) in the size of the run; a store that rewrites the file on each append grows linearly
and the ratio with it). Part 2 plans ``--cells`` cells (default 9,700) that cannot be provisioned, with the
real probes (``--probe``, default inventory; ``--probe all`` for every probe), and runs the real runner
over them: every variant is decided without running and recorded by the store. It prints the lines, the
seconds and lines per second. The line written is a real result's (one of results/), about 700 bytes.
``--dir``: where the scratch results folder goes (default: a temporary folder; the store fsyncs, so the
file system matters).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checks.results.result import ProbeResult  # noqa: E402
from checks.results.store import RunStore, read_file  # noqa: E402
from checks.run.options import RunOptions  # noqa: E402
from checks.run.plan import CellTarget, plan_work  # noqa: E402
from checks.run.runner import Work, execute  # noqa: E402
from common import reasons  # noqa: E402
from inenv import registry  # noqa: E402
from inenv.probe import HostView  # noqa: E402

HOST = "cpu-0123abcd"
RUN = "20261201T000000Z-0000"


def sample() -> ProbeResult:
    """A recorded result from the committed results, re-homed to the scratch host and run."""
    line = next(p for p in sorted((ROOT / "results").glob("*/*.jsonl"))).read_text().splitlines()[0]
    r = ProbeResult.from_json(json.loads(line))
    return dataclasses.replace(r, run_id=RUN, host_id=HOST)


def appends(folder: Path, n: int) -> tuple[float, float]:
    store = RunStore(folder, HOST, RUN)
    base = sample()
    times = []
    for i in range(n):
        r = dataclasses.replace(base, variant=f"ranks=1,i={i}")
        t = time.perf_counter()
        store.append(r)
        times.append(time.perf_counter() - t)
    results, warnings = read_file(store.results_path)
    assert len(results) == n and not warnings, (len(results), warnings[:3])
    k = min(1000, n // 2)
    return sum(times[:k]), sum(times[-k:])


def decided(folder: Path, cells: int, probe_ids: list[str]) -> tuple[int, float]:
    probes = {pid: mod for pid, (_, mod) in registry.discover().items()}
    if probe_ids != ["all"]:
        probes = {pid: probes[pid] for pid in probe_ids}
    targets = [CellTarget(f"cu130-torch2.{i // 100}.{i % 100}-sgl0.4.2-fi0.6.16", "unavailable",
                          "no wheel of this torch for CUDA 13.0") for i in range(cells)]
    items = plan_work(targets, probes, HostView(gpu_count=0, compute_capability=None, gpu_name=None))
    store = RunStore(folder, HOST, RUN)
    t = time.perf_counter()
    report = execute(RunOptions(all_probes=True), Work(items, store, reasons.default(), 0))
    took = time.perf_counter() - t
    assert len(report.results) == len(items) and not store.unstored
    return len(items), took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--appends", type=int, default=10_000)
    ap.add_argument("--cells", type=int, default=9_700)
    ap.add_argument("--probe", action="append", metavar="ID", help="probes of the plan (default inventory; all)")
    ap.add_argument("--dir", type=Path, help="where the scratch results go (default: a temporary folder)")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-store-", dir=args.dir))
    try:
        first, last = appends(scratch / "appends", args.appends)
        k = min(1000, args.appends // 2)
        print(f"appends: {args.appends} results one at a time; first {k}: {first:.3f} s, last {k}: {last:.3f} s, "
              f"ratio last/first {last / first:.2f} (1.00 = constant cost per append)")
        lines, took = decided(scratch / "decided", args.cells, args.probe or ["inventory"])
        print(f"decided without running: {args.cells} cells x {', '.join(args.probe or ['inventory'])} = "
              f"{lines} lines recorded in {took:.2f} s ({lines / took:.0f} lines/s)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
