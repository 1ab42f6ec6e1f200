"""What the kernel stage builds: one job per module of each built cell with flashinfer and a target list, grouped
by build (the same module, flashinfer, CUDA and list in several cells), the longest group first; and what a job
answers without compiling (the module its kernel set holds for the same inputs, or the cell's own known
failure). Pure but for reading the kernel set (kit.kernel_set)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import reasons
from common.build.buildrecord import BuildStatus, missing_nvcc
from common.home import CACHE_ROOT
from inenv import gpuarch, kit
from inenv.kit import COMM_MODULES
from inenv.probes.fi_jit import BUILD_COST, QUICK_MODULE

# `provision build` carries the quick module in its own run (what `checks run`'s quick pass loads) and the
# long ones after it returns (`python -m provision.kernels JOB`: provision.kernels.detached), so the first table
# does not wait for them
QUICK_MODULES = (QUICK_MODULE,)
LONG_MODULES = tuple(m for m in COMM_MODULES if m not in QUICK_MODULES)

KERNELS = CACHE_ROOT / "kernels"  # one kernel set per cell: <cell id>/<name>/<name>.so + record


@dataclass(frozen=True)
class Job:
    cell_id: str
    module: str
    archs: tuple[str, ...]
    flashinfer: str
    torch_cuda: str
    cost: float

    @property
    def build(self) -> tuple[str, ...]:
        """What cells share: the module, flashinfer, CUDA and arch list (the compile cache does the rest)."""
        return (self.module, self.flashinfer, self.torch_cuda, *self.archs)


def plan(cells: Sequence[Mapping[str, Any]], modules: Sequence[str] = COMM_MODULES) -> list[list[Job]]:
    """The jobs of every cell that has flashinfer and a non-empty arch list, grouped by build, the longest
    group first (pure). ``cells``: cell id, flashinfer version, torch's CUDA, arch list."""
    costs = dict(BUILD_COST)
    groups: dict[tuple[str, ...], list[Job]] = {}
    for c in cells:
        if c.get("flashinfer") in (None, "", "none") or not c.get("archs"):
            continue
        for module in modules:
            job = Job(str(c["cell_id"]), module, tuple(c["archs"]), str(c["flashinfer"]), str(c.get("torch_cuda")),
                      costs.get(module, 0.0) * len(c["archs"]))
            groups.setdefault(job.build, []).append(job)
    return sorted(groups.values(), key=lambda g: -g[0].cost)


