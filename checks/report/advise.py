"""`checks advise`: which allreduce backend to use at each decode message size, from recorded results only (pure).

A backend *works* at a size on a host, cell and rank count when both hold there:

- its ar-latency variant timed that size: the probe times only a CUDA graph whose replay it first checked
  exactly on two inputs, so a latency is a graph-exact measurement;
- the probe that exercises it eagerly recorded exact results (``EAGER``): nccl-graphs for NCCL, symm-mem for
  torch symmetric memory, custom-ar for the custom allreduce, pcie-ipc for flashinfer's PCIe IPC all-reduce.

Per size the fastest working backend is named, with its time against NCCL measured in the same processes.
Switching away from NCCL is advised only where the gain is larger than the run-to-run spread of the two
backends at that size (``spreads``: the same backend, size and rank count timed in every cell of one CUDA
and torch build on the host; ``NOISE`` where no backend was timed twice). Everything that failed,
hung, crashed or works only in part is listed to avoid, with the verdict that rules it out; a working backend
clearly slower than NCCL at some sizes is listed too. Where a fact is missing, the probe to run is named.
Every item carries the ids of the results it stands on (``ProbeResult.result_id``).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from checks.results.freshness import command
from checks.results.result import ProbeResult
from common import cellid, escape
from common.cellid import CellId
from inenv import registry
from inenv.probe import Declared, Role
from inenv.status import Status

LATENCY_PROBE = "ar-latency"
BASELINE = "nccl"
NCCL_BACKENDS = frozenset({"nccl", "nccl-direct"})
# The tie threshold assumed where the host timed no backend twice at a size: the probe's agreement with
# nccl-tests (within 4.2% on 2x H200) rounded up; measured spreads replace it (``spreads``).
TOO_FEW_GPUS = "too-few-gpus"  # the skip of a variant whose ranks need more GPUs than the host has
NOISE = 0.05
DTYPE_BYTES = 2  # ar-latency measures bf16
DECLARED = registry.declarations()  # what each probe records: advise reads keys through its roles
# Probes whose failures say something about an allreduce path (ALLREDUCE_PATH): the ones listed under "avoid".
PATH_PROBES = tuple(pid for pid, d in DECLARED.items() if d.allreduce_path)


def declared_metric(r: ProbeResult, role: Role) -> Any:
    """The value of the metric ``r``'s probe declares with ``role`` (None: it declares none, or r lacks it)."""
    key = DECLARED.get(r.probe_id, Declared()).metric(role)
    return r.verdict.metrics.get(key) if key is not None else None


def _evidence(r: ProbeResult, role: Role) -> Any:
    key = DECLARED.get(r.probe_id, Declared()).evidence_key(role)
    return r.verdict.evidence.get(key) if key is not None else None


