"""The probe API shared by the host side and the in-environment side.

Standard library only: this module is imported inside cell images and on the lent GPU host,
and also by the host-side planner, which must not need torch.

A probe is a module in ``inenv/probes/`` that defines:

- ``SPEC: ProbeSpec``: metadata;
- ``variants(host: HostView) -> list[Variant]`` (optional): the variants to run on a host;
  the default is one variant per world size in ``SPEC.ranks``;
- ``run(ctx: RankContext) -> dict``: runs in every rank process and returns an outcome
  (build it with :func:`outcome`); module-level code must not import torch or the libraries under
  test, only ``run`` (and what it calls) may;
- ``combine(outcomes: list[dict]) -> dict`` (optional): merges the per-rank outcomes; the default
  is :func:`combine_worst`;
- ``preflight(variant: Variant) -> dict | None`` (optional): run by the worker before any rank starts,
  without importing the libraries under test; an outcome when the environment's files already show the
  verdict the ranks would reach (an API the installed version lacks), else None;
- ``METRICS`` and ``EVIDENCE`` (optional): the fields its outcomes write, as ``(name, unit, meaning, role)``
  rows (see :class:`Field`), and ``ALLREDUCE_PATH = True`` when its failures rule out an allreduce path.
  The host reads them through :func:`declared` (the table's headline, ``checks advise``), never by key
  names of its own. They sit in one block at the end of the file, after a line starting with
  ``DECLARED_MARK``: the block describes the records and changes no verdict, so it is left out of the
  probe's hash (``checks.results.provenance``).

The rank launcher (``inenv.worker``) sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT,
and exports every variant param named ``env.NAME`` as the environment variable NAME of each rank
(an empty value unsets it), so a variant such as ``env.NCCL_ALGO=Tree`` is applied before any library
reads its environment. ``run`` should not tear down its process group: the rank records its outcome
first and then tears down (which may hang after graph capture; the launcher ends such ranks).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from inenv.status import ORDER, RUN_STATUSES, Status, worst
from inenv.status import parse as status_of

# The verdict vocabulary lives in inenv.status; these names stay for the probes that import them.
STATUSES: tuple[Status, ...] = ORDER  # best to worst; RUN_STATUSES: what a probe itself may return

RESULT_MARKER = "@@STACKPROBE-RESULT@@"  # prefix of the one line of JSON the worker prints

# `checks run --level`: full runs everything; quick plans fi-jit's smallest module only and runs the GPU
# probes at one message size. The ranks of a quick run's GPU variants get LEVEL_ENV=quick.
FULL, QUICK = "full", "quick"
LEVELS = (FULL, QUICK)
LEVEL_ENV = "STACKPROBE_LEVEL"
# A timed variant the runner placed on some of the host's GPUs (checks.run.placement) sees only those, as CUDA's
# devices 0, 1, ...; this names their indices on the host in that order ("2,5": device 0 is the host's GPU 2).
LANE_GPUS_ENV = "STACKPROBE_LANE_GPUS"
T = TypeVar("T")


def visible_index(host_index: int) -> int | None:
    """The CUDA device index this process gives the host's GPU ``host_index``: its place among the GPUs the
    runner placed the variant on (:data:`LANE_GPUS_ENV`), else the index itself (the variant sees every GPU);
    None when the variant was placed on GPUs without it."""
    lane = os.environ.get(LANE_GPUS_ENV, "").strip()
    if not lane:
        return host_index
    try:
        order = [int(g) for g in lane.split(",")]
    except ValueError:
        return host_index  # not the runner's spelling: the variant sees the GPUs as CUDA numbers them
    return order.index(host_index) if host_index in order else None



@dataclass(frozen=True)
class ProbeSpec:
    id: str
    title: str
    feature: str  # the question a user asks that this probe answers
    ranks: tuple[int, ...] = (1,)  # world sizes it runs with by default
    # The fewest ranks that test the feature at all: over one rank an allreduce returns its input, so a
    # one-rank collective would pass having tested nothing. The worker refuses a variant with fewer.
    min_ranks: int = 1
    # (param, value, min_ranks): variants with that param value need another minimum (e.g. a mode that
    # simulates all its ranks in one process).
    min_ranks_by_param: tuple[tuple[str, str, int], ...] = ()
    # Every rank needs a GPU of its own (NCCL refuses two ranks on one device; a latency of ranks
    # time-slicing one GPU means nothing). False: ranks may share a GPU, and Variant.share_gpu says
    # whether a variant does. The worker refuses a sharing variant of a probe whose ranks need their own.
    distinct_gpus: bool = True
    requires: tuple[str, ...] = ()  # importable modules the environment must have, else `skip`
    needs_gpu: bool = True
    # (param, value): variants of a GPU probe with that param value run on a host without a GPU too, reading
    # what they can there and skipping their GPU parts with a reason (host-p2p's host facts). On a GPU host
    # they are GPU variants like the others.
    gpu_optional: tuple[tuple[str, str], ...] = ()
    timeout_s: float = 300.0  # per variant, enforced by the host-side watchdog
    # False: a later run never carries this probe's result forward (what it reads, such as a bridge's ACS
    # bits or the IOMMU mode, changes with the host's state, which no recorded input captures)
    reusable: bool = True
    # The variant param that names a build other cells may share through the compile cache (fi-jit's
    # module): the host does not start two variants with the same value side by side, so the second finds
    # the first one's build stored instead of holding a job slot while it waits for it.
    build_param: str = ""
    # (param, value, flashinfer JIT modules): what a variant with that param value loads, for a probe that
    # declares it here rather than in inenv.kit._flashinfer.PROBE_MODULES (the host starts such a variant
    # after fi-jit has built them, and a quick pass defers it while they are unbuilt)
    loads: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    # What a rank does before it waits for the GPUs (inenv.gpugate), while another variant runs: modules to
    # import, and ``module:function`` steps called with the RankContext (the rendezvous). None may read anything
    # the probe sets before it would have done the step itself, and none may touch a GPU.
    preload: tuple[str, ...] = ()
    # True: every variant runs in rank processes of its own, never in ranks kept from an earlier variant
    # (inenv.warm). For a probe that leaves process-wide state the warm ranks' own checks cannot see (a CUDA
    # graph or an IPC mapping kept in a module global, a setting written to a library through ctypes).
    fresh_ranks: bool = False
    # False: no variant of the probe times anything (its verdicts are exact checks), so its variants may share
    # the GPUs with others that time nothing (inenv.gpugate's shared lock; :func:`untimed`)
    timed: bool = True
    # (param, value) pairs of a timed probe's variants that time nothing (a pattern that only checks), which may
    # share the GPUs as a probe with ``timed`` False does (:func:`untimed`)
    untimed_params: tuple[tuple[str, str], ...] = ()
    # False: a quick pass leaves this probe's shallow variants (:func:`shallow`: the set-up and one agreement
    # case, untimed) to the full pass: for a probe whose answer is its timings, run on backends whose set-up
    # and agreement the feature probes' own quick variants already answer (step)
    quick_shallow: bool = True
    # True: every variant replays a backend under sustained load, minutes of one question asked deeply: what a
    # --budget leaves out first (checks.run.cost.budget's last tier)
    sustained: bool = False
    # Seconds a rank's progress record (inenv.progress) may stand still while it replays before the launcher
    # treats the rank as hung, well before ``timeout_s``; 0: the probe writes no records. The probe's ranks
    # write it into their records, so every launcher that watches them applies it.
    stall_s: float = 0.0

    def __post_init__(self) -> None:
        floors = [self.min_ranks, *(n for _, _, n in self.min_ranks_by_param)]
        if min(floors) < 1:
            raise ValueError(f"{self.id}: a minimum rank count is at least 1")
        if any(n < self.min_ranks for n in self.ranks):
            raise ValueError(f"{self.id}: default world sizes {self.ranks} go below min_ranks={self.min_ranks}")

    def runs_without_gpu(self, variant: Variant) -> bool:
        """Whether ``variant`` runs on a host without a GPU (see ``gpu_optional``)."""
        return any(variant.param(name) == value for name, value in self.gpu_optional)

    def loads_for(self, params: Mapping[str, str]) -> tuple[str, ...]:
        """The flashinfer JIT modules ``loads`` names for a variant with these params."""
        return tuple(m for name, value, mods in self.loads if params.get(name) == value for m in mods)

    def min_ranks_for(self, variant: Variant) -> int:
        """The fewest ranks ``variant`` can test the feature with."""
        for name, value, n in self.min_ranks_by_param:
            if variant.param(name) == value:
                return n
        return self.min_ranks


DECLARED_MARK = "# --- declared fields"  # the line that opens a probe's declaration block


class Role(StrEnum):
    """What the host side may do with a declared field. A role is held by one field of a probe at most."""

    HEADLINE = "headline"  # metrics: a short text the table shows for a passing variant as written
    RATIO_VS_NCCL = "ratio-vs-nccl"  # metrics: {bytes: this path's time / NCCL's, same processes}; ranked on
    LATENCY = "latency"  # metrics: {bytes: median µs of one call}; ranked on
    NCCL_LATENCY = "nccl-latency"  # metrics: {bytes: NCCL's median µs in the same processes}
    WORKSPACE = "workspace"  # metrics: bytes of workspace per rank, shown in the table
    COMPILE_TIME = "compile-time"  # metrics: seconds spent compiling, shown in the table
    CACHED = "cached"  # metrics: True when built objects were reused instead of built
    HIDDEN = "hidden"  # evidence: hidden size of the messages timed (tokens x hidden elements)
    MULTICAST = "multicast"  # evidence: whether the GPUs support multicast (a device attribute)
    FULL_NVLINK = "full-nvlink"  # evidence: NVLink between every pair of GPUs
    OP_CHECKS = "op-checks"  # evidence: {op: {"eager": {"verdict"}, "graph": {"verdict"}}} per collective
    EAGER_CHECKS = "eager-checks"  # evidence: {size: {"verdict"}} of eager calls against the exact result
    GRAPH_CHECKS = "graph-checks"  # evidence: {"checks": {size: {"verdict"}}} of graph replays
    # metrics: the rank-agreement summary of inenv.kit._agree (ranks_identical, deterministic, divergent_cases...)
    AGREEMENT = "agreement"
    NO_ATOMICS = "no-atomics"  # metrics: {pair: NVML status} of GPU pairs with peer access but no native atomics


@dataclass(frozen=True)
class Field:
    """One metric or evidence field a probe writes: its key, unit, meaning, and the role the host may give it
    (None: recorded for people and for `checks diff`, never ranked on)."""

    name: str
    unit: str  # e.g. "µs by message bytes", "bytes", "s", "count", "bool", "text", "record"
    meaning: str
    role: Role | None = None


@dataclass(frozen=True)
class Declared:
    """What a probe declares about its records (see :func:`declared`)."""

    metrics: tuple[Field, ...] = ()
    evidence: tuple[Field, ...] = ()
    allreduce_path: bool = False  # a failure rules out an allreduce path (`checks advise` lists it to avoid)
    # (value of the spec's ``build_param``, seconds): how long that build takes, for a host that has timed none
    # of it yet; the host starts the longest expected build first (an earlier run's time wins over this).
    build_cost: tuple[tuple[str, float], ...] = ()

    def metric(self, role: Role) -> str | None:
        """The key of the metric holding ``role``, if the probe writes one."""
        return next((f.name for f in self.metrics if f.role is role), None)

    def evidence_key(self, role: Role) -> str | None:
        return next((f.name for f in self.evidence if f.role is role), None)


def _fields(rows: Any, where: str) -> tuple[Field, ...]:
    if not isinstance(rows, tuple):
        raise ValueError(f"{where}: a tuple of (name, unit, meaning, role) rows")
    out: list[Field] = []
    for row in rows:
        if not (isinstance(row, tuple) and len(row) == 4 and all(isinstance(x, str) for x in row[:3])
                and (row[3] is None or isinstance(row[3], str))):
            raise ValueError(f"{where}: {row!r} is not a (name, unit, meaning, role or None) row")
        name, unit, meaning, role = row
        if not name or not unit or not meaning:
            raise ValueError(f"{where}: {name or row!r} needs a name, a unit and a meaning")
        try:
            out.append(Field(name, unit, meaning, Role(role) if role is not None else None))
        except ValueError:
            raise ValueError(f"{where}: {name}: unknown role {role!r}; known: "
                             f"{', '.join(r.value for r in Role)}") from None
    names = [f.name for f in out]
    roles = [f.role for f in out if f.role is not None]
    if len(set(names)) != len(names) or len(set(roles)) != len(roles):
        raise ValueError(f"{where}: a field name or a role appears twice")
    return tuple(out)


def declared(module: ModuleType | Mapping[str, Any]) -> Declared:
    """A probe module's declaration (its ``METRICS``, ``EVIDENCE``, ``ALLREDUCE_PATH`` and ``BUILD_COST``),
    checked; a probe
    that declares nothing has no fields the host may read. ValueError names what is malformed."""
    attrs = module if isinstance(module, Mapping) else vars(module)
    spec = attrs.get("SPEC")
    where = spec.id if isinstance(spec, ProbeSpec) else str(attrs.get("__name__", "probe"))
    path = attrs.get("ALLREDUCE_PATH", False)
    if not isinstance(path, bool):
        raise ValueError(f"{where}.ALLREDUCE_PATH: True or False")
    return Declared(_fields(attrs.get("METRICS", ()), f"{where}.METRICS"),
                    _fields(attrs.get("EVIDENCE", ()), f"{where}.EVIDENCE"), path,
                    _build_cost(attrs.get("BUILD_COST", ()), f"{where}.BUILD_COST"))


def _build_cost(raw: Any, where: str) -> tuple[tuple[str, float], ...]:
    """``BUILD_COST``: pairs of a build parameter's value and the seconds its build takes (>= 0)."""
    if not isinstance(raw, tuple | list):
        raise ValueError(f"{where}: a tuple of (value, seconds) pairs")
    out = []
    for pair in raw:
        ok = isinstance(pair, tuple | list) and len(pair) == 2 and isinstance(pair[0], str) and isinstance(
            pair[1], int | float) and not isinstance(pair[1], bool) and pair[1] >= 0
        if not ok:
            raise ValueError(f"{where}: {pair!r} is not a (value, seconds >= 0) pair")
        out.append((pair[0], float(pair[1])))
    return tuple(out)


