"""What a `checks run` says while it runs (host side): which cell of how many, which variant is running and
for how long, how many are done, and the time left estimated from the durations this host recorded before.

A variant this host never timed is estimated from what hosts of its class recorded under the same results
root (:func:`lent`): the same GPU model and GPU count, or for a host without a GPU any host without one, its
compile times scaled by cores (theirs / ours: a compile spreads over the cores it has). This host's own
records always come first, and each result of the run itself is learnt as it arrives (:meth:`RunView.finish`),
so its own measurements replace borrowed estimates for the variants still to run.

The text is made here from plain values (the clock is an argument), so it can be tested without running
anything; the command line decides where it goes (one line per event, or a live bar on a terminal).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checks.results import ids
from checks.results.result import ProbeResult
from checks.results.store import read_file, read_manifest
from checks.run.cost import model as costmodel
from checks.run.cost.budget import Lanes
from checks.run.plan import WorkItem, not_carried
from common.progress import Estimate, duration
from inenv import kit
from inenv.probe import key_parts, untimed
from inenv.status import Status

Key = tuple[str, str, str]

MAX_LENT_S = 2 * 86400.0  # a borrowed duration longer than two days is no duration: left out
MAX_LENT_FILE = 64 << 20  # bytes: another host's results file larger than this is not read
MAX_LENT_RUNS = 64  # the newest runs of each other host that are read
MAX_GPUS = 1024
MAX_CORES = 1 << 16
MAX_GPU_NAME = 200


@dataclass(frozen=True)
class Learned:
    """One recorded duration and what it was learnt from: the backend that ran it (the run manifest's
    ``executor``: docker, venv, local) and how it ended (status and reason code): a compile that failed at
    once in an image without nvcc says nothing about a full compile with the host's nvcc. A record borrowed
    from another host names it (``host``) and why it stands for this one (``basis``); its seconds are already
    scaled to this host."""

    seconds: float
    backend: str
    outcome: str
    host: str = ""  # "" for this host's own record
    basis: str = ""  # "same GPU model and count", "a CPU host of 16 cores, scaled to 2"


History = dict[Key, dict[str, Learned]]  # per (cell, probe, variant), per backend: the newest record
# the verdicts of a variant that did not run its feature: their seconds say nothing of a sibling's run
NOTHING_RAN = frozenset({Status.SKIP.value, Status.NOT_RUN.value})


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


def timed(result: ProbeResult) -> bool:
    """Whether ``result`` measured its variant: it took time, and was not carried from an earlier run
    (evidence ``reused_from``)."""
    return result.verdict.duration_s > 0 and not result.verdict.evidence.get("reused_from")


def learned(folder: Path) -> History:
    """Every (cell, probe, variant) this host's results folder timed, per backend, newest run last wins.
    A result carried from an earlier run (evidence ``reused_from``) timed nothing and is left out."""
    out: History = {}
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        backend = _backend(path)
        for r in read_file(path)[0]:
            if timed(r):
                out.setdefault(r.key, {})[backend] = Learned(r.verdict.duration_s, backend, outcome_of(r))
    return out


@dataclass(frozen=True)
class HostClass:
    """What decides whether one host's durations stand for another's: the GPU model and count, and the
    number of cores (0: not known)."""

    gpu_name: str  # "" on a host without a GPU
    gpu_count: int
    cores: int = 0


def _count(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def host_class(facts: Any) -> HostClass | None:
    """The class of the host whose facts (``checks.results.hostfacts.collect``, as a run manifest records
    them) are ``facts``; None when they do not say (missing, of the wrong type or out of range)."""
    if not isinstance(facts, Mapping):
        return None
    count, name, cores = facts.get("gpu_count"), facts.get("gpu_name"), facts.get("cpu_count")
    if not _count(count, 0, MAX_GPUS):
        return None
    if count and not (isinstance(name, str) and 0 < len(name) <= MAX_GPU_NAME):
        return None
    return HostClass(name if count else "", count, cores if _count(cores, 1, MAX_CORES) else 0)


def basis(theirs: HostClass, ours: HostClass, scaled: bool) -> str | None:
    """Why a host of class ``theirs`` stands for one of class ``ours`` (``scaled``: its durations are scaled
    by cores), or None when it does not: a GPU host stands for one of the same GPU model and count, a host
    without a GPU for another without one when both say how many cores they have."""
    if ours.gpu_count:
        same = theirs.gpu_count == ours.gpu_count and theirs.gpu_name == ours.gpu_name
        return "same GPU model and count" if same else None
    if theirs.gpu_count or not theirs.cores or not ours.cores:
        return None
    if not scaled:
        return f"a CPU host of {theirs.cores} cores"
    if theirs.cores == ours.cores:
        return f"a CPU host of {theirs.cores} cores, as this one"
    return f"a CPU host of {theirs.cores} cores, scaled to {ours.cores}"


def _sane(seconds: float) -> bool:
    return math.isfinite(seconds) and 0 < seconds <= MAX_LENT_S


def _dirs(root: Path, own: str) -> Iterator[tuple[str, Path]]:
    """The host folders under ``root`` but ``own``, by name: real folders (not links) named as host ids."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        try:
            is_dir = e.is_dir(follow_symlinks=False)
        except OSError:
            continue
        if is_dir and e.name != own and ids.valid("host id", e.name):
            yield e.name, Path(e.path)


