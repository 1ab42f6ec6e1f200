"""A cell's build record (``envs/<cell>/build.json``, ``build-venv.json``): its status, one type, and one reader
that gives one typed value (BuildRecord) for both sides: `provision build` writes and rereads it
(provision.cellrecord), `checks run` reads it to know which cells can run and what they carry
(checks.run.plan, checks.run.venvcell, checks.run.session). Nothing else opens these files."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

from common.build import backend
from inenv.selfcheck import ENGINES


class BuildStatus(StrEnum):
    """How a cell's last build by one backend ended, as its record says."""

    BUILT = "built"
    UNCHANGED = "skipped-unchanged"  # nothing to do: the inputs match the build that is there
    FAILED = "failed"
    WOULD_BUILD = "would-build"  # --dry-run: the plan of a build, never written to a record

    @property
    def runnable(self) -> bool:
        """A record with this status names a cell that can run."""
        return self in (BuildStatus.BUILT, BuildStatus.UNCHANGED)

    @classmethod
    def of(cls, record: dict[str, Any]) -> BuildStatus | None:
        """The status a record (as read from disk) names, or None when it names none this type knows."""
        try:
            return cls(str(record.get("status", "")))
        except ValueError:
            return None


def runnable(record: dict[str, Any]) -> bool:
    """A record (as read from disk) whose status names a cell that can run."""
    status = BuildStatus.of(record)
    return status is not None and status.runnable


@dataclass(frozen=True)
class BuildRecord:
    """A cell's build record as read back: one typed value. The fields the run side decides on are checked once
    here (a value of the wrong type reads as absent); ``data`` is the whole record as it lies on disk, for
    what only its writer (provision) reads back."""

    cell_id: str
    status: BuildStatus | None  # None: a status this type does not know
    backend: str  # backend.DOCKER or backend.VENV; a record that names neither is Docker's
    tag: str | None  # the image's tag (Docker)
    reason: str  # why the build failed, when it did
    python: str | None  # the venv's interpreter (venv)
    base_python: str | None  # the base environment's interpreter of an overlay venv cell
    from_base_summary: str  # what an overlay venv cell takes from its base ("" for a full cell)
    carried: Mapping[str, tuple[str, ...]]  # installed carried comm modules -> their SASS targets
    data: Mapping[str, Any] = field(repr=False)
    # comm modules compiled by this build -> the compilers' CPU seconds per target (provision.kernels)
    compile_costs: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    no_nvcc: str = ""  # what the build's look for nvcc in the cell found instead of one ("": it found one)
    # what the build's self-check found installed of the serving engines and sgl-kernel (CHECKED: distribution ->
    # version); None: the record says nothing of the engines
    holds: Mapping[str, str] | None = None

    @property
    def runnable(self) -> bool:
        return self.status is not None and self.status.runnable

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BuildRecord:
        named = data.get("backend")
        return cls(cell_id=_text(data.get("cell_id")) or "", status=BuildStatus.of(dict(data)),
                   backend=named if named in backend.RECORD_NAMES else backend.DOCKER,
                   tag=_text(data.get("tag")), reason=_text(data.get("reason")) or "",
                   python=_text(data.get("python")), base_python=_text(data.get("base_python")),
                   from_base_summary=_text(data.get("from_base_summary")) or "", carried=_carried(data),
                   data=MappingProxyType(dict(data)), compile_costs=_compile_costs(data), no_nvcc=_no_nvcc(data),
                   holds=_holds(data))


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _carried(data: Mapping[str, Any]) -> Mapping[str, tuple[str, ...]]:
    """The comm modules a record says its cell carries, installed, with their SASS (provision.kernels); {}
    when it has none or they are not of that shape."""
    kernels = data.get("kernels")
    if not isinstance(kernels, Mapping) or kernels.get("installed") is not True:
        return MappingProxyType({})
    modules = kernels.get("modules")
    out: dict[str, tuple[str, ...]] = {}
    for name, row in (modules.items() if isinstance(modules, Mapping) else ()):
        sass = row.get("sass") if isinstance(row, Mapping) and row.get("carried") is True else None
        if isinstance(name, str) and isinstance(sass, list):
            out[name] = tuple(str(s) for s in sass)
    return MappingProxyType(out)


