"""What a pass costs and what fits a time budget (pure; host side).

A pass's cost is its timed GPU variants' seconds one after another (the GPU gate gives a variant that times
anything the GPUs alone), its GPU variants that time nothing (``inenv.probe.untimed``) spread over the
runner's rank cap (they hold the gate shared, side by side: their rank-seconds over the cap, never less than
the longest of them), and its CPU-only variants' seconds spread over the
run's ``jobs`` slots: the same arithmetic as the time left that a run shows while it goes
(checks.run.runprogress.RunView.left).

``checks run --budget MIN`` keeps the most informative variants that fit and leaves the rest as ``not-run
over-budget`` (a not-run is never reused, so a later run with a larger budget runs exactly those). How
informative a variant is, most first:

0. a variant with one rank, or a multi-rank one at the smallest world size of its probe and params: the quick
   answer, one per question;
1. a GPU per rank at the largest world size the host has: the tensor-parallel size the host would serve at;
2. a GPU per rank at the other world sizes;
3. ranks sharing GPUs (world sizes above the GPU count), smaller world sizes first;
4. sustained-load variants (a ``load`` parameter, or every variant of a probe that declares
   ``ProbeSpec.sustained``: the load probe): replays that answer one question deeply.

Within a tier the cheaper variant is kept first, so a budget answers as many questions as it can.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from checks.run import placement
from checks.run.plan import Decided, WorkItem
from checks.run.runner import OVER_BUDGET, rank_cap
from common.progress import duration
from inenv.probe import question, untimed
from inenv.status import Status

Key = tuple[str, str, str]
# Seconds assumed for a variant nothing has timed (no record here, on a host of its class or in the prior):
# the median GPU variant of the committed 1x and 2x H200 runs takes 4-9 s, so a guess of 10 s leans long.
UNTIMED_S = 10.0
TIER_NAMES = ("the quick answer", "a GPU per rank at the host's GPU count", "a GPU per rank at other world sizes",
              "ranks sharing GPUs", "sustained load")


def tier(item: WorkItem, smallest: Mapping[tuple[str, str, tuple[tuple[str, str], ...]], int], gpus: int) -> int:
    """How informative ``item`` is (0 most; the module docstring gives the order). ``smallest``: the smallest
    world size planned for each (cell, probe, params); ``gpus``: the host's GPU count."""
    v = item.variant
    if v.param("load") is not None or item.spec.sustained:
        return 4
    if v.ranks <= 1 or v.ranks == smallest.get(_group(item), v.ranks):
        return 0
    if v.share_gpu:
        return 3
    return 1 if v.ranks == gpus else 2


def _group(item: WorkItem) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    # one question at every world size, deep or shallow (``depth=setup``: a GPU per rank at another size)
    return (item.cell.cell_id, item.spec.id, question(item.variant))


def smallest_sizes(items: Iterable[WorkItem]) -> dict[tuple[str, str, tuple[tuple[str, str], ...]], int]:
    """The smallest world size planned to run for each (cell, probe, params)."""
    out: dict[tuple[str, str, tuple[tuple[str, str], ...]], int] = {}
    for it in items:
        if it.runs:
            g = _group(it)
            out[g] = min(out.get(g, it.variant.ranks), it.variant.ranks)
    return out


def seconds_of(item: WorkItem, expected: Mapping[Key, float | None]) -> float:
    """The expected seconds of ``item``: its estimate, else :data:`UNTIMED_S`."""
    got = expected.get(item.key)
    return UNTIMED_S if got is None else max(0.0, float(got))


def pass_seconds(items: Iterable[WorkItem], expected: Mapping[Key, float | None], jobs: int,
                 shared_ranks: int | None = None, gpus: int = 0, switched: bool = False,
                 islands: placement.Islands = ()) -> float:
    """The wall seconds the items that run should take (the module docstring's arithmetic; ``shared_ranks`` 0:
    --gpu-alone; ``switched``: the host's ``gpus`` are every pair joined by NVLink, or grouped behind PCIe switches
    (``islands``), so timed variants go side by side on disjoint GPU sets: checks.run.placement)."""
    lanes = Lanes(jobs, shared_ranks, gpus=gpus, switched=switched, islands=islands)
    for it in items:
        if it.runs:
            lanes.add(it, seconds_of(it, expected))
    return lanes.wall()