def _get(obj: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(k)
    return obj


def _verdicts_ok(checks: Any, word: str) -> bool:
    """Every check record in a non-empty mapping says ``word``."""
    return (isinstance(checks, Mapping) and bool(checks)
            and all(isinstance(c, Mapping) and c.get("verdict") == word for c in checks.values()))


def _nccl_allreduce_exact(r: ProbeResult) -> bool:
    op = _get(_evidence(r, Role.OP_CHECKS), "all_reduce")
    eager = _get(op, "eager") or _get(op, "eager_after")
    return _get(eager, "verdict") == "ok" and _get(op, "graph", "verdict") == "ok"


def _symm_exact(kind: str) -> Callable[[ProbeResult], bool]:
    def check(r: ProbeResult) -> bool:
        op = _get(_evidence(r, Role.OP_CHECKS), kind)
        return _get(op, "eager", "verdict") == "ok" and _get(op, "graph", "verdict") == "ok"

    return check


def _custom_ar_exact(r: ProbeResult) -> bool:
    return (_verdicts_ok(_evidence(r, Role.EAGER_CHECKS), "exact")
            and _verdicts_ok(_get(_evidence(r, Role.GRAPH_CHECKS), "checks"), "exact"))


def _passed(r: ProbeResult) -> bool:
    return r.verdict.status is Status.PASS  # pcie-ipc passes only when every admitted shape is exact both ways


@dataclass(frozen=True)
class EagerCheck:
    """Where a backend's eager exactness is recorded: a probe, the variant parameters that select the same
    path, and how its evidence shows the path exact eagerly (and captured)."""

    probe: str
    match: Mapping[str, str]
    exact: Callable[[ProbeResult], bool]
    what: str


EAGER: Mapping[str, EagerCheck] = {
    "nccl": EagerCheck("nccl-graphs", {"algo": "default"}, _nccl_allreduce_exact,
                       "NCCL all_reduce exact eagerly and captured (NCCL_ALGO unset)"),
    # The same libnccl collective, here called through ctypes: its exactness is NCCL's, checked by nccl-graphs.
    "nccl-direct": EagerCheck("nccl-graphs", {"algo": "default"}, _nccl_allreduce_exact,
                              "NCCL all_reduce exact eagerly and captured (NCCL_ALGO unset)"),
    "symm-mem-one-shot": EagerCheck("symm-mem", {}, _symm_exact("one_shot"), "one_shot exact eagerly and captured"),
    "symm-mem-two-shot": EagerCheck("symm-mem", {}, _symm_exact("two_shot"), "two_shot exact eagerly and captured"),
    "flashinfer-custom-ar": EagerCheck("custom-ar", {"impl": "flashinfer"}, _custom_ar_exact,
                                       "custom allreduce exact eagerly and captured"),
    "flashinfer-pcie-ipc": EagerCheck("pcie-ipc", {"op": "all-reduce"}, _passed,
                                      "PCIe IPC all-reduce exact eagerly and captured"),
}
BACKENDS = tuple(EAGER)  # every backend advice can name; ar-latency variants of others are never recommended
# Allreduce paths exact eagerly and in a graph that nothing times, so nothing ranks them
UNTIMED = tuple(p for p in PATH_PROBES if p != LATENCY_PROBE and p not in {c.probe for c in EAGER.values()})


# --------------------------------------------------------------------------------------------------
# The advice


@dataclass(frozen=True)
class Curve:
    """A working backend's measured latency: bytes -> median µs of one captured call, exact sizes only."""

    backend: str
    latency_us: Mapping[int, float]
    ratio_vs_nccl: Mapping[int, float]  # against NCCL timed in the same processes
    ids: tuple[str, ...]  # the ar-latency result, then the eager-exact one


@dataclass(frozen=True)
class SizeAdvice:
    nbytes: int
    tokens: int | None  # at the hidden size ar-latency measured
    fastest: str
    fastest_us: float
    ratio_vs_nccl: float | None
    use: str  # the fastest, or the NCCL baseline where the fastest gains less than ``tie``
    runner_up: str = ""
    runner_up_us: float | None = None
    ids: tuple[str, ...] = ()
    tie: float = NOISE  # the gain under which the fastest and NCCL are a tie here (Spreads.tie)


@dataclass(frozen=True)
class Spread:
    """How far repeated timings of one backend at one size and rank count lie apart on one host: the range
    over the median of the latest result of every cell of one CUDA and torch build that timed it."""

    backend: str
    nbytes: int
    relative: float  # (max - min) / median
    samples: int


@dataclass(frozen=True)
class Spreads:
    """The measured spreads of one cell's rank count, and the tie threshold they give."""

    by: Mapping[tuple[str, int], Spread]

    def tie(self, backend: str, nbytes: int) -> float:
        """The larger spread of ``backend`` and NCCL at ``nbytes``; ``NOISE`` when neither was timed twice."""
        known = [sp.relative for b in (backend, BASELINE) if (sp := self.by.get((b, nbytes)))]
        return max(known) if known else NOISE

    def per_backend(self) -> list[tuple[str, float, int]]:
        """(backend, largest spread over its sizes, fewest samples at one size) in backend order."""
        out = []
        for b in BACKENDS:
            mine = [sp for (x, _), sp in self.by.items() if x == b]
            if mine:
                out.append((b, max(sp.relative for sp in mine), min(sp.samples for sp in mine)))
        return out


def build_of(cell: CellId | None, cell_id: str) -> tuple[str, ...]:
    """The CUDA and torch build of a cell (``cu130``, ``2.11.0``, local or not): cells that share it time NCCL
    and torch's backends with the same code; their flashinfer versions differ. An id cellid did not make is a
    build of its own."""
    return (cell.cuda, cell.torch, str(cell.local)) if cell is not None else ("", cell_id)


def spreads(results: Iterable[ProbeResult], cell_id: str, ranks: int) -> Spreads:
    """Run-to-run spread of every backend at every size, from the latest ar-latency result of each cell of
    ``cell_id``'s build at ``ranks`` (ranks sharing a GPU left out); sizes timed once have none."""
    build = build_of(cellid.parse(cell_id), cell_id)
    seen: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in results:
        if (r.probe_id != LATENCY_PROBE or r.ranks != ranks or r.shared_gpu or build_of(r.cell, r.cell_id) != build
                or r.verdict.status not in (Status.PASS, Status.PARTIAL)):
            continue
        backend = r.params.get("backend", "")
        for n, us in _sizes(declared_metric(r, Role.LATENCY)).items():
            seen[(backend, n)].append(us)
    out = {}
    for (backend, n), xs in seen.items():
        if len(xs) > 1:
            out[(backend, n)] = Spread(backend, n, (max(xs) - min(xs)) / statistics.median(xs), len(xs))
    return Spreads(out)


@dataclass(frozen=True)
class Crossover:
    below: str  # used up to ``lo``
    above: str  # used from ``hi``
    lo: int
    hi: int
    at: float | None  # bytes where the two measured curves cross, linearly interpolated; None: they do not
    ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Avoid:
    what: str
    status: str
    reason_code: str
    why: str
    ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Untimed:
    feature: str
    why: str
    ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Missing:
    what: str
    why: str
    run: str = ""  # the command that records it; "" when rerunning cannot help (too few GPUs, not installed)


@dataclass(frozen=True)
class CellAdvice:
    host_id: str
    cell_id: str
    ranks: int
    hidden: int | None
    curves: tuple[Curve, ...] = ()
    sizes: tuple[SizeAdvice, ...] = ()
    crossovers: tuple[Crossover, ...] = ()
    avoid: tuple[Avoid, ...] = ()
    untimed: tuple[Untimed, ...] = ()
    missing: tuple[Missing, ...] = ()
    multicast: bool | None = None  # whether the GPUs support multicast (see ``multicast``); None: unknown
    full_nvlink: bool | None = None  # NVLink between every pair of GPUs, as custom-ar read it from NVML
    spread: Spreads = Spreads({})  # run-to-run spread per backend and size: the tie threshold
    not_for_verify: tuple[NotForVerify, ...] = ()  # backends whose ranks diverged: never for a verify step

    def curve(self, backend: str) -> Curve | None:
        return next((c for c in self.curves if c.backend == backend), None)

    @property
    def used(self) -> tuple[str, ...]:
        """The backends advised at one size or more, in order of first use."""
        return tuple(dict.fromkeys(s.use for s in self.sizes))


def _sizes(metric: Any) -> dict[int, float]:
    """A ``{"<bytes>": value}`` metric as {bytes: value}, keeping only positive finite numbers."""
    if not isinstance(metric, Mapping):
        return {}
    out = {}
    for k, v in metric.items():
        if (isinstance(k, str) and k.isdigit() and isinstance(v, int | float) and not isinstance(v, bool)
                and math.isfinite(v) and v > 0):
            out[int(k)] = float(v)
    return out


def _rerun(probe: str, cell_id: str, cell: CellId | None, executor: str) -> str:
    """The command that runs ``probe`` on the cell again, through the back end that made its results."""
    return command((probe,), (cell_id,), "local" if cell is not None and cell.local else executor)


def _plain(r: ProbeResult) -> int:
    """How many parameters keep the setting an engine uses by default (preferred as the proof to cite)."""
    return sum(v in ("default", "yes", "topology") for v in r.params.values())


def _eager_proof(backend: str, rs: Sequence[ProbeResult]) -> tuple[ProbeResult | None, list[ProbeResult]]:
    """The newest result proving ``backend`` exact eagerly, and the candidates that ran but do not prove it."""
    check = EAGER[backend]
    cands = [r for r in rs if r.probe_id == check.probe and not r.shared_gpu
             and all(r.params.get(k) == v for k, v in check.match.items())]
    ran = [r for r in cands if r.verdict.status not in (Status.SKIP, Status.NOT_RUN, Status.UNAVAILABLE)]
    proving = [r for r in ran if r.verdict.status in (Status.PASS, Status.PARTIAL) and check.exact(r)]
    best = max(proving, key=lambda r: (r.verdict.status is Status.PASS, r.run_id, _plain(r)), default=None)
    return best, [r for r in ran if r not in proving]


def _skip_why(rs: Iterable[ProbeResult]) -> str:
    skips = [r for r in rs if r.verdict.status is Status.SKIP]
    if not skips:
        return ""
    v = skips[0].verdict
    return f"skip ({v.reason_code}): {v.note}" if v.reason_code else f"skip: {v.note}"


def _curves(cell_id: str, cell: CellId | None, rs: Sequence[ProbeResult],
            executor: str) -> tuple[list[Curve], list[Missing]]:
    """Working backends' curves and what is missing for the others."""
    timed = {r.params.get("backend", ""): r for r in rs if r.probe_id == LATENCY_PROBE}
    curves: list[Curve] = []
    missing: list[Missing] = []
    short: list[ProbeResult] = []  # skipped for too few GPUs: one line for all, what a bigger host would add
    for backend in BACKENDS:
        lat = timed.get(backend)
        if lat is None:
            missing.append(Missing(backend, "no ar-latency result", _rerun(LATENCY_PROBE, cell_id, cell, executor)))
            continue
        if lat.verdict.status is Status.SKIP and lat.verdict.reason_code == TOO_FEW_GPUS:
            short.append(lat)
            continue
        if lat.verdict.status is Status.SKIP:
            missing.append(Missing(backend, _skip_why([lat])))
            continue
        latency = _sizes(declared_metric(lat, Role.LATENCY))
        if lat.verdict.status not in (Status.PASS, Status.PARTIAL) or not latency:
            continue  # listed under avoid with its verdict
        proof, _ = _eager_proof(backend, rs)
        if proof is None:
            check = EAGER[backend]
            cands = [r for r in rs if r.probe_id == check.probe]
            why = _skip_why(cands) or f"{check.probe} recorded no exact eager run for it"
            missing.append(Missing(f"{backend} (eager exactness)", why,
                                   "" if why.startswith("skip") else _rerun(check.probe, cell_id, cell, executor)))
            continue
        ratio = _sizes(declared_metric(lat, Role.RATIO_VS_NCCL))
        if backend == BASELINE:
            ratio = dict.fromkeys(latency, 1.0)
        curves.append(Curve(backend, dict(sorted(latency.items())), dict(sorted(ratio.items())),
                            (lat.result_id, proof.result_id)))
    if short:
        missing.insert(0, bigger_host(short))
    return curves, missing


def bigger_host(short: Sequence[ProbeResult]) -> Missing:
    """One line for the backends ar-latency skipped for too few GPUs: what a host with a GPU per rank would add
    (their latency curves, hence a choice between them); nothing to rerun here."""
    names = ", ".join(r.params.get("backend", "?") for r in short)
    ranks = short[0].ranks
    note = " ".join(short[0].verdict.note.split())[:300]
    return Missing(f"allreduce latency at {ranks} ranks ({names})",
                   f"{note}; a host with a GPU per rank would time {'it' if len(short) == 1 else 'these'} "
                   "and rank them here")


def _ratio(c: Curve, n: int, base: Curve | None) -> float | None:
    if n in c.ratio_vs_nccl:
        return c.ratio_vs_nccl[n]
    if base is not None and n in base.latency_us:
        return c.latency_us[n] / base.latency_us[n]
    return None


def _per_size(curves: Sequence[Curve], hidden: int | None, spread: Spreads) -> list[SizeAdvice]:
    base = next((c for c in curves if c.backend == BASELINE), None)
    out = []
    for n in sorted({n for c in curves for n in c.latency_us}):
        here = sorted((c for c in curves if n in c.latency_us), key=lambda c: (c.latency_us[n], c.backend))
        best = here[0]
        ratio = _ratio(best, n, base)
        has_base = base is not None and n in base.latency_us
        tie = spread.tie(best.backend, n)
        # Leave NCCL only for a gain beyond the run-to-run spread; NCCL through either caller is the baseline.
        gains = ratio is not None and ratio < 1 - tie and best.backend not in NCCL_BACKENDS
        use = best.backend if gains or not has_base else BASELINE
        runner = here[1] if len(here) > 1 else None
        ids = tuple(dict.fromkeys(best.ids + (base.ids if base is not None and use == BASELINE else ())))
        tokens = n // (hidden * DTYPE_BYTES) if hidden and n % (hidden * DTYPE_BYTES) == 0 else None
        out.append(SizeAdvice(n, tokens, best.backend, best.latency_us[n], ratio, use,
                              runner.backend if runner else "", runner.latency_us[n] if runner else None, ids, tie))
    return out


def crossing(lo: int, hi: int, a: Curve, b: Curve) -> float | None:
    """Bytes between ``lo`` and ``hi`` where a's and b's latencies are equal, each curve linear between its
    two measured points; None when a measured point is missing or the lines do not cross in between."""
    try:
        a1, a2, b1, b2 = a.latency_us[lo], a.latency_us[hi], b.latency_us[lo], b.latency_us[hi]
    except KeyError:
        return None
    d1, d2 = a1 - b1, a2 - b2
    if d1 == d2 or d1 * d2 > 0:
        return None
    t = d1 / (d1 - d2)
    return lo + t * (hi - lo)


def _crossovers(sizes: Sequence[SizeAdvice], curves: Sequence[Curve]) -> list[Crossover]:
    by = {c.backend: c for c in curves}
    out = []
    for prev, nxt in zip(sizes, sizes[1:], strict=False):
        if prev.use != nxt.use and prev.use in by and nxt.use in by:
            a, b = by[prev.use], by[nxt.use]
            out.append(Crossover(prev.use, nxt.use, prev.nbytes, nxt.nbytes, crossing(prev.nbytes, nxt.nbytes, a, b),
                                 tuple(dict.fromkeys(a.ids[:1] + b.ids[:1]))))
    return out


def _label(rs: Sequence[ProbeResult]) -> str:
    """A group of one probe's variants named by the parameters they share (ranks left out)."""
    common = None
    for r in rs:
        p = dict(r.params)
        common = p if common is None else {k: v for k, v in common.items() if p.get(k) == v}
    parts = [f"{k}={v}" if v else k for k, v in (common or {}).items()]
    if rs and rs[0].probe_id == "nccl-graphs" and "algo" in (common or {}):
        parts = [f"NCCL_ALGO={common['algo']}"] + [p for p in parts if not p.startswith("algo=")]  # type: ignore[index]
    label = " ".join([rs[0].probe_id, *parts]) if rs else ""
    return label + (f" ({len(rs)} variants)" if len(rs) > 1 else "")


BAD = frozenset({Status.FAIL, Status.CRASH, Status.HANG, Status.PARTIAL})

# The host's own peer-to-peer check (host-p2p): when a GPU pair's peer copy or its first NCCL allreduce with
# NCCL's defaults failed, the backends that read and write peer GPU memory directly are not advised on it.
P2P_PROBE = "host-p2p"
P2P_BACKENDS = frozenset({"symm-mem-one-shot", "symm-mem-two-shot", "flashinfer-custom-ar", "flashinfer-pcie-ipc"})
P2P_BROKEN = frozenset({Status.FAIL, Status.CRASH, Status.HANG})


def p2p_broken(results: Iterable[ProbeResult]) -> list[ProbeResult]:
    """The host's host-p2p pair checks that failed: a peer copy, or NCCL with its defaults (any cell: the
    GPUs' peer-to-peer path is the host's, whatever stack ran the check)."""
    return [r for r in results if r.probe_id == P2P_PROBE and r.verdict.status in P2P_BROKEN
            and (r.params.get("check") == "copy"
                 or (r.params.get("check") == "nccl" and r.params.get("p2p", "default") == "default"))]


# The load probe: a backend whose graphs hung or drifted while they were replayed under load with a GPU per rank
# (at any world size: a deadlock from two streams at 2 ranks is one at 8 too) is not advised in that cell; ranks
# sharing a GPU test the code paths, not a server's placement.
LOAD_PROBE = "load"


def load_broken(results: Iterable[ProbeResult]) -> list[ProbeResult]:
    """The load probe's variants with a GPU per rank that hung, failed (drifted) or crashed."""
    return [r for r in results if r.probe_id == LOAD_PROBE and not r.shared_gpu and r.verdict.status in BAD
            and r.verdict.reason_code != DIVERGENT]  # right numbers that differ bitwise: kept off verify only


# Backends whose signals are peer-to-peer atomics: torch symmetric memory's one-/two-shot allreduce. A host whose
# pairs have peer access without native atomics (host-p2p's facts, NVML's atomics bit) does not get them advised.
ATOMIC_BACKENDS = frozenset({"symm-mem-one-shot", "symm-mem-two-shot"})
NO_ATOMICS = "p2p-no-native-atomics"


def no_atomics(results: Iterable[ProbeResult]) -> list[ProbeResult]:
    """The host's newest host-p2p facts results (any cell: the pairs are the host's) that name GPU pairs without
    native peer-to-peer atomics."""
    return [r for r in results if r.probe_id == P2P_PROBE and r.params.get("check") == "facts"
            and isinstance(bare := declared_metric(r, Role.NO_ATOMICS), Mapping) and bare]


def atomics_avoid(found: Sequence[ProbeResult]) -> list[Avoid]:
    """One line per backend that needs native P2P atomics, on a host whose pairs lack them."""
    if not found:
        return []
    bare = declared_metric(found[0], Role.NO_ATOMICS)
    pairs = "; ".join(f"GPUs {k}: {v}" for k, v in sorted(bare.items())[:4])
    return [Avoid(f"{b} (needs native peer-to-peer atomics)", "host", NO_ATOMICS,
                  f"host-p2p's facts: NVML reports peer access but no native atomics ({pairs}); torch symmetric "
                  "memory's signals can wedge under load there", tuple(r.result_id for r in found[:3]))
            for b in sorted(ATOMIC_BACKENDS)]


def p2p_avoid(results: Sequence[ProbeResult], broken: Sequence[ProbeResult]) -> list[Avoid]:
    """One line per P2P backend the host's failed peer-to-peer check rules out, with that check's reason, and
    whether NCCL without P2P (``NCCL_P2P_DISABLE=1``) passed on the same pair."""
    if not broken:
        return []
    first = broken[0]
    pair = first.params.get("pair", "")
    fallback = [r for r in results if r.probe_id == P2P_PROBE and r.params.get("check") == "nccl"
                and r.params.get("pair", "") == pair and r.params.get("p2p") == "disabled"
                and r.verdict.status is Status.PASS]
    note = " ".join(first.verdict.note.split())[:300]
    also = (f"; NCCL with NCCL_P2P_DISABLE=1 passes on GPUs {pair}: run with it until the host is fixed"
            if fallback else "")
    return [Avoid(f"{b} (needs direct GPU peer-to-peer)", "host", first.verdict.reason_code,
                  f"host-p2p {first.variant} failed on this host: {note}{also}",
                  tuple(r.result_id for r in broken[:3]))
            for b in sorted(P2P_BACKENDS)]


def _avoid(rs: Sequence[ProbeResult], curves: Sequence[Curve], spread: Spreads = Spreads({})) -> list[Avoid]:
    groups: dict[tuple[str, str, str, str], list[ProbeResult]] = defaultdict(list)
    for r in rs:
        # Ranks sharing a GPU test correctness only; no server runs that way.
        # A rank-divergent backend gives right numbers: it is kept off the verify step only (not_for_verify).
        if (r.probe_id in PATH_PROBES and r.verdict.status in BAD and not r.shared_gpu
                and r.verdict.reason_code != DIVERGENT):
            v = r.verdict
            groups[(r.probe_id, v.status.value, v.reason_code, " ".join(v.note.split())[:300])].append(r)
    out = [Avoid(_label(g), status, code, note, tuple(r.result_id for r in g))
           for (_, status, code, note), g in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1]))]
    for c in curves:
        if c.backend in NCCL_BACKENDS:
            continue
        slow = {n: x for n, x in c.ratio_vs_nccl.items() if x > 1 + spread.tie(c.backend, n)}
        if slow:
            lo, hi = min(slow.values()), max(slow.values())
            sizes = ", ".join(human_bytes(n) for n in sorted(slow))
            span = f"{lo:.2f}×" if lo == hi else f"{lo:.2f}–{hi:.2f}×"
            out.append(Avoid(f"{c.backend} at {sizes}", "slower", "", f"{span} NCCL time, measured in the same "
                             "processes", c.ids[:1]))
    return out


