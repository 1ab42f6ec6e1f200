"""How far are the ar-latency probe's NCCL numbers from a second, independent measurement on the same host?

    python benchmarks/bench_latency_crosscheck.py [--gpus N] [--json OUT]

1. The probe: ``python -m checks.worker --probe ar-latency`` with backend ``nccl`` (CUDA events per replay of
   a 20-call graph after an on-stream barrier, slowest rank, median over replays).
2. The second measurement: nccl-tests' ``all_reduce_perf`` when it is on PATH; otherwise a plain
   torch.distributed loop timed the way nccl-tests times ``-G``: N all_reduce calls captured in one graph
   (thread-local capture mode), the graph replayed G times back to back, host wall clock after a
   synchronize, divided by N*G, averaged over ranks. Different clock, statistic, capture mode and batch.

Prints, per size, both numbers and their ratio; the target is every size within 10%. Exits 2 with one
line when the host has fewer than two GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checks.probe import RESULT_MARKER  # noqa: E402

TARGET = 0.10
HIDDEN = 7168
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LOOP_CALLS = 50  # per graph
LOOP_REPLAYS = 20


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for ln in out.stdout.splitlines() if ln.startswith("GPU "))


def probe_numbers(ranks: int, gpus: int) -> dict[int, float]:
    variant = json.dumps({"probe_id": "ar-latency", "ranks": ranks, "params": [["backend", "nccl"]]})
    cmd = [sys.executable, "-m", "checks.worker", "--probe", "ar-latency", "--variant", variant, "--gpus", str(gpus)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER)), None)
    if line is None:
        raise SystemExit(f"bench: the probe printed no result (exit {proc.returncode}): {proc.stderr[-800:]}")
    result = json.loads(line[len(RESULT_MARKER) :])
    if result["status"] != "pass":
        raise SystemExit(f"bench: the probe's NCCL variant is {result['status']}: {result.get('note', '')[:300]}")
    return {int(k): float(v) for k, v in result["metrics"]["latency_us"].items()}


# --- second measurement: nccl-tests if present --------------------------------------------------------


def nccl_tests_numbers(binary: str, ranks: int) -> dict[int, float]:
    lo, hi = TOKENS[0] * HIDDEN * 2, TOKENS[-1] * HIDDEN * 2
    cmd = [
        binary,
        "-g",
        str(ranks),
        "-d",
        "bfloat16",
        "-b",
        str(lo),
        "-e",
        str(hi),
        "-f",
        "2",
        "-w",
        "20",
        "-n",
        "50",
        "-G",
        "20",
        "-c",
        "1",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
    numbers: dict[int, float] = {}
    for ln in out.splitlines():
        parts = ln.split()
        if len(parts) > 6 and parts[0].isdigit():
            numbers[int(parts[0])] = float(parts[5])  # out-of-place time, us
    return numbers


# --- second measurement: a plain torch.distributed loop -----------------------------------------------


def _rank_main() -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    results: dict[int, float] = {}
    for tokens in TOKENS:
        x = torch.zeros(tokens * HIDDEN, dtype=torch.bfloat16, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(5):
                dist.all_reduce(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(LOOP_CALLS):
                dist.all_reduce(x)
        graph.replay()
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(LOOP_REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
        per_call_us = (time.perf_counter() - t0) * 1e6 / (LOOP_CALLS * LOOP_REPLAYS)
        mean = torch.tensor([per_call_us], dtype=torch.float64, device="cuda")
        dist.all_reduce(mean)
        results[tokens * HIDDEN * 2] = float(mean.item()) / world
    if rank == 0:
        print(json.dumps(results), flush=True)
    os._exit(0)  # skip teardown: destroy_process_group can hang after graph capture


def loop_numbers(ranks: int) -> dict[int, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--rank"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"bench: a loop rank failed (exit {p.returncode}): {err[-800:]}")
    return {int(k): float(v) for k, v in json.loads(outs[0][0].strip().splitlines()[-1]).items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gpus", type=int, help="GPUs to use (default: all, at most 8)")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    if args.rank:
        _rank_main()
        return 0
    gpus = args.gpus or min(gpu_count(), 8)
    if gpus < 2:
        print("bench_latency_crosscheck: needs at least 2 GPUs (NCCL allreduce between GPUs)", file=sys.stderr)
        return 2
    ranks = 2 if gpus < 4 else (4 if gpus < 8 else 8)
    t0 = time.monotonic()
    probe = probe_numbers(ranks, gpus)
    t_probe = time.monotonic() - t0
    binary = shutil.which("all_reduce_perf")
    t0 = time.monotonic()
    other = nccl_tests_numbers(binary, ranks) if binary else loop_numbers(ranks)
    t_other = time.monotonic() - t0
    method = "nccl-tests all_reduce_perf -G 20" if binary else f"torch loop: {LOOP_CALLS}-call graph x {LOOP_REPLAYS}"
    print(f"ranks={ranks}  probe: {t_probe:.1f}s  second measurement ({method}): {t_other:.1f}s")
    print(f"{'bytes':>9} {'probe_us':>9} {'other_us':>9} {'ratio':>6}  within {TARGET:.0%}")
    rows = []
    for size in sorted(probe):
        if size not in other:
            continue
        ratio = probe[size] / other[size]
        ok = abs(ratio - 1.0) <= TARGET
        rows.append({"bytes": size, "probe_us": probe[size], "other_us": other[size], "ratio": ratio, "ok": ok})
        print(f"{size:>9} {probe[size]:>9.2f} {other[size]:>9.2f} {ratio:>6.3f}  {'yes' if ok else 'NO'}")
    inside = sum(r["ok"] for r in rows)
    print(f"{inside}/{len(rows)} sizes within {TARGET:.0%} (target: all)")
    if args.json:
        args.json.write_text(json.dumps({"ranks": ranks, "method": method, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