@dataclass
class Lanes:
    """Seconds on each lane of a pass: timed GPU variants (one at a time, or with ``gpus`` GPUs every pair joined by
    NVLink, side by side on disjoint GPU sets: :func:`placed_seconds`); GPU variants that time nothing, side by
    side with at most ``shared_ranks`` of their rank processes at once (the runner's rank cap,
    checks.run.runner.rank_cap; 0: --gpu-alone, one at a time like timed ones), so that lane lasts their
    rank-seconds over the cap, and never less than its longest variant; CPU-only variants, ``jobs`` at a time."""

    jobs: int
    shared_ranks: int | None = None  # None: this host's rank cap
    timed: float = 0.0
    shared: float = 0.0  # rank-seconds
    longest_shared: float = 0.0
    cpu: float = 0.0
    gpus: int = 0  # with ``switched``: the host's GPUs, over which timed variants are placed side by side
    switched: bool = False  # timed variants side by side (checks.run.placement.side_by_side)
    islands: placement.Islands = ()  # with ``switched`` on a PCIe host: its switch groups (placement.islands)
    # timed variants placed side by side: (how many GPUs, or which, they take: placement.wants; seconds)
    placed: tuple[tuple[int | tuple[int, ...], float], ...] = ()

    def __post_init__(self) -> None:
        if self.shared_ranks is None:
            self.shared_ranks = rank_cap()

    def add(self, item: WorkItem, seconds: float) -> None:
        self.put(seconds, item.spec.needs_gpu, item.spec.needs_gpu and untimed(item.spec, item.variant),
                 item.variant.ranks, placement.wants(item.variant, self.gpus) if self.lanes else 0)

    @property
    def lanes(self) -> bool:
        """Timed variants go side by side (not with --gpu-alone, ``shared_ranks`` 0: every variant alone)."""
        return self.switched and self.gpus > 1 and bool(self.shared_ranks)

    def put(self, seconds: float, gpu: bool, shared: bool, ranks: int = 1, takes: int | tuple[int, ...] = 0) -> None:
        """``seconds`` of a variant of ``ranks`` rank processes on the lane of a GPU variant (``shared``: one that
        times nothing) or a CPU-only one; ``takes``: how many GPUs a timed one is placed on, or which (0: the
        one-at-a-time lane; checks.run.placement.wants)."""
        if not gpu:
            self.cpu += seconds
        elif shared and self.shared_ranks:
            self.shared += seconds * max(1, ranks)
            self.longest_shared = max(self.longest_shared, seconds)
        elif takes and self.lanes:
            self.placed = (*self.placed, (takes if isinstance(takes, tuple) else min(takes, self.gpus), seconds))
        else:
            self.timed += seconds

    def timed_wall(self) -> float:
        """The seconds of the timed lane: those one at a time, then those placed side by side."""
        return self.timed + placed_seconds(self.placed, self.gpus, self.islands)

    def wall(self) -> float:
        side_by_side = max(self.shared / max(1, self.shared_ranks or 1), self.longest_shared) if self.shared else 0.0
        return self.timed_wall() + side_by_side + self.cpu / max(1, self.jobs)


def placed_seconds(placed: Iterable[tuple[int | tuple[int, ...], float]], gpus: int,
                   islands: placement.Islands = ()) -> float:
    """The wall seconds of timed variants (how many GPUs they take, or which: checks.run.placement.wants;
    seconds) placed side by side on ``gpus`` GPUs as the runner places them (checks.run.runner.pick with lanes,
    checks.run.placement.take): whenever GPUs are free, the costliest variant whose GPUs are free starts (ties:
    the one given first); when none can, the next to end frees its GPUs."""
    todo = sorted(((_on(n, gpus), s) for n, s in placed), key=lambda p: -p[1])
    now = 0.0
    running: list[tuple[float, tuple[int, ...]]] = []  # (ends at, GPUs)
    while todo or running:
        room = placement.free((held for _, held in running), gpus, islands)
        got = next(((k, on) for k, (n, _) in enumerate(todo)
                    if (on := placement.take(n, room.busy, gpus, islands, room.crossing)) is not None), None)
        if got is not None:
            k, on = got
            running.append((now + todo.pop(k)[1], on))
            continue
        running.sort()
        now = running.pop(0)[0]
    return now


def _on(takes: int | tuple[int, ...], gpus: int) -> int | tuple[int, ...]:
    """What a placed variant takes of ``gpus``: the GPUs it names when the host has them all, once each (else
    every GPU, as checks.run.placement.wants gives such a variant); else how many, within the host's."""
    if isinstance(takes, tuple):
        return takes if len(set(takes)) == len(takes) and all(0 <= g < gpus for g in takes) else gpus
    return min(max(1, takes), gpus)


@dataclass(frozen=True)
class Fitted:
    """A pass fitted into its budget: every item (those left out decided ``not-run over-budget``), the left-out
    ones, and the cost of the plan before and after."""

    items: list[WorkItem]
    left_out: list[WorkItem]
    planned_s: float
    kept_s: float
    budget_s: float
    tiers: Mapping[Key, int] = dataclasses.field(default_factory=dict)  # each item that would run: its tier


