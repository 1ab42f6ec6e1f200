"""Speed of `provision`: plan on the default and on a 1000-cell matrix, and a second build of 16 built cells.

Prints each time with its ratio to the target (ratio < 1 meets it). The build part needs a Docker daemon;
it builds 16 tiny cells FROM the registry-free base (first run only), then times the rebuild, which must
invoke no build at all.

    uv run python benchmarks/bench_provision.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.api import DEFAULT_MATRIX  # noqa: E402
from provision.build import build_locked  # noqa: E402
from provision.dockercli import Docker  # noqa: E402
from provision.lock import uv_compile, uv_version, write_dir_atomically  # noqa: E402
from provision.options import BuildOptions  # noqa: E402

FLASHINFER = [f"0.6.{i}" for i in range(1, 19)] + ["0.7.1", "0.7.2"]
SYNTHETIC = {
    "matrix": {
        "cuda": ["12.8", "13.0"],
        "torch": ["stable", "nightly", "2.9.1", "2.11.0", "2.13.0"],
        "sgl_kernel": ["0.4.1", "0.4.2", "0.4.5", "0.4.7", "none"],
        "flashinfer": FLASHINFER,
    }
}


def time_cli(args: list[str], runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "provision.cli", *args], cwd=ROOT, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def report(name: str, seconds: float, target: float, extra: str = "") -> None:
    print(f"{name:<52} {seconds:7.3f} s   target {target:4.1f} s   ratio {seconds / target:5.2f}{extra}")


def bench_plan(tmp: Path) -> None:
    report("plan, default matrix (index hosts checked)", time_cli(["plan"]), 1.0)
    report("plan, default matrix (--offline)", time_cli(["plan", "--no-reach-check"]), 1.0)
    big = tmp / "synthetic.yaml"
    big.write_text(json.dumps(SYNTHETIC))  # JSON is YAML
    out = subprocess.run([sys.executable, "-m", "provision.cli", "plan", "--matrix", str(big), "--json",
                          "--no-reach-check"],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    n = len(json.loads(out))
    assert n == 1000, n
    report(f"plan, synthetic {n}-cell matrix", time_cli(["plan", "--matrix", str(big)], runs=3), 3.0)


def tiny_cells(envs: Path, n: int) -> list[Path]:
    """n locked cells with one small real package each, so their images build in seconds."""
    lock = uv_compile("six==1.16.0\n", ["--universal", "--python-version", "3.11", "--generate-hashes",
                                        "--no-header"])
    uv = uv_version()
    folders = []
    for i in range(n):
        cid = f"bench-tiny-{i:02d}"
        cell = {"cell_id": cid, "expected": {"cuda": "13.0", "torch": "", "torch_cuda": "", "sgl_kernel": "none",
                                             "flashinfer": "none"},
                "indexes": [], "prerelease": False, "toolkit": "cuda-toolkit==13.0.2", "uv": uv}
        write_dir_atomically(envs / cid, {"cell.json": json.dumps(cell), "requirements.lock": lock,
                                          "torch.lock": lock, "toolkit.lock": ""})
        folders.append(envs / cid)
    return folders


def bench_rebuild(tmp: Path) -> None:
    docker = Docker()
    try:
        docker.check_daemon()
    except Exception as e:  # a benchmark without docker still reports the plan numbers
        print(f"second build: skipped ({e})")
        return
    envs = Path(tempfile.gettempdir()) / "stackprobe-bench-envs"  # kept, so later runs reuse the images
    folders = tiny_cells(envs, 16)
    opts = BuildOptions(DEFAULT_MATRIX, envs=envs, dockerfiles=tmp / "dockerfiles", toolkit=False, jobs=2)
    first = build_locked(folders, opts, Docker())
    bad = [r for r in first if r["status"] not in ("built", "skipped-unchanged")]
    assert not bad, bad
    second = Docker()
    t0 = time.perf_counter()
    results = build_locked(folders, opts, second)
    dt = time.perf_counter() - t0
    assert all(r["status"] == "skipped-unchanged" for r in results)
    report("second build, 16 built cells", dt, 3.0, f"   build invocations: {second.builds}")


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        bench_plan(Path(d))
        bench_rebuild(Path(d))


if __name__ == "__main__":
    main()
