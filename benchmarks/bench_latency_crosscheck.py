"""How far are the ar-latency probe's NCCL numbers from independent measurements on the same host?

    python benchmarks/bench_latency_crosscheck.py [--gpus N] [--json OUT]

The probe's ``nccl-direct`` variant gives two columns from one run (20 calls per graph replayed on a side
stream, CUDA events per replay after an on-stream barrier, slowest rank, median over replays): NCCL called
directly through ctypes, as serving engines capture it, and NCCL through torch.distributed, its baseline
in the same processes. Each is compared with a measurement made by other code:

* NCCL direct against nccl-tests' ``all_reduce_perf`` (the field's reference; tools/build_nccl_tests.sh
  builds it): one process driving all GPUs, ``-n 20 -G 20``, host clock over back-to-back graph launches,
  run with the NCCL and CUDA runtime of the Python under test.
* torch NCCL against a plain torch.distributed loop in two processes: 20 all_reduce calls captured in one
  graph, replayed 20 times back to back on a side stream, timed by the host clock after a synchronize (and
  by CUDA events over the same span, printed beside it).

Where the graph is replayed matters: on the legacy default stream every NCCL call costs about 5 us more
at 20 calls per graph and 10 us at 50 on 2x H200 (benchmarks/bench_latency_factors.py), so both sides
use a side stream. The target is every size within 10% in both comparisons. Exits 2 with one line when
the host has fewer than two GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inenv.probe import RESULT_MARKER  # noqa: E402
from inenv.probes.ar_latency import CALLS_PER_GRAPH  # noqa: E402

TARGET = 0.10
HIDDEN = 7168
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LOOP_CALLS = CALLS_PER_GRAPH  # the probe's graph size: torch's per-call cost depends on it
LOOP_REPLAYS = 20


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for ln in out.stdout.splitlines() if ln.startswith("GPU "))


def probe_numbers(ranks: int, gpus: int) -> tuple[dict[int, float], dict[int, float]]:
    """(NCCL direct, NCCL through torch.distributed) per size from one run of the nccl-direct variant."""
    variant = json.dumps({"probe_id": "ar-latency", "ranks": ranks, "params": [["backend", "nccl-direct"]]})
    cmd = [sys.executable, "-m", "inenv.worker", "--probe", "ar-latency", "--variant", variant, "--gpus", str(gpus)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER)), None)
    if line is None:
        raise SystemExit(f"bench: the probe printed no result (exit {proc.returncode}): {proc.stderr[-800:]}")
    result = json.loads(line[len(RESULT_MARKER) :])
    if result["status"] != "pass":
        raise SystemExit(f"bench: the probe's NCCL variant is {result['status']}: {result.get('note', '')[:300]}")
    metrics = result["metrics"]
    if "nccl_latency_us" not in metrics:
        raise SystemExit("bench: the probe result has no torch NCCL baseline")
    return tuple({int(k): float(v) for k, v in metrics[key].items()} for key in ("latency_us", "nccl_latency_us"))


# --- second measurement: nccl-tests if present --------------------------------------------------------


def nccl_tests_binary() -> str | None:
    local = ROOT / ".whl" / "bin" / "all_reduce_perf"
    return shutil.which("all_reduce_perf") or (str(local) if os.access(local, os.X_OK) else None)


def torch_library_path() -> str:
    """NCCL and CUDA runtime directories of the Python under test (pip's nvidia-* wheels)."""
    site = Path(sysconfig.get_paths()["purelib"])
    dirs = [d for d in sorted(site.glob("nvidia/*/lib")) if any(d.glob("lib*.so*"))]
    return os.pathsep.join([*map(str, dirs), os.environ.get("LD_LIBRARY_PATH", "")]).strip(os.pathsep)


def nccl_tests_numbers(binary: str, ranks: int, graph_launches: int) -> dict[int, float]:
    lo, hi = TOKENS[0] * HIDDEN * 2, TOKENS[-1] * HIDDEN * 2
    cmd = [binary, "-g", str(ranks), "-d", "bfloat16", "-b", str(lo), "-e", str(hi), "-f", "2"]
    cmd += ["-w", "20", "-n", str(LOOP_CALLS), "-G", str(graph_launches), "-c", "1"]
    env = dict(os.environ, LD_LIBRARY_PATH=torch_library_path())
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    numbers: dict[int, float] = {}
    for ln in proc.stdout.splitlines():
        parts = ln.split()
        if len(parts) > 6 and parts[0].isdigit():
            numbers[int(parts[0])] = float(parts[5])  # out-of-place time, us
    if not numbers:
        raise SystemExit(f"bench: all_reduce_perf gave no numbers (exit {proc.returncode}): {proc.stderr[-800:]}")
    return numbers


# --- second measurement: a plain torch.distributed loop -----------------------------------------------


def _rank_main() -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    torch.cuda.set_stream(torch.cuda.Stream())  # as the probe: not the legacy default stream
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    results: dict[int, list[float]] = {}
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
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(LOOP_REPLAYS):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        calls = LOOP_CALLS * LOOP_REPLAYS
        host_us = (time.perf_counter() - t0) * 1e6 / calls
        event_us = start.elapsed_time(end) * 1e3 / calls
        mean = torch.tensor([host_us, event_us], dtype=torch.float64, device="cuda")
        dist.all_reduce(mean)
        results[tokens * HIDDEN * 2] = [float(v) / world for v in mean.tolist()]
    if rank == 0:
        print(json.dumps(results), flush=True)
    os._exit(0)  # skip teardown: destroy_process_group can hang after graph capture


def loop_numbers(ranks: int) -> dict[int, list[float]]:
    """Per size: [host-clock us, CUDA-event us] per call, averaged over ranks."""
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
    return {int(k): v for k, v in json.loads(outs[0][0].strip().splitlines()[-1]).items()}


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
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    direct, via_torch = probe_numbers(ranks, gpus)
    timings["probe"] = time.monotonic() - t0
    pairs: list[tuple[str, dict[int, float], str, dict[int, float]]] = []
    binary = nccl_tests_binary()
    if binary:
        t0 = time.monotonic()
        reference = nccl_tests_numbers(binary, ranks, LOOP_REPLAYS)
        timings["nccl-tests"] = time.monotonic() - t0
        pairs.append(("probe NCCL direct", direct, f"nccl-tests -n{LOOP_CALLS} -G{LOOP_REPLAYS}", reference))
    else:
        print("bench: no all_reduce_perf (tools/build_nccl_tests.sh builds it): NCCL direct not cross-checked")
    t0 = time.monotonic()
    loop = loop_numbers(ranks)
    timings["loop"] = time.monotonic() - t0
    loop_host = {k: v[0] for k, v in loop.items()}
    pairs.append(("probe torch NCCL", via_torch, f"torch loop {LOOP_CALLS}x{LOOP_REPLAYS} host", loop_host))
    print(f"ranks={ranks}  " + "  ".join(f"{k}: {v:.1f}s" for k, v in timings.items()))
    report: dict[str, list[dict[str, object]]] = {}
    inside = total = 0
    for probe_name, probe, ref_name, ref in pairs:
        print(f"\n{'bytes':>9} {probe_name:>18} {ref_name:>26} {'ratio':>6}  within {TARGET:.0%}")
        rows = report.setdefault(f"{probe_name} vs {ref_name}", [])
        for size in sorted(probe):
            if size not in ref:
                continue
            ratio = probe[size] / ref[size]
            ok = abs(ratio - 1.0) <= TARGET
            inside, total = inside + ok, total + 1
            rows.append({"bytes": size, "probe_us": probe[size], "other_us": ref[size], "ratio": ratio, "ok": ok})
            print(f"{size:>9} {probe[size]:>18.2f} {ref[size]:>26.2f} {ratio:>6.3f}  {'yes' if ok else 'NO'}")
    print(f"\nloop timed by CUDA events over the same span (us): {', '.join(f'{v[1]:.2f}' for v in loop.values())}")
    print(f"{inside}/{total} comparisons within {TARGET:.0%} (target: all)")
    if args.json:
        payload = {"ranks": ranks, "calls_per_graph": LOOP_CALLS, "comparisons": report, "loop": loop}
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
