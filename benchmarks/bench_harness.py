"""Per-variant overhead of the checks harness for a trivial probe, local and docker.

    uv run python benchmarks/bench_harness.py [--repeat N] [--image TAG] [--python PATH]

Overhead = wall time of one variant through the executor (spawn, isolation, rank launch, result
collection, cleanup sweep) minus the interpreter starts it cannot avoid: the worker and its rank run
one after the other, so two bare `python -c pass` starts (docker: one `docker run` of `python -c pass`
plus one more interpreter start). Target: under 1 s local. Printed as ratios to the target.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("STACKPROBE_PROBE_PATH", str(ROOT / "tests" / "probes_fixtures"))

from checks.run.executor import LocalExecutor  # noqa: E402
from common import reasons  # noqa: E402
from inenv.probe import Variant  # noqa: E402

TARGET_LOCAL_S = 1.0


def _median(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_local(python: str, repeat: int) -> None:
    cat = reasons.default()
    ex = LocalExecutor(python)
    env = ex.env()

    def bare() -> None:
        subprocess.run([python, "-c", "pass"], env=env, check=True)

    def one(ranks: int) -> None:
        r = ex.run(Variant("t-trivial", ranks), 0, 60, cat)
        assert r.status == "pass", r

    base = _median(bare, repeat)
    for ranks in (1, 2):
        total = _median(lambda ranks=ranks: one(ranks), repeat)
        overhead = total - 2 * base
        print(f"local  ranks={ranks}: variant {total:.3f} s, interpreter start {base:.3f} s x2, "
              f"harness overhead {overhead:.3f} s = {overhead / TARGET_LOCAL_S:.2f}x of the 1 s target")


def bench_docker(image: str, repeat: int) -> None:
    from checks.run.container import DockerExecutor, client

    cat = reasons.default()
    docker = client()
    ex = DockerExecutor(image=image, _client=docker)

    def bare() -> None:
        docker.containers.run(image, ["python3", "-c", "pass"], remove=True, network_mode="none")

    def one() -> None:
        r = ex.run(Variant("t-trivial", 2), 0, 60, cat)
        assert r.status == "pass", r

    base = _median(bare, repeat)
    total = _median(one, repeat)
    overhead = total - base
    print(f"docker ranks=2: variant {total:.3f} s, bare container run {base:.3f} s, "
          f"harness overhead {overhead:.3f} s = {overhead / TARGET_LOCAL_S:.2f}x of the 1 s target")
    assert not ex.leftovers()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--image", help="an image with python3 (e.g. stackprobe/base:bookworm) for the docker case")
    args = ap.parse_args()
    bench_local(args.python, args.repeat)
    if args.image:
        bench_docker(args.image, args.repeat)


if __name__ == "__main__":
    main()
