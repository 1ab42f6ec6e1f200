"""How far are the ar-latency probe's NCCL and flashinfer PCIe IPC numbers from independent measurements
on the same host?

    python benchmarks/bench_latency_crosscheck.py [--gpus N] [--compare all|nccl|pcie-ipc] [--json OUT]

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
use a side stream. The target is every size within 10% in both comparisons.

The probe's ``flashinfer-pcie-ipc`` variant is compared with flashinfer's own benchmark method, run in
two processes of this script: flashinfer's public ``flashinfer.testing.bench_gpu_time`` with the settings its
PCIe IPC benchmark passes (20 calls per graph, 5 untimed and 20 timed replays back to back, warm L2, the
legacy default stream), the configuration flashinfer resolves itself, the slowest rank per replay. Both
sides' medians and fastest replays are printed with their ratio per size, then flashinfer's method at its
benchmark's default shape (hidden 2048 at 2 ranks), where its quoted numbers come from. Needs flashinfer
with the PCIe IPC all-reduce in the Python that runs this; without it one line says so and the NCCL
comparisons still run. Exits 2 with one line when the host has fewer than two GPUs.
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inenv.probe import RESULT_MARKER  # noqa: E402
from inenv.probes.ar_latency import CALLS_PER_GRAPH  # noqa: E402

TARGET = 0.10
HIDDEN = 7168
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LOOP_CALLS = CALLS_PER_GRAPH  # the probe's graph size: torch's per-call cost depends on it
LOOP_REPLAYS = 20
COMPARE = ("all", "nccl", "pcie-ipc")
Pair = tuple[str, dict[int, float], str, dict[int, float]]  # (probe name, numbers, reference name, numbers)


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for ln in out.stdout.splitlines() if ln.startswith("GPU "))


def probe_result(ranks: int, gpus: int, backend: str) -> dict[str, Any]:
    """One run of the probe's variant for ``backend``: its result when it passed, else exit with one line."""
    variant = json.dumps({"probe_id": "ar-latency", "ranks": ranks, "params": [["backend", backend]]})
    cmd = [sys.executable, "-m", "inenv.worker", "--probe", "ar-latency", "--variant", variant, "--gpus", str(gpus)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER)), None)
    if line is None:
        raise SystemExit(f"bench: the probe printed no result (exit {proc.returncode}): {proc.stderr[-800:]}")
    result = json.loads(line[len(RESULT_MARKER) :])
    if result["status"] != "pass":
        raise SystemExit(f"bench: the probe's {backend} variant is {result['status']}: {result.get('note', '')[:300]}")
    return result


def probe_numbers(ranks: int, gpus: int) -> tuple[dict[int, float], dict[int, float]]:
    """(NCCL direct, NCCL through torch.distributed) per size from one run of the nccl-direct variant."""
    metrics = probe_result(ranks, gpus, "nccl-direct")["metrics"]
    if "nccl_latency_us" not in metrics:
        raise SystemExit("bench: the probe result has no torch NCCL baseline")
    return tuple({int(k): float(v) for k, v in metrics[key].items()} for key in ("latency_us", "nccl_latency_us"))


def probe_pcie_numbers(ranks: int, gpus: int) -> tuple[dict[int, float], dict[int, float]]:
    """(median, fastest replay) per call per size from one run of the flashinfer-pcie-ipc variant."""
    result = probe_result(ranks, gpus, "flashinfer-pcie-ipc")
    median = {int(k): float(v) for k, v in result["metrics"]["latency_us"].items()}
    per_size = result.get("evidence", {}).get("per_size", {})
    fastest = {int(k): float(r["timing"]["min_us"]) for k, r in per_size.items() if "min_us" in r.get("timing", {})}
    return median, fastest


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