@dataclass(frozen=True)
class HostView:
    """What variant planning may know about the host (a subset of the host facts)."""

    gpu_count: int = 0
    compute_capability: str | None = None  # e.g. "9.0"
    gpu_name: str | None = None
    target_archs: tuple[str, ...] = ("12.0a", "12.0f")  # cross-compile targets asked by the user
    level: str = FULL  # QUICK: plan the fewest variants that still answer each question once


@dataclass(frozen=True)
class Skip:
    """Why a variant is decided without launching: a reason code and a note, as data, and the status: ``skip``
    (not testable here), or ``not-run`` (the plan leaves it out on purpose: its question is asked elsewhere, as
    the note says; a not-run never hides an earlier verdict, and the next run decides it again)."""

    code: str  # e.g. no-gpu, too-few-gpus, not-applicable
    note: str
    status: str = "skip"  # inenv.status: skip or not-run


# The reason code of a variant a probe plans ``not-run`` at a world size on purpose (a :class:`Skip` of that
# status): the same question runs at other world sizes, which its note names.
NARROWED = "narrowed-world-size"


def gpu_shortfall(host: HostView, ranks: int, why: str = "") -> Skip | None:
    """The skip for a variant of ``ranks`` ranks, each on its own GPU, on this host (None: it fits).
    ``why`` says why the ranks cannot share a GPU, where that is not obvious."""
    if host.gpu_count == 0:
        return Skip("no-gpu", "no GPU on this host")
    if ranks > host.gpu_count:
        return Skip("too-few-gpus", f"needs {ranks} GPUs{f' ({why})' if why else ''}, host has {host.gpu_count}")
    return None


