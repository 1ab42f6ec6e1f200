"""Latency of captured collectives, measured the way serving engines run them.

K calls are captured in one CUDA graph; R replays are timed with CUDA events after an on-stream
barrier; per replay the slowest rank counts (a collective ends when its last rank does); median and
p99 over replays are divided by K. In-environment side: torch inside the functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from inenv.kit import _dist


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
    """Per replay the slowest rank counts; the statistics are over replays, scaled to one call.
    Input: for each rank, ms per replay."""
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
    return aggregate(_dist.gather_objects(mine, group), calls_per_replay)


def stream_barrier(device: Any, group: Any = None) -> Callable[[], None]:
    """A barrier ordered on the current stream: a one-element all_reduce on the given group."""
    import torch
    import torch.distributed as dist

    flag = torch.zeros(1, device=device, dtype=torch.float32)  # zeros: repeated sums stay zero

    def barrier() -> None:
        dist.all_reduce(flag, group=group)

    return barrier
