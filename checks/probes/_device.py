"""Device work with a deadline: CUDA graph capture after an eager warm-up, and waits that give up.

A collective whose peer never arrives blocks ``torch.cuda.synchronize`` forever; waiting with a
deadline lets the rank still report which step hung. In-environment side: torch inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

WARMUP_DEADLINE_S = 60.0


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
