"""What a `checks run` will do: cells x probes x variants, and which are decided without running (pure)."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import ModuleType
from typing import Any

from checks.results.result import ProbeResult
from common import cellid
from common.build import backend, buildrecord
from inenv import kit
from inenv.probe import HostView, ProbeSpec, Variant, default_variants, question, shallow
from inenv.status import Status


class CellState(StrEnum):
    """Where a cell stands before any probe runs (the JSON of the manifest spells the value)."""

    RESOLVED = "resolved"  # the matrix resolved its versions: it has an image or a venv to run in
    UNAVAILABLE = "unavailable"  # a version it names cannot be installed (no such wheel)
    UNREACHABLE = "unreachable"  # the resolver could not reach an index to decide
    LOCAL = "local"  # an existing environment, run with `checks run --local`


class ImageState(StrEnum):
    """Whether the environment a resolved cell runs in (an image or a venv) is there."""

    NONE = ""  # nothing was looked for: the cell did not resolve
    BUILT = "built"
    FAILED = "failed"  # its build failed
    MISSING = "missing"  # never built, or its record is unreadable or names the other backend
    LOCAL = "local"  # the interpreter of `checks run --local`


@dataclass(frozen=True)
class CellTarget:
    """A cell as the checks see it: its versions and where it runs (an image, or a local interpreter).
    ``status`` and ``image_status`` may be given spelled; they are kept as their enums (ValueError otherwise)."""

    cell_id: str
    status: CellState
    reason: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    image: str | None = None
    image_status: ImageState = ImageState.NONE
    image_reason: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", CellState(self.status))
        object.__setattr__(self, "image_status", ImageState(self.image_status))


@dataclass(frozen=True)
class Decided:
    """A verdict reached without running anything (a cell that cannot run, a planned skip, a planner error)."""

    status: Status
    reason_code: str
    note: str


@dataclass(frozen=True)
class WorkItem:
    cell: CellTarget
    spec: ProbeSpec
    variant: Variant
    timeout_s: float
    decided: Decided | None = None
    # a result recorded earlier from the same inputs (checks.run.incremental): carried into this run, not rerun
    reused: ProbeResult | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.cell.cell_id, self.spec.id, self.variant.key)

    @property
    def runs(self) -> bool:
        """Whether this item starts a worker (else it is decided in advance or reused)."""
        return self.decided is None and self.reused is None


def cell_decided(cell: CellTarget) -> Decided | None:
    if cell.status is CellState.UNAVAILABLE:
        return Decided(Status.UNAVAILABLE, "cell-unavailable", cell.reason)
    if cell.status is CellState.UNREACHABLE:
        return Decided(Status.NOT_RUN, "cell-unreachable", cell.reason)
    if cell.image_status is ImageState.FAILED:
        return Decided(Status.NOT_RUN, "image-failed", cell.image_reason or "the image failed to build")
    if cell.image_status is ImageState.MISSING:
        return Decided(Status.NOT_RUN, "image-missing", cell.image_reason or "the image was never built")
    return None


def variants_for(module: ModuleType, host: HostView) -> list[Variant]:
    spec: ProbeSpec = module.SPEC
    planner = getattr(module, "variants", None)
    return list(planner(host)) if planner else default_variants(spec, host)


def plan_work(cells: list[CellTarget], probes: dict[str, ModuleType], host: HostView,
              timeout_scale: float = 1.0) -> list[WorkItem]:
    items: list[WorkItem] = []
    planned: dict[str, list[Variant] | Exception] = {}
    for pid in sorted(probes):
        try:
            planned[pid] = variants_for(probes[pid], host)
        except Exception as exc:  # a probe's planner bug must not stop the run
            planned[pid] = exc
    # In each cell the probes that need no GPU come first: GPU variants run alone, and each one starts up while
    # the one before it runs (inenv.gpugate), so a CPU variant between two GPU ones would cost a cold start.
    order = sorted(probes, key=lambda pid: (probes[pid].SPEC.needs_gpu, pid))
    for cell in cells:
        decided = cell_decided(cell)
        for pid in order:
            spec: ProbeSpec = probes[pid].SPEC
            variants = planned[pid]
            if isinstance(variants, Exception):
                items.append(WorkItem(cell, spec, Variant(pid), spec.timeout_s * timeout_scale,
                                      Decided(Status.FAIL, "probe-bug", f"variants() raised {variants!r}"[:300])))
                continue
            for v in variants:
                p = decided or (Decided(Status(v.skip.status), v.skip.code, v.skip.note) if v.skip else None)
                items.append(WorkItem(cell, spec, v, spec.timeout_s * timeout_scale, p))
    return items


def select_cells(cells: list[CellTarget], only: list[str]) -> list[CellTarget]:
    if not only:
        return cells
    return [c for c in cells if any(fnmatch.fnmatchcase(c.cell_id, g) for g in only)]


def matches_cuda(cell_cuda: str, wanted: str) -> bool:
    """`--cuda 13` selects every 13.x cell; `--cuda 12.8` exactly 12.8."""
    return cell_cuda == wanted or cell_cuda.startswith(wanted + ".")


def local_cell_id(versions: dict[str, Any]) -> str:
    """A readable id for an existing environment, in the order of provisioned cell ids, plus its nvcc."""
    return str(cellid.local(versions))


def image_state(envs_dir: Path, cell_id: str) -> tuple[ImageState, str | None, str]:
    """(built | failed | missing, image tag, reason) from envs/<cell>/build.json written by `provision build`."""
    loaded = buildrecord.read(envs_dir / cell_id, backend.DOCKER)
    path, rec = loaded.path, loaded.record
    if rec is None:
        if loaded.problem:
            return ImageState.MISSING, None, f"{path} {loaded.problem}: rerun `provision build --only {cell_id}`"
        return ImageState.MISSING, None, f"no {path}: run `provision build --only {cell_id}`"
    if rec.backend == backend.VENV:  # the latest `provision build` of this cell made a venv, not an image
        return ImageState.MISSING, None, (f"{path} records a venv cell: checks run --backend venv, or "
                                 f"`provision build --backend docker --only {cell_id}`")
    if rec.runnable and rec.tag:
        return ImageState.BUILT, rec.tag, ""
    return ImageState.FAILED, rec.tag, rec.reason or f"build status {rec.data.get('status', '')!r}"


REUSED = "reused"  # summary_counts' key for the variants an earlier run answered


def jit_modules(item: WorkItem) -> tuple[str, ...]:
    """The flashinfer JIT modules a variant loads: its probe's entry in the flashinfer kit, or what the probe
    declares itself (ProbeSpec.loads)."""
    params = dict(item.variant.params)
    return kit.modules_for(item.spec.id, params) or item.spec.loads_for(params)


def not_carried(item: WorkItem, carries: Mapping[str, Mapping[str, tuple[str, ...]]],
                capability: str | None) -> list[str]:
    """The flashinfer modules ``item`` loads that its cell does not carry for a GPU of ``capability``."""
    have = carries.get(item.cell.cell_id, {})
    return [m for m in jit_modules(item) if not (capability and m in have and kit.runs_on(have[m], capability))]


def compiles_here(item: WorkItem, carries: Mapping[str, Mapping[str, tuple[str, ...]]], capability: str | None,
                  unpublished: Callable[[WorkItem, list[str]], list[str]]) -> bool:
    """Whether a variant of a compile probe (its build parameter names a flashinfer module: fi-jit) will compile
    that module here: its target (``arch=local``: this GPU's ``capability``; else the named one) is not in what
    the cell carries (``carries``: from its build record, or what a user's environment holds) and no fi-jit build
    has published it for the cell (``unpublished``)."""
    name = item.spec.build_param
    module = item.variant.param(name) if name else None
    if not module or not item.runs:
        return False
    arch = item.variant.param("arch") or "local"
    target = capability if arch == "local" else arch.rstrip("af")
    have = carries.get(item.cell.cell_id, {}).get(module)
    if target and have is not None and kit.runs_on(have, target):
        return False
    return bool(unpublished(item, [module]))


def deferred(items: list[WorkItem], carries: Mapping[str, Mapping[str, tuple[str, ...]]], capability: str | None,
             unpublished: Callable[[WorkItem, list[str]], list[str]]) -> list[WorkItem]:
    """A quick pass's GPU variants that would compile a flashinfer module in their turn (neither carried for
    this GPU's ``capability`` nor built here: ``unpublished``) become decided not-run ``deferred-compile``:
    the full pass compiles and runs them, and the quick answer does not wait minutes for one build."""
    out: list[WorkItem] = []
    for it in items:
        lacking = not_carried(it, carries, capability) if it.runs and it.spec.needs_gpu else []
        missing = unpublished(it, lacking) if lacking else []
        if missing:
            note = (f"loads {', '.join(missing)}, which this cell does not carry for compute capability "
                    f"{capability or 'unknown'} and fi-jit has not built here: left to the full pass")
            it = dataclasses.replace(it, decided=Decided(Status.NOT_RUN, "deferred-compile", note))
        out.append(it)
    return out


STAGE_WAIT = "awaiting-kernel-stage"  # a full pass run while the kernel stage builds leaves these to the pass after it


def stage_modules(item: WorkItem) -> tuple[str, ...]:
    """The flashinfer modules ``item`` needs built: those it loads (:func:`jit_modules`) and the one it builds
    (its probe's ``build_param``: fi-jit's module)."""
    built = item.variant.param(item.spec.build_param) if item.spec.build_param else None
    return (*jit_modules(item), *((built,) if built else ()))


def awaiting_stage(items: list[WorkItem], building: Mapping[str, Iterable[str]]) -> list[WorkItem]:
    """A full pass run while the kernel stage `provision build` left running builds ``building`` (cell id ->
    modules: common.build.kernelstage.building): each variant that would run and needs one of its cell's
    modules among them (:func:`stage_modules`) becomes decided not-run :data:`STAGE_WAIT`, for the pass after the
    stage to run with what it carried, neither compiled a second time nor loaded half-built. Everything else
    runs while the stage builds."""
    out: list[WorkItem] = []
    for it in items:
        pending = set(building.get(it.cell.cell_id, ()))
        needs = [m for m in stage_modules(it) if m in pending] if it.runs and pending else []
        if needs:
            note = (f"needs {', '.join(needs)}, which the kernel stage `provision build` started is building in "
                    "this cell: run after it ends")
            it = dataclasses.replace(it, decided=Decided(Status.NOT_RUN, STAGE_WAIT, note))
        out.append(it)
    return out


def deferred_sizes(items: list[WorkItem]) -> list[WorkItem]:
    """A quick pass runs each multi-rank GPU variant at its smallest world size only: the same probe and
    params at more ranks (at any depth: ``inenv.probe.question``) become decided not-run ``deferred-world-size``
    (the full pass runs them). On a host with one GPU every such size shares it, and 3, 4 and 8 ranks
    time-slicing one GPU take minutes, so without this the first answer waits for them."""
    smallest: dict[tuple[str, str, tuple[tuple[str, str], ...]], int] = {}
    for it in items:
        if it.decided is None and it.spec.needs_gpu and it.variant.ranks >= 2:
            group = (it.cell.cell_id, it.spec.id, question(it.variant))
            smallest[group] = min(smallest.get(group, it.variant.ranks), it.variant.ranks)
    out: list[WorkItem] = []
    for it in items:
        least = smallest.get((it.cell.cell_id, it.spec.id, question(it.variant)))
        if it.runs and it.spec.needs_gpu and least is not None and it.variant.ranks > least:
            note = (f"{it.variant.ranks} ranks: the quick pass runs this variant at {least} ranks only; "
                    "left to the full pass")
            it = dataclasses.replace(it, decided=Decided(Status.NOT_RUN, "deferred-world-size", note))
        out.append(it)
    return out


def deferred_shallow(items: list[WorkItem]) -> list[WorkItem]:
    """A quick pass leaves the shallow variants (``inenv.probe.shallow``: ranks sharing a GPU, or depth=setup) of a
    probe that declares ``ProbeSpec.quick_shallow`` False to the full pass, as decided not-run
    ``deferred-shallow``: their set-up and agreement checks repeat what the feature probes' quick variants check on
    the same backends, and each costs a variant's start on the first answer's path."""
    out: list[WorkItem] = []
    for it in items:
        if it.runs and it.spec.needs_gpu and not it.spec.quick_shallow and shallow(it.variant):
            note = ("checked, not timed, at this world size: the quick pass leaves it to the full pass (the "
                    "feature probes' quick variants check the same backend's set-up)")
            it = dataclasses.replace(it, decided=Decided(Status.NOT_RUN, "deferred-shallow", note))
        out.append(it)
    return out


def summary_counts(items: list[WorkItem]) -> dict[str, Counter[str]]:
    """Per cell: how many variants run, how many are reused, and how many are decided in advance, by reason."""
    out: dict[str, Counter[str]] = {}
    for it in items:
        c = out.setdefault(it.cell.cell_id, Counter())
        if it.decided is not None:
            c[f"{it.decided.status}: {it.decided.note}"] += 1
        else:
            c[REUSED if it.reused is not None else "run"] += 1
    return out
