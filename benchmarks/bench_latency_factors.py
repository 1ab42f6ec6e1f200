"""Why do graph-captured NCCL allreduce timings differ between methods? One factor at a time, same host.

    python benchmarks/bench_latency_factors.py [--json OUT]

Companion to bench_latency_crosscheck.py, which found the ar-latency probe, a torch loop and nccl-tests
disagreeing at decode sizes. Two ranks, one GPU each, every number a per-call time in microseconds:

* ``torch``: torch.distributed in two processes, for each size and each combination of
  calls per graph (20, 50), capture mode (global, thread_local) and buffer (a view of one large buffer, as
  the probe uses, or a fresh tensor, as the loop uses). Each graph is timed three ways in the same process:
  ``b2b`` replays back to back, CUDA events around the whole batch; ``b2b-med`` the median of per-replay
  events in that batch; ``barrier`` per-replay events after an on-stream one-element allreduce, median
  (the probe's method). Ranks are combined by the max.
* ``raw``: libnccl and libcudart through ctypes in two processes, no torch in the path: the same
  graphs and the same three timings, in thread-local capture mode.
* ``mixed``: torch loaded with its communicator up, NCCL called directly (inenv/kit/_nccl.py) and
  through torch.distributed, captured by torch.cuda.graph or by the runtime API on a torch side stream, and
  replayed on that side stream or on the legacy default stream.
* ``nccl-tests``: all_reduce_perf in one process driving both GPUs (``-g 2``), and one process with a
  thread per GPU (``-t 2``), graph-launched, when the binary is available (tools/build_nccl_tests.sh).

On 2x H200 (benchmarks/results/h200x2-20261129/) the replay stream alone explains the spread: on the
legacy default stream every NCCL call costs about 5 us more with 20 calls per graph and about 10 us more
with 50; on a side stream every method gives nccl-tests' 7.4-7.7 us at 14 KiB. ``--only`` picks kinds.

Exits 2 with one line when the host has fewer than two GPUs.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_latency_crosscheck import gpu_count, nccl_tests_binary, torch_library_path  # noqa: E402

SIZES = (14336, 229376, 1835008, 7340032)  # bytes of bf16: 1, 16, 128 and 512 tokens at hidden 7168
CALLS = (20, 50)
REPLAYS = 40
BF16 = 9  # ncclBfloat16
SUM = 0  # ncclSum


def _median(values: list[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _three_timings(
    replay: Callable[[], Any],
    barrier: Callable[[], Any],
    event: Callable[[], Any],
    record: Callable[[Any], Any],
    elapsed: Callable[[Any, Any], float],
    sync: Callable[[], Any],
    calls: int,
) -> dict[str, float]:
    """b2b (batch span), b2b-med (median per replay in that batch), barrier (median per replay after a
    stream barrier); per call, us. ``event()`` makes an event, ``record(ev)`` records it on the stream."""
    starts = [event() for _ in range(REPLAYS)]
    ends = [event() for _ in range(REPLAYS)]
    for i in range(REPLAYS):
        record(starts[i])
        replay()
        record(ends[i])
    sync()
    per = [elapsed(starts[i], ends[i]) * 1e3 / calls for i in range(REPLAYS)]
    out = {"b2b": elapsed(starts[0], ends[-1]) * 1e3 / (calls * REPLAYS), "b2b-med": _median(per)}
    for i in range(REPLAYS):
        barrier()
        record(starts[i])
        replay()
        record(ends[i])
    sync()
    out["barrier"] = _median([elapsed(starts[i], ends[i]) * 1e3 / calls for i in range(REPLAYS)])
    return out


def _torch_timings(replay: Callable[[], Any], barrier: Callable[[], Any], calls: int) -> dict[str, float]:
    """:func:`_three_timings` with torch's CUDA events on the current stream."""
    import torch

    return _three_timings(
        replay,
        barrier,
        lambda: torch.cuda.Event(enable_timing=True),
        lambda ev: ev.record(),
        lambda a, b: a.elapsed_time(b),
        torch.cuda.synchronize,
        calls,
    )


# --- torch ranks ---------------------------------------------------------------------------------------


