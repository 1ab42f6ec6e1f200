"""What a variant should cost on a host that never ran it: a prior measured on our hosts, and the rules that
carry it to world sizes nobody measured (pure, but for reading the packaged prior; host side).

A variant's cost is keyed by its :class:`Shape`: probe, world size, whether its ranks share GPUs, the value of the
probe's build parameter (fi-jit's module) and whether it compiles that module here (loading a carried or cached
module and compiling one differ by minutes).
The prior (``prior.json`` beside this module, written by ``tools/make_prior.py`` from committed results) holds
the median seconds of each shape per class of host it was measured on, over the newest run that ran the shape's
feature on a host of that class: each run measured the code of its day (on 2x H200, ar-latency's variants took
18-23 s each in the runs of 2026-11-29/30 and 3.9-7.1 s on 2026-12-01, with ranks that rendezvous before taking the
GPUs), and a median over every run would price today's variants at an earlier code's cost. A skip decided before
the feature ran (a cell without the backend's package: 0.3 s) costs its check, not the variant, so a run whose
records of the shape are all skips stands only where no run ran it. A run whose host compiled a module (fi-jit
measured a compile) ran its other variants beside nvcc on the same cores (on a 1x H100, a local run compiling
trtllm_comm with a split compile priced the prior's 8-GPU figures a fifth above the carried run of the same code
minutes before), so a quiet run (one that compiled nothing) of the same probe code stands before it; an older
code's quiet run does not, and the compile shapes themselves come only from runs that compiled. Run ids begin
with their UTC time, so the newest is the greatest. For a shape not measured:

- ranks sharing GPUs time-slice them, so the cost scales with the world size from the nearest measured one:
  ``s(w) = s(w0) * w / w0``;
- a GPU per rank runs the ranks side by side; what grows is the rendezvous, the communicators and the ranks'
  start on the host's cores: ``s(w) = s(w0) * (1 + growth * (w - w0))``, ``growth`` per extra rank. No host of
  ours has had more than two GPUs, so ``growth`` is a stated assumption (:data:`RANK_GROWTH`) until records of
  more GPUs say otherwise, and every prediction that uses it says so.

Below every class's records, the prior may hold figures measured as one rank of a GPU-per-rank variant no host of
ours could run (``one_rank``: per GPU name, a shape's seconds; the step's full grid at 2, 4 and 8 ranks' widths,
benchmarks/bench_step_grid.py, with the links' time estimated per allreduce). They stand for a shape only where no
class's records predict it, and such a prediction says how it was made.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRIOR_PATH = Path(__file__).with_name("prior.json")
PRIOR_SCHEMA = 1
MAX_PRIOR_BYTES = 1 << 20
MAX_SECONDS = 2 * 86400.0
# Growth of a GPU-per-rank variant's cost per extra rank (an assumption: see the module docstring).
RANK_GROWTH = 0.05
CPU_CLASS = "no GPU"
ONE_RANK_KEY = "one_rank"
ONE_RANK_HOW = "one rank of such a variant measured, the links' time estimated"
PLACEMENTS = ("own", "shared", "setup")  # a GPU per rank; ranks sharing GPUs; a GPU per rank, set-up checks only


@dataclass(frozen=True, order=True)
class Shape:
    probe: str
    ranks: int
    shared: bool
    module: str = ""  # the probe's build parameter's value ("" when it has none)
    compiles: bool = False  # the variant compiles its module (else it loads one carried, cached or published)
    setup: bool = False  # a GPU per rank, set-up and one agreement case only (``depth=setup``)

    def label(self) -> str:
        placement = "shared" if self.shared else "setup" if self.setup else "own"
        return "|".join((self.probe, str(self.ranks), placement, self.module, *(("compile",) if self.compiles else ())))

    @classmethod
    def parse(cls, text: str) -> Shape | None:
        parts = text.split("|")
        if len(parts) not in (4, 5) or parts[2] not in PLACEMENTS or not parts[1].isdigit() or not parts[0] \
                or parts[4:] not in ([], ["compile"]):
            return None
        return cls(parts[0], int(parts[1]), parts[2] == "shared", parts[3], len(parts) == 5, parts[2] == "setup")


@dataclass(frozen=True)
class Prediction:
    seconds: float
    how: str  # "measured", or how it was carried from a measured shape


@dataclass(frozen=True)
class CostTable:
    """Median seconds per shape, measured on hosts of one class (``label``: "NVIDIA H200 x1", "no GPU")."""

    label: str
    seconds: Mapping[Shape, float]
    growth: float = RANK_GROWTH
    one_rank: bool = False  # measured as one rank of each variant, the links' time estimated (module docstring)

    def predict(self, shape: Shape) -> Prediction | None:
        """The shape's measured median, else one carried from the nearest measured world size of the same
        probe, module and placement (module docstring), else (set-up checks with a GPU per rank) the same checks
        by ranks sharing GPUs at that size, else None."""
        if (got := self.seconds.get(shape)) is not None:
            return Prediction(got, ONE_RANK_HOW if self.one_rank else "measured")
        like = (shape.probe, shape.shared, shape.setup, shape.module, shape.compiles)
        near = [s for s in self.seconds if (s.probe, s.shared, s.setup, s.module, s.compiles) == like]
        if not near and shape.setup and not shape.shared:
            # the same selection (set-up, one exact case per dtype); ranks that share a GPU wait for each other's
            # turns, so their time is at most what a GPU each takes
            shared = self.predict(Shape(shape.probe, shape.ranks, True, shape.module, shape.compiles))
            return None if shared is None else Prediction(
                shared.seconds, f"the same set-up checks by ranks sharing GPUs ({shared.how}): a GPU each takes "
                                "no longer")
        if not near:
            return None
        base = min(near, key=lambda s: (abs(s.ranks - shape.ranks), s.ranks))
        s0, w0, w = self.seconds[base], max(1, base.ranks), max(1, shape.ranks)
        if shape.shared:
            return Prediction(s0 * w / w0, f"scaled from {w0} ranks sharing GPUs by the world size")
        factor = max(0.1, 1.0 + self.growth * (w - w0))
        how = f" ({ONE_RANK_HOW})" if self.one_rank else ""
        return Prediction(s0 * factor, f"from {w0} ranks with a GPU each{how}, {self.growth:g} more per extra rank "
                                       "(an assumption: no host measured this world size)")


def host_label(gpu_name: str, gpu_count: int) -> str:
    return f"{gpu_name} x{gpu_count}" if gpu_count else CPU_CLASS


# (host class label, shape, seconds, id of the run that timed it, whether the feature ran: not a skip)
# (host class label, shape, seconds, run id, ran: not a skip, quiet: the run compiled nothing on its host, the
# probe's code hash)
Record = tuple[str, Shape, float, str, bool, bool, str]


def one_rank_label(gpu_name: str) -> str:
    return f"{gpu_name}, one rank of each"


def derive(records: Iterable[Record], one_rank: Mapping[str, Mapping[Shape, float]] | None = None) -> dict[str, Any]:
    """The prior's JSON from :data:`Record` records: per class and shape, the median over the newest run that ran
    the shape's feature (else the newest run), or over the newest quiet run of the same probe code as that one
    (the module docstring); ``one_rank``: per GPU name, shapes measured as one rank of each variant."""
    runs: dict[str, dict[Shape, dict[tuple[bool, str], list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list)))
    kind: dict[tuple[str, str], tuple[bool, str]] = {}  # (run id, probe) -> (quiet, probe code)
    for label, shape, seconds, run, ran, quiet, code in records:
        if math.isfinite(seconds) and 0 < seconds <= MAX_SECONDS:
            runs[label][shape][(ran, run)].append(seconds)
            kind[(run, shape.probe)] = (quiet, code)

    def chosen(shape: Shape, by_run: dict[tuple[bool, str], list[float]]) -> list[float]:
        # (ran, run id) orders the runs that ran the feature after every run of skips, each group newest last
        ran, newest = max(by_run)
        code = kind[(newest, shape.probe)][1]
        quiet = [k for k in by_run if k[0] == ran and kind[(k[1], shape.probe)] == (True, code)]
        return by_run[max(quiet)] if quiet else by_run[(ran, newest)]

    per = {label: {shape: chosen(shape, by_run) for shape, by_run in shapes.items()}
           for label, shapes in runs.items()}
    floors = {gpu: {s.label(): round(v, 3) for s, v in sorted(shapes.items())
                    if math.isfinite(v) and 0 < v <= MAX_SECONDS}
              for gpu, shapes in sorted((one_rank or {}).items())}
    return {"schema": PRIOR_SCHEMA, "rank_growth": RANK_GROWTH,
            "classes": {label: {s.label(): round(statistics.median_low(sorted(v)), 3)
                                for s, v in sorted(shapes.items())}
                        for label, shapes in sorted(per.items())},
            **({ONE_RANK_KEY: {gpu: shapes for gpu, shapes in floors.items() if shapes}} if floors else {})}


def parse_prior(data: Any) -> dict[str, CostTable]:
    """The tables of a prior's JSON; what does not fit its grammar is left out (the file is data)."""
    if not isinstance(data, dict) or data.get("schema") != PRIOR_SCHEMA or not isinstance(data.get("classes"), dict):
        return {}
    growth = data.get("rank_growth")
    growth = float(growth) if isinstance(growth, (int, float)) and not isinstance(growth, bool) \
        and 0 <= growth <= 1 else RANK_GROWTH
    out: dict[str, CostTable] = {}
    floors = data.get(ONE_RANK_KEY)
    for section, one_rank in ((data["classes"], False), (floors if isinstance(floors, dict) else {}, True)):
        for name, shapes in section.items():
            if not isinstance(name, str) or not isinstance(shapes, dict) or len(name) > 200:
                continue
            table = {}
            for text, seconds in shapes.items():
                shape = Shape.parse(text) if isinstance(text, str) else None
                if shape is not None and isinstance(seconds, (int, float)) and not isinstance(seconds, bool) \
                        and math.isfinite(seconds) and 0 < seconds <= MAX_SECONDS:
                    table[shape] = float(seconds)
            label = one_rank_label(name) if one_rank else name
            if table and label not in out:
                out[label] = CostTable(label, table, growth, one_rank)
    return out