Params = tuple[tuple[str, str], ...]
SHARED = "shared"  # the value of ``placement`` in the key of a variant whose ranks share GPUs
# World sizes checked with ranks sharing GPUs where the host has fewer: the tensor-parallel sizes engines
# serve with most (and 3, which the engines' gates treat apart)
SHARED_WORLDS = (2, 3, 4, 8)
# A variant's depth, as a param of its key (``depth=setup``): at a world size outside :func:`deep_sizes` a probe
# with a shallow path runs with a GPU per rank what ranks sharing a GPU run (its set-up and one exact agreement
# case per dtype), not its full grid and timings. Absent: the probe's full selection.
DEPTH = "depth"
SETUP = "setup"


@dataclass(frozen=True)
class Variant:
    probe_id: str
    ranks: int = 1
    params: tuple[tuple[str, str], ...] = ()  # ordered (name, value) pairs
    share_gpu: bool = False  # this variant places several ranks on one GPU
    skip: Skip | None = None  # planned as `skip` without launching (e.g. too few GPUs)
    gpus: int = 0  # ranks sharing GPUs: how many GPUs they wrap over (0: every GPU the host has)

    @property
    def parts(self) -> Params:
        """The (name, value) pairs of the key in order: ranks, ``placement=shared`` and the GPU count when ranks
        share GPUs, params."""
        shared: Params = ()
        if self.share_gpu:
            shared = (("placement", SHARED), *((("gpus", str(self.gpus)),) if self.gpus else ()))
        return (("ranks", str(self.ranks)), *shared, *self.params)

    @property
    def gpu_count(self) -> int:
        """The GPUs this variant's ranks use: one each, or the count they share (0: the host's, unknown here)."""
        return self.gpus if self.share_gpu else self.ranks

    @property
    def key(self) -> str:
        """Stable, human-readable variant id, e.g. ``ranks=2,algo=allreduce:tree,mode=graph``."""
        return ",".join(f"{k}={v}" for k, v in self.parts)

    def param(self, name: str, default: str | None = None) -> str | None:
        return dict(self.params).get(name, default)

    def to_json(self) -> dict[str, Any]:
        return {
            "probe_id": self.probe_id,
            "ranks": self.ranks,
            "params": [list(p) for p in self.params],
            "share_gpu": self.share_gpu,
            "gpus": self.gpus,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Variant:
        return cls(
            probe_id=str(data["probe_id"]),
            ranks=int(data.get("ranks", 1)),
            params=tuple((str(k), str(v)) for k, v in data.get("params", [])),
            share_gpu=bool(data.get("share_gpu", False)),
            gpus=int(data.get("gpus", 0) or 0),
        )


def key_parts(key: str) -> Params:
    """The (name, value) pairs of a recorded :attr:`Variant.key`, in order (its inverse: a part without ``=``
    maps to ""). Recorded keys are read here only."""
    return tuple((k, v) for k, _, v in (part.partition("=") for part in key.split(",") if part))


@dataclass(frozen=True)
class RankContext:
    """Everything a rank process knows; built by the rank launcher from its environment."""

    rank: int
    world_size: int
    local_rank: int
    device_index: int | None  # CUDA device for this rank, None without a GPU
    variant: Variant
    workdir: Path  # private scratch directory of this variant (removed afterwards)
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    env: dict[str, str] = field(default_factory=dict)

    def param(self, name: str, default: str | None = None) -> str | None:
        return self.variant.param(name, default)

    def init_process_group(self, backend: str | None = None, timeout_s: float = 120.0) -> Any:
        """Join this rank to torch.distributed (nccl with a GPU, else gloo) and return the module.

        Imports torch here, never at module level. Sets the rank's CUDA device first."""
        import datetime

        import torch
        import torch.distributed as dist

        if self.device_index is not None:
            torch.cuda.set_device(self.device_index)
        dist.init_process_group(
            backend or ("nccl" if self.device_index is not None else "gloo"),
            init_method=f"tcp://{self.master_addr}:{self.master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        return dist

    def log(self, message: str) -> None:
        """Progress lines go to stderr (stdout belongs to the result protocol)."""
        os.write(2, f"[rank {self.rank}] {message}\n".encode())


def outcome(
    status: str,
    note: str = "",
    reason_code: str = "",
    metrics: dict[str, Any] | None = None,
    evidence: dict[str, Any] | None = None,
) -> dict[str, Any]:
    parsed = status_of(status)
    if parsed not in RUN_STATUSES:
        raise ValueError(f"a probe may return {sorted(s.value for s in RUN_STATUSES)}, not {status!r}")
    if parsed is Status.PARTIAL and not note:
        raise ValueError("a partial outcome needs a note naming the limitation")
    return {
        "status": parsed.value,
        "note": note,
        "reason_code": reason_code,
        "metrics": metrics or {},
        "evidence": evidence or {},
    }


def combine_worst(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """Default merge: the worst rank's outcome wins; metrics of rank 0, evidence per rank."""
    if not outcomes:
        return outcome("fail", note="no rank reported an outcome", reason_code="no-result")
    verdict = worst(o.get("status", "fail") for o in outcomes)
    chosen = next(o for o in outcomes if (status_of(o.get("status", "fail")) or Status.FAIL) is verdict)
    merged = dict(chosen)
    merged["metrics"] = {**outcomes[0].get("metrics", {}), **chosen.get("metrics", {})}
    return merged


def at_level(sizes: tuple[T, ...]) -> tuple[T, ...]:
    """The message sizes (or cases) a rank measures: all of them, or in a quick run only the first, which
    every probe lists smallest first. Read from the rank's environment, so the variant keeps its key."""
    return sizes[:1] if os.environ.get(LEVEL_ENV) == QUICK else sizes


def default_variants(spec: ProbeSpec, host: HostView) -> list[Variant]:
    """One variant per world size; too few GPUs means `skip` unless ranks may share a GPU."""
    out: list[Variant] = []
    for n in spec.ranks:
        short = gpu_shortfall(host, n) if spec.needs_gpu else None
        if short and (short.code == "no-gpu" or spec.distinct_gpus):
            out.append(Variant(spec.id, n, skip=short))
        else:
            out.append(Variant(spec.id, n, share_gpu=spec.needs_gpu and n > host.gpu_count))
    return out


def per_world_size(spec: ProbeSpec, host: HostView, param_sets: Iterable[Params]) -> list[Variant]:
    """One variant per world size of ``spec`` and per set of params, each rank on a GPU of its own: a
    world size over the host's GPU count is a planned skip."""
    sets = list(param_sets)
    return [Variant(spec.id, n, params=p, skip=gpu_shortfall(host, n)) for n in spec.ranks for p in sets]


def world_sizes(host: HostView) -> tuple[int, ...]:
    """The world sizes a multi-rank probe is planned at: every size from 2 to the host's GPU count (3, 5, 6 and 7
    included: engines serve with them and their gates treat them apart), and :data:`SHARED_WORLDS` beyond it."""
    return tuple(sorted({*range(2, host.gpu_count + 1), *SHARED_WORLDS}))


def deep_sizes(host: HostView) -> tuple[int, ...]:
    """The world sizes that get a probe's full grid and timings with a GPU per rank: the powers of two from 2 up to
    the host's GPU count, and the GPU count itself (8 GPUs: 2, 4, 8; 6 GPUs: 2, 4, 6; 2 GPUs: 2; fewer: none).
    Engines serve tensor parallelism mostly at powers of two and at the whole host, so shapes and latencies
    are asked there; the other sizes are asked mainly of the engines' gates and the backends' set-up (a
    world size a kernel refuses), which a set-up and one exact agreement case answer (:data:`DEPTH`)."""
    if host.gpu_count < 2:
        return ()
    powers = {1 << k for k in range(1, host.gpu_count.bit_length()) if 1 << k <= host.gpu_count}
    return tuple(sorted({*powers, host.gpu_count}))


def shallow(variant: Variant) -> bool:
    """Whether ``variant`` runs its probe's shallow selection (the set-up and one exact agreement case per dtype,
    untimed) rather than the full grid: its ranks share GPUs (``Variant.share_gpu``, which also says how they are
    placed: a gloo process group, nothing timed), or they have a GPU each at a world size outside
    :func:`deep_sizes` (``depth=setup``)."""
    return variant.share_gpu or variant.param(DEPTH) == SETUP


def untimed(spec: ProbeSpec, variant: Variant) -> bool:
    """Whether ``variant`` times nothing, so it may run beside other such variants on the GPUs: its probe never
    times (``ProbeSpec.timed`` False), one of its params is among the probe's ``untimed_params``, or the variant
    runs the shallow selection (:func:`shallow`)."""
    return (not spec.timed or any(variant.param(k) == v for k, v in spec.untimed_params)
            or shallow(variant))


def question(variant: Variant) -> Params:
    """The params that name what ``variant`` asks, its depth left out: the variants of one question at every world
    size, deep or shallow (the quick pass's smallest world size, the budget's tiers)."""
    return tuple(p for p in variant.params if p[0] != DEPTH)


# What a multi-rank probe plans at a world size with a GPU per rank outside :func:`deep_sizes` (``other_sizes``):
# FULL_DEPTH its full selection, as at a deep size; SETUP ``depth=setup``, its shallow selection (:func:`shallow`);
# OMIT nothing (a probe whose only answer is a timing)
FULL_DEPTH = "full"
OMIT = "omit"


def multi_rank(spec: ProbeSpec, host: HostView, param_sets: Iterable[Params],
               shares: Callable[[Params], bool] = lambda _: False, shared_gpus: int = 0,
               why: str = "", other_sizes: str = FULL_DEPTH) -> list[Variant]:
    """One variant per world size (:func:`world_sizes`) and per set of params. Each rank has a GPU of its own
    where the host has enough; beyond that, a set of params ``shares`` accepts runs with its ranks sharing
    ``shared_gpus`` GPUs (0: all the host's; correctness and agreement only, never timed against the others)
    and any other is a planned skip saying ``why`` its ranks cannot share. At a world size the host has GPUs for
    outside :func:`deep_sizes`, ``other_sizes`` says what is planned: the full selection (:data:`FULL_DEPTH`),
    the shallow one marked ``depth=setup`` (:data:`SETUP`) or nothing (:data:`OMIT`)."""
    if other_sizes not in (FULL_DEPTH, SETUP, OMIT):
        raise ValueError(f"{spec.id}: other_sizes {other_sizes!r} is not one of {FULL_DEPTH}, {SETUP}, {OMIT}")
    sets = list(param_sets)
    deep = deep_sizes(host)
    out: list[Variant] = []
    for n in world_sizes(host):
        if 2 <= n <= host.gpu_count and n not in deep:
            if other_sizes == OMIT:
                continue
            if other_sizes == SETUP:
                out += [Variant(spec.id, n, params=(*p, (DEPTH, SETUP))) for p in sets]
                continue
        for p in sets:
            short = gpu_shortfall(host, n, why)
            if short is not None and short.code != "no-gpu" and shares(p):
                gpus = min(shared_gpus or host.gpu_count, host.gpu_count)
                out.append(Variant(spec.id, n, params=p, share_gpu=True, gpus=gpus))
            else:
                out.append(Variant(spec.id, n, params=p, skip=short))
    return out
