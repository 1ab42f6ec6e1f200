"""What a `checks run` says while it runs (host side): which cell of how many, which variant is running and
for how long, how many are done, and the time left estimated from the durations this host recorded before.

The text is made here from plain values (the clock is an argument), so it can be tested without running
anything; the command line decides where it goes (one line per event, or a live bar on a terminal).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from checks.results.result import ProbeResult
from checks.results.store import read_file
from checks.run.plan import WorkItem
from common.progress import Estimate, duration, estimate
from inenv.kit import _compile_cache as cc
from inenv.kit import _flashinfer as fi

Key = tuple[str, str, str]


@dataclass(frozen=True)
class Learned:
    """One recorded duration and what it was learnt from: the backend that ran it (the run manifest's
    ``executor``: docker, venv, local) and how it ended (status and reason code): a compile that failed at
    once in an image without nvcc says nothing about a full compile with the host's nvcc."""

    seconds: float
    backend: str
    outcome: str


History = dict[Key, dict[str, Learned]]  # per (cell, probe, variant), per backend: the newest record


def _backend(jsonl: Path) -> str:
    """The executor a results file's run manifest names; "" when the manifest is missing or unreadable."""
    try:
        data = json.loads(jsonl.with_suffix("").with_suffix(".manifest.json").read_text())
    except (OSError, ValueError):
        return ""
    value = data.get("executor") if isinstance(data, dict) else None
    return value if isinstance(value, str) else ""


def outcome_of(result: ProbeResult) -> str:
    v = result.verdict
    return f"{v.status} {v.reason_code}".strip()


def learned(folder: Path) -> History:
    """Every (cell, probe, variant) this host's results folder timed, per backend, newest run last wins.
    A result carried from an earlier run (evidence ``reused_from``) timed nothing and is left out."""
    out: History = {}
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        backend = _backend(path)
        for r in read_file(path)[0]:
            if r.verdict.duration_s > 0 and not r.verdict.evidence.get("reused_from"):
                out.setdefault(r.key, {})[backend] = Learned(r.verdict.duration_s, backend, outcome_of(r))
    return out


@dataclass(frozen=True)
class Expected:
    """How long a variant should take, and what that was learnt from."""

    seconds: float | None
    own: bool = False  # this very variant's record on this backend (else its probe's and module's, or nothing)
    outcome: str = ""  # how the run it was learnt from ended
    backend: str = ""
    module: str = ""  # the value of the probe's build parameter it was learnt for (fi-jit: the module)

    def text(self) -> str:
        if self.seconds is None:
            return "no earlier run"
        took = duration(self.seconds)
        how = " ".join(p for p in (self.outcome, f"on {self.backend}" if self.backend else "") if p)
        if self.own:
            return f"last time {took}" + (f" ({how})" if how else "")
        what = " ".join(p for p in ("its probe's", self.module) if p)
        return f"about {took} by {what} record" + (f" ({how})" if how else "")


def _module(item: WorkItem) -> str:
    name = item.spec.build_param
    return (item.variant.param(name) or "") if name else ""


def expected_durations(items: Iterable[WorkItem], history: History, backend: str = "") -> dict[Key, Expected]:
    """For each item that will run (not decided in advance, not reused): its own newest record on this
    backend; else the mean of what its probe took for the same module on this backend, from the runs of the
    one outcome that took longest (a fail-fast outcome does not stand for a full compile); else nothing. A
    record from another backend is never borrowed: there the same variant can do other work."""
    siblings: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    items = list(items)
    build_param = {it.spec.id: it.spec.build_param for it in items}
    for (_, probe, variant), per_backend in history.items():
        got = per_backend.get(backend)
        if got is not None:
            siblings[(probe, _param_of(variant, build_param.get(probe, "")))][got.outcome].append(got.seconds)
    out: dict[Key, Expected] = {}
    for it in items:
        if not it.runs:
            continue
        own = history.get(it.key, {}).get(backend)
        if own is not None:
            out[it.key] = Expected(own.seconds, True, own.outcome, backend)
            continue
        module = _module(it)
        groups = siblings.get((it.spec.id, module), {})
        if groups:
            outcome, took = max(groups.items(), key=lambda kv: sum(kv[1]) / len(kv[1]))
            out[it.key] = Expected(sum(took) / len(took), False, outcome, backend, module)
        else:
            out[it.key] = Expected(None)
    return out


def start_costs(items: Iterable[WorkItem], expected: Mapping[Key, Expected],
                declared: Mapping[str, Mapping[str, float]]) -> dict[Key, float]:
    """How long each item should take, for starting the longest first: what an earlier run took (its own
    record, else its probe's for the same build), else what its probe declares for that build (``declared``:
    probe id -> build parameter value -> seconds, from ``BUILD_COST``), else 0."""
    out: dict[Key, float] = {}
    for it in items:
        learnt = expected.get(it.key)
        if learnt is not None and learnt.seconds is not None:
            out[it.key] = learnt.seconds
        else:
            out[it.key] = declared.get(it.spec.id, {}).get(_module(it), 0.0)
    return out