def _untimed(rs: Sequence[ProbeResult]) -> list[Untimed]:
    out = []
    for probe in UNTIMED:
        ok = [r for r in rs if r.probe_id == probe and r.verdict.status is Status.PASS and not r.shared_gpu]
        if ok:
            out.append(Untimed(probe, "exact eagerly and in a CUDA graph; not timed, so not ranked",
                               tuple(r.result_id for r in ok)))
    # NCCL_ALGO settings other than NCCL's own choice: nccl-graphs checks them, ar-latency does not time them.
    algos: dict[str, list[ProbeResult]] = defaultdict(list)
    for r in rs:
        algo = r.params.get("algo", "")
        if r.probe_id == "nccl-graphs" and algo not in ("", "default") and r.verdict.status is Status.PASS:
            algos[algo].append(r)
    for algo, ok in sorted(algos.items()):
        out.append(Untimed(escape.setting(f"NCCL_ALGO={algo}"),
                           "all four collectives exact eagerly and in a CUDA graph; not timed "
                           "(ar-latency times NCCL's own choice)", tuple(r.result_id for r in ok)))
    return out


def multicast(rs: Sequence[ProbeResult], host_facts: Mapping[str, Any]) -> bool | None:
    """Whether the GPUs support multicast (what engines' torch symmetric-memory paths need): the device
    attribute symm-mem records, else the host facts; None when neither says. stackprobe itself keeps multicast
    off while probing, so a refused multimem op alone does not answer this."""
    for r in sorted(rs, key=lambda r: r.run_id, reverse=True):
        v = _evidence(r, Role.MULTICAST)
        if isinstance(v, bool):
            return v
    mc = host_facts.get("multicast")
    if isinstance(mc, list) and mc and all(isinstance(x, bool) for x in mc):
        return all(mc)
    return None