def _runs(folder: Path) -> list[tuple[str, Path]]:
    """(run id, results file) of the newest MAX_LENT_RUNS runs in a host folder: regular files named as runs,
    of at most MAX_LENT_FILE bytes."""
    found = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for e in entries:
        run_id = e.name[: -len(".jsonl")] if e.name.endswith(".jsonl") else ""
        if not ids.valid("run id", run_id):
            continue
        try:
            ok = e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_size <= MAX_LENT_FILE
        except OSError:
            continue
        if ok:
            found.append((run_id, Path(e.path)))
    return sorted(found)[-MAX_LENT_RUNS:]


def lent(root: Path, own: str, facts: Mapping[str, Any], compiles: Iterable[str] = ()) -> History:
    """What the other hosts under the results root ``root`` (one folder per host id; ``own``, this host's,
    left out) timed, per (cell, probe, variant) and backend, from the runs of hosts of this host's class
    (``facts``: this host's facts; each run's class from its manifest's): of each host its newest run's
    record, and of several hosts the :func:`median` one. The durations of probes in ``compiles`` (those with
    a build parameter: their time is compiling) recorded on a CPU host are scaled by cores, theirs / ours;
    every other duration is taken as it was recorded.

    The files are other machines' and read as untrusted: a folder or file that is a link, a name outside its
    grammar, an unreadable or oversized file, a manifest without the host's facts or its executor, and a
    duration that is not a finite number of seconds up to MAX_LENT_S are left out, never an error."""
    ours = host_class(facts)
    if ours is None:
        return {}
    compiles = frozenset(compiles)
    newest: dict[tuple[Key, str], dict[str, tuple[str, Learned]]] = {}  # (key, backend) -> host -> newest
    for host, folder in _dirs(root, own):
        for run_id, path in _runs(folder):
            made = read_manifest(path.with_name(f"{run_id}.manifest.json"))[0] or {}
            theirs, backend = host_class(made.get("facts")), made.get("executor")
            if theirs is None or basis(theirs, ours, False) is None or not isinstance(backend, str) or not backend:
                continue
            for r in read_file(path)[0]:
                scaled = r.probe_id in compiles and not ours.gpu_count
                why = basis(theirs, ours, scaled) or ""
                seconds = r.verdict.duration_s * (theirs.cores / ours.cores if scaled else 1.0)
                if timed(r) and _sane(r.verdict.duration_s) and _sane(seconds):
                    newest.setdefault((r.key, backend), {})[host] = (run_id, Learned(seconds, backend,
                                                                                     outcome_of(r), host, why))
    out: History = {}
    for (key, backend), per_host in newest.items():
        out.setdefault(key, {})[backend] = median(got for _, got in per_host.values())
    return out