def compile_note(compile_cache: Path | None) -> Callable[[WorkItem], str]:
    """For a GPU variant that loads flashinfer comm modules fi-jit has not published for its cell (in the
    compile cache ``compile_cache``, as the cell's ranks see it), ``; compiles X in its turn (...)``; else ""."""

    def note(item: WorkItem) -> str:
        release = item.cell.versions.get("flashinfer") or ""
        if not item.spec.needs_gpu or not release or release == "none":
            return ""
        wanted = fi.modules_for(item.spec.id, dict(item.variant.params))
        env = {cc.ENV: str(compile_cache or ""), cc.CELL_ENV: item.cell.cell_id}
        missing = fi.unpublished(wanted, release, env)
        return (f"; compiles {', '.join(missing)} in its turn: fi-jit has not built it for this GPU here"
                if missing else "")

    return note


def _param_of(variant_key: str, name: str) -> str:
    """The value of parameter ``name`` in a recorded variant key (``ranks=1,module=vllm_comm,arch=local``);
    "" when the probe has no build parameter or the key lacks it."""
    if not name:
        return ""
    return dict(p.partition("=")[::2] for p in variant_key.split(",")).get(name, "")

@dataclass
class RunView:
    """Counts and text for one run's progress. ``items``: what this invocation will go through (variants a
    --resume found recorded are left out by the caller; reused ones are in it, done as the run starts)."""

    items: list[WorkItem]
    expected: dict[Key, Expected]
    done: set[Key] = field(default_factory=set)
    jobs: int = 1  # CPU-only variants of different cells run this many at once
    compile_note: Callable[[WorkItem], str] | None = None  # what a GPU variant will compile in its turn
    cells: list[str] = field(init=False)
    running: set[Key] = field(default_factory=set)
    _shown_cells: set[str] = field(default_factory=set)
    _gpu: set[Key] = field(init=False)

    def __post_init__(self) -> None:
        self.cells = list(dict.fromkeys(it.cell.cell_id for it in self.items))
        self._gpu = {it.key for it in self.items if it.spec.needs_gpu}

    @property
    def total(self) -> int:
        return len(self.items)

    def finish(self, item: WorkItem) -> None:
        self.running.discard(item.key)
        self.done.add(item.key)

    def left(self, running: Key | None = None, elapsed: float = 0.0) -> Estimate:
        """Time left: every item still to run; the running one counts what it has left of its record. GPU
        variants run one at a time; the CPU-only ones share ``jobs`` slots, so their part is divided."""
        gpu, cpu = [], []
        for key, exp in self.expected.items():
            if key in self.done:
                continue
            seconds = exp.seconds
            if key == running and seconds is not None:
                seconds = max(0.0, seconds - elapsed)
            (gpu if key in self._gpu else cpu).append(seconds)
        a, b = estimate(gpu), estimate(cpu)
        return Estimate(a.seconds + b.seconds / max(1, self.jobs), a.unknown + b.unknown, a.steps + b.steps)

    def opening(self) -> str:
        """Said once before the first variant: how many will run and how long that should take."""
        n = len(self.expected)
        if not n:
            how = "reused or decided" if any(it.reused is not None for it in self.items) else "decided"
            return f"nothing to run: all {self.total} variant(s) are {how} without running"
        est = self.left()
        where = "from the durations this host recorded" if est.unknown < n else "no earlier run on this host"
        return f"to run: {n} of {self.total} variant(s), {est.text()} ({where})"

    def cell_header(self, item: WorkItem) -> str | None:
        """``cell 2 of 5 <id>: 6 to run, 23 decided without running`` the first time a cell comes up."""
        cid = item.cell.cell_id
        if cid in self._shown_cells:
            return None
        self._shown_cells.add(cid)
        mine = [it for it in self.items if it.cell.cell_id == cid]
        run = sum(1 for it in mine if it.runs)
        reused = sum(1 for it in mine if it.reused is not None)
        decided = len(mine) - run - reused
        parts = [f"{run} to run" if run else "nothing to run"]
        if reused:
            parts.append(f"{reused} unchanged (reused)")
        if decided:
            parts.append(f"{decided} decided without running")
        return f"cell {self.cells.index(cid) + 1} of {len(self.cells)} {cid}: {', '.join(parts)}"

    def _last(self, item: WorkItem) -> str:
        return self.expected.get(item.key, Expected(None)).text()

    def label(self, item: WorkItem) -> str:
        return f"{item.cell.cell_id} {item.spec.id} {item.variant.key}"

    def start_line(self, item: WorkItem) -> str:
        """Said when ``item`` starts; it counts as running from here until :meth:`finish`. A GPU variant that
        will compile a flashinfer module in its own turn (fi-jit has not published it) says so."""
        self.running.add(item.key)
        n = len(self.done) + len(self.running)
        compiles = self.compile_note(item) if self.compile_note else ""
        return f"  start {self.label(item)} ({n} of {self.total}; {self._last(item)}){compiles}"

    def tick_line(self, item: WorkItem, elapsed: float) -> str:
        left = self.left(item.key, elapsed)
        return (f"running {self.label(item)}: {duration(elapsed)} so far ({self._last(item)}); "
                f"{len(self.done)} of {self.total} done, {left.text()} left")

    def result_line(self, item: WorkItem, result: ProbeResult) -> str:
        """One line per variant that ran; the caller marks the item done first."""
        v = result.verdict
        reason = f" {v.reason_code}" if v.reason_code else ""
        left = self.left()
        return (f"{v.status:>7} {self.label(item)} {duration(v.duration_s)}{reason} · "
                f"{len(self.done)} of {self.total} done" + (f", {left.text()} left" if left.steps else ""))