def full_nvlink(rs: Sequence[ProbeResult]) -> bool | None:
    for r in sorted(rs, key=lambda r: r.run_id, reverse=True):
        v = _evidence(r, Role.FULL_NVLINK)
        if isinstance(v, bool):
            return v
    return None


def measured_hidden(rs: Iterable[ProbeResult]) -> int | None:
    for r in rs:
        h = _evidence(r, Role.HIDDEN) if r.probe_id == LATENCY_PROBE else None
        if isinstance(h, int) and not isinstance(h, bool) and h > 0:
            return h
    return None


# Probes that check whether the ranks of an allreduce hold the same bits (inenv/kit/_agree.py): they declare the
# agreement metric; a backend whose ranks diverged is never advised for a speculative verify step.
AGREEMENT_PROBES = tuple(pid for pid, d in DECLARED.items() if d.metric(Role.AGREEMENT))
DIVERGENT = "rank-divergent"


@dataclass(frozen=True)
class NotForVerify:
    """A backend not to use for a speculative verify step: its ranks' outputs differed bit for bit, so ranks can
    accept different numbers of draft tokens and wait for each other forever."""

    backend: str
    why: str
    ids: tuple[str, ...] = ()


# A probe whose agreement cases run one backend that EAGER does not name, by the name the step and load give it
AGREEMENT_NAMES: Mapping[str, str] = {"fi-fusion": "flashinfer-fusion"}