def loop_numbers(ranks: int, entry: str = "--rank") -> dict[str, list[Any]]:
    """Per size, what rank 0 of ``ranks`` processes running ``entry`` printed: for the torch loop
    [host-clock us, CUDA-event us] per call averaged over ranks; for flashinfer's PCIe IPC harness
    [median us, fastest us] per call, slowest rank per replay."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, entry], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"bench: a loop rank failed (exit {p.returncode}): {err[-800:]}")
    return dict(json.loads(outs[0][0].strip().splitlines()[-1]))


# --- flashinfer's own PCIe IPC benchmark method, beside the probe's flashinfer-pcie-ipc variant ----------

# What flashinfer's benchmarks/comm/bench_pcie_ipc_all_reduce.py passes to its public timing helper
# flashinfer.testing.bench_gpu_time: a CUDA graph of 20 calls, 5 untimed replays, 20 timed replays back to
# back with CUDA events (no barrier between them), warm L2. It replays on the caller's current stream,
# which in that script is the legacy default stream; so does the harness here.
FI_BENCH_KWARGS: dict[str, Any] = {
    "use_cuda_graph": True,
    "num_iters_within_graph": 20,
    "dry_run_iters": 5,
    "repeat_iters": 20,
    "cold_l2_cache": False,
}
FI_DEFAULT_HIDDEN = {2: 2048, 4: 4096, 8: 6144}  # flashinfer's benchmark default hidden per world size
FI_DEFAULT_BATCHES = (1, 64, 128)  # the rows quoted from flashinfer's benchmark on 2x H200


def pcie_ipc_missing() -> str | None:
    """Why flashinfer's PCIe IPC all-reduce cannot be cross-checked with this Python, or None when it can.
    Decided from the installed files (no flashinfer import, no GPU)."""
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed in this Python"
    from inenv import kit

    unknown = kit.unknown_without_import("all-reduce")
    if unknown is not None:
        return unknown.note
    root = kit.package_root()
    helper = root / "testing" / "utils.py" if root is not None else None
    if helper is None or not helper.is_file() or "def bench_gpu_time(" not in helper.read_text(errors="replace"):
        return "this flashinfer has no flashinfer.testing.bench_gpu_time"
    return None


def fi_shapes(world: int) -> list[tuple[int, int]]:
    """(tokens, hidden) timed by the flashinfer harness: the probe's shapes (hidden 7168, same bytes), then
    flashinfer's benchmark default shape at this world size for the rows its benchmark reports."""
    shapes = [(t, HIDDEN) for t in TOKENS]
    default_hidden = FI_DEFAULT_HIDDEN.get(world)
    if default_hidden is not None and default_hidden != HIDDEN:
        shapes += [(b, default_hidden) for b in FI_DEFAULT_BATCHES]
    return shapes


def _pcie_rank_main() -> None:
    import flashinfer.comm as comm
    import torch
    import torch.distributed as dist
    from flashinfer.testing import bench_gpu_time

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    group = dist.group.WORLD
    shapes = fi_shapes(world)
    ws = comm.PcieIpcAllReduceWorkspace(group=group, max_numel=max(t * h for t, h in shapes), dtype=torch.bfloat16)
    results: dict[str, list[Any]] = {}
    for tokens, hidden in shapes:
        inp = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
        out = torch.empty_like(inp)
        config = ws.tuned_launch_config(inp)  # collective: every rank asks for the same shape
        if config is None:
            continue
        torch.cuda.synchronize()
        ws.rebind_stream()  # bench_gpu_time warms up on its own stream: ordered by the sync above
        samples = bench_gpu_time(lambda i=inp, o=out, c=config: ws.all_reduce(i, out=o, config=c), **FI_BENCH_KWARGS)
        worst = torch.tensor(list(samples), dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)  # slowest rank per replay
        us = worst.cpu() * 1e3
        cfg = f"{config.blocks}x{config.threads} {getattr(config.variant, 'name', config.variant)}"
        results[f"{tokens}x{hidden}"] = [float(us.median()), float(us.min()), cfg]
    if rank == 0:
        print(json.dumps(results), flush=True)
    os._exit(0)  # skip teardown: destroy_process_group can hang after graph capture


def fi_numbers(ranks: int) -> dict[str, list[Any]]:
    """Per "TOKENSxHIDDEN": [median us, fastest us, launch configuration] from flashinfer's method."""
    return loop_numbers(ranks, "--rank-pcie")


def ratio_rows(probe: dict[int, float], ref: dict[int, float], target: float = TARGET) -> list[dict[str, Any]]:
    """One row per size both sides measured: the probe's number over the reference's, and whether the
    ratio lies within ``target`` of 1."""
    rows = []
    for size in sorted(probe):
        if size in ref and ref[size] > 0:
            ratio = probe[size] / ref[size]
            rows.append(
                {
                    "bytes": size,
                    "probe_us": probe[size],
                    "other_us": ref[size],
                    "ratio": ratio,
                    "ok": abs(ratio - 1.0) <= target,
                }
            )
    return rows


def format_rows(probe_name: str, ref_name: str, rows: list[dict[str, Any]], target: float = TARGET) -> list[str]:
    lines = [f"{'bytes':>9} {probe_name:>22} {ref_name:>30} {'ratio':>6}  within {target:.0%}"]
    for r in rows:
        lines.append(
            f"{r['bytes']:>9} {r['probe_us']:>22.2f} {r['other_us']:>30.2f} {r['ratio']:>6.3f}  "
            f"{'yes' if r['ok'] else 'NO'}"
        )
    return lines