def torch_rank() -> dict[str, dict[str, float]]:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    big = torch.zeros(max(SIZES) // 2, dtype=torch.bfloat16, device=dev)
    flag = torch.zeros(1, device=dev)
    results: dict[str, dict[str, float]] = {}
    for size in SIZES:
        for calls in CALLS:
            for mode in ("global", "thread_local"):
                for buf in ("view", "fresh"):
                    print(f"torch rank {rank}: {size} K={calls} {mode} {buf}", file=sys.stderr, flush=True)
                    x = big[: size // 2] if buf == "view" else torch.zeros(size // 2, dtype=torch.bfloat16, device=dev)
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(3):
                            dist.all_reduce(x)
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, capture_error_mode=mode):
                        for _ in range(calls):
                            dist.all_reduce(x)
                    graph.replay()
                    torch.cuda.synchronize()
                    dist.barrier()
                    torch.cuda.synchronize()
                    t = _torch_timings(graph.replay, lambda: dist.all_reduce(flag), calls)
                    results[f"torch K={calls} {mode} {buf}|{size}"] = t
                    del graph
    return results


def mixed_rank() -> dict[str, dict[str, float]]:
    """torch loaded and its communicator up; NCCL called directly (inenv/kit/_nccl.py). The same
    calls captured by torch.cuda.graph, and by the CUDA runtime API on a torch stream (instantiated with
    no flags, and with auto-free-on-launch as torch does): tells torch's graph wrapper from torch's presence."""
    import torch
    import torch.distributed as dist

    from inenv import kit

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    gloo = dist.new_group(backend="gloo")
    comm = kit.DirectComm(rank, world, gloo)
    rt = ctypes.CDLL(kit.loaded_library("libcudart.so", "libcudart.so.13"))
    big = torch.zeros(max(SIZES) // 2, dtype=torch.bfloat16, device=dev)
    flag = torch.zeros(1, dtype=torch.bfloat16, device=dev)
    results: dict[str, dict[str, float]] = {}

    def timings(replay: Callable[[], Any], calls: int) -> dict[str, float]:
        return _torch_timings(replay, lambda: comm.all_reduce_bf16(flag), calls)

    def captured(step: Callable[[], Any], calls: int, stream: Any) -> Any:
        """Three eager warm-up calls, then ``calls`` steps captured by torch.cuda.graph on ``stream``."""
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                step()
        torch.cuda.synchronize()
        return graph

    for size in SIZES:
        x = big[: size // 2]
        for calls in CALLS:
            print(f"mixed rank {rank}: {size} K={calls}", file=sys.stderr, flush=True)
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                graph = captured(lambda x=x: comm.all_reduce_bf16(x), calls, stream)
                results[f"direct in torch.cuda.graph K={calls}|{size}"] = timings(graph.replay, calls)
                tgraph = captured(lambda x=x: dist.all_reduce(x), calls, stream)
                results[f"torch.dist in torch.cuda.graph K={calls}|{size}"] = timings(tgraph.replay, calls)
            # The same two graphs replayed on the legacy default stream, where torch runs by default.
            legacy = torch.cuda.default_stream()
            with torch.cuda.stream(legacy):
                torch.cuda.synchronize()
                results[f"direct, replayed on default stream K={calls}|{size}"] = timings(graph.replay, calls)
                results[f"torch.dist, replayed on default stream K={calls}|{size}"] = timings(tgraph.replay, calls)
            with torch.cuda.stream(stream):
                for flags in (0, 1):  # 1 = cudaGraphInstantiateFlagAutoFreeOnLaunch
                    handle = ctypes.c_void_p(stream.cuda_stream)
                    if rt.cudaStreamBeginCapture(handle, 1) != 0:
                        raise RuntimeError("cudaStreamBeginCapture failed")
                    for _ in range(calls):
                        comm.all_reduce_bf16(x)
                    g, exe = ctypes.c_void_p(), ctypes.c_void_p()
                    if rt.cudaStreamEndCapture(handle, ctypes.byref(g)) != 0:
                        raise RuntimeError("cudaStreamEndCapture failed")
                    if rt.cudaGraphInstantiate(ctypes.byref(exe), g, ctypes.c_ulonglong(flags)) != 0:
                        raise RuntimeError("cudaGraphInstantiate failed")
                    torch.cuda.synchronize()
                    results[f"direct in runtime graph flags={flags} K={calls}|{size}"] = timings(
                        lambda exe=exe, handle=handle: rt.cudaGraphLaunch(exe, handle), calls
                    )
            del graph, tgraph
    return results


# --- raw NCCL ranks (ctypes) ---------------------------------------------------------------------------


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def _lib(name: str) -> ctypes.CDLL:
    for d in torch_library_path().split(os.pathsep):
        if d and (Path(d) / name).exists():
            return ctypes.CDLL(str(Path(d) / name))
    return ctypes.CDLL(name)


def raw_rank(id_file: str) -> dict[str, dict[str, float]]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rt, nccl = _lib("libcudart.so.13"), _lib("libnccl.so.2")

    def ck(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} returned {code}")

    ck(rt.cudaSetDevice(rank), "cudaSetDevice")
    uid = _UniqueId()
    if rank == 0:
        ck(nccl.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        Path(id_file + ".tmp").write_bytes(ctypes.string_at(ctypes.addressof(uid), 128))  # .internal stops at NUL
        os.replace(id_file + ".tmp", id_file)
    else:
        while not os.path.exists(id_file):
            time.sleep(0.01)
        ctypes.memmove(ctypes.byref(uid), Path(id_file).read_bytes(), 128)
    comm = ctypes.c_void_p()
    ck(nccl.ncclCommInitRank(ctypes.byref(comm), world, uid, rank), "ncclCommInitRank")
    stream = ctypes.c_void_p()
    ck(rt.cudaStreamCreateWithFlags(ctypes.byref(stream), 1), "cudaStreamCreateWithFlags")
    buf, flag = ctypes.c_void_p(), ctypes.c_void_p()
    ck(rt.cudaMalloc(ctypes.byref(buf), ctypes.c_size_t(max(SIZES))), "cudaMalloc")
    ck(rt.cudaMalloc(ctypes.byref(flag), ctypes.c_size_t(4)), "cudaMalloc")
    nccl.ncclAllReduce.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_size_t, ctypes.c_int, ctypes.c_int] + [
        ctypes.c_void_p
    ] * 2

    def allreduce(ptr: ctypes.c_void_p, count: int, dtype: int = BF16) -> None:
        ck(nccl.ncclAllReduce(ptr, ptr, count, dtype, SUM, comm, stream), "ncclAllReduce")

    def sync() -> None:
        ck(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def event() -> ctypes.c_void_p:
        ev = ctypes.c_void_p()
        ck(rt.cudaEventCreate(ctypes.byref(ev)), "cudaEventCreate")
        return ev

    def elapsed(a: ctypes.c_void_p, b: ctypes.c_void_p) -> float:
        ms = ctypes.c_float()
        ck(rt.cudaEventElapsedTime(ctypes.byref(ms), a, b), "cudaEventElapsedTime")
        return ms.value

    results: dict[str, dict[str, float]] = {}
    for size in SIZES:
        for calls in CALLS:
            print(f"raw rank {rank}: size {size} K={calls}", file=sys.stderr, flush=True)
            for _ in range(3):
                allreduce(buf, size // 2)
            sync()
            # thread-local mode, as nccl-tests captures: NCCL may allocate during capture
            ck(rt.cudaStreamBeginCapture(stream, 1), "cudaStreamBeginCapture")
            for _ in range(calls):
                allreduce(buf, size // 2)
            graph, exe = ctypes.c_void_p(), ctypes.c_void_p()
            ck(rt.cudaStreamEndCapture(stream, ctypes.byref(graph)), "cudaStreamEndCapture")
            ck(rt.cudaGraphInstantiate(ctypes.byref(exe), graph, ctypes.c_ulonglong(0)), "cudaGraphInstantiate")
            ck(rt.cudaGraphLaunch(exe, stream), "cudaGraphLaunch")
            sync()
            allreduce(flag, 1, 7)
            sync()
            results[f"raw K={calls} thread_local|{size}"] = _three_timings(
                lambda exe=exe: ck(rt.cudaGraphLaunch(exe, stream), "cudaGraphLaunch"),
                lambda: allreduce(flag, 1, 7),
                event,
                lambda ev: ck(rt.cudaEventRecord(ev, stream), "cudaEventRecord"),
                elapsed,
                sync,
                calls,
            )
    return results


# --- host side -----------------------------------------------------------------------------------------


def run_ranks(kind: str, world: int, timeout_s: float = 150.0) -> dict[str, dict[str, float]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mkdtemp()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [sys.executable, __file__, "--rank", kind, "--id-file", os.path.join(tmp, "uid")]
        with open(os.path.join(tmp, f"rank{r}.err"), "w") as err:
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True))

    def tails() -> str:
        return " | ".join(Path(tmp, f"rank{r}.err").read_text(errors="replace")[-600:] for r in range(world))

    # A rank that fails leaves its peer blocked in a collective: stop all as soon as one exits badly.
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        bad = next((p for p in procs if p.poll() not in (None, 0)), None)
        if bad is not None or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            why = f"exit {bad.returncode}" if bad is not None else f"no result in {timeout_s:.0f} s"
            raise SystemExit(f"bench: {kind} ranks stopped ({why}): {tails()}")
        time.sleep(0.2)
    per_rank = []
    for p in procs:
        out = p.communicate()[0]
        if p.returncode != 0 or not out.strip():
            raise SystemExit(f"bench: a {kind} rank failed (exit {p.returncode}): {tails()}")
        per_rank.append(json.loads(out.strip().splitlines()[-1]))
    return {k: {m: max(r[k][m] for r in per_rank) for m in per_rank[0][k]} for k in per_rank[0]}


def nccl_tests(binary: str, world: int, threads: bool, calls: int) -> dict[int, float]:
    layout = ["-t", str(world), "-g", "1"] if threads else ["-g", str(world)]
    cmd = [binary, *layout, "-d", "bfloat16", "-b", str(min(SIZES)), "-e", str(max(SIZES)), "-f", "2"]
    cmd += ["-w", "20", "-n", str(calls), "-G", str(REPLAYS), "-c", "0"]
    env = dict(os.environ, LD_LIBRARY_PATH=torch_library_path())
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env).stdout
    rows = {}
    for ln in out.splitlines():
        parts = ln.split()
        if len(parts) > 6 and parts[0].isdigit() and int(parts[0]) in SIZES:
            rows[int(parts[0])] = float(parts[5])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", choices=("torch", "raw", "mixed"), help=argparse.SUPPRESS)
    parser.add_argument("--only", help="comma-separated kinds to run: raw, torch, mixed, nccl-tests")
    parser.add_argument("--id-file", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    if args.rank:
        res = {"torch": torch_rank, "mixed": mixed_rank}[args.rank]() if args.rank != "raw" else raw_rank(args.id_file)
        print(json.dumps(res), flush=True)
        os._exit(0)  # skip teardown: destroy_process_group can hang after graph capture
    if gpu_count() < 2:
        print("bench_latency_factors: needs at least 2 GPUs", file=sys.stderr)
        return 2
    rows: dict[str, dict[int, float]] = {}
    kinds = args.only.split(",") if args.only else ["raw", "torch", "mixed", "nccl-tests"]
    for kind in (k for k in ("raw", "torch", "mixed") if k in kinds):
        print(f"{kind} ranks ...", flush=True)
        try:
            measured = run_ranks(kind, 2)
        except SystemExit as exc:  # keep what the other methods give
            print(exc, flush=True)
            continue
        for key, timing in measured.items():
            name, size = key.split("|")
            for method, value in timing.items():
                rows.setdefault(f"{name} {method}", {})[int(size)] = value
    binary = nccl_tests_binary()
    if binary and "nccl-tests" in kinds:
        for threads in (False, True):
            for calls in CALLS:
                print(f"nccl-tests threads={threads} K={calls} ...", flush=True)
                rows[f"nccl-tests {'-t 2' if threads else '-g 2'} K={calls} b2b host"] = nccl_tests(
                    binary, 2, threads, calls
                )
    print(f"{'per-call us':<42}" + "".join(f"{s:>10}" for s in SIZES))
    for name, values in rows.items():
        print(f"{name:<42}" + "".join(f"{values.get(s, float('nan')):>10.2f}" for s in SIZES))
    if args.json:
        payload = {n: {str(k): v for k, v in vals.items()} for n, vals in rows.items()}
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