def _agreement_backend(r: ProbeResult) -> str:
    """The backend a result's agreement check ran, by the name the step, load and ar-latency give it: its
    ``backend`` parameter; NCCL for nccl-graphs (with the forced algorithm named); the one backend of EAGER whose
    probe and parameters the result has (pcie-ipc's all-reduce, custom-ar's flashinfer implementation); else
    :data:`AGREEMENT_NAMES`, or the probe's own id (symm-mem: torch symmetric memory's ops)."""
    if "backend" in r.params:
        return r.params["backend"]
    if r.probe_id != "nccl-graphs":
        named = [b for b, c in EAGER.items()
                 if c.probe == r.probe_id and all(r.params.get(k) == v for k, v in c.match.items())]
        return named[0] if len(named) == 1 else AGREEMENT_NAMES.get(r.probe_id, r.probe_id)
    algo = r.params.get("algo", "default")
    return BASELINE if algo in ("", "default") else f"{BASELINE} (NCCL_ALGO={algo})"


def not_for_verify(results: Iterable[ProbeResult], cell_id: str) -> list[NotForVerify]:
    """The backends whose ranks diverged in ``cell_id``, at any rank count and placement (ranks sharing a GPU
    run the same kernels' arithmetic: a divergence there is the backend's), in an agreement check or while the
    load probe replayed them (at verify-shaped sizes among others)."""
    found: dict[str, list[ProbeResult]] = defaultdict(list)
    for r in results:
        if r.cell_id != cell_id or r.probe_id not in (*AGREEMENT_PROBES, LOAD_PROBE):
            continue
        summary = declared_metric(r, Role.AGREEMENT)
        split = isinstance(summary, Mapping) and bool(summary.get("divergent_cases"))
        if r.verdict.reason_code == DIVERGENT or split:
            found[_agreement_backend(r)].append(r)
    out = []
    for backend, rs in sorted(found.items()):
        first = rs[0]
        summary = declared_metric(first, Role.AGREEMENT)
        cases = summary.get("divergent_cases") if isinstance(summary, Mapping) else None
        cases = cases if isinstance(cases, list) else []
        where = ", ".join(sorted({f"{r.ranks} ranks" + (" sharing GPUs" if r.shared_gpu else "") for r in rs}))
        detail = (f"{len(cases)} case(s), e.g. {cases[0]}, up to {summary.get('max_ulp_between_ranks')} ulp apart"
                  if cases and isinstance(summary, Mapping) else " ".join(first.verdict.note.split())[:200])
        out.append(NotForVerify(backend, f"ranks' outputs differ bit for bit ({first.probe_id} at {where}: {detail}); "
                                "ranks could accept different numbers of draft tokens and deadlock the verify step",
                                tuple(r.result_id for r in rs[:3])))
    return out


