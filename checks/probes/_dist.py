"""Shared helpers for the torch.distributed probes (NCCL graphs, symmetric memory, allreduce latency).

In-environment side: standard library at module level; torch is imported inside the functions that
need it, so the host-side planner can import the probe modules without torch.

Conventions the probes rely on:

- Inputs are small integers (-4..4) stored in bf16, so any sum over up to 32 ranks is exact and the
  reference can be computed locally on every rank from the formula (no collective needed to check a
  collective).
- Outputs are pre-filled with a sentinel that no correct result can contain, so a kernel that did
  nothing is told apart from one that computed the wrong numbers.
- Timings as serving runs the collectives: K calls captured in one graph, R replays timed with CUDA events after
  an on-stream barrier, the slowest rank per replay, then median and p99 divided by K.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from checks.probe import RankContext, outcome

# NVLink multicast can take a shared host's GPUs out of service; these stay set in every rank.
# A user who wants multicast probed on their own NVSwitch machine opts in explicitly.
MULTICAST_OFF: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
ALLOW_MULTICAST_ENV = "STACKPROBE_ALLOW_MULTICAST"

SENTINEL = 111.0  # exactly representable in bf16, outside every possible sum of -4..4 inputs over <= 27 ranks
HIDDEN = 7168  # DeepSeek-V3 / Kimi hidden size: the decode allreduce the research measures
ERROR_TAIL_CHARS = 600
WARMUP_DEADLINE_S = 60.0


def keep_multicast_off(env: dict[str, str] | None = None) -> dict[str, str]:
    """Make sure the multicast-off variables are set in this process (never unsets anything).

    Returns the values in force, for the evidence. Call before torch initialises CUDA or NCCL.
    """
    target = os.environ if env is None else env
    if target.get(ALLOW_MULTICAST_ENV) != "1":
        for key, value in MULTICAST_OFF.items():
            target.setdefault(key, value)
    return {key: target.get(key, "") for key in MULTICAST_OFF}


def error_tail(exc: BaseException, limit: int = ERROR_TAIL_CHARS) -> str:
    """The useful end of an exception message (torch prefixes long C++ stacks)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    noise = ("frame #", "Exception raised")
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith(noise)]
    text = "\n".join(lines)
    return text[-limit:]


def gpu_precheck(ctx: RankContext, shared: bool = False) -> dict[str, Any] | None:
    """A `skip` outcome when this rank has no GPU, or too few are visible for one GPU per rank."""
    import torch

    if not torch.cuda.is_available() or ctx.device_index is None:
        return outcome("skip", "no CUDA device in this rank", "no-gpu")
    if not shared and torch.cuda.device_count() < ctx.world_size:
        return outcome("skip", f"needs {ctx.world_size} GPUs, {torch.cuda.device_count()} visible", "too-few-gpus")
    return None


# --------------------------------------------------------------------------------------------------
# Process groups


def init_dist(ctx: RankContext, backend: str = "nccl", timeout_s: float = 120.0) -> Any:
    """Bind this rank to its GPU (if any) and join the env:// rendezvous; returns the torch device.

    With NCCL the communicator is created eagerly (``device_id``) so that the first collective a
    probe issues, possibly inside a graph capture, is the first *collective*, not the first init.
    """
    import datetime

    import torch
    import torch.distributed as dist

    keep_multicast_off()
    if ctx.device_index is not None and torch.cuda.is_available():
        torch.cuda.set_device(ctx.device_index)
        device = torch.device("cuda", ctx.device_index)
    else:
        device = torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", ctx.master_addr)
    if ctx.master_port:
        os.environ.setdefault("MASTER_PORT", str(ctx.master_port))
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=ctx.rank,
        world_size=ctx.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    return device


def cpu_group() -> Any:
    """A gloo group beside the main one: host-side exchanges that must not touch NCCL's state."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def gather_objects(value: Any, group: Any = None) -> list[Any]:
    """Every rank's JSON-able ``value``, in rank order. Unlike ``all_gather_object`` this needs no
    numpy (cell images may lack it): JSON bytes travel as uint8 tensors."""
    import json

    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    on_gpu = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    data = json.dumps(value).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(max(longest, 1), dtype=torch.uint8, device=device)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [json.loads(bytes(b[: int(s.item())].cpu().tolist())) for b, s in zip(bufs, sizes, strict=True)]


VERDICT_ORDER = ("ok", "close", "error", "zero", "no-op", "wrong", "hang")


def worst_verdict(verdicts: Sequence[str]) -> str:
    """The most serious of several ranks' verdicts (unknown words rank as errors)."""
    rank = {v: i for i, v in enumerate(VERDICT_ORDER)}
    return max(verdicts, key=lambda v: rank.get(v, rank["error"]), default="ok")


