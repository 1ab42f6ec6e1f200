"""The load engine (inenv.load_engine) on gloo ranks with stand-in backends registered in its registry.

Every stand-in sums its lane's input over a gloo group of its own and writes the sum (checked exactly) and twice
the sum (checked bitwise across ranks). Each misbehaves in one way, and writes where it did into the file the
``env.T_LOAD_LOG`` param names, so a test reads the truth from the stand-in, never from the engine:

- ``standin-honest``: none;
- ``standin-deadlock-switch``: rank 0 blocks for good in the first replay after ``T_LOAD_K`` replays whose token
  count differs from the one before (its peer then waits in the sum);
- ``standin-corrupt-switch``: rank 1 adds 1 to one element of the first such replay's sum;
- ``standin-two-streams``: replays stay in flight until the engine waits for them, as a stream's do; a replay
  issued on one lane while another lane's is in flight wedges the communicator: it and everything after it never
  finish, so the engine's wait gives up;
- ``standin-setup-blocks``: rank 0 blocks for good while the backend is made (its peer then waits to agree on the
  set-up).

The probe's own backends are registered too: its ``nccl`` adapter runs over the gloo group on CPU (its graph is
the call itself there).
"""

import os
import threading
import time
from typing import Any

from inenv import load_engine as engine
from inenv.kit import _device
from inenv.probe import ProbeSpec, RankContext
from inenv.probes import load as _probe  # noqa: F401  (registers the probe's own backends: nccl runs on gloo here)

SPEC = ProbeSpec(id="t-load", title="load engine with stand-ins", feature="hang and drift under load, on CPU",
                 ranks=(2,), min_ranks=2, needs_gpu=False, requires=("torch",), timeout_s=90, stall_s=3.0)
HIDDEN = 32
SWITCH = 8  # the stand-ins' "one-shot" limit: the walk alternates counts <= 8 and > 8


def _log(text: str) -> None:
    path = os.environ.get("T_LOAD_LOG")
    if path:
        with open(path, "a") as f:
            f.write(text + "\n")


class StandIn:
    name = "standin-honest"
    takes_pdl = True

    def __init__(self, s: engine.Setup) -> None:
        self.s = s
        self.calls = 0
        self.now = 0
        self.last = 0
        self.lanes: list[dict[str, Any]] = []

    def switches(self, hidden: int) -> tuple[int, ...]:
        return (SWITCH,)

    def prepare(self, max_tokens: int, hidden: int) -> int:
        import torch

        for _ in range(self.s.lanes):
            self.lanes.append({k: torch.zeros(max_tokens, hidden, dtype=torch.bfloat16) for k in ("inp", "out", "dbl")})
        return max_tokens

    def buffers(self, lane: int) -> engine.Buffers:
        b = self.lanes[lane]
        return engine.Buffers(b["inp"], {"sum": engine.Output(b["out"], engine.SUM),
                                         "double": engine.Output(b["dbl"], engine.BITS)})

    def capture(self, size: int, pdl: bool, lane: int) -> Any:
        def replay() -> None:
            self.calls += 1
            self.now = size
            self.op(size, lane)
            self.last = size

        return replay

    def op(self, size: int, lane: int) -> None:
        import torch.distributed as dist

        b = self.lanes[lane]
        out = b["out"][:size]
        out.copy_(b["inp"][:size])
        dist.all_reduce(out, group=self.s.group)
        b["dbl"][:size].copy_(out * 2)

    def switched(self) -> bool:
        """This call is past the K-th and its token count differs from the call before."""
        return self.calls >= int(os.environ.get("T_LOAD_K", "40")) and self.last not in (0, self.now)

    def sync(self, deadline_s: float) -> None:
        pass

    def facts(self) -> dict[str, Any]:
        return {"stand_in": self.name}


class DeadlockSwitch(StandIn):
    name = "standin-deadlock-switch"
    blocked = False

    def op(self, size: int, lane: int) -> None:
        if self.s.rank == 0 and self.switched() and not self.blocked:
            self.blocked = True
            _log(f"rank 0 blocked at call {self.calls} size {size}")
            threading.Event().wait()  # for good: the peer waits in its sum
        super().op(size, lane)


class CorruptSwitch(StandIn):
    name = "standin-corrupt-switch"
    corrupted = False

    def op(self, size: int, lane: int) -> None:
        super().op(size, lane)
        if self.switched() and not self.corrupted:
            self.corrupted = True
            if self.s.rank == 1:
                self.lanes[lane]["out"][0, 0] += 1
                _log(f"rank 1 corrupted call {self.calls} size {size}")


class TwoStreams(StandIn):
    name = "standin-two-streams"

    def __init__(self, s: engine.Setup) -> None:
        super().__init__(s)
        self.in_flight: set[int] = set()
        self.wedged = False

    def op(self, size: int, lane: int) -> None:
        if self.in_flight - {lane} and not self.wedged:
            self.wedged = True
            _log(f"rank {self.s.rank} wedged at call {self.calls} size {size} lane {lane}")
        self.in_flight.add(lane)
        if not self.wedged:
            super().op(size, lane)

    def sync(self, deadline_s: float) -> None:
        if self.wedged:
            time.sleep(deadline_s)
            raise _device.Hung(f"{_device.HUNG_WORDS} {deadline_s:.0f} s")
        self.in_flight.clear()


class SetupBlocks(StandIn):
    """Rank 0 never comes back from making the backend (a rendezvous that never completes)."""

    name = "standin-setup-blocks"

    def __init__(self, s: engine.Setup) -> None:
        super().__init__(s)
        if s.rank == 0:
            _log("rank 0 blocked in set-up")
            threading.Event().wait()


for _cls in (StandIn, DeadlockSwitch, CorruptSwitch, TwoStreams, SetupBlocks):
    engine.register(_cls.name, _cls)


def run(ctx: RankContext) -> dict:
    return engine.run(ctx, backend=ctx.param("backend") or "standin-honest", pattern=ctx.param("pattern") or "replay",
                      pdl=ctx.param("pdl") == "on", mode=ctx.param("mode") or "", stall_s=SPEC.stall_s,
                      hidden=HIDDEN)
