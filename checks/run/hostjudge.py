"""What the host adds to a probe's verdict from what the probe recorded, with libraries the environment under
test need not hold. One registry by probe id (JUDGES); the runner applies a probe's judge as it records the
verdict, whichever backend ran it.

inventory: every installed distribution's declared requirements, judged as ``pip check`` judges them, with
``packaging``, the library pip uses: a requirement whose marker holds for the environment's recorded marker
variables (no extra requested) must name an installed distribution whose version its specifier allows,
pre-releases included. Any that does not makes a pass partial (dependency-pin-violated).

The note leads with the cause: a broken pin on the stack the probes judge (torch, CUDA's packages, NCCL,
flashinfer, sgl-kernel) comes first, before the probe's own note and before the count of the other requirements
not met, since a reader (and the table, which shortens long notes from the end) stops at the first clause.
A torch pin is said as a pin: where the inventory read the declaring package's extensions and every torch
symbol they import resolves in this torch, the note says so, so the pin is not read as an ABI break.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.markers import InvalidMarker, UndefinedComparison, UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from checks.results import provenance
from checks.results.result import Verdict
from common import cellid
from inenv import dists
from inenv.probes.inventory import COMPILED
from inenv.status import Status

SHOWN = 3  # broken requirements named in a note; the evidence lists them all
# The stack whose pins lead a note: torch, flashinfer's packages, sgl-kernel, NCCL and CUDA's Python packages
# (dists.LIBRARIES, triton left out), and CUDA's runtime wheels by their family prefix.
STACK_KEYS = ("torch", "flashinfer", "flashinfer_jit_cache", "flashinfer_cubin", "sgl_kernel", "nccl",
              "cuda_bindings", "cuda_python")
STACK = frozenset(canonicalize_name(d) for key in STACK_KEYS for d in dists.BY_KEY[key].dists) | {"cuda-toolkit"}
STACK_PREFIXES = ("nvidia-cuda-",)
# distribution -> the evidence key the inventory records its extensions' fit with torch under
ABI_EVIDENCE = {canonicalize_name(d): f"{module}_abi" for module, _, names in COMPILED for d in names}


@dataclass(frozen=True)
class Broken:
    dist: str  # the distribution that declares the requirement
    version: str
    requirement: str  # as declared, markers left out ("torch==2.14.1")
    required: str  # canonical name of what it requires
    installed: str | None  # that distribution's version here; None when absent

    def describe(self) -> str:
        have = f"{self.installed} is installed" if self.installed else f"{self.required} is absent"
        return f"{self.dist} {self.version} requires {self.requirement}; {have}"

    @property
    def on_stack(self) -> bool:
        return self.required in STACK or self.required.startswith(STACK_PREFIXES)

    def as_dict(self) -> dict[str, Any]:
        return {"dist": self.dist, "version": self.version, "requirement": self.requirement,
                "required": self.required, "installed": self.installed}


def _allows(req: Requirement, version: str) -> bool:
    try:
        return req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:  # a version PEP 440 cannot read: only an arbitrary-equality clause can name it
        return req.specifier.contains(version, prereleases=True)


def broken_requirements(requirements: Mapping[str, Any], markers: Mapping[str, str]
                        ) -> tuple[list[Broken], list[str]]:
    """(requirements not met, requirements that could not be read) over every distribution recorded, each
    ``{"version": ..., "requires": [...]}`` by name; pure."""
    env = {**{str(k): str(v) for k, v in markers.items()}, "extra": ""}
    versions = {canonicalize_name(str(n)): str(info.get("version")) for n, info in requirements.items()
                if isinstance(info, Mapping)}
    broken: list[Broken] = []
    unread: list[str] = []
    for name, info in sorted(requirements.items()):
        if not isinstance(info, Mapping):
            continue
        for text in info.get("requires") or []:
            try:
                req = Requirement(str(text))
                if req.marker is not None and not req.marker.evaluate(env):
                    continue
            except (InvalidRequirement, InvalidMarker, UndefinedComparison, UndefinedEnvironmentName) as exc:
                unread.append(f"{name} {info.get('version')}: {str(text)[:120]} ({type(exc).__name__})")
                continue
            have = versions.get(canonicalize_name(req.name))
            if have is not None and _allows(req, have):
                continue
            declared = f"{req.name}{req.specifier}" + (f" @ {req.url}" if req.url else "")
            broken.append(Broken(str(name), str(info.get("version")), declared, canonicalize_name(req.name), have))
    return broken, unread


def declared(b: Broken, cell: cellid.CellId | None) -> bool:
    """Whether ``b`` is the override the cell declares: an NCCL-axis cell (``-nccl2.32.6``) puts that NCCL release
    beside torch in place of the one torch pins, so torch's pin on it is broken on purpose, at exactly that
    release."""
    return (cell is not None and bool(cell.nccl) and b.required.startswith("nvidia-nccl-")
            and b.installed == cell.nccl)


def pip_check(v: Verdict, cell_id: str = "") -> Verdict:
    """The inventory's verdict with its environment's requirements judged (see the module); the NCCL override the
    cell declares (:func:`declared`) is recorded as such, not as a broken pin. A verdict that recorded no
    requirements (an older probe's) is left as it is."""
    installed = v.evidence.get("installed")
    if not isinstance(installed, Mapping) or not isinstance(installed.get("requirements"), Mapping):
        return v
    markers = installed.get("markers") if isinstance(installed.get("markers"), Mapping) else {}
    found, unread = broken_requirements(installed["requirements"], markers)
    cell = cellid.parse(cell_id)
    broken = [b for b in found if not declared(b, cell)]
    overridden = [b for b in found if declared(b, cell)]
    # the judgement replaces the raw table in what is stored: it is what a reader needs, and much smaller
    kept = {k: val for k, val in installed.items() if k != "requirements"}
    kept.update(requirements_read=sum(len(i.get("requires") or []) for i in installed["requirements"].values()
                                      if isinstance(i, Mapping)),
                broken_requirements=[b.as_dict() for b in broken])
    if overridden:
        kept["declared_overrides"] = [b.as_dict() for b in overridden]
    if unread:
        kept["requirements_unchecked"] = unread[:20]
    v = v.with_evidence(installed=kept)
    if not broken:
        return v
    lead, rest = _cause_first(broken, v.evidence)
    findings = [*(v.evidence.get("metadata_findings") or []), "dependency-pin-violated"]
    v = v.with_evidence(metadata_findings=findings)
    if v.status is Status.PASS:
        return v.replace(status=Status.PARTIAL, reason_code="dependency-pin-violated",
                         note="; ".join(p for p in (lead, rest, v.note) if p))
    return v.replace(note="; ".join(p for p in (lead, v.note, rest) if p))


def _cause_first(broken: list[Broken], evidence: Mapping[str, Any]) -> tuple[str, str]:
    """(what leads the note, what follows the probe's own note). With a broken pin on the stack: those pins
    (at most SHOWN, then their count), and after the note the count of the other requirements not met. With
    none: the first SHOWN broken requirements and the count of the rest, which lead a pass's note and follow
    a failed verdict's own cause."""
    stack = sorted((b for b in broken if b.on_stack), key=lambda b: b.required != "torch")  # torch's first
    others = [b for b in broken if not b.on_stack]
    if not stack:
        return "", _named(others)
    lead = "; ".join(_said(b, evidence) for b in stack[:SHOWN])
    if len(stack) > SHOWN:
        lead += f"; {len(stack) - SHOWN} more pins on torch, CUDA, flashinfer or sgl-kernel are broken"
    if not others:
        return lead, ""
    names = ", ".join(dict.fromkeys(b.required for b in others[:SHOWN])) + (", ..." if len(others) > SHOWN else "")
    return lead, f"{len(others)} other declared requirement(s) not met ({names})"


def _named(broken: list[Broken]) -> str:
    more = f" and {len(broken) - SHOWN} more" if len(broken) > SHOWN else ""
    return "; ".join(b.describe() for b in broken[:SHOWN]) + more


def _said(b: Broken, evidence: Mapping[str, Any]) -> str:
    """A broken pin; for torch, with what the inventory read of the declaring package's extensions: every
    torch symbol they import resolving means the pin is broken, not the ABI."""
    text = b.describe()
    abi = evidence.get(ABI_EVIDENCE.get(canonicalize_name(b.dist), ""))
    if b.required != "torch" or not b.installed or not isinstance(abi, Mapping):
        return text
    imported, missing = abi.get("torch_symbols_imported"), abi.get("torch_symbols_missing")
    if isinstance(imported, int) and imported > 0 and missing == 0:
        return (f"{text} (the {imported} torch symbols its extensions import all resolve in torch {b.installed}: "
                "the pin is broken, not the ABI)")
    return text


JUDGES: dict[str, Callable[[Verdict, str], Verdict]] = {"inventory": pip_check}


VERDICT_ROLE = "requirement judge"  # what checks.results.provenance.VERDICT_CODE reads this file as
NAME = "hostjudge.py"  # this file, as checks.results.provenance.VERDICT_CODE names it


def judge(probe_id: str, verdict: Verdict, cell_id: str = "") -> Verdict:
    """``verdict`` with the host's judgement of probe ``probe_id`` in cell ``cell_id`` added, if that probe has one;
    a verdict
    the judge changed records the judge's version (provenance.JUDGED_BY: this file and the project modules it
    imports) and the third-party versions it judged with (provenance.JUDGED_WITH: packaging), so that a later
    change of either marks it stale instead of leaving it silently different from what this code would say."""
    found = JUDGES.get(probe_id)
    if found is None:
        return verdict
    judged = found(verdict, cell_id)
    if judged is verdict:  # nothing recorded for it to judge
        return verdict
    return judged.with_evidence(**provenance.judged_evidence(Path(__file__)))