def agree(ok: bool, group: Any = None) -> bool:
    """True only if every rank says True (a verdict must not differ between ranks)."""
    return all(gather_objects(bool(ok), group))


# --------------------------------------------------------------------------------------------------
# Integer-valued data and exact checks


def pattern(shape: Sequence[int], rank: int, seed: int, device: Any = "cpu", dtype: Any = None) -> Any:
    """Deterministic small integers in -4..4 that differ per rank, per seed and per element."""
    import torch

    dtype = dtype or torch.bfloat16
    n = math.prod(shape)
    idx = torch.arange(n, device=device, dtype=torch.int64)
    vals = (idx * 5 + rank * 3 + seed * 7 + (idx // 13) * rank) % 9 - 4
    return vals.to(dtype).reshape(tuple(shape))


def pattern_sum(shape: Sequence[int], world_size: int, seed: int, device: Any = "cpu", dtype: Any = None) -> Any:
    """The exact allreduce(sum) of :func:`pattern` over ranks 0..world_size-1, summed in int64."""
    import torch

    dtype = dtype or torch.bfloat16
    total = sum(pattern(shape, r, seed, device, torch.int64) for r in range(world_size))
    return total.to(dtype)


def filled(shape: Sequence[int], value: float = SENTINEL) -> Any:
    """A CPU tensor holding what a sentinel-filled output buffer held before the call."""
    import torch

    return torch.full(tuple(shape), value, dtype=torch.float64)


@dataclass(frozen=True)
class Check:
    """Result of comparing a collective's output with its exact reference."""

    verdict: str  # exact | close | no-op | zero | wrong
    mismatches: int = 0
    numel: int = 0
    max_abs_err: float = 0.0
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict == "exact"

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "mismatches": self.mismatches,
            "numel": self.numel,
            "max_abs_err": self.max_abs_err,
            "detail": self.detail,
        }


def check_exact(
    out: Any,
    expected: Any,
    *,
    prior: Any = None,
    own_input: Any = None,
    atol: float = 0.0,
) -> Check:
    """Compare exactly first; a tolerance, if given, is only a second, reported level.

    ``prior`` is what the output buffer held before the call (the sentinel fill) and ``own_input``
    this rank's contribution: an output equal to either, when the reference differs from it, is a
    silent no-op rather than a wrong result.
    """
    import torch

    got = out.detach().to("cpu", torch.float64).reshape(-1)
    ref = expected.detach().to("cpu", torch.float64).reshape(-1)
    numel = ref.numel()
    if got.numel() != numel:
        return Check("wrong", numel, numel, math.inf, f"shape {tuple(out.shape)} vs {tuple(expected.shape)}")
    diff = (got - ref).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    mismatches = int((diff != 0).sum())
    max_err = float(diff.max()) if numel else 0.0
    if mismatches == 0:
        return Check("exact", 0, numel, 0.0)
    for name, before in (("prior contents", prior), ("own input", own_input)):
        if before is None:
            continue
        b = before.detach().to("cpu", torch.float64).reshape(-1)
        if b.numel() == numel and bool(torch.equal(got, b)) and not bool(torch.equal(b, ref)):
            return Check("no-op", mismatches, numel, max_err, f"output equals its {name}")
    if bool((got == 0).all()) and not bool((ref == 0).all()):
        return Check("zero", mismatches, numel, max_err, "output is all zero")
    if atol > 0 and max_err <= atol:
        return Check("close", mismatches, numel, max_err, f"within atol {atol}, not exact")
    return Check("wrong", mismatches, numel, max_err, f"{mismatches}/{numel} elements differ")


# --------------------------------------------------------------------------------------------------
# CUDA graphs


def capture(step: Callable[[], Any], calls: int, warmup: int = 3, pool: Any = None) -> Any:
    """Eager warm-up on a side stream (skipped when ``warmup`` is 0), then capture ``calls`` steps.

    ``warmup=0`` is deliberate in the NCCL probe: it makes the capture the first use of a collective.
    """
    import torch

    if warmup > 0:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step()
        torch.cuda.current_stream().wait_stream(side)
        wait_device(WARMUP_DEADLINE_S)  # a warm-up collective whose peer never arrives must not block forever
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        for _ in range(calls):
            step()
    torch.cuda.synchronize()
    return graph


class Hung(Exception):
    """Device work did not finish in time (typically a collective whose peer never arrived)."""


def wait_device(deadline_s: float) -> None:
    """Like ``torch.cuda.synchronize`` but gives up, so the rank can still report which step hung."""
    import time

    import torch

    done = torch.cuda.Event()
    done.record()
    end = time.monotonic() + deadline_s
    while not done.query():
        if time.monotonic() > end:
            raise Hung(f"device work not finished after {deadline_s:.0f} s")
        time.sleep(0.0005)


# --------------------------------------------------------------------------------------------------
# Symmetric memory (torch.distributed._symmetric_memory)


def symm_rendezvous(tensor: Any, group: Any) -> tuple[Any, bool]:
    """Rendezvous a symmetric tensor over ``group``; the one place that knows torch < 2.11 needs
    ``enable_symm_mem_for_group`` first. Returns the handle and whether that call was made."""
    import torch.distributed._symmetric_memory as symm_mem

    enabled_here = False
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    is_enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
    if enable is not None and (is_enabled is None or not is_enabled(group.group_name)):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated (a no-op need) on newer torch
            enable(group.group_name)
        enabled_here = True
    return symm_mem.rendezvous(tensor, group), enabled_here


def symm_op(name: str) -> Any:
    """``torch.ops.symm_mem.<name>`` or None when this torch does not have it."""
    import torch

    try:
        return getattr(torch.ops.symm_mem, name)
    except (AttributeError, RuntimeError):
        return None


# --------------------------------------------------------------------------------------------------
# Timing


@dataclass(frozen=True)
class Timing:
    median_us: float
    p99_us: float
    min_us: float
    replays: int
    calls_per_replay: int
    per_replay_us: list[float] = field(default_factory=list)

    def to_json(self, with_samples: bool = False) -> dict[str, Any]:
        data: dict[str, Any] = {
            "median_us": round(self.median_us, 3),
            "p99_us": round(self.p99_us, 3),
            "min_us": round(self.min_us, 3),
            "replays": self.replays,
            "calls_per_replay": self.calls_per_replay,
        }
        if with_samples:
            data["per_replay_us"] = [round(x, 3) for x in self.per_replay_us]
        return data


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): always one of the observed values."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def aggregate(per_rank_ms: Sequence[Sequence[float]], calls_per_replay: int) -> Timing:
    """Per replay the slowest rank counts (a collective ends when its last rank does); the
    statistics are over replays, scaled to one call. Input: for each rank, ms per replay."""
    if not per_rank_ms or calls_per_replay < 1:
        raise ValueError("need at least one rank and one call per replay")
    replays = {len(r) for r in per_rank_ms}
    if len(replays) != 1 or 0 in replays:
        raise ValueError(f"ranks timed different or zero replay counts: {sorted(replays)}")
    slowest = [max(col) * 1000.0 / calls_per_replay for col in zip(*per_rank_ms, strict=True)]
    return Timing(
        median_us=median(slowest),
        p99_us=percentile(slowest, 99),
        min_us=min(slowest),
        replays=len(slowest),
        calls_per_replay=calls_per_replay,
        per_replay_us=slowest,
    )