def fi_by_bytes(fi: dict[str, list[Any]], column: int, hidden: int = HIDDEN) -> dict[int, float]:
    """flashinfer harness numbers at ``hidden`` keyed by message bytes (bf16); ``column`` 0 median, 1 fastest."""
    out: dict[int, float] = {}
    for shape, values in fi.items():
        tokens, _, h = shape.partition("x")
        if int(h) == hidden:
            out[int(tokens) * hidden * 2] = float(values[column])
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank-pcie", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gpus", type=int, help="GPUs to use (default: all, at most 8)")
    parser.add_argument(
        "--compare", choices=COMPARE, default="all", help="which backends to cross-check (default: all)"
    )
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    if args.gpus is not None and args.gpus < 0:
        parser.error("--gpus must be 0 or more")
    return args


def nccl_pairs(ranks: int, gpus: int, timings: dict[str, float]) -> tuple[list[Pair], dict[str, Any]]:
    direct, via_torch = _timed(timings, "probe nccl-direct", lambda: probe_numbers(ranks, gpus))
    pairs: list[Pair] = []
    binary = nccl_tests_binary()
    if binary:
        reference = _timed(timings, "nccl-tests", lambda: nccl_tests_numbers(binary, ranks, LOOP_REPLAYS))
        pairs.append(("probe NCCL direct", direct, f"nccl-tests -n{LOOP_CALLS} -G{LOOP_REPLAYS}", reference))
    else:
        print("bench: no all_reduce_perf (tools/build_nccl_tests.sh builds it): NCCL direct not cross-checked")
    loop = {int(k): v for k, v in _timed(timings, "loop", lambda: loop_numbers(ranks)).items()}
    loop_host = {k: float(v[0]) for k, v in loop.items()}
    pairs.append(("probe torch NCCL", via_torch, f"torch loop {LOOP_CALLS}x{LOOP_REPLAYS} host", loop_host))
    return pairs, {"loop": loop}


def pcie_pairs(ranks: int, gpus: int, timings: dict[str, float]) -> tuple[list[Pair], dict[str, Any]]:
    median, fastest = _timed(timings, "probe flashinfer-pcie-ipc", lambda: probe_pcie_numbers(ranks, gpus))
    fi = _timed(timings, "flashinfer harness", lambda: fi_numbers(ranks))
    pairs = [
        ("probe pcie-ipc median", median, "flashinfer method median", fi_by_bytes(fi, 0)),
        ("probe pcie-ipc fastest", fastest, "flashinfer method fastest", fi_by_bytes(fi, 1)),
    ]
    return pairs, {"flashinfer_method": fi}


def _timed(timings: dict[str, float], name: str, step: Any) -> Any:
    t0 = time.monotonic()
    value = step()
    timings[name] = time.monotonic() - t0
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank:
        _rank_main()
        return 0
    if args.rank_pcie:
        _pcie_rank_main()
        return 0
    gpus = args.gpus if args.gpus is not None else min(gpu_count(), 8)
    if gpus < 2:
        print("bench_latency_crosscheck: needs at least 2 GPUs (allreduce between GPUs)", file=sys.stderr)
        return 2
    ranks = 2 if gpus < 4 else (4 if gpus < 8 else 8)
    timings: dict[str, float] = {}
    pairs: list[Pair] = []
    extra: dict[str, Any] = {}
    if args.compare in ("all", "nccl"):
        found, more = nccl_pairs(ranks, gpus, timings)
        pairs += found
        extra.update(more)
    if args.compare in ("all", "pcie-ipc"):
        missing = pcie_ipc_missing()
        if missing is not None:
            print(f"bench: flashinfer-pcie-ipc not cross-checked: {missing}")
        else:
            found, more = pcie_pairs(ranks, gpus, timings)
            pairs += found
            extra.update(more)
    print(f"ranks={ranks}  " + "  ".join(f"{k}: {v:.1f}s" for k, v in timings.items()))
    report: dict[str, list[dict[str, Any]]] = {}
    for probe_name, probe, ref_name, ref in pairs:
        rows = ratio_rows(probe, ref)
        report[f"{probe_name} vs {ref_name}"] = rows
        print("\n" + "\n".join(format_rows(probe_name, ref_name, rows)))
    if "loop" in extra:
        loop_events = ", ".join(f"{v[1]:.2f}" for v in extra["loop"].values())
        print(f"\nloop timed by CUDA events over the same span (us): {loop_events}")
    if "flashinfer_method" in extra:
        print("\nflashinfer method, every shape (median us, fastest us, launch configuration):")
        for shape, (med, low, cfg) in extra["flashinfer_method"].items():
            print(f"  {shape:>10} {med:>8.2f} {low:>8.2f}  {cfg}")
    rows_all = [r for rows in report.values() for r in rows]
    inside = sum(1 for r in rows_all if r["ok"])
    print(f"\n{inside}/{len(rows_all)} comparisons within {TARGET:.0%} (target: all)")
    if args.json:
        payload = {"ranks": ranks, "calls_per_graph": LOOP_CALLS, "comparisons": report, **extra}
        tmp = args.json.with_name(args.json.name + ".partial")
        tmp.write_text(json.dumps(payload, indent=1))
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