def load_prior(path: Path = PRIOR_PATH) -> dict[str, CostTable]:
    """The packaged prior; {} when it is missing, oversized or unreadable."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_PRIOR_BYTES + 1)
        return parse_prior(json.loads(raw)) if len(raw) <= MAX_PRIOR_BYTES else {}
    except (OSError, ValueError):
        return {}


def tables_for(tables: Mapping[str, CostTable], gpu_name: str, gpu_count: int) -> list[CostTable]:
    """The tables that may stand for a host, best first: its own class, then (a GPU host) the other GPU
    classes, the nearest GPU count first; a host without a GPU takes only CPU records."""
    own = host_label(gpu_name, gpu_count)
    if not gpu_count:
        return [tables[own]] if own in tables else []

    def count(label: str) -> int:
        tail = label.rpartition(" x")[2]
        return int(tail) if tail.isdigit() else 0

    others = sorted((t for label, t in tables.items() if label not in (own, CPU_CLASS) and not t.one_rank),
                    key=lambda t: (abs(count(t.label) - gpu_count), t.label))
    # one rank's figures only below every class's records: this GPU's first
    floors = sorted((t for t in tables.values() if t.one_rank),
                    key=lambda t: (t.label != one_rank_label(gpu_name), t.label))
    return ([tables[own]] if own in tables else []) + others + floors


def at_level(tables: Iterable[CostTable], quick: bool) -> list[CostTable]:
    """The tables that may stand for a pass: one rank's figures are the full level's grid, so a quick pass (one shape
    and one case of it) is not costed from them."""
    return [t for t in tables if not (quick and t.one_rank)]


def predict(tables: Iterable[CostTable], shape: Shape) -> tuple[Prediction, str] | None:
    """The first table's prediction for ``shape`` (tables best first) and that table's label."""
    for t in tables:
        if (got := t.predict(shape)) is not None:
            return got, t.label
    return None