def side_stream(device: Any) -> Any:
    """A context that makes a fresh stream current: where timed graphs are captured and replayed.

    Not the legacy default stream: a graph replayed there costs every NCCL call about 5 us more at
    20 calls per graph and 10 us at 50 on 2x H200 (direct NCCL and torch.distributed alike, other
    backends not; benchmarks/bench_latency_factors.py), which would time the stream, not the backend."""
    import torch

    return torch.cuda.stream(torch.cuda.Stream(device=device))


def time_replays(replay: Callable[[], Any], replays: int, barrier: Callable[[], Any] | None = None) -> list[float]:
    """This rank's time per replay in ms: CUDA events on a GPU, the host clock on CPU.

    The barrier runs before each replay, outside the timed span, so ranks start together; on a GPU
    it should be stream-ordered (a tiny collective) so no host sync sneaks in between replays.
    """
    import time

    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
        for i in range(replays):
            if barrier is not None:
                barrier()
            starts[i].record()
            replay()
            ends[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    out: list[float] = []
    for _ in range(replays):
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        replay()
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


def timed_across_ranks(
    replay: Callable[[], Any],
    replays: int,
    calls_per_replay: int,
    barrier: Callable[[], Any] | None = None,
    group: Any = None,
) -> Timing:
    """Time on every rank, gather all ranks' samples, aggregate identically everywhere."""
    mine = time_replays(replay, replays, barrier)
    return aggregate(gather_objects(mine, group), calls_per_replay)


def stream_barrier(device: Any, group: Any = None) -> Callable[[], None]:
    """A barrier ordered on the current stream: a one-element all_reduce on the given group."""
    import torch
    import torch.distributed as dist

    flag = torch.zeros(1, device=device, dtype=torch.float32)  # zeros: repeated sums stay zero

    def barrier() -> None:
        dist.all_reduce(flag, group=group)

    return barrier


# --------------------------------------------------------------------------------------------------
# NCCL logs


_TRANSPORT_RE = re.compile(r"Channel \d+/\d+ : \d+\[\S+\] -> \d+\[\S+\] (?:\[\w+\] )?via (\S+)")
_NCCL_VERSION_RE = re.compile(r"NCCL version (\S+)")
_ALGO_RE = re.compile(r"(\w+): (\d+) Bytes -> Algo (\w+) proto (\w+)")


def nccl_debug_env(workdir: os.PathLike[str] | str, subsys: str = "INIT,ENV,TUNING") -> dict[str, str]:
    """Variables that make NCCL log its transports and algorithm choices to a per-process file."""
    return {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": subsys,
        "NCCL_DEBUG_FILE": os.path.join(os.fspath(workdir), "nccl.%h.%p.log"),
    }


def nccl_log_files(workdir: os.PathLike[str] | str, pid: int | None = None) -> list[str]:
    pid = os.getpid() if pid is None else pid
    root = os.fspath(workdir)
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [os.path.join(root, n) for n in names if n.startswith("nccl.") and n.endswith(f".{pid}.log")]


def parse_nccl_log(text: str) -> dict[str, Any]:
    """Transports (``P2P/CUMEM``, ``SHM/direct/direct``, ``NET/Socket``...), the NCCL version and
    the algorithm/protocol NCCL chose per collective, as far as the log shows them."""
    transports = sorted(set(_TRANSPORT_RE.findall(text)))
    version = _NCCL_VERSION_RE.search(text)
    algos: dict[str, list[str]] = {}
    for func, _size, algo, proto in _ALGO_RE.findall(text):
        choice = f"{algo}/{proto}"
        seen = algos.setdefault(func, [])
        if choice not in seen:
            seen.append(choice)
    return {
        "transports": transports,
        "nccl_version": version.group(1) if version else "",
        "algorithms": algos,
    }


def read_nccl_logs(workdir: os.PathLike[str] | str, pid: int | None = None) -> dict[str, Any]:
    text = ""
    for path in nccl_log_files(workdir, pid):
        try:
            with open(path, errors="replace") as f:
                text += f.read()
        except OSError:
            continue
    parsed = parse_nccl_log(text)
    errors = [ln.strip() for ln in text.splitlines() if " WARN " in ln][-5:]
    parsed["warnings"] = errors
    return parsed


# Named refusals the NCCL probes recognise in error text (the reason catalogue holds the remediation).
NCCL_ERROR_CODES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("nccl-algo-unavailable", re.compile(r"No algorithm/protocol available|NCCL_ALGO was set to", re.I)),
    (
        "nccl-capture-failed",
        re.compile(
            r"operation not permitted when stream is capturing|during capture|capture.*invalidat"
            r"|cudaErrorStreamCapture|stream is capturing",
            re.I,
        ),
    ),
    ("nccl-invalid-usage", re.compile(r"invalid usage|ncclInvalidUsage", re.I)),
)


def classify_error(text: str) -> str:
    for code, pat in NCCL_ERROR_CODES:
        if pat.search(text):
            return code
    return "nccl-error"