def facts_for(job: Job, identity: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What a carried ``job.module`` must have been built from to be current for the cell (``kit.KERNEL_IDENTITY``):
    the cell's facts as its identity query read them, the job's flashinfer and target list; None when the
    cell's identity is unknown (then nothing is current: the module is built)."""
    if not isinstance(identity, Mapping):
        return None
    hashes = identity.get("source_hash") if isinstance(identity.get("source_hash"), Mapping) else {}
    return {"flashinfer": job.flashinfer, "torch": identity.get("torch"), "torch_cuda": identity.get("torch_cuda"),
            "nvcc": identity.get("nvcc"), kit.TVM_FFI: identity.get(kit.TVM_FFI),
            "declared": " ".join(job.archs), "source_hash": hashes.get(job.module)}


def current(kernel_dir: Path, job: Job, identity: Mapping[str, Any] | None) -> tuple[kit.Carried | None, str]:
    """The module of ``job`` in the kernel set when everything that decides its bytes is the cell's (flashinfer,
    torch with its CUDA build, nvcc, apache-tvm-ffi, the declared target list, the module's sources) and its SASS
    answers every declared target flashinfer's gate did not refuse, with "" ; else None and which fact differed
    (or why the set holds none)."""
    found = kit.kernel_set(kernel_dir).get(job.module)
    if found is None:
        return None, "not in the kernel set"
    facts = facts_for(job, identity)
    if facts is None:
        return None, "the cell's identity (torch, nvcc, sources) could not be read"
    why = kit.differs(found.record, facts) or uncovered(found, job.archs)
    return (None, why) if why else (found, "")


def uncovered(found: kit.Carried, archs: Sequence[str]) -> str:
    """The first declared target that the module's recorded SASS does not answer (none of the SASS flashinfer
    compiles that target into, gpuarch.flashinfer_sass) and that flashinfer's gate did not refuse, said as
    ``sass: sm_90a wanted for 9.0a, sm_75 in the record``; "" when every target is answered."""
    have = set(found.sass)
    for arch in archs:
        if arch in found.refused:
            continue
        try:
            wanted = gpuarch.flashinfer_sass(gpuarch.parse_target(arch))
        except gpuarch.TargetError:
            return f"declared target {kit.visible(arch)} is not a GPU architecture"
        if not wanted & have:
            shown = ", ".join(kit.visible(s) for s in found.sass) or "none"
            return f"sass: {' or '.join(sorted(wanted))} wanted for {arch}, {shown} in the record"
    return ""


def known_failure(rec: Mapping[str, Any], job: Job) -> dict[str, Any] | None:
    """The answer the cell's last kernel stage gave for ``job`` when the module was not carried for a reason
    of the cell's own (no nvcc, a module this flashinfer lacks, an architecture gate) and nothing it was
    decided from has changed: the cell is unchanged since (its build was skipped) and the list is the same.
    None otherwise: a failure of stackprobe's own (the reason catalogue's ``harness`` flag: the builder's
    error, a time-out) is always tried again."""
    kernels = rec.get("kernels")
    if BuildStatus.of(rec) is not BuildStatus.UNCHANGED or not isinstance(kernels, Mapping):
        return None
    row = (kernels.get("modules") or {}).get(job.module) if isinstance(kernels.get("modules"), Mapping) else None
    if (kernels.get("arch_list") != " ".join(job.archs) or not isinstance(row, Mapping)
            or row.get("carried") is not False):
        return None
    code = str(row.get("reason_code") or "")
    if not code or retried(code):
        return None
    return {"ok": False, "reason_code": code, "line": row.get("line"), "from": "the cell's last kernel stage"}


def retried(code: str) -> bool:
    """Whether a module not carried for ``code`` is built again by the next kernel stage: the one rule for
    what is tried again, the catalogue's ``harness`` flag (stackprobe's own failure), and any code the
    catalogue does not know."""
    catalogue = reasons.default()
    return code in catalogue.harness_codes or catalogue.get(code) is None


def ready_answer(kernel_dir: Path, job: Job, rec: Mapping[str, Any],
                 identity: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, str]:
    """What a job answers without compiling: the module its kernel set holds for the same inputs, or the
    cell's own known failure; None when it must be built, with why (the fact that differed)."""
    have, why = current(kernel_dir, job, identity)
    if have is not None:
        return {"ok": True, "name": have.name, "sass": have.sass, "from": "kernel set", "refused": have.refused,
                "library_bytes": have.library.stat().st_size}, ""
    if (lacking := no_nvcc(identity)) is not None:
        return lacking, why
    return known_failure(rec, job), why


def no_nvcc(identity: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The answer of every module of a cell whose identity query found no nvcc where flashinfer looks for one
    (a CUDA 12 cell from the registry ships none): nothing can compile there, so no build is started for it
    and its row says why. None when the cell has an nvcc or its identity is unknown."""
    error = missing_nvcc(identity)
    if not error:
        return None
    return {"ok": False, "reason_code": "fi-no-nvcc", "line": f"no nvcc in this cell ({error}): nothing to compile "
            "with, so no build was started", "from": "the cell's identity"}


def set_digest(kernel_dir: Path) -> str:
    """A digest of a kernel set's records (each names its library's build); "" for an empty set."""
    carried = kit.kernel_set(kernel_dir).values()
    recs = sorted((c.name, json.dumps(dict(c.record), sort_keys=True)) for c in carried)
    return hashlib.sha256(json.dumps(recs).encode()).hexdigest()[:16] if recs else ""
