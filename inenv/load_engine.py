"""The load engine: an allreduce backend replayed the way serving engines replay it, thousands of times with the
token count moving between replays, checked while it runs (docs/probes.md, load).

What it reproduces: a backend that passes a short exact check and then hangs or drifts after thousands of CUDA
graph replays with changing sizes, PDL, or two streams. The pattern is the engines': one graph per token count,
captured once and replayed back to back, the count walking between decode sizes (1..64), speculative verify sizes
(batch x (draft + 1)) and prefill chunks, so that it crosses the backend's one-shot/two-shot switch again and again
(the thresholds below are the backends' own, read from their sources).

- Backends sit behind one protocol (:class:`Backend`) in one registry (:data:`REGISTRY`, name -> factory); the
  engine never asks which one it holds. The GPU backends are registered by ``inenv.probes.load``; tests register
  stand-ins that run on CPU over gloo.
- Patterns: ``replay`` (one stream), ``two-streams`` (one communicator, two lanes of graphs replayed on two
  streams with no order between them: the green-context pattern) and ``two-comms`` (two communicators, one per
  stream: the draft/target pattern). Each waits for its work with a deadline.
- Inputs are small integers that depend on the replay number, the rank and the token count, so every replay's sum
  is known in closed form (``_data.pattern_sum`` plus a per-replay offset). Checks are sampled (every
  :data:`SAMPLE_EVERY`-th replay and the first replay after each size change on a lane), queued on the device
  behind the replay they check and read back every :data:`FLUSH` replays, so checking does not stall the replays:
  an output with a closed form (the sum, a fused residual) is compared exactly, which is also bitwise across ranks;
  an output without one (a fused RMSNorm, a quantized output) is compared bitwise across ranks (a digest exchanged
  over gloo) and with the same output for the same input earlier on the same rank.
- Latency per token count (p50 and p99, the slowest rank per replay) from CUDA events in the ``replay`` pattern
  with a GPU per rank; ranks sharing a GPU are checked, not timed; on CPU stand-ins the host clock.
- Every replay rewrites this rank's progress record (``inenv.progress``) with the probe's stall deadline, so a rank
  blocked inside a library call is found by the launcher's watch; device work that does not finish is found by the
  rank itself (a wait with a deadline) and reported as ``hang`` naming the replay.

Levels: full (at most :data:`FULL` replays and seconds per variant), quick (a few hundred replays, for a first
look and the CPU tests), and a soak (``STACKPROBE_SOAK_S`` seconds of replays, no replay cap: the host must give
the variant a timeout that covers it).

In-environment side: standard library at module level, torch inside the functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from inenv import progress
from inenv.kit import _data, _device, _dist, _errors
from inenv.kit._timing import percentile
from inenv.probe import LEVEL_ENV, QUICK, RankContext, outcome

HIDDEN = _data.HIDDEN
REPLAY, TWO_STREAMS, TWO_COMMS = "replay", "two-streams", "two-comms"
PATTERNS = (REPLAY, TWO_STREAMS, TWO_COMMS)

# --- the backends' own switches (facts, from their sources) ---------------------------------------------------
# flashinfer's trtllm allreduce fusion, asked to choose (use_oneshot=None), runs one-shot while tokens x hidden x 2
# x world x bytes per element, in MiB, is at most this per world size (flashinfer/comm/trtllm_ar.py,
# _use_oneshot_heuristics, "based on all configs of trtllm_allreduce_fusion on B200"); two-shot also needs more
# tokens than ranks (an assert there).
FUSION_ONESHOT_MIB = {2: 512, 4: 64, 8: 42}
# The one-shot token limit of flashinfer's own fusion test (tests/comm/test_trtllm_allreduce_fusion.py,
# kOneShotMaxTokenNum): mode=crossing runs one-shot up to it and two-shot above, so every world size crosses it.
CROSSING_TOKENS = 128
# The vLLM-style custom allreduce (flashinfer's and sgl-kernel's copies, vllm_custom_all_reduce.cuh): one stage at
# 2 ranks; with full NVLink one stage below 512 KiB up to 4 ranks and below 256 KiB up to 8 ranks, two stages above.
CUSTOM_AR_ONE_STAGE = ((4, 512 * 1024), (8, 256 * 1024))


def fusion_switch(world: int, hidden: int, itemsize: int = 2) -> int | None:
    """The largest token count flashinfer's fusion heuristic runs one-shot at (None: a world size its table lacks)."""
    limit = FUSION_ONESHOT_MIB.get(world)
    if limit is None:
        return None
    return int(limit * 1024 * 1024 // (hidden * 2 * world * itemsize))


def custom_ar_switch(world: int, hidden: int, itemsize: int = 2) -> int | None:
    """The largest token count the custom allreduce runs in one stage at (None: one stage at every size)."""
    if world <= 2:
        return None
    for most, below in CUSTOM_AR_ONE_STAGE:
        if world <= most:
            return max(0, (below - 1) // (hidden * itemsize))
    return None


# --- the size schedule -------------------------------------------------------------------------------------------
DECODE = (1, 2, 4, 8, 16, 32, 64)  # decode batches
VERIFY = ((8, 3), (16, 3), (32, 3), (8, 7), (32, 7))  # (batch, draft): EAGLE-3 / MTP verify steps
PREFILL = (512, 2048)  # chunked-prefill chunks
QUICK_SIZES = (1, 8, 32, 512)  # the quick level's decode, verify and prefill sizes
DWELL = (1, 3, 1, 2, 5, 1, 8, 2)  # replays per visit to a size: engines change the batch most steps, hold it some


def verify_tokens() -> tuple[int, ...]:
    return tuple(b * (d + 1) for b, d in VERIFY)


def sizes(switches: Sequence[int], limit: int, quick: bool = False) -> tuple[int, ...]:
    """The token counts captured (one graph each, per lane): decode, verify and prefill sizes and, around each
    switch, the last count below it and the first above, all at most ``limit`` (pure)."""
    base = set(QUICK_SIZES) if quick else {*DECODE, *verify_tokens(), *PREFILL}
    near = {n for s in switches for n in (s, s + 1)}
    return tuple(sorted(n for n in base | near if 1 <= n <= limit))


def walk(counts: Sequence[int], switch: int | None, seed: int) -> Iterator[int]:
    """The token count of each replay, forever (pure, deterministic): visits alternate between the counts at or
    below ``switch`` and those above it (every count when one side is empty), each visit holding its count for
    :data:`DWELL` replays in turn; within a side a linear congruential sequence seeded by ``seed`` picks."""
    low = [n for n in counts if switch is not None and n <= switch]
    high = [n for n in counts if switch is not None and n > switch]
    sides = [low, high] if low and high else [list(counts)]
    state = (seed * 2654435761 + 1) % 2**31
    visit = 0
    while True:
        side = sides[visit % len(sides)]
        state = (state * 1103515245 + 12345) % 2**31
        count = side[(state >> 8) % len(side)]
        for _ in range(DWELL[visit % len(DWELL)]):
            yield count
        visit += 1


def offset(replay: int, rank: int) -> int:
    """What rank ``rank`` adds to every element of its input at replay ``replay`` (-2..2): with the pattern's -4..4
    every sum over up to 8 ranks stays an integer bf16 holds exactly."""
    return (replay * 7 + rank * 3) % 5 - 2


def offset_sum(replay: int, world: int) -> int:
    return sum(offset(replay, r) for r in range(world))


# --- levels ------------------------------------------------------------------------------------------------------
SOAK_ENV = "STACKPROBE_SOAK_S"  # seconds of replays per variant: a soak, no replay cap


@dataclass(frozen=True)
class Budget:
    """How long one variant replays: at most ``replays`` replays (0: no cap) and ``seconds`` of replaying, decided
    by rank 0's clock at each flush so every rank stops at the same replay."""

    label: str
    replays: int
    seconds: float


FULL = Budget("full", 4000, 4.0)
QUICK_BUDGET = Budget("quick", 300, 1.0)


def budget(env: Mapping[str, str] | None = None) -> Budget:
    """The budget this rank's environment asks for: a soak, the quick level, or the full level."""
    env = os.environ if env is None else env
    soak = env.get(SOAK_ENV, "").strip()
    if soak:
        try:
            seconds = float(soak)
        except ValueError:
            seconds = 0.0
        if seconds > 0:
            return Budget("soak", 0, seconds)
    return QUICK_BUDGET if env.get(LEVEL_ENV) == QUICK else FULL


# --- the backend protocol ------------------------------------------------------------------------------------------
SUM, SUM_RESIDUAL, BITS = "sum", "sum+residual", "bits"  # how an output is checked


@dataclass(frozen=True)
class Output:
    """One output of a replay: its buffer (the first ``size`` rows hold a replay's result at ``size`` tokens) and
    how it is checked: the exact sum, the exact sum plus the residual input, or bitwise (across ranks, and with
    the same output for the same input)."""

    tensor: Any
    check: str


@dataclass(frozen=True)
class Buffers:
    """A lane's buffers, ``max_tokens`` rows each: ``inp`` the engine writes before every replay (the backend's own
    buffer where it needs one), ``residual`` a fused backend's residual input, filled once by the engine."""

    inp: Any
    outputs: Mapping[str, Output]
    residual: Any = None


@dataclass(frozen=True)
class Setup:
    """What a factory is given: this rank, the communicator's group (NCCL with a GPU per rank, gloo otherwise) and
    a gloo group of the communicator's own for its host-side exchanges, the device, whether ranks share it, the
    variant's mode (a fusion's one-shot choice) and how many lanes it serves."""

    rank: int
    world: int
    device: Any
    group: Any
    cpu: Any
    shared: bool
    mode: str = ""
    lanes: int = 1
    log: Callable[[str], None] = lambda _: None


class Backend(Protocol):
    name: str
    takes_pdl: bool  # launch_with_pdl is a switch of its API (the variant's pdl param applies)

    def switches(self, hidden: int) -> tuple[int, ...]:
        """Token counts where it changes algorithm (the last count of the lower side)."""
        ...

    def prepare(self, max_tokens: int, hidden: int) -> int:
        """Set up workspaces and every lane's buffers; the most tokens it takes (<= ``max_tokens``). Collective."""
        ...

    def buffers(self, lane: int) -> Buffers: ...

    def capture(self, size: int, pdl: bool, lane: int) -> Callable[[], None]:
        """A replay of ``size`` tokens on ``lane``'s buffers: on a GPU one CUDA graph, captured once here. Called
        with the lane's stream current; collective."""
        ...

    def sync(self, deadline_s: float) -> None:
        """Wait for work it queued off the engine's streams (a CPU stand-in's lanes); raise ``_device.Hung``
        after ``deadline_s``. A GPU backend has none."""
        ...

    def facts(self) -> dict[str, Any]: ...


Factory = Callable[[Setup], Backend]
REGISTRY: dict[str, Factory] = {}


class Unavailable(Exception):
    """A factory's refusal before anything ran: the variant is ``skip`` with this code (``missing-package``,
    ``not-applicable``) and note."""

    def __init__(self, code: str, why: str) -> None:
        super().__init__(why)
        self.code = code


class SizeRefused(Exception):
    """A backend's refusal of one token count at capture (its policy has no configuration for it, or the engines
    send it to another backend at that size): when every rank refuses it, the count is left out of the walk and
    named in the evidence."""


def register(name: str, factory: Factory) -> None:
    REGISTRY[name] = factory


# --- one variant ---------------------------------------------------------------------------------------------------
SAMPLE_EVERY = 16  # a replay is checked when its number is a multiple of this, or it follows a size change
FLUSH = 64  # replays queued between two reads of the checks (and one exchange between ranks)
CAPTURE_WAIT_S = 60.0  # a capture's eager warm-up (a collective) must finish within this
# The set-up (process groups, the backend made, its workspace) must move on within this many replay deadlines
# (``stall_s``): the flashinfer modules a backend loads are built before the variant starts (ProbeSpec.loads), so
# the set-up compiles nothing and takes seconds; a rank stuck there (a rendezvous or a CUDA call that never
# returns) is a hang named in its phase, instead of running to the probe's whole timeout.
PREPARE_STALLS = 4


@dataclass
class Lane:
    """One stream of replays: the backend serving it, its lane index in that backend, its stream index."""

    backend: Backend
    index: int
    stream: int
    bufs: Buffers | None = None
    replays: dict[int, Callable[[], None]] = field(default_factory=dict)
    base: Any = None  # this rank's input pattern, max rows
    want: Any = None  # the exact sum over ranks of the patterns, max rows
    want_res: Any = None  # ... plus the residual input
    walk: Iterator[int] | None = None
    last: int = 0  # the count of its previous replay


@dataclass
class Sample:
    replay: int
    lane: int
    stream: int
    size: int
    total: int  # the sum of the ranks' offsets at this replay
    values: list[tuple[str, str, int, Any]] = field(default_factory=list)  # (output, kind, elements, 0-d tensor)


@dataclass
class Finding:
    """The first thing a flush found wrong: ``drift`` (a wrong sum, or an output that changed for the same
    input), ``divergent`` (ranks' bits differ), ``hang``, ``error``."""

    kind: str
    replay: int
    size: int
    stream: int
    detail: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Checks:
    """The sampled checks of every lane, queued behind the replays on the lane's stream and read at each flush."""

    def __init__(self, device: Any, hidden: int, limit: int) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.samples: list[Sample] = []
        self.first: dict[tuple[str, int, int, int], int] = {}  # (output, stream, size, total) -> digest seen first
        self.checked = 0
        col = torch.arange(max(hidden, 1), dtype=torch.int64, device=device)
        row = torch.arange(max(limit, 1), dtype=torch.int64, device=device)
        # weights below 2**16 and a row sum taken modulo a prime below 2**31: no int64 product overflows
        self.col_w = (col * 40503 + 97) % 65521 | 1
        self.row_w = (row * 2531 + 7) % 65521 | 1

    def digest(self, t: Any) -> Any:
        """A 0-d int64 tensor of ``t``'s bits, weighted by position (equal bits: equal digests), a float's zero
        taken as +0: a sum that cancels may carry either sign by the order of its additions, and the two are equal
        as numbers (as ``_agree.judge`` reads ranks' outputs). The fold works on the bits (-0 is the sign bit
        alone), since FP8 tensors have no arithmetic to add +0 with; the ``fnuz`` FP8 types have no -0 (that
        pattern is their NaN) and are left as they are."""
        torch = self.torch
        size = t.element_size()
        kind = {1: torch.int8, 2: torch.int16, 4: torch.int32}.get(size, torch.int64)
        bits = t.reshape(t.shape[0], -1).view(kind)
        if t.is_floating_point() and "fnuz" not in str(t.dtype):
            bits = torch.where(bits == torch.iinfo(kind).min, torch.zeros_like(bits), bits)
        rows = bits.to(torch.int64) & ((1 << (8 * size)) - 1) if size < 8 else bits.to(torch.int64)
        width = rows.shape[1]
        col_w = self.col_w[:width] if width <= self.col_w.numel() else self.col_w.repeat(
            (width + self.col_w.numel() - 1) // self.col_w.numel())[:width]
        return ((rows * col_w).sum(dim=1) % 2147483647 * self.row_w[: rows.shape[0]]).sum()

    def queue(self, lane: Lane, index: int, replay: int, size: int, total: int) -> None:
        torch = self.torch
        assert lane.bufs is not None
        sample = Sample(replay, index, lane.stream, size, total)
        for name, out in lane.bufs.outputs.items():
            got = out.tensor[:size]
            if out.check == BITS:
                sample.values.append((name, BITS, got.numel(), self.digest(got)))
                continue
            want = (lane.want_res if out.check == SUM_RESIDUAL else lane.want)[:size]
            sample.values.append((name, out.check, got.numel(), torch.ne(got, want + total).sum()))
        self.samples.append(sample)
        self.checked += 1

    def read(self) -> tuple[Finding | None, list[int]]:
        """After the lanes were waited for: the first local finding (a wrong sum, or a digest that changed for the
        same input) and every digest in order, for the exchange between ranks; the samples are consumed."""
        torch = self.torch
        values = [v for s in self.samples for _, _, _, v in s.values]
        numbers = torch.stack(values).cpu().tolist() if values else []
        found: Finding | None = None
        digests: list[int] = []
        at = 0
        for s in self.samples:
            for name, kind, numel, _ in s.values:
                got = int(numbers[at])
                at += 1
                if kind == BITS:
                    digests.append(got)
                    key = (name, s.stream, s.size, s.total)
                    seen = self.first.setdefault(key, got)
                    if seen != got and found is None:
                        found = Finding("drift", s.replay, s.size, s.stream,
                                        f"{name}: bits differ from the same input's output at an earlier replay")
                elif got and found is None:
                    found = Finding("drift", s.replay, s.size, s.stream,
                                    f"{name}: {got} of {numel} elements differ from the exact sum")
        self.samples = []
        return found, digests

    def divergence(self, everyone: list[list[int]], samples: list[tuple[int, int, int]]) -> Finding | None:
        """The first sampled replay whose digests differ between ranks (``samples``: (replay, size, stream) per
        digest, in order), or None."""
        for i, (replay, size, stream) in enumerate(samples):
            column = {d[i] for d in everyone if i < len(d)}
            if len(column) > 1:
                return Finding("divergent", replay, size, stream, "ranks' outputs differ bit for bit")
        return None


def _digest_places(samples: list[Sample]) -> list[tuple[int, int, int]]:
    return [(s.replay, s.size, s.stream) for s in samples for _, kind, _, _ in s.values if kind == BITS]


class Streams:
    """The lanes' streams on a GPU (``torch.cuda.Stream``), or nothing on CPU; ``on(i)`` makes stream i current."""

    def __init__(self, count: int, gpu: bool, device: Any) -> None:
        import torch

        self.torch = torch
        self.gpu = gpu
        self.streams = tuple(torch.cuda.Stream(device=device) for _ in range(count)) if gpu else ()

    def on(self, index: int) -> Any:
        return self.torch.cuda.stream(self.streams[index]) if self.gpu else contextlib.nullcontext()

    def wait(self, deadline_s: float) -> None:
        if self.gpu:
            _device.wait_device(deadline_s, self.streams)

    def mark(self) -> Any:
        """A marker of the work queued so far on the current stream (a CUDA event; None on CPU)."""
        if not self.gpu:
            return None
        event = self.torch.cuda.Event()
        event.record()
        return event

    def settle(self) -> None:
        """Every stream and the current one idle (once, after the set-up: buffers made on one stream are read on
        the others)."""
        if self.gpu:
            self.torch.cuda.synchronize()


@dataclass
class Clock:
    """Per token count, this rank's time of each timed replay (µs), from CUDA events or the host clock."""

    gpu: bool
    pending: list[tuple[int, Any, Any]] = field(default_factory=list)
    by_size: dict[int, list[float]] = field(default_factory=dict)

    def start(self) -> Any:
        if self.gpu:
            import torch

            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            return begin, end
        return time.perf_counter(), None

    def stop(self, size: int, mark: Any) -> None:
        begin, end = mark
        if self.gpu:
            end.record()
            self.pending.append((size, begin, end))
        else:
            self.by_size.setdefault(size, []).append((time.perf_counter() - begin) * 1e6)

    def settle(self) -> None:
        """Read the events of replays already waited for."""
        for size, begin, end in self.pending:
            self.by_size.setdefault(size, []).append(begin.elapsed_time(end) * 1000.0)
        self.pending = []


def latency(per_rank: list[dict[str, list[float]]]) -> tuple[dict[str, float], dict[str, float]]:
    """(p50, p99) µs per token count, the slowest rank per replay (pure; every rank replayed the same sequence)."""
    p50: dict[str, float] = {}
    p99: dict[str, float] = {}
    for size in sorted({k for r in per_rank for k in r}, key=int):
        runs = [r.get(size, []) for r in per_rank]
        n = min(len(x) for x in runs)
        if n == 0:
            continue
        slowest = [max(x[i] for x in runs) for i in range(n)]
        p50[size] = round(percentile(slowest, 50), 2)
        p99[size] = round(percentile(slowest, 99), 2)
    return p50, p99


@dataclass
class Run:
    """One variant as this rank runs it."""

    ctx: RankContext
    backend: str
    pattern: str
    pdl: bool
    mode: str
    stall_s: float
    hidden: int
    budget: Budget
    record: progress.Writer
    evidence: dict[str, Any] = field(default_factory=dict)
    replay: int = 0
    verified: int = 0
    refused: dict[int, str] = field(default_factory=dict)  # token count -> why the backend refused it

    @property
    def wait_s(self) -> float:
        """How long this rank waits for queued device work before it calls it hung: within the launcher's stall
        deadline, so the rank names the replay itself."""
        return max(1.0, self.stall_s / 2) if self.stall_s > 0 else 60.0

    def where(self, size: int, stream: int) -> str:
        return (f"replay {self.replay} ({size} tokens, PDL {'on' if self.pdl else 'off'}, stream {stream}"
                f"{f', mode {self.mode}' if self.mode else ''}; verified to replay {self.verified})")

    def result(self, status: str, note: str, code: str, metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        self.record.at("done", replay=self.replay, verified=self.verified, pdl=self.pdl)
        self.record.close()
        head = f"{self.backend} {self.pattern}" + (f" ({self.mode})" if self.mode else "")
        return outcome(status, f"{head}: {note}"[:600] if note else "", code, metrics,
                       {**self.evidence, "position": {"replay": self.replay, "verified": self.verified}})


def run(ctx: RankContext, *, backend: str, pattern: str, pdl: bool, mode: str = "", stall_s: float,
        hidden: int = HIDDEN, budget_: Budget | None = None) -> dict[str, Any]:
    """Run one variant on this rank and return its outcome (every rank returns the same one unless a rank hung):
    ``pass``; ``fail`` ``load-drift`` naming the replay and size whose output was wrong; ``partial``
    ``rank-divergent`` when ranks' bits differ; ``hang`` ``load-hang`` when queued work did not finish;
    ``fail`` ``load-setup-failed``/``load-capture-failed``/``load-replay-failed``; ``skip`` for a refusal."""
    import torch
    import torch.distributed as dist

    if pattern not in PATTERNS:
        return outcome("fail", f"unknown pattern {pattern!r}; known: {', '.join(PATTERNS)}", "probe-bug")
    if backend not in REGISTRY:
        return outcome("fail", f"unknown backend {backend!r}; known: {', '.join(sorted(REGISTRY))}", "probe-bug")
    named = {"backend": backend, "pattern": pattern, **({"mode": mode} if mode else {})}
    record = progress.Writer(ctx.workdir, ctx.rank, **named)
    record.at("prepare", pdl=pdl, stall_s=PREPARE_STALLS * stall_s)
    shared = ctx.variant.share_gpu
    gpu = ctx.device_index is not None and torch.cuda.is_available()
    kind = "gloo" if shared or not gpu else "nccl"
    device = _dist.init_dist(ctx, kind)
    exchange = _dist.cpu_group()
    comms = 2 if pattern == TWO_COMMS else 1
    groups = [dist.group.WORLD] + [dist.new_group(backend=kind) for _ in range(comms - 1)]
    cpus = [_dist.cpu_group() for _ in range(comms)]
    lanes_per = 2 if pattern == TWO_STREAMS else 1
    load = Run(ctx, backend, pattern, pdl, mode, stall_s, hidden, budget_ or budget(), record)
    load.evidence.update({"backend": backend, "pattern": pattern, "pdl": pdl, "mode": mode, "hidden": hidden,
                          "process_group": kind, "budget": dataclasses.asdict(load.budget),
                          "placement": ("shared: ranks on one GPU (checked, not timed)" if shared else
                                        "one GPU per rank" if gpu else "CPU (gloo)")})
    made: list[Backend] = []
    refused: Unavailable | None = None
    err = ""
    try:
        for g, c in zip(groups, cpus, strict=True):
            made.append(REGISTRY[backend](Setup(ctx.rank, ctx.world_size, device, g, c, shared, mode, lanes_per,
                                                ctx.log)))
    except Unavailable as exc:
        refused = exc
    except Exception as exc:
        err = _errors.error_tail(exc)
    states = _dist.gather_objects([refused.code, str(refused)] if refused else err or None, exchange)
    if any(isinstance(s, list) for s in states):
        code, why = next(s for s in states if isinstance(s, list))
        return load.result("skip", why, code)
    if any(states):
        return load.result("fail", f"set-up failed: {err or 'on a peer rank'}", "load-setup-failed")
    if pdl and not made[0].takes_pdl:
        return load.result("skip", "its API has no launch_with_pdl switch", "not-applicable")
    return _drive(load, made, lanes_per, device, gpu, shared, exchange)


def _drive(load: Run, made: list[Backend], lanes_per: int, device: Any, gpu: bool, shared: bool,
           exchange: Any) -> dict[str, Any]:
    world = load.ctx.world_size
    limit, err = 0, ""
    try:
        limit = min(b.prepare(max(PREFILL), load.hidden) for b in made)
    except Exception as exc:
        err = _errors.error_tail(exc)
    limits = _dist.gather_objects(None if err else limit, exchange)
    if any(x is None for x in limits):
        return load.result("fail", f"workspace failed: {err or 'on a peer rank'}", "load-setup-failed")
    limit = min(int(x) for x in limits)
    # two-streams: one backend, lanes 0 and 1 on streams 0 and 1; two-comms: two backends, lane 0 each, streams 0, 1
    lanes = [Lane(b, i, 0) for b in made for i in range(lanes_per)]
    for n, lane in enumerate(lanes):
        lane.stream = n
    switches = tuple(s for s in made[0].switches(load.hidden) if 1 <= s < limit)
    counts = sizes(switches, limit, load.budget.label == "quick")
    middle = switches[0] if switches else None
    load.evidence.update({"sizes": list(counts), "switches": list(switches), "walk_switch": middle,
                          "lanes": len(lanes), "facts": made[0].facts()})
    streams = Streams(len(lanes), gpu, device)
    found = _capture(load, lanes, counts, streams, device, exchange)
    if found is not None:
        return found
    if load.refused:
        counts = tuple(n for n in counts if n not in load.refused)
        load.evidence["refused_sizes"] = {str(n): why for n, why in sorted(load.refused.items())}
        if not counts:
            return load.result("fail", f"the backend refused every token count: {next(iter(load.refused.values()))}",
                               "load-setup-failed")
    for lane in lanes:
        lane.walk = walk(counts, middle, lane.stream + 1)
    clock = Clock(gpu) if load.pattern == REPLAY and not shared else None
    return _replay(load, lanes, streams, clock, Checks(device, load.hidden, limit), world, middle, exchange, made)


def _fill(lane: Lane, rank: int, world: int, hidden: int, limit: int, device: Any) -> None:
    """The lane's input pattern, its exact sums, and its residual input (filled once)."""
    assert lane.bufs is not None
    dtype = lane.bufs.inp.dtype
    seed = lane.stream + 1
    shape = (limit, hidden)
    lane.base = _data.pattern(shape, rank, seed, device, dtype)
    lane.want = _data.pattern_sum(shape, world, seed, device, dtype)
    lane.bufs.inp[:limit].copy_(lane.base)
    if lane.bufs.residual is not None:
        res = _data.pattern(shape, 0, seed + 1000, device, dtype)
        lane.bufs.residual[:limit].copy_(res)
        lane.want_res = lane.want + res


def _capture(load: Run, lanes: list[Lane], counts: tuple[int, ...], streams: Streams, device: Any,
             exchange: Any) -> dict[str, Any] | None:
    """One graph per lane and token count, every rank in the same order, each capture agreed on; an outcome when
    one failed (naming the count), else None."""
    limit = max(counts)
    for lane in lanes:
        err = ""
        try:
            lane.bufs = lane.backend.buffers(lane.index)
            with streams.on(lane.stream):
                _fill(lane, load.ctx.rank, load.ctx.world_size, load.hidden, limit, device)
        except Exception as exc:
            err = _errors.error_tail(exc)
        if not _dist.agree(not err, exchange):
            return load.result("fail", f"buffers failed: {err or 'on a peer rank'}", "load-setup-failed")
        for size in counts:
            if size in load.refused:
                continue
            load.record.at("capture", replay=0, size=size, stream=lane.stream, pdl=load.pdl, stall_s=load.stall_s)
            err, hung, refused = "", False, ""
            try:
                with streams.on(lane.stream):
                    lane.replays[size] = lane.backend.capture(size, load.pdl, lane.index)
                streams.wait(CAPTURE_WAIT_S)
            except SizeRefused as exc:
                refused = str(exc) or "refused"
            except _device.Hung as exc:
                err, hung = str(exc), True
            except Exception as exc:
                err = _errors.error_tail(exc)
            verdicts = _dist.gather_objects("hang" if hung else "error" if err else "refused" if refused else "ok",
                                            exchange)
            if set(verdicts) == {"refused"}:
                load.refused[size] = refused[:300]
                continue
            if any(v != "ok" for v in verdicts):
                what = f"capture of the {size}-token graph on stream {lane.stream} (PDL {'on' if load.pdl else 'off'})"
                if "hang" in verdicts:
                    return load.result("hang", f"{what} did not finish: {err or 'on a peer rank'}", "load-hang")
                why = err or (f"refused here ({refused}), taken on a peer rank" if refused else "on a peer rank")
                return load.result("fail", f"{what} failed: {why}", "load-capture-failed")
    load.evidence["graphs"] = len(lanes) * len(counts)
    return None


def _replay(load: Run, lanes: list[Lane], streams: Streams, clock: Clock | None, checks: Checks, world: int,
            switch: int | None, exchange: Any, made: list[Backend]) -> dict[str, Any]:
    """Replay until the budget is spent or something is found, flushing every :data:`FLUSH` replays."""
    import torch

    rank = load.ctx.rank
    streams.settle()
    started = time.monotonic()
    per_size: dict[int, int] = {}
    crossings = 0
    finding: Finding | None = None
    while True:
        places: list[tuple[int, int, int]] = []
        marks: list[tuple[int, int, int, Any]] = []  # (replay, size, stream, marker after it)
        err = ""
        size, stream = 0, 0
        try:
            for _ in range(max(1, FLUSH // len(lanes))):
                for i, lane in enumerate(lanes):
                    assert lane.walk is not None and lane.bufs is not None
                    size, stream = next(lane.walk), lane.stream
                    load.replay += 1
                    load.record.at("replay", replay=load.replay, size=size, stream=stream, pdl=load.pdl,
                                   verified=load.verified, stall_s=load.stall_s)
                    with streams.on(stream):
                        torch.add(lane.base[:size], offset(load.replay, rank), out=lane.bufs.inp[:size])
                        mark = clock.start() if clock is not None else None
                        lane.replays[size]()
                        if clock is not None:
                            clock.stop(size, mark)
                        marks.append((load.replay, size, stream, streams.mark()))
                        if lane.last != size or load.replay % SAMPLE_EVERY == 0:
                            checks.queue(lane, i, load.replay, size, offset_sum(load.replay, world))
                    if switch is not None and lane.last and (lane.last <= switch) != (size <= switch):
                        crossings += 1
                    lane.last = size
                    per_size[size] = per_size.get(size, 0) + 1
        except Exception as exc:
            err = _errors.error_tail(exc)
        load.record.at("flush", replay=load.replay, size=size, stream=stream, pdl=load.pdl, verified=load.verified,
                       stall_s=load.stall_s)
        try:
            streams.wait(load.wait_s)
            for b in made:
                b.sync(load.wait_s)
        except _device.Hung as exc:
            return _hung(load, exc, marks, per_size, size, stream, crossings)
        except Exception as exc:  # a CUDA error the wait surfaced: reported with the peers, as one raised above
            err = err or _errors.error_tail(exc)
        places = _digest_places(checks.samples)
        local: Finding | None = None
        digests: list[int] = []
        if not err:
            try:
                local, digests = checks.read()
                if clock is not None:
                    clock.settle()
            except Exception as exc:
                err = _errors.error_tail(exc)
        spent = time.monotonic() - started
        done = spent >= load.budget.seconds or (load.budget.replays and load.replay >= load.budget.replays)
        mine = {"error": err, "found": local.to_json() if local else None, "digests": digests, "stop": bool(done)}
        everyone = _dist.gather_objects(mine, exchange)
        errors = [(r, e["error"]) for r, e in enumerate(everyone) if e["error"]]
        if errors:
            r, e = errors[0]
            return load.result("fail", f"rank {r} failed at or before {load.where(size, stream)}: {e}",
                               "load-replay-failed", {"replays": load.replay})
        founds = [Finding(**e["found"]) for e in everyone if e["found"]]
        finding = min(founds, key=lambda f: f.replay) if founds else checks.divergence(
            [e["digests"] for e in everyone], places)
        if finding is not None:
            break
        load.verified = load.replay
        if any(e["stop"] for e in everyone):
            break
    return _summary(load, finding, clock, per_size, crossings, checks.checked, exchange, time.monotonic() - started)


def _hung(load: Run, exc: Exception, marks: list[tuple[int, int, int, Any]], per_size: dict[int, int], size: int,
          stream: int, crossings: int) -> dict[str, Any]:
    """The hang verdict of a flush that did not finish: the first replay whose marker never completed (``marks``:
    replay, size, stream, marker after it), else where the queue stood."""
    load.evidence.update(replays_by_size={str(k): v for k, v in sorted(per_size.items())})
    stuck = next((m for m in marks if m[3] is not None and not m[3].query()), None)
    if stuck is not None:
        load.replay, size, stream = stuck[0], stuck[1], stuck[2]
        what = f"{load.where(size, stream)} and the replays queued after it did not finish"
    else:
        what = f"queued replays did not finish: stopped at or before {load.where(size, stream)}"
    return load.result("hang", f"{what}; {exc}", "load-hang", {"replays": load.replay, "crossings": crossings})


def _summary(load: Run, finding: Finding | None, clock: Clock | None, per_size: dict[int, int], crossings: int,
             checked: int, exchange: Any, seconds: float) -> dict[str, Any]:
    metrics: dict[str, Any] = {"replays": load.replay, "crossings": crossings, "checked": checked,
                               "load_s": round(seconds, 3)}
    load.evidence.update(replays_by_size={str(k): v for k, v in sorted(per_size.items())})
    if clock is not None:
        mine = {str(k): v for k, v in clock.by_size.items()}
        p50, p99 = latency(_dist.gather_objects(mine, exchange))
        if p50:
            metrics.update(latency_p50_us=p50, latency_p99_us=p99)
    if finding is not None:
        where = (f"replay {finding.replay} ({finding.size} tokens, PDL {'on' if load.pdl else 'off'}, stream "
                 f"{finding.stream}{f', mode {load.mode}' if load.mode else ''})")
        load.evidence["finding"] = finding.to_json()
        if finding.kind == "divergent":
            return load.result("partial", f"{finding.detail} at {where}, after {load.verified} replays that agreed",
                               "rank-divergent", metrics)
        return load.result("fail", f"wrong output at {where}: {finding.detail}", "load-drift", metrics)
    metrics["headline"] = (f"{load.replay} replays, {len(per_size)} sizes, {crossings} switch crossings"
                           + ("" if "latency_p50_us" in metrics else ", checked, not timed"))
    return load.result("pass", "", "", metrics)
