"""Device work with a deadline: CUDA graph capture after an eager warm-up, waits that give up, and one
stream per simulated rank.

A collective whose peer never arrives blocks ``torch.cuda.synchronize`` forever; waiting with a
deadline lets the rank still report which step hung. In-environment side: torch inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

WARMUP_DEADLINE_S = 60.0
REASON = "device-work-hung"  # the reason code of a Hung (common/reasons.yaml matches the message too)
HUNG_WORDS = "device work not finished after"


class Hung(Exception):
    """Device work did not finish in time (typically a collective whose peer never arrived)."""


def reason(error: str, otherwise: str) -> str:
    """``REASON`` when ``error`` (an exception's text) is a :class:`Hung`, else ``otherwise``; a Lockstep step
    takes this as its code so a hang inside a step is not reported as the step's own error."""
    return REASON if HUNG_WORDS in error else otherwise


def wait_device(deadline_s: float, streams: Sequence[Any] = ()) -> None:
    """Like ``torch.cuda.synchronize`` but gives up, so the rank can still report which step hung.

    Waits for the current stream and for every stream in ``streams``: work queued on torch's side streams
    is not ordered with the default stream, so an event there alone would not cover it."""
    import time

    import torch

    events = []
    for stream in (None, *streams):
        done = torch.cuda.Event()
        done.record(stream)
        events.append(done)
    end = time.monotonic() + deadline_s
    while not all(done.query() for done in events):
        if time.monotonic() > end:
            raise Hung(f"{HUNG_WORDS} {deadline_s:.0f} s")
        time.sleep(0.0005)


@dataclass(frozen=True)
class Lanes:
    """One CUDA stream per simulated rank, and a deadline wait on all of them. Kernels of simulated ranks
    that spin on each other's flags must each be on its own stream: on a shared one the second would wait
    behind the first, which waits for it."""

    streams: tuple[Any, ...]

    @classmethod
    def open(cls, count: int) -> Lanes:
        import torch

        return cls(tuple(torch.cuda.Stream() for _ in range(count)))

    @contextmanager
    def on(self, index: int) -> Iterator[None]:
        """Work queued in the block goes to stream ``index``."""
        import torch

        with torch.cuda.stream(self.streams[index]):
            yield

    def wait(self, deadline_s: float) -> None:
        """Until every stream (and the current one) has run dry; :class:`Hung` after ``deadline_s``."""
        wait_device(deadline_s, self.streams)


def capture(step: Callable[[], Any], calls: int, warmup: int = 3, pool: Any = None, keep: bool = False) -> Any:
    """Eager warm-up on a side stream (skipped when ``warmup`` is 0), then capture ``calls`` steps.

    ``warmup=0`` is deliberate in the NCCL probe: it makes the capture the first use of a collective.
    ``keep``: CUDA's graph object is kept beside its executable (torch's ``keep_graph``; a torch without it
    captures as usual) so ``inenv.kit._kernels`` can read which kernels it launches; it is instantiated here, so
    the first replay costs what every other does.
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
    graph, kept = _new_graph(keep)
    with torch.cuda.graph(graph, pool=pool):
        for _ in range(calls):
            step()
    if kept and hasattr(graph, "instantiate"):  # else its first replay instantiates it
        graph.instantiate()
    torch.cuda.synchronize()
    return graph


def _new_graph(keep: bool) -> tuple[Any, bool]:
    """A graph to capture into, and whether it keeps CUDA's graph object."""
    import torch

    if keep:
        try:
            return torch.cuda.CUDAGraph(keep_graph=True), True
        except TypeError:  # a torch before keep_graph: inenv.kit._kernels falls back to the profiler
            pass
    return torch.cuda.CUDAGraph(), False