def advise_cell(host_id: str, cell_id: str, ranks: int, results: Sequence[ProbeResult],
                host_facts: Mapping[str, Any] | None = None, executor: str = "docker") -> CellAdvice:
    """The advice for one cell at ``ranks`` from the host's latest results (other cells and ranks are ignored);
    ``executor``: the back end that ran the cell there, which the commands for what is missing name."""
    rs = [r for r in results if r.cell_id == cell_id and r.ranks == ranks]
    hidden = measured_hidden(rs)
    in_cell = [r for r in results if r.cell_id == cell_id]
    mc, nvl = multicast(in_cell, host_facts or {}), full_nvlink(in_cell)
    cell = next((r.cell for r in in_cell), None)
    if not any(r.probe_id == LATENCY_PROBE for r in rs):
        return CellAdvice(host_id, cell_id, ranks, hidden, missing=(
            Missing(f"allreduce latency at {ranks} ranks", "no ar-latency result",
                    _rerun(LATENCY_PROBE, cell_id, cell, executor)),),
            avoid=(*p2p_avoid(results, p2p_broken(results)), *atomics_avoid(no_atomics(results)),
                   *_avoid(rs, ())), untimed=tuple(_untimed(rs)),
            multicast=mc, full_nvlink=nvl, not_for_verify=tuple(not_for_verify(results, cell_id)))
    curves, missing = _curves(cell_id, cell, rs, executor)
    broken = p2p_broken(results)
    if broken:  # a backend that needs peer-to-peer is never advised on a host whose peer-to-peer failed
        curves = [c for c in curves if c.backend not in P2P_BACKENDS]
    bare = no_atomics(results)
    if bare:  # nor one whose signals are peer atomics on a host whose pairs lack them
        curves = [c for c in curves if c.backend not in ATOMIC_BACKENDS]
    loaded = load_broken(in_cell)
    if loaded:  # nor one that hung, drifted or diverged under load
        curves = [c for c in curves if c.backend not in {r.params.get("backend") for r in loaded}]
    spread = spreads(results, cell_id, ranks)
    sizes = _per_size(curves, hidden, spread)
    elsewhere = [r for r in loaded if r.ranks != ranks]  # this rank count's own are among rs
    avoid = (*p2p_avoid(results, broken), *atomics_avoid(bare), *_avoid([*rs, *elsewhere], curves, spread))
    return CellAdvice(host_id, cell_id, ranks, hidden, tuple(curves), tuple(sizes),
                      tuple(_crossovers(sizes, curves)), avoid, tuple(_untimed(rs)),
                      tuple(missing), mc, nvl, spread, tuple(not_for_verify(results, cell_id)))


def rank_counts(results: Iterable[ProbeResult], cell_id: str) -> list[int]:
    """Rank counts worth advising on in a cell: those of ar-latency variants that were not skipped for too few
    GPUs (others cannot be measured on this host)."""
    out = set()
    for r in results:
        if r.cell_id == cell_id and r.probe_id == LATENCY_PROBE and (n := r.ranks) is not None and not (
                r.verdict.status is Status.SKIP and r.verdict.reason_code == TOO_FEW_GPUS):
            out.add(n)
    return sorted(out)


def human_bytes(n: float) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.3g} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.3g} KiB"
    return f"{n:.0f} B"