def median(records: Iterable[Learned]) -> Learned:
    """The record in the middle by seconds (of an even count, the shorter of the middle two; of equal
    seconds, the first host by id), so one host's outlier, a slow machine or older code, moves nothing."""
    ordered = sorted(records, key=lambda g: (g.seconds, g.host))
    return ordered[(len(ordered) - 1) // 2]


@dataclass(frozen=True)
class Expected:
    """How long a variant should take, and what that was learnt from."""

    seconds: float | None
    own: bool = False  # this very variant's record on this backend (else its probe's and module's, or nothing)
    outcome: str = ""  # how the run it was learnt from ended
    backend: str = ""
    module: str = ""  # the value of the probe's build parameter it was learnt for (fi-jit: the module)
    host: str = ""  # the other host(s) whose records it was borrowed from; "" for this host's
    basis: str = ""  # why those hosts stand for this one
    prior: str = ""  # the class of hosts whose packaged prior (checks.run.cost.model) it comes from
    lacking: str = ""  # a distribution the variant needs that its cell lacks: it skips at once

    def text(self) -> str:
        if self.seconds is None:
            return "no earlier run"
        took = duration(self.seconds)
        if self.lacking:
            return f"about {took}: {self.lacking} is not installed in its cell, so it skips at once"
        if self.prior:
            return f"about {took} by the prior measured on {self.prior}" + (f" ({self.basis})" if self.basis
                                                                           else "")
        how = " ".join(p for p in (self.outcome, f"on {self.backend}" if self.backend else "") if p)
        if self.host:
            how = "; ".join(p for p in (how, self.basis) if p)
            if self.own:
                return f"about {took} by {self.host}'s record" + (f" ({how})" if how else "")
            what = " ".join(p for p in ("its probe's", self.module) if p)
            return f"about {took} by {what} record on {self.host}" + (f" ({how})" if how else "")
        if self.own:
            return f"last time {took}" + (f" ({how})" if how else "")
        what = " ".join(p for p in ("its probe's", self.module) if p)
        return f"about {took} by {what} record" + (f" ({how})" if how else "")


def _module(item: WorkItem) -> str:
    name = item.spec.build_param
    return (item.variant.param(name) or "") if name else ""


# What a variant that skips at once takes: its worker's start and the probe's first check (0.1-3.3 s on the
# project's CPU machine and GPU hosts, the first variant of a container the slowest)
SKIP_S = 1.0


def expected_durations(items: Iterable[WorkItem], history: History, backend: str = "",
                       lent: History | None = None, prior: Sequence[costmodel.CostTable] = (),
                       compiling: Collection[Key] = (),
                       lacking: Mapping[Key, str] | None = None) -> dict[Key, Expected]:
    """For each item that will run (not decided in advance, not reused): its own newest record on this
    backend; else the mean of what its probe took for the same module at the same world size and placement on
    this backend, from the runs of the one outcome that took longest (a fail-fast outcome does not stand for a
    full compile); else the same two from what hosts of its class recorded (``lent``, from :func:`lent`), at
    most the item's timeout; else the packaged prior's prediction for its shape (``prior``: the tables that may
    stand for this host, best first; checks.run.cost.model; ``compiling``: the items that will compile their
    module here, costed as compiles), at most the item's timeout; else the same module's records at another
    world size (this host's, then its class's); else nothing. A record from another backend is never
    borrowed: there the same variant can do other work. An item in ``lacking`` (a distribution it needs that its
    cell lacks) without a record of its own is costed as the skip it will be (:data:`SKIP_S`)."""
    items = [it for it in items if it.runs]
    # what ran at the same world size and placement (this host's, then its class's), then the prior for the
    # shape, and only then a sibling of another size: 8 ranks sharing a GPU take several times what 2 do
    mine, mine_any = _from(items, history, backend)
    theirs, theirs_any = _from(items, lent, backend) if lent else ({}, {})

    def recorded(it: WorkItem, found: Mapping[Key, Expected], borrowed: bool) -> Expected | None:
        """``found``'s estimate of ``it``; a borrowed one at most the item's timeout."""
        other = found.get(it.key)
        if other is None or other.seconds is None:
            return None
        cap = it.timeout_s if borrowed and it.timeout_s > 0 else other.seconds
        return Expected(min(other.seconds, cap), other.own, other.outcome, other.backend, other.module,
                        other.host, other.basis)

    def predicted(it: WorkItem) -> Expected | None:
        guess = costmodel.predict(prior, shape_of(it, it.key in compiling))
        if guess is None:
            return None
        (pred, label), cap = guess, it.timeout_s if it.timeout_s > 0 else guess[0].seconds
        return Expected(min(pred.seconds, cap), module=_module(it), prior=label,
                        basis="" if pred.how == "measured" else pred.how)

    lacking = lacking or {}

    def skips(it: WorkItem) -> Expected | None:
        """The skip ``it`` will be, unless this host recorded the variant itself (a sibling's run in a cell
        that holds the package stands for nothing here)."""
        if it.key not in lacking:
            return None
        own = recorded(it, mine, False)
        return own if own is not None and own.own else Expected(SKIP_S, lacking=lacking[it.key])

    return {it.key: skips(it) or recorded(it, mine, False) or recorded(it, theirs, True) or predicted(it)
            or recorded(it, mine_any, False) or recorded(it, theirs_any, True) or Expected(None) for it in items}


def shape_of(item: WorkItem, compiles: bool = False) -> costmodel.Shape:
    """The cost model's key of a work item: probe, world size, shared placement, build module, and whether it
    compiles that module here."""
    v = item.variant
    return costmodel.Shape(item.spec.id, v.ranks, v.share_gpu, _module(item), compiles and bool(_module(item)),
                           v.param("depth") == "setup")


def _size_of(variant_key: str) -> tuple[str, bool]:
    """The world size and whether the ranks share a GPU, read from a variant key (``ranks=8,placement=shared``)."""
    params = dict(key_parts(variant_key))
    return params.get("ranks", "1"), params.get("placement") == "shared"


def _from(items: list[WorkItem], history: History,
          backend: str) -> tuple[dict[Key, Expected], dict[Key, Expected]]:
    """:func:`expected_durations` from one history, in one pass over it: per item, its own record, else its
    probe's for the same module and the longest outcome, else nothing; first among the records of the item's world
    size and placement, then among those of any size. A sibling that was skipped or not run (a package the variant
    needs is absent: decided in a fraction of a second) stands for no other variant's run. Borrowed records name
    their hosts."""
    any_size: dict[tuple[str, str], dict[str, list[Learned]]] = defaultdict(lambda: defaultdict(list))
    same_size: dict[tuple[str, str, str, bool], dict[str, list[Learned]]] = defaultdict(lambda: defaultdict(list))
    build_param = {it.spec.id: it.spec.build_param for it in items}
    for (_, probe, variant), per_backend in history.items():
        got = per_backend.get(backend)
        if got is not None and got.outcome.split(" ")[0] not in NOTHING_RAN:
            module = _param_of(variant, build_param.get(probe, ""))
            any_size[(probe, module)][got.outcome].append(got)
            same_size[(probe, module, *_size_of(variant))][got.outcome].append(got)

    def sibling(groups: Mapping[str, list[Learned]], module: str) -> Expected:
        if not groups:
            return Expected(None)
        outcome, took = max(groups.items(), key=lambda kv: sum(g.seconds for g in kv[1]) / len(kv[1]))
        hosts = " and ".join(sorted({g.host for g in took if g.host}))
        why = "; ".join(sorted({g.basis for g in took if g.basis}))
        return Expected(sum(g.seconds for g in took) / len(took), False, outcome, backend, module, hosts, why)

    same: dict[Key, Expected] = {}
    other: dict[Key, Expected] = {}
    for it in items:
        own = history.get(it.key, {}).get(backend)
        if own is not None:
            same[it.key] = other[it.key] = Expected(own.seconds, True, own.outcome, backend, "", own.host, own.basis)
            continue
        module = _module(it)
        same[it.key] = sibling(same_size.get((it.spec.id, module, *_size_of(it.variant.key)), {}), module)
        other[it.key] = sibling(any_size.get((it.spec.id, module), {}), module)
    return same, other


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


def compile_env(compile_cache: Path | None) -> Callable[[WorkItem], dict[str, str]]:
    """The compile cache and cell names a cell's ranks see (where fi-jit publishes for its GPU probes)."""
    return lambda item: {kit.COMPILE_CACHE_ENV: str(compile_cache or ""), kit.CELL_ENV: item.cell.cell_id}


def compile_note(compile_cache: Path | None, carries: Mapping[str, Mapping[str, tuple[str, ...]]] | None = None,
                 capability: str | None = None) -> Callable[[WorkItem], str]:
    """For a GPU variant that loads flashinfer comm modules its cell does not carry for this GPU
    (``carries``: cell -> module -> SASS targets, ``capability``: this GPU's) and fi-jit has not published for
    its cell (in the compile cache ``compile_cache``, as the cell's ranks see it), ``; compiles X in its turn
    (...)``; else ""."""

    def note(item: WorkItem) -> str:
        release = item.cell.versions.get("flashinfer") or ""
        if not item.spec.needs_gpu or not release or release == "none":
            return ""
        wanted = not_carried(item, carries or {}, capability)
        if not wanted:
            return ""
        env = {kit.COMPILE_CACHE_ENV: str(compile_cache or ""), kit.CELL_ENV: item.cell.cell_id}
        missing = kit.unpublished(wanted, release, env)
        return (f"; compiles {', '.join(missing)} in its turn: fi-jit has not built it for this GPU here"
                if missing else "")

    return note


def _param_of(variant_key: str, name: str) -> str:
    """The value of parameter ``name`` in a recorded variant key (``ranks=1,module=vllm_comm,arch=local``);
    "" when the probe has no build parameter or the key lacks it."""
    if not name:
        return ""
    return dict(key_parts(variant_key)).get(name, "")

@dataclass
class RunView:
    """Counts and text for one run's progress. ``items``: what this invocation will go through (variants a
    --resume found recorded are left out by the caller; reused ones are in it, done as the run starts).
    With ``history`` (what ``expected`` was made from: this host's records, ``lent`` and ``backend``), each
    result :meth:`finish` is given joins it and the variants still to run are estimated again."""

    items: list[WorkItem]
    expected: dict[Key, Expected]
    done: set[Key] = field(default_factory=set)
    jobs: int = 1  # CPU-only variants of different cells run this many at once
    compile_note: Callable[[WorkItem], str] | None = None  # what a GPU variant will compile in its turn
    history: History | None = None  # this host's records, with this run's results as they arrive
    lent: History | None = None  # what hosts of this host's class recorded
    backend: str = ""
    prior: Sequence[costmodel.CostTable] = ()  # the packaged prior's tables for this host, best first
    compiling: Collection[Key] = ()  # the items that compile their module here (costed as compiles)
    lacking: Mapping[Key, str] = field(default_factory=dict)  # items whose cell lacks a distribution they need
    # cells whose build found no nvcc in them -> what it found instead: their compile probe's variants compile nothing
    no_nvcc: Mapping[str, str] = field(default_factory=dict)
    shared_ranks: int | None = None  # rank processes of GPU variants that time nothing at once (0: --gpu-alone)
    gpus: int = 0  # the host's GPUs
    switched: bool = False  # timed variants run side by side on disjoint sets of the ``gpus`` (placement.side_by_side)
    islands: tuple[tuple[int, ...], ...] = ()  # with ``switched`` on a PCIe host: its switch groups (placement.islands)
    cells: list[str] = field(init=False)
    running: set[Key] = field(default_factory=set)
    _shown_cells: set[str] = field(default_factory=set)
    _gpu: set[Key] = field(init=False)
    _shared: set[Key] = field(init=False)  # GPU variants that time nothing: side by side up to shared_ranks
    _ranks: dict[Key, int] = field(init=False)
    _items: dict[Key, WorkItem] = field(init=False)
    # called after a finished variant changed the estimates of those still to run (the runner's start order
    # follows them: checks.run.session.run_work)
    on_estimates: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self.cells = list(dict.fromkeys(it.cell.cell_id for it in self.items))
        self._gpu = {it.key for it in self.items if it.spec.needs_gpu}
        self._shared = {it.key for it in self.items if it.spec.needs_gpu and untimed(it.spec, it.variant)}
        self._ranks = {it.key: it.variant.ranks for it in self.items}
        self._items = {it.key: it for it in self.items}

    @property
    def total(self) -> int:
        return len(self.items)

    def finish(self, item: WorkItem, result: ProbeResult | None = None) -> None:
        """``item`` is done. A ``result`` that timed its variant joins this host's history, and every item
        still to run is estimated again from it: a sibling this run measured replaces a borrowed estimate."""
        self.running.discard(item.key)
        self.done.add(item.key)
        if self.history is None or result is None or not timed(result):
            return
        v = result.verdict
        self.history.setdefault(result.key, {})[self.backend] = Learned(v.duration_s, self.backend,
                                                                         outcome_of(result))
        todo = [it for it in self.items if it.key not in self.done]
        self.expected.update(expected_durations(todo, self.history, self.backend, self.lent, self.prior,
                                                self.compiling, self.lacking))
        if self.on_estimates is not None:
            self.on_estimates()

    def left(self, running: Key | None = None, elapsed: float = 0.0) -> Estimate:
        """Time left: every item still to run; the running one counts what it has left of its record. Timed GPU
        variants run one at a time (``switched``: side by side on disjoint GPU sets, as the runner places them),
        those that time nothing side by side within the rank cap, the CPU-only ones ``jobs`` slots
        (checks.run.cost.budget's arithmetic)."""
        lanes = Lanes(self.jobs, self.shared_ranks, gpus=self.gpus, switched=self.switched, islands=self.islands)
        steps = unknown = 0
        for key, exp in self.expected.items():
            if key in self.done:
                continue
            steps += 1
            if exp.seconds is None:
                unknown += 1
                continue
            seconds = max(0.0, exp.seconds - elapsed) if key == running else exp.seconds
            if key in self._items:
                lanes.add(self._items[key], seconds)
            else:
                lanes.put(seconds, key in self._gpu, key in self._shared, self._ranks.get(key, 1))
        return Estimate(lanes.wall(), unknown, steps)

    def opening(self) -> str:
        """Said once before the first variant: how many will run and how long that should take."""
        n = len(self.expected)
        if not n:
            how = "reused or decided" if any(it.reused is not None for it in self.items) else "decided"
            return f"nothing to run: all {self.total} variant(s) are {how} without running"
        return f"to run: {n} of {self.total} variant(s), {self.left().text()} ({self.basis()})"

    def basis(self) -> str:
        """Where the estimate of what is left comes from: ``from the durations this host recorded`` (or
        ``no earlier run on this host``), then how many variants other hosts' records estimate, which hosts
        and why they stand for this one: ``4 by h200x1-5bce98f7's records: same GPU model and count``."""
        known = [e for k, e in self.expected.items() if k not in self.done and e.seconds is not None]
        lenders: dict[str, Counter[str]] = defaultdict(Counter)  # why -> host -> how many
        priors: Counter[str] = Counter()  # class of the prior -> how many
        skips = 0
        for e in known:
            if e.lacking:
                skips += 1
            elif e.prior:
                priors[e.prior] += 1
            elif e.host:
                lenders[e.basis][e.host] += 1
        own = len(known) - sum(sum(c.values()) for c in lenders.values()) - sum(priors.values()) - skips
        parts = ["from the durations this host recorded" if own else "no earlier run on this host"]
        if skips:
            parts.append(f"{skips} as a skip: a package they need is not in their cell (its build's self-check)")
        parts += [f"{n} by the prior measured on {label} (packaged with stackprobe)"
                  for label, n in sorted(priors.items())]
        for why, hosts in sorted(lenders.items()):
            n = sum(hosts.values())
            by = f"{next(iter(hosts))}'s records" if len(hosts) == 1 else \
                "the records of " + ", ".join(f"{h} ({k})" for h, k in sorted(hosts.items()))
            parts.append(f"{n} by {by}" + (f": {why}" if why else ""))
        return "; ".join(parts)

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