def fit(items: list[WorkItem], expected: Mapping[Key, float | None], budget_s: float, jobs: int,
        gpus: int, shared_ranks: int | None = None, switched: bool = False, islands: placement.Islands = ()) -> Fitted:
    """Keep the most informative variants whose cost fits ``budget_s`` (see the module docstring); the rest
    become decided not-run over-budget, with a note saying what was left and how to run it."""
    todo = [it for it in items if it.runs]
    smallest = smallest_sizes(todo)
    tiers = {it.key: tier(it, smallest, gpus) for it in todo}
    order = sorted(todo, key=lambda it: (tiers[it.key], seconds_of(it, expected), it.key))
    lanes = Lanes(jobs, shared_ranks, gpus=gpus, switched=switched, islands=islands)
    keep: set[Key] = set()
    for it in order:
        trial = dataclasses.replace(lanes)
        trial.add(it, seconds_of(it, expected))
        if trial.wall() <= budget_s:
            lanes = trial
            keep.add(it.key)
    out: list[WorkItem] = []
    left: list[WorkItem] = []
    for it in items:
        if it.runs and it.key not in keep:
            t = tiers[it.key]
            note = (f"left out to fit --budget {duration(budget_s)} (about {duration(seconds_of(it, expected))}; "
                    f"{TIER_NAMES[t]}, tier {t} of 4): a later run with a larger --budget, or without one, runs it")
            it = dataclasses.replace(it, decided=Decided(Status.NOT_RUN, OVER_BUDGET, note))
            left.append(it)
        out.append(it)
    planned_s = pass_seconds(items, expected, jobs, shared_ranks, gpus, switched, islands)
    return Fitted(out, left, planned_s, lanes.wall(), budget_s, tiers)


def cost_lines(items: Iterable[WorkItem], expected: Mapping[Key, float | None],
               untimed: Mapping[Key, bool] | None = None) -> list[str]:
    """The plan's cost per probe and world size, one line per probe, longest first:
    ``step: 6 variant(s), about 1m02s (2 ranks 3 x 12s; 4 ranks shared 3 x 9s)``. A world size with a variant
    nothing has timed says how many were guessed (``untimed``: key -> True for those)."""
    per: dict[str, dict[tuple[int, bool], list[float]]] = defaultdict(lambda: defaultdict(list))
    guessed: dict[str, int] = defaultdict(int)
    for it in items:
        if not it.runs:
            continue
        per[it.spec.id][(it.variant.ranks, it.variant.share_gpu)].append(seconds_of(it, expected))
        if untimed and untimed.get(it.key):
            guessed[it.spec.id] += 1
    lines = []
    for probe, sizes in sorted(per.items(), key=lambda kv: (-sum(sum(v) for v in kv[1].values()), kv[0])):
        total = sum(sum(v) for v in sizes.values())
        n = sum(len(v) for v in sizes.values())
        parts = [f"{r} rank{'s' if r > 1 else ''}{' shared' if shared else ''} {len(v)} x "
                 f"{duration(sum(v) / len(v))}" for (r, shared), v in sorted(sizes.items())]
        guess = f"; {guessed[probe]} never timed, guessed at {duration(UNTIMED_S)}" if guessed.get(probe) else ""
        lines.append(f"{probe}: {n} variant(s), about {duration(total)} ({'; '.join(parts)}{guess})")
    return lines


# A pass longer than this without --budget is told what --budget of this many minutes would keep and leave
HINT_MINUTES = 10


def budget_hint(items: list[WorkItem], expected: Mapping[Key, float | None], jobs: int, gpus: int,
                shared_ranks: int | None = None, switched: bool = False, islands: placement.Islands = (),
                minutes: int = HINT_MINUTES) -> str:
    """For a pass run without --budget: when its cost passes ``minutes``, one line saying what ``--budget
    minutes`` would run of it and leave out (:func:`fit`), so a host that has only that long knows what to
    type; "" when the pass fits."""
    if pass_seconds(items, expected, jobs, shared_ranks, gpus, switched, islands) <= minutes * 60.0:
        return ""  # fits: no fit to try
    fitted = fit(items, expected, minutes * 60.0, jobs, gpus, shared_ranks, switched, islands)
    if not fitted.left_out:
        return ""
    return (f"budget: none given, and this pass costs about {duration(fitted.planned_s)}; given {minutes} minutes "
            f"(`--budget {minutes}`, which counts the whole command) it would run about {duration(fitted.kept_s)} "
            f"and leave out {len(fitted.left_out)} variant(s) for a later run: {_left_out_what(fitted)}")


def _left_out_what(fitted: Fitted) -> str:
    """What ``fit`` left out, counted per probe and tier: ``load 11 (sustained load), step 2 (...)``."""
    counts: dict[tuple[str, int], int] = defaultdict(int)
    for it in fitted.left_out:
        counts[(it.spec.id, fitted.tiers.get(it.key, 0))] += 1
    return ", ".join(f"{probe} {n} ({TIER_NAMES[t]})" for (probe, t), n in sorted(counts.items()))


def left_out_lines(fitted: Fitted) -> list[str]:
    """What ``fit`` left out, per probe and tier, and how to run it."""
    if not fitted.left_out:
        return [f"budget: {duration(fitted.budget_s)} left, and this pass's cost, about {duration(fitted.planned_s)}, "
                "fits"]
    what = _left_out_what(fitted)
    probes = " ".join(f"--probe {p}" for p in sorted({it.spec.id for it in fitted.left_out}))
    return [f"budget: {duration(fitted.budget_s)} left, and this pass's cost, about {duration(fitted.planned_s)}, "
            f"does not fit; running about {duration(fitted.kept_s)} and leaving out {len(fitted.left_out)} "
            f"variant(s) as not-run over-budget: {what}",
            f"  to run them: the same command with a larger --budget or none, or `checks run {probes}` (what "
            "ran is reused, so only what was left out runs)"]