def missing_nvcc(identity: Any) -> str:
    """What a cell's identity query (the kernel stage's, in the cell) found instead of nvcc where flashinfer looks
    for one, as one line of at most 300 characters; "" when it found one or the identity is not that shape."""
    if not isinstance(identity, Mapping) or identity.get("nvcc") or not identity.get("nvcc_error"):
        return ""
    return " ".join(str(identity["nvcc_error"]).split())[:300]


def _no_nvcc(data: Mapping[str, Any]) -> str:
    """:func:`missing_nvcc` of the identity the record's kernel stage read; "" when it read none."""
    kernels = data.get("kernels")
    return missing_nvcc(kernels.get("identity") if isinstance(kernels, Mapping) else None)


def _engines(data: Mapping[str, Any]) -> Mapping[str, str] | None:
    """The serving engines the record's self-check found (inenv.selfcheck.engine_facts), names and versions as
    text; None when the record has no such mapping."""
    check = data.get("selfcheck")
    found = check.get("engines") if isinstance(check, Mapping) else None
    if not isinstance(found, Mapping):
        return None
    return MappingProxyType({k: v for k, v in found.items() if isinstance(k, str) and isinstance(v, str)})


# sgl-kernel under either of its distribution names (sgl-kernel, sglang-kernel: inenv.dists), as a probe's
# DISTRIBUTIONS names it; the self-check reports it under ``sgl_kernel``
SGL_KERNEL = "sgl-kernel"
CHECKED = (*ENGINES, SGL_KERNEL)  # the distributions whose presence a build's self-check reports (BuildRecord.holds)


def _holds(data: Mapping[str, Any]) -> Mapping[str, str] | None:
    """The engines (:func:`_engines`) and sgl-kernel, when the self-check found it (``selfcheck.sgl_kernel``
    with a version, under :data:`SGL_KERNEL`); None when the record says nothing of the engines."""
    engines = _engines(data)
    if engines is None:
        return None
    check = data.get("selfcheck")
    kernel = check.get("sgl_kernel") if isinstance(check, Mapping) else None
    version = kernel.get("version") if isinstance(kernel, Mapping) else None
    return MappingProxyType({**engines, **({SGL_KERNEL: version} if isinstance(version, str) else {})})


def _compile_costs(data: Mapping[str, Any]) -> Mapping[str, float]:
    """CPU seconds per target of each comm module the record says this build compiled (a module it reused or
    found cached records none); a row of another shape is left out."""
    kernels = data.get("kernels")
    modules = kernels.get("modules") if isinstance(kernels, Mapping) else None
    out: dict[str, float] = {}
    for name, row in (modules.items() if isinstance(modules, Mapping) else ()):
        cpu, targets = (row.get("compile_cpu_s"), row.get("targets")) if isinstance(row, Mapping) else (None, None)
        if (isinstance(name, str) and isinstance(cpu, int | float) and not isinstance(cpu, bool) and cpu > 0
                and isinstance(targets, int) and not isinstance(targets, bool) and targets > 0):
            out[name] = float(cpu) / targets
    return MappingProxyType(out)


@dataclass(frozen=True)
class Loaded:
    """What reading a cell's record gave: the record (None when absent or unreadable) and, when unreadable,
    why (without the path)."""

    path: Path
    record: BuildRecord | None = None
    problem: str = ""

    @property
    def status(self) -> BuildStatus | None:
        return self.record.status if self.record is not None else None

    @property
    def runnable(self) -> bool:
        return self.record is not None and self.record.runnable


def _load(path: Path) -> Loaded:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return Loaded(path)
    except (OSError, ValueError) as exc:
        return Loaded(path, problem=f"unreadable ({exc})")
    if not isinstance(data, dict):
        return Loaded(path, problem="unreadable (not a JSON object)")
    return Loaded(path, BuildRecord.from_json(data))


def read(folder: Path, of: str = backend.DOCKER) -> Loaded:
    """The record of the cell in ``folder`` that backend ``of`` wrote (its own file, backend.RECORD_NAMES);
    absent or unreadable says so. A build.json that records a venv cell (``backend: venv``) is read as the
    venv record while there is no build-venv.json."""
    own = _load(folder / backend.RECORD_NAMES[of])
    if of == backend.VENV and own.record is None and not own.problem:
        shared = _load(folder / backend.RECORD_NAMES[backend.DOCKER])
        if shared.record is not None and shared.record.backend == backend.VENV:
            return shared
    return own
